"""What keel sends to the loggers, compared with Lightning 2.6.6: the logged step axis and the keys added to a row,
LearningRateMonitor's names, hooks and steps, TensorBoardLogger's ``log_graph`` / ``default_hp_metric``, and the
default logger's folder (``Trainer.default_log_name``).

Every expected value written as a constant below was measured by running the same program under Lightning 2.6.6
(``lightning.Trainer`` / ``lightning.LightningModule``, a Logger subclass recording its ``log_metrics(metrics, step)``
calls); keel must make the same calls (its own ``perf/`` metrics aside). Lightning itself is never imported here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import LearningRateMonitor
from callbacks.lr_monitor import lr_metric_names
from trainer import Callback, TaskModule, Trainer
from trainer.loggers import CSVLogger, Logger, TensorBoardLogger
from trainer.loggers.local import default_loggers
from trainer.metrics import logged_step, logger_row

Call = tuple[int, dict[str, float]]


class Recorder(Logger):
    """A logger that keeps every ``log_metrics`` call as ``(step, {name: value rounded})``, less the ``perf/``
    metrics keel adds to the task's row on logging steps (docs/slow-runs.md), which Lightning has no counterpart
    of."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, "rec", 0)
        self.calls: list[Call] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, {k: round(float(v), 5) for k, v in metrics.items() if not k.startswith("perf/")}))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        pass


def data(n: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 2), torch.randn(n, 1)), batch_size=1)


def options(recorder: Recorder, **kwargs: Any) -> dict[str, Any]:
    base = dict(
        max_epochs=2,
        logger=[recorder],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(recorder.save_dir),
    )
    base.update(kwargs)
    return base


class Logs(TaskModule):
    """Logs ``batch_idx`` on_step (``s``), on_epoch (``e``) and both (``b``); ``v`` / ``t`` in validation / test;
    optionally ``tee`` in on_train_epoch_end (no on_step / on_epoch given: Lightning's defaults there)."""

    def __init__(self, epoch_end_log: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.epoch_end_log = epoch_end_log

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.log("s", float(batch_idx), on_step=True, on_epoch=False)
        self.log("e", float(batch_idx), on_step=False, on_epoch=True)
        self.log("b", float(batch_idx), on_step=True, on_epoch=True)
        return ((self.layer(x) - y) ** 2).mean()

    def on_train_epoch_end(self) -> None:
        if self.epoch_end_log:
            self.log("tee", 7.0)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("v", float(batch_idx))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("t", float(batch_idx))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _epoch(steps: range, epoch: int, values: range) -> list[Call]:
    return [(s, {"s": float(v), "b_step": float(v), "epoch": epoch}) for s, v in zip(steps, values)]


def _end(step: int, epoch: int, *, v: bool = True, e: float = 2.5, **extra: float) -> list[Call]:
    val = [(step, {"v": 0.5, "epoch": epoch})] if v else []
    return val + [(step, {"e": e, "b_epoch": e, **extra, "epoch": epoch})]


# Lightning 2.6.6's calls, 6 training batches of 1 and 2 validation batches per epoch, 2 epochs (unless said).
LIGHTNING_CALLS: dict[str, tuple[dict[str, Any], dict[str, Any], list[Call]]] = {
    # log_every_n_steps=1 (then test after fit: at global_step, 12).
    "every_step": (
        dict(log_every_n_steps=1),
        {},
        [*_epoch(range(0, 6), 0, range(6)), *_end(5, 0), *_epoch(range(6, 12), 1, range(6)), *_end(11, 1)],
    ),
    "every_2_steps": (
        dict(log_every_n_steps=2),
        {},
        [*_epoch(range(1, 6, 2), 0, range(1, 6, 2)), *_end(5, 0), *_epoch(range(7, 12, 2), 1, range(1, 6, 2))]
        + _end(11, 1),
    ),
    # The step counts optimizer steps: batches 1, 3, 5 complete steps 1, 2, 3 (logged at 0, 1, 2).
    "accumulate_2": (
        dict(log_every_n_steps=1, accumulate_grad_batches=2),
        {},
        [*_epoch(range(0, 3), 0, range(1, 6, 2)), *_end(2, 0), *_epoch(range(3, 6), 1, range(1, 6, 2)), *_end(5, 1)],
    ),
    # Validation mid-epoch after 3 optimizer steps: at step 2, after the step metrics of that step.
    "val_check_interval_3": (
        dict(log_every_n_steps=1, val_check_interval=3, max_epochs=1),
        {},
        [*_epoch(range(0, 3), 0, range(3)), (2, {"v": 0.5, "epoch": 0}), *_epoch(range(3, 6), 0, range(3, 6))]
        + _end(5, 0),
    ),
    # self.log("tee", 7.0) in on_train_epoch_end: an epoch value, in the epoch's row.
    "epoch_end_hook": (
        dict(log_every_n_steps=3),
        dict(epoch_end_log=True),
        [*_epoch(range(2, 6, 3), 0, range(2, 6, 3)), *_end(5, 0, tee=7.0), *_epoch(range(8, 12, 3), 1, range(2, 6, 3))]
        + _end(11, 1, tee=7.0),
    ),
}


@pytest.mark.parametrize("case", sorted(LIGHTNING_CALLS))
def test_logged_steps_and_rows_are_lightnings(case: str, tmp_path: Path) -> None:
    trainer_options, task_options, expected = LIGHTNING_CALLS[case]
    torch.manual_seed(0)
    recorder = Recorder(tmp_path)
    trainer = Trainer(**options(recorder, **trainer_options))
    task = Logs(**task_options)
    trainer.fit(task, data(6), data(2))
    assert recorder.calls == expected
    if case == "every_step":
        trainer.test(task, data(2), verbose=False)
        assert recorder.calls[-1] == (12, {"t": 0.5, "epoch": 2})  # Lightning 2.6.6: test after fit at step 12


def test_max_steps_ending_mid_epoch_logs_the_epoch_at_the_last_step(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    Trainer(**options(recorder, log_every_n_steps=1, max_steps=4)).fit(Logs(), data(6))
    # Lightning 2.6.6: steps 0..3, then the (partial) epoch's aggregates at step 3.
    assert recorder.calls == [*_epoch(range(4), 0, range(4)), *_end(3, 0, v=False, e=1.5)]


class StepKey(Logs):
    """Logs a ``step`` value (Lightning uses it as the row's step) or an ``epoch`` value (kept as logged)."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.key == "step":
            self.log("step", float(self.current_epoch * 100 + batch_idx))
            self.log("x", 1.0)
        else:
            self.log("epoch", 42.0)
        x, y = batch
        return ((self.layer(x) - y) ** 2).mean()


@pytest.mark.parametrize(
    "key, expected",
    [
        # Lightning 2.6.6: the logged value is the step, the row has no "step" and no "epoch".
        ("step", [(1, {"x": 1.0}), (3, {"x": 1.0}), (101, {"x": 1.0}), (103, {"x": 1.0})]),
        # Lightning 2.6.6: a logged "epoch" is not replaced by the epoch counter.
        ("epoch", [(1, {"epoch": 42.0}), (3, {"epoch": 42.0}), (5, {"epoch": 42.0}), (7, {"epoch": 42.0})]),
    ],
)
def test_a_logged_step_or_epoch_value_is_used_as_lightning_does(key: str, expected: list[Call], tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    Trainer(**options(recorder, log_every_n_steps=2)).fit(StepKey(key), data(4))
    assert recorder.calls == expected


def test_logger_row_and_logged_step() -> None:
    assert logged_step(0, in_fit_step=True) == 0  # never negative
    assert logged_step(5, in_fit_step=True) == 4
    assert logged_step(5, in_fit_step=False) == 5
    assert logger_row({"a": 1.0}, 2, 10, True) == ({"a": 1.0, "epoch": 2}, 9)
    assert logger_row({"a": 1.0}, 2, 10, False) == ({"a": 1.0, "epoch": 2}, 10)
    assert logger_row({"a": 1.0, "step": 7.0}, 2, 10, True) == ({"a": 1.0}, 7)


class StepProbe(Callback):
    """What ``trainer.log_metrics(values)`` (no step) writes at in each hook."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []

    def _record(self, trainer: Trainer, hook: str) -> None:
        recorder = trainer.loggers[0]
        assert isinstance(recorder, Recorder)
        trainer.log_metrics({"probe": 1.0})
        self.seen.append((hook, trainer.global_step, recorder.calls[-1][0]))

    def on_train_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._record(trainer, "train_start")

    def on_train_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._record(trainer, "epoch_start")

    def on_train_batch_start(self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int) -> None:
        self._record(trainer, "batch_start")

    def on_train_batch_end(self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._record(trainer, "batch_end")

    def on_validation_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._record(trainer, "val_end")

    def on_train_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._record(trainer, "epoch_end")

    def on_train_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._record(trainer, "train_end")


def test_callback_log_metrics_default_step_is_lightnings_counter(tmp_path: Path) -> None:
    recorder, probe = Recorder(tmp_path), StepProbe()
    trainer = Trainer(**options(recorder, val_check_interval=2, callbacks=[probe]))
    trainer.fit(Logs(), data(4), data(1))
    # (hook, global_step, Lightning 2.6.6's fit_loop.epoch_loop._batches_that_stepped there): 4 batches per epoch,
    # validation every 2 steps. Between an optimizer step and the end of its batch it is global_step - 1.
    lightning = [("train_start", 0, 0)]
    for epoch in range(2):
        first = 4 * epoch
        lightning.append(("epoch_start", first, first))
        for s in range(first, first + 4):
            lightning += [("batch_start", s, s), ("batch_end", s + 1, s)]
            if (s + 1) % 2 == 0:
                lightning.append(("val_end", s + 1, s))
        lightning.append(("epoch_end", first + 4, first + 4))
    lightning.append(("train_end", 8, 8))
    assert probe.seen == lightning


# ---------------------------------------------------------------------------------------------- LearningRateMonitor
class Optimizers(TaskModule):
    def __init__(self, opt: str = "sgd", sched: str | None = None) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 1), torch.nn.Linear(1, 1)
        self.opt, self.sched = opt, sched

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.b(self.a(x)) - y) ** 2).mean()

    def configure_optimizers(self) -> Any:
        a, b = list(self.a.parameters()), list(self.b.parameters())
        if self.opt == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        elif self.opt == "adam2":
            opt = torch.optim.Adam([{"params": a}, {"params": b, "lr": 0.5}], lr=0.1)
        elif self.opt == "named":
            opt = torch.optim.Adam([{"params": a, "name": "enc"}, {"params": b, "lr": 0.5}], lr=0.1)
        else:
            opt = torch.optim.Adagrad(self.parameters(), lr=0.1)
        halve = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        if self.sched == "step":
            return {"optimizer": opt, "lr_scheduler": {"scheduler": halve, "interval": "step"}}
        if self.sched == "epoch":
            return {"optimizer": opt, "lr_scheduler": halve}
        if self.sched == "named":
            return {"optimizer": opt, "lr_scheduler": {"scheduler": halve, "name": "my_lr"}}
        return opt


def _lr(steps: list[int], values: list[float] | float, name: str = "lr-SGD") -> list[Call]:
    values = values if isinstance(values, list) else [values] * len(steps)
    return [(s, {name: v}) for s, v in zip(steps, values)]


SGD_ALL = {"lr-SGD": 0.1, "lr-SGD-momentum": 0.9, "lr-SGD-weight_decay": 0.01}
ADAM2_ALL = {
    "lr-Adam/pg1": 0.1,
    "lr-Adam/pg1-momentum": 0.9,
    "lr-Adam/pg1-weight_decay": 0.0,
    "lr-Adam/pg2": 0.5,
    "lr-Adam/pg2-momentum": 0.9,
    "lr-Adam/pg2-weight_decay": 0.0,
}
BOTH = [0, 1, 3, 4, 5, 7]  # epoch starts (0, 4) and the batches that start logging steps (1, 3, 5, 7)

# Lightning 2.6.6's calls: 4 batches of 1 per epoch, 2 epochs, log_every_n_steps=2; StepLR(step_size=1, gamma=0.5).
LR_CALLS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any], list[Call]]] = {
    "default_no_scheduler": ({}, {}, {}, _lr(BOTH, 0.1)),
    "step_no_scheduler": (dict(logging_interval="step"), {}, {}, _lr([1, 3, 5, 7], 0.1)),
    "epoch_no_scheduler": (dict(logging_interval="epoch"), {}, {}, _lr([0, 4], 0.1)),
    "default_step_scheduler": ({}, dict(sched="step"), {}, _lr([1, 3, 5, 7], [0.05, 0.0125, 0.00313, 0.00078])),
    "default_epoch_scheduler": ({}, dict(sched="epoch"), {}, _lr([0, 4], [0.1, 0.05])),
    "epoch_step_scheduler": (dict(logging_interval="epoch"), dict(sched="step"), {}, _lr([0, 4], [0.1, 0.00625])),
    "step_epoch_scheduler": (
        dict(logging_interval="step"),
        dict(sched="epoch"),
        {},
        _lr([1, 3, 5, 7], [0.1] * 2 + [0.05] * 2),
    ),
    "momentum_weight_decay_sgd": (
        dict(log_momentum=True, log_weight_decay=True),
        {},
        {},
        [(s, SGD_ALL) for s in BOTH],
    ),
    "momentum_weight_decay_adam_groups": (
        dict(log_momentum=True, log_weight_decay=True),
        dict(opt="adam2"),
        {},
        [(s, ADAM2_ALL) for s in BOTH],
    ),
    "named_scheduler_and_group": (
        {},
        dict(opt="named", sched="named"),
        {},
        [(0, {"my_lr/enc": 0.1, "my_lr/pg2": 0.5}), (4, {"my_lr/enc": 0.05, "my_lr/pg2": 0.25})],
    ),
    "momentum_without_momentum": (
        dict(log_momentum=True),
        dict(opt="adagrad"),
        {},
        [(s, {"lr-Adagrad": 0.1, "lr-Adagrad-momentum": 0.0}) for s in BOTH],
    ),
    # Lightning 2.6.6 logs each of these twice (once per micro-batch of the window); keel once.
    "accumulation": (
        dict(logging_interval="step"),
        {},
        dict(accumulate_grad_batches=2, log_every_n_steps=1),
        _lr([0, 1, 2, 3], 0.1),
    ),
}


@pytest.mark.parametrize("case", sorted(LR_CALLS))
def test_lr_monitor_logs_what_lightning_logs(case: str, tmp_path: Path) -> None:
    monitor_options, task_options, trainer_options, expected = LR_CALLS[case]
    recorder = Recorder(tmp_path)
    monitor = LearningRateMonitor(**monitor_options)
    trainer = Trainer(**options(recorder, callbacks=[monitor], **{"log_every_n_steps": 2, **trainer_options}))
    trainer.fit(Optimizers(**task_options), data(4))
    assert [(s, {k: round(v, 5) for k, v in row.items()}) for s, row in recorder.calls] == expected
    last = expected[-1][1]
    assert {k: float(v) for k, v in trainer.callback_metrics.items() if k in last} == pytest.approx(last, abs=1e-5)
    lr_names = [k for k in last if not k.endswith(("-momentum", "-weight_decay"))]
    assert {name: len(monitor.lrs[name]) for name in lr_names} == {name: len(expected) for name in lr_names}


def test_lr_monitor_warns_about_optimizers_without_momentum(tmp_path: Path) -> None:
    monitor = LearningRateMonitor(log_momentum=True)
    with pytest.warns(UserWarning, match="Adagrad.*logged as 0"):
        Trainer(**options(Recorder(tmp_path), callbacks=[monitor], max_epochs=1)).fit(Optimizers("adagrad"), data(2))


def test_lr_metric_names_follow_lightning() -> None:
    p = [torch.nn.Parameter(torch.zeros(1)) for _ in range(4)]
    sgd, sgd2 = torch.optim.SGD([p[0]], lr=0.1), torch.optim.SGD([p[1]], lr=0.2)
    adam = torch.optim.Adam([{"params": [p[2]]}, {"params": [p[3]], "lr": 0.5}])
    # Lightning 2.6.6's names: a repeated class gets -1, several param groups /pg1, /pg2.
    assert lr_metric_names([sgd, sgd2, adam]) == [["lr-SGD"], ["lr-SGD-1"], ["lr-Adam/pg1", "lr-Adam/pg2"]]
    named = torch.optim.SGD([{"params": [p[0]], "name": "head"}], lr=0.1)
    assert lr_metric_names([named]) == [["lr-SGD/head"]]
    twice = torch.optim.SGD([{"params": [p[0]], "name": "x"}, {"params": [p[1]], "name": "x"}], lr=0.1)
    with pytest.raises(ValueError, match="several param groups named \\['x'\\]"):
        lr_metric_names([twice])
    with pytest.raises(ValueError, match="logging_interval='batch'"):
        LearningRateMonitor(logging_interval="batch")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- TensorBoardLogger
class Graphed(Optimizers):
    def __init__(self, example: Any = None, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters("lr")
        self.example_input_array = example

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _events(log_dir: str) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return acc


def _hparams(acc: Any) -> tuple[list[str], list[str]]:
    """(metric names, hyperparameter names) of the HPARAMS tab's experiment summary; ([], []) when none."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    try:
        content = acc.PluginTagToContent("hparams")
    except KeyError:
        return [], []
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    return [m.name.tag for m in experiment.metric_infos], [h.name for h in experiment.hparam_infos]


def _fit_tb(tmp_path: Path, task: TaskModule, **logger_options: Any) -> TensorBoardLogger:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path, **logger_options)
    trainer = Trainer(**options(Recorder(tmp_path), logger=logger, max_epochs=1, log_every_n_steps=1))
    trainer.fit(task, data(2))
    return logger


def test_tensorboard_log_graph_writes_the_traced_graph(tmp_path: Path) -> None:
    logger = _fit_tb(tmp_path, Graphed(torch.zeros(3, 2)), log_graph=True)
    acc = _events(logger.log_dir)
    assert acc.Tags()["graph"]  # Lightning 2.6.6 writes a graph: input/x, output/output.1 and the layers
    names = [node.name for node in acc.Graph().node]
    assert "input/x" in names and any(name.startswith("output/") for name in names)
    assert any("Linear[a]" in name for name in names)
    # Lightning 2.6.6, default_hp_metric=True: hp_metric = -1 at step 0, a metric of the HPARAMS tab.
    assert [(e.step, e.value) for e in acc.Scalars("hp_metric")] == [(0, -1.0)]
    metrics, hparams = _hparams(acc)
    assert metrics == ["hp_metric"] and "task/lr" in hparams
    # Lightning 2.6.6's TensorBoardLogger also leaves hparams.yaml in the run folder.
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        assert "lr: 0.1" in f.read()


def test_tensorboard_log_graph_without_example_input_warns(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="example_input_array` attribute is not set"):
        logger = _fit_tb(tmp_path, Graphed(None), log_graph=True)
    assert not _events(logger.log_dir).Tags()["graph"]
    with pytest.warns(UserWarning, match="can't be traced"):
        _fit_tb(tmp_path / "list", Graphed([torch.zeros(3, 2)]), log_graph=True)


def test_tensorboard_without_log_graph_or_hp_metric(tmp_path: Path) -> None:
    logger = _fit_tb(tmp_path, Graphed(torch.zeros(3, 2)), default_hp_metric=False)
    acc = _events(logger.log_dir)
    # Lightning 2.6.6: no graph, no hp_metric scalar (and no hparams summary: keel still writes the hyperparameters
    # there, without a metric).
    assert not acc.Tags()["graph"]
    assert "hp_metric" not in acc.Tags()["scalars"]
    metrics, hparams = _hparams(acc)
    assert metrics == [] and "task/lr" in hparams


def test_tensorboard_log_hyperparams_with_metrics_prefix_and_sub_dir(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path, name="tb", version=0, prefix="run", sub_dir="inner")
    assert logger.log_dir == os.path.join(str(tmp_path), "tb", "version_0", "inner")
    logger.log_hyperparams({"lr": 0.1}, {"hp/acc": 0.5}, step=3)
    logger.log_metrics({"loss": 1.0}, step=4)
    logger.finalize("success")
    acc = _events(logger.log_dir)
    assert sorted(acc.Tags()["scalars"]) == ["run-hp/acc", "run-loss"]  # Lightning's prefix joins with "-"
    assert [(e.step, e.value) for e in acc.Scalars("run-hp/acc")] == [(3, 0.5)]
    assert _hparams(acc) == (["hp/acc"], ["lr"])


def test_csv_logger_prefix_and_flush_option(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, prefix="a", flush_logs_every_n_steps=10)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    with open(logger.metrics_file_path) as f:
        assert f.read().splitlines() == ["step,a-loss", "0,1.0"]


# ---------------------------------------------------------------------------------------------- the default folder
class LightningNamed(Trainer):
    default_log_name = "lightning_logs"


@pytest.mark.parametrize("cls, folder", [(Trainer, "keel_logs"), (LightningNamed, "lightning_logs")])
def test_default_logger_folder_is_the_trainers_default_log_name(
    cls: type[Trainer], folder: str, tmp_path: Path
) -> None:
    trainer = cls(logger=True, default_root_dir=str(tmp_path), enable_progress_bar=False)
    (logger,) = trainer.loggers
    assert logger.root_dir == os.path.join(str(tmp_path), folder)
    (csv_logger,) = default_loggers(True, str(tmp_path), name=folder)
    assert csv_logger.name == folder


def test_lr_monitor_without_logger_only_warns(tmp_path: Path) -> None:
    # Lightning 2.6.6 raises MisconfigurationException here; keel warns and trains on.
    with pytest.warns(UserWarning, match="no logger"):
        Trainer(**options(Recorder(tmp_path), logger=False, max_epochs=1, callbacks=[LearningRateMonitor()])).fit(
            Optimizers(), data(2)
        )


def test_the_lightning_layer_logs_under_lightning_logs(tmp_path: Path) -> None:
    """Under callbacks.lightning the default logger, TensorBoardLogger and CSVLogger write lightning_logs/ as
    Lightning's do; keel's own Trainer keeps keel_logs/."""
    from models import Regression, loader, quiet, regression_data

    import callbacks.lightning as L
    from trainer import Trainer

    for trainer_class, folder in ((L.Trainer, "lightning_logs"), (Trainer, "keel_logs")):
        root = tmp_path / folder
        trainer_class(**quiet(max_steps=1, logger=True, default_root_dir=str(root))).fit(
            Regression(), loader(regression_data(), 16)
        )
        assert (root / folder / "version_0").is_dir()
    assert Path(L.CSVLogger(tmp_path / "csv", version=0).log_dir) == tmp_path / "csv" / "lightning_logs" / "version_0"
    assert Path(L.TensorBoardLogger(tmp_path / "tb", version=0).log_dir).parent.name == "lightning_logs"
