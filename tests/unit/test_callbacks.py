"""Built-in callbacks (callbacks/), each checked on real single-process ``Trainer.fit`` runs."""

from __future__ import annotations

import csv
import datetime
import logging
import math
import re
import time
from pathlib import Path

import pytest
import torch
from models import Regression, loader, quiet, regression_data
from torch.nn import functional as F
from torch.utils.data import Dataset

from callbacks import (
    EarlyStopping,
    LambdaCallback,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ThroughputMonitor,
    Timer,
)
from callbacks import throughput as throughput_module
from callbacks.lambda_function import HOOK_NAMES
from callbacks.lr_monitor import lr_metric_names
from callbacks.timer import parse_duration
from trainer import Callback, Trainer
from trainer.hooks import TRAIN_BATCH_HOOKS, TrainHooks
from trainer.loggers import CSVLogger, TensorBoardLogger


def read_csv(logger: CSVLogger) -> list[dict[str, str]]:
    with open(logger.metrics_file_path, newline="") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    """(step, value) of the rows that have ``key``."""
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key, "") != ""]


# ---------------------------------------------------------------------------------------------- LearningRateMonitor
def test_lr_monitor_follows_step_lr_at_logging_steps(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    monitor = LearningRateMonitor(log_momentum=True)
    # 64 samples / batch 8 = 8 steps per epoch; StepLR(step_size=3, gamma=0.5) stepped every optimizer step.
    Trainer(**quiet(max_epochs=2, log_every_n_steps=2, logger=logger, callbacks=[monitor])).fit(
        Regression(lr=0.1, scheduler="step"), loader(regression_data(), 8)
    )
    rows = read_csv(logger)
    lrs = column(rows, "lr-SGD")
    # Lightning 2.6.6: at the start of the batch of each logging step (the 2nd, 4th, ... step), at the step that
    # step is logged at (1, 3, ..., 15: s steps done), the rate it uses: the scheduler has stepped s times.
    assert lrs == [(s, pytest.approx(0.1 * 0.5 ** (s // 3), rel=1e-12)) for s in range(1, 16, 2)]
    assert column(rows, "lr-SGD-momentum") == [(s, 0.9) for s in range(1, 16, 2)]


def test_lr_monitor_epoch_interval(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    monitor = LearningRateMonitor(logging_interval="epoch")
    # 2 steps per epoch; StepLR(step_size=3) stepped per epoch, before the next epoch starts.
    Trainer(**quiet(max_epochs=4, log_every_n_steps=1, logger=logger, callbacks=[monitor])).fit(
        Regression(lr=0.1, scheduler="epoch"), loader(regression_data(16), 8)
    )
    lrs = column(read_csv(logger), "lr-SGD")
    # Lightning 2.6.6: at the start of each epoch e (at step 2e), the rate that epoch uses.
    assert lrs == [(2 * e, pytest.approx(0.1 * 0.5 ** (e // 3))) for e in range(4)]


def test_lr_metric_names_for_groups_and_repeated_classes() -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    sgd = torch.optim.SGD([a], lr=0.1)
    sgd2 = torch.optim.SGD([b], lr=0.2)
    adam = torch.optim.Adam([{"params": [c]}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.5}])
    # Lightning 2.6.6's names: param groups count from 1 (more in tests/unit/test_lightning_logging.py).
    assert lr_metric_names([sgd, sgd2, adam]) == [["lr-SGD"], ["lr-SGD-1"], ["lr-Adam/pg1", "lr-Adam/pg2"]]
    with pytest.raises(ValueError, match="logging_interval='batch'"):
        LearningRateMonitor(logging_interval="batch")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- ThroughputMonitor
class ManualClock:
    """A clock for ThroughputMonitor (its module's ``time``) that moves only when ``sleep`` is called: the
    slow data or step below advance it, everything else takes no time on it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class SlowData(Dataset):
    """regression_data whose items take ``delay`` seconds to produce (on ``clock``; real time by default)."""

    def __init__(self, n: int, delay: float, clock=time) -> None:
        self.data, self.delay, self.clock = regression_data(n), delay, clock

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        self.clock.sleep(self.delay)
        return self.data[i]


class SlowStep(Regression):
    def __init__(self, delay: float, clock=time) -> None:
        super().__init__()
        self.delay, self.clock = delay, clock

    def training_step(self, batch, batch_idx):
        self.clock.sleep(self.delay)
        return super().training_step(batch, batch_idx)


class ItemsTask(Regression):
    """Returns a summed loss with ``num_items`` = 3 per sample (say, 3 tokens per sample)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.mse_loss(self(x), y, reduction="sum"), "num_items": torch.tensor(3 * len(x))}


def test_throughput_keys_only_at_logging_steps(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    monitor = ThroughputMonitor(window=4)
    # 8 steps per epoch x 2 epochs, logging every 3 steps: steps 3, 6, ... logged at 2, 5, ... (Lightning's axis,
    # docs/tracking.md); the epoch LR monitor adds rows at the epoch starts, steps 0 and 8.
    Trainer(
        **quiet(
            max_epochs=2,
            log_every_n_steps=3,
            logger=logger,
            callbacks=[monitor, LearningRateMonitor(logging_interval="epoch")],
        )
    ).fit(ItemsTask(), loader(regression_data(), 8))
    rows = read_csv(logger)
    keys = [
        "throughput/samples_per_sec",
        "throughput/items_per_sec",
        "throughput/step_time",
        "throughput/data_wait_fraction",
    ]
    for key in keys:
        assert [s for s, _ in column(rows, key)] == [2, 5, 8, 11, 14], key
    assert {s for s, _ in column(rows, "lr-SGD")} == {0, 8}  # rows without throughput exist
    for row in rows:
        if row["throughput/samples_per_sec"]:
            samples = float(row["throughput/samples_per_sec"])
            assert samples > 0
            assert float(row["throughput/items_per_sec"]) == pytest.approx(3 * samples, rel=1e-9)
            assert 0 <= float(row["throughput/data_wait_fraction"]) <= 1
            # step_time x samples/s = samples per step (8), over the same window.
            assert float(row["throughput/step_time"]) * samples == pytest.approx(8, rel=1e-6)


@pytest.mark.parametrize("slow, wait_fraction", [("data", 1.0), ("step", 0.0)])
def test_throughput_data_wait_fraction(slow: str, wait_fraction: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock that only the slow part moves (4 x 5 ms per batch of 4, or a 20 ms training step), every step
    takes 20 ms: all of it waiting for data, or none of it. Exact, whatever the machine's load."""
    clock = ManualClock()
    monkeypatch.setattr(throughput_module, "time", clock)
    monitor = ThroughputMonitor(window=8)
    data = SlowData(32, 0.005, clock) if slow == "data" else regression_data(32)
    task = SlowStep(0.02, clock) if slow == "step" else Regression()
    Trainer(**quiet(max_epochs=1, log_every_n_steps=4, callbacks=[monitor])).fit(task, loader(data, 4))
    values = monitor.last_values
    assert "throughput/items_per_sec" not in values  # the task reports no num_items
    assert values["throughput/step_time"] == pytest.approx(0.02, rel=1e-9)
    assert values["throughput/samples_per_sec"] == pytest.approx(4 / 0.02, rel=1e-9)
    assert values["throughput/data_wait_fraction"] == pytest.approx(wait_fraction, abs=1e-9)


# ---------------------------------------------------------------------------------------------- EarlyStopping
class Sequence(Regression):
    """Validation logs ``values[current_epoch]`` as ``val/metric``; training logs it as ``train/metric``."""

    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.values = values
        self.epochs_trained: list[int] = []

    def training_step(self, batch, batch_idx):
        self.log("train/metric", self.values[self.current_epoch], on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val/metric", self.values[self.current_epoch])

    def on_train_epoch_end(self) -> None:
        self.epochs_trained.append(self.current_epoch)


def fit_sequence(values: list[float], stopper: Callback, *, val: bool = True, **options) -> tuple[Trainer, Sequence]:
    task = Sequence(values)
    trainer = Trainer(**quiet(**{"max_epochs": len(values), "callbacks": [stopper], **options}))
    trainer.fit(task, loader(regression_data(16), 8), loader(regression_data(8, seed=1), 4) if val else None)
    return trainer, task


@pytest.mark.parametrize(
    "values, kwargs, stop_epoch",
    [
        ([5, 4, 4.5, 4.2, 4.1, 3, 2, 1], dict(patience=3), 4),  # best 4 at epoch 1, then 3 checks without
        ([5, 4.95, 4.9, 4.85, 4, 3], dict(patience=2, min_delta=0.1), 2),  # 0.05 improvements do not count
        ([1, 2, 2, 1.5, 3, 4], dict(mode="max", patience=2), 3),
        ([5, 4, 3, 2, 1], dict(patience=1), None),  # always improving: runs all epochs
    ],
)
def test_early_stopping_stops_at_expected_epoch(values, kwargs, stop_epoch) -> None:
    stopper = EarlyStopping("val/metric", **kwargs)
    # A sanity pass logs values[0] too: it must not count as a check.
    trainer, task = fit_sequence(values, stopper, num_sanity_val_steps=1)
    last = len(values) - 1 if stop_epoch is None else stop_epoch
    assert task.epochs_trained == list(range(last + 1))
    assert trainer.should_stop == (stop_epoch is not None)
    assert stopper.stopped_epoch == (-1 if stop_epoch is None else stop_epoch)


def test_early_stopping_on_train_epoch_end_without_validation() -> None:
    stopper = EarlyStopping("train/metric", patience=2)
    _, task = fit_sequence([3, 2, 2.5, 2.1, 1, 0], stopper, val=False)
    assert task.epochs_trained == [0, 1, 2, 3] and stopper.stopped_epoch == 3


def test_early_stopping_auto_mode_with_sparse_validation() -> None:
    values = [9, 4, 9, 4.5, 9, 4.6]  # validation runs after epochs 1, 3, 5 only
    stopper = EarlyStopping("val/metric", patience=1)
    # The sanity check shows that this fit validates: no check at train epoch ends.
    _, task = fit_sequence(values, stopper, check_val_every_n_epoch=2, num_sanity_val_steps=1)
    assert task.epochs_trained == [0, 1, 2, 3] and stopper.stopped_epoch == 3
    # Without a sanity check the first check (epoch 0's end) cannot know: the error says what to pass.
    with pytest.raises(KeyError, match="check_on_train_epoch_end=False"):
        fit_sequence(values, EarlyStopping("val/metric", patience=1), check_val_every_n_epoch=2)
    stopper = EarlyStopping("val/metric", patience=1, check_on_train_epoch_end=False)
    _, task = fit_sequence(values, stopper, check_val_every_n_epoch=2)
    assert task.epochs_trained == [0, 1, 2, 3] and stopper.stopped_epoch == 3


def test_early_stopping_ignores_validate_calls() -> None:
    stopper = EarlyStopping("val/metric", patience=1)
    trainer, task = fit_sequence([5, 4, 3, 9], stopper, max_epochs=3)
    state = stopper.state_dict()
    trainer.validate(task, loader(regression_data(8, seed=1), 4))  # logs values[3] = 9: no improvement
    assert stopper.state_dict() == state and not trainer.should_stop


def test_early_stopping_non_finite_stops_with_message(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="callbacks")
    stopper = EarlyStopping("val/metric", patience=5)
    trainer, task = fit_sequence([3.0, math.nan, 1.0, 0.5], stopper)
    assert task.epochs_trained == [0, 1] and trainer.should_stop
    (record,) = [r for r in caplog.records if r.name == "callbacks.early_stopping"]
    assert record.levelno == logging.WARNING
    assert "'val/metric' = nan is not finite" in record.getMessage()
    assert "Previous best value was 3" in record.getMessage()


def test_early_stopping_unknown_monitor_names_the_keys() -> None:
    with pytest.raises(KeyError) as info:
        fit_sequence([3, 2], EarlyStopping("val/acc"))
    message = str(info.value)
    # train/metric (on_epoch) is published at the training epoch's end, after this first validation.
    assert "'val/acc'" in message and "'val/metric'" in message
    # strict=False: skipped (with a warning), training runs all epochs.
    _, task = fit_sequence([3, 2], EarlyStopping("val/acc", strict=False))
    assert task.epochs_trained == [0, 1]


def test_early_stopping_state_round_trips_through_checkpoints(tmp_path: Path) -> None:
    values = [5, 4, 4.5, 4.2, 4.1, 3, 2, 1]
    stopper = EarlyStopping("val/metric", patience=3)
    assert stopper.state_key == "EarlyStopping{'monitor': 'val/metric', 'mode': 'min'}"
    ckpts = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    fit_sequence(values, stopper, callbacks=[stopper, ckpts], enable_checkpointing=True)
    assert stopper.stopped_epoch == 4
    (path,) = tmp_path.glob("epoch=3-*.ckpt")
    saved = torch.load(path / "keel.pt", weights_only=True)["callbacks"][stopper.state_key]  # a save folder
    assert saved == {"wait_count": 2, "stopped_epoch": -1, "best_score": 4.0}
    # Resuming after epoch 3 with a fresh callback stops at the same epoch as the uninterrupted run.
    resumed = EarlyStopping("val/metric", patience=3)
    task = Sequence(values)
    Trainer(
        **quiet(
            max_epochs=len(values),
            callbacks=[resumed, ModelCheckpoint(dirpath=tmp_path / "b")],
            enable_checkpointing=True,
        )
    ).fit(task, loader(regression_data(16), 8), loader(regression_data(8, seed=1), 4), ckpt_path=str(path))
    assert task.epochs_trained == [4] and resumed.stopped_epoch == 4 and resumed.wait_count == 3
    # Plain round trip, and strict loading.
    copy = EarlyStopping("val/metric", patience=3)
    copy.load_state_dict(stopper.state_dict())
    assert copy.state_dict() == stopper.state_dict()
    with pytest.raises(KeyError, match=r"missing keys \['best_score'\], unknown keys \['extra'\]"):
        copy.load_state_dict({"wait_count": 0, "stopped_epoch": -1, "extra": 1})


def test_early_stopping_argument_checks() -> None:
    for kwargs, name in [
        (dict(mode="best"), "mode"),
        (dict(patience=0), "patience"),
        (dict(min_delta=-1), "min_delta"),
    ]:
        with pytest.raises(ValueError, match=name):
            EarlyStopping("val/loss", **kwargs)
    # Two instances with different monitors may live in one Trainer (distinct state keys).
    Trainer(**quiet(callbacks=[EarlyStopping("a"), EarlyStopping("b"), EarlyStopping("a", mode="max")]))


# ---------------------------------------------------------------------------------------------- Timer
class Counting(SlowStep):
    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return super().training_step(batch, batch_idx)


def test_timer_stops_quickly_at_a_step_boundary() -> None:
    timer = Timer(duration=0.2)
    task = Counting(0.03)  # 2 micro-batches per step: >= 0.06 s per step, so >= 0.24 s after 4 steps
    trainer = Trainer(**quiet(max_epochs=5, accumulate_grad_batches=2, callbacks=[timer]))
    trainer.fit(task, loader(regression_data(), 2))  # 16 steps per epoch: 80 steps if it never stopped
    assert trainer.should_stop and 1 <= trainer.global_step <= 4  # at the first step past 0.2 s
    assert task.calls == 2 * trainer.global_step  # stopped right after an optimizer step
    assert timer.time_elapsed() >= 0.2 and timer.time_remaining() <= 0


def test_timer_epoch_interval_finishes_the_epoch() -> None:
    timer = Timer(duration=0, interval="epoch")
    trainer = Trainer(**quiet(max_epochs=3, callbacks=[timer]))
    trainer.fit(Regression(), loader(regression_data(), 8))
    assert trainer.current_epoch == 1 and trainer.global_step == 8


def test_timer_budget_survives_resume(tmp_path: Path) -> None:
    first = Timer()  # no limit: just measures
    Trainer(**quiet(max_epochs=1, callbacks=[first, ModelCheckpoint(dirpath=tmp_path)], enable_checkpointing=True)).fit(
        Counting(0.01), loader(regression_data(16), 8)
    )
    (path,) = tmp_path.glob("*.ckpt")
    saved = torch.load(path / "keel.pt", weights_only=True)["callbacks"]["Timer"]["time_elapsed"]  # a save folder
    assert 0.02 <= saved <= first.time_elapsed()
    # The resumed run starts with the saved time spent: a budget of exactly that stops after one step.
    second = Timer(duration=saved)
    trainer = Trainer(
        **quiet(max_epochs=4, callbacks=[second, ModelCheckpoint(dirpath=tmp_path / "b")], enable_checkpointing=True)
    )
    trainer.fit(Counting(0.0), loader(regression_data(16), 8), ckpt_path=str(path))
    assert trainer.global_step == 2 + 1 and second.time_elapsed() >= saved
    assert second.state_dict()["time_elapsed"] >= saved


def test_timer_durations() -> None:
    assert parse_duration(None) is None
    assert parse_duration(1.5) == 1.5
    assert parse_duration("01:02:03:04") == 86400 + 2 * 3600 + 3 * 60 + 4
    assert parse_duration({"days": 1, "hours": 12}) == 1.5 * 86400
    assert parse_duration(datetime.timedelta(minutes=2)) == 120
    for bad, fragment in [
        ("12:00:00", "'12:00:00'"),
        ("1 day", "'1 day'"),
        ({"hourz": 1}, "['hourz']"),
        (-1, "-1"),
        (True, "True"),
        ([1], "[1]"),
    ]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            Timer(duration=bad)
    with pytest.raises(ValueError, match="interval"):
        Timer(duration=1, interval="batch")  # type: ignore[arg-type]
    timer = Timer(duration=10)
    timer.load_state_dict({"time_elapsed": 4.0})
    assert timer.time_elapsed() == 4.0 and timer.time_remaining() == 6.0
    with pytest.raises(KeyError, match="elapsed"):
        timer.load_state_dict({"elapsed": 1.0})


# ---------------------------------------------------------------------------------------------- ModelSummary
def test_model_summary_logs_table_and_totals(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="callbacks")
    task = Regression()  # net = Linear(8, 16) -> Tanh -> Linear(16, 1): 144 + 17 = 161 parameters
    task.net[2].weight.requires_grad_(False)  # 16 frozen
    Trainer(**quiet(max_steps=1, callbacks=[ModelSummary(max_depth=2)])).fit(task, loader(regression_data(), 8))
    (record,) = [r for r in caplog.records if r.name == "callbacks.model_summary"]
    text = record.getMessage()
    assert "161 total params" in text and "145 trainable params" in text and "16 non-trainable params" in text
    lines = text.splitlines()
    assert any(line.split()[1:] == ["net", "Sequential", "161"] for line in lines if line.split())
    assert any(line.split()[1:] == ["net.0", "Linear", "144"] for line in lines if line.split())
    assert any(line.split()[1:] == ["net.2", "Linear", "17"] for line in lines if line.split())
    assert f"{161 * 4 / 2**20:.3f} total estimated model params size (MB)" in text


# ---------------------------------------------------------------------------------------------- LambdaCallback
def test_lambda_callback_calls_the_given_hooks() -> None:
    calls: list[tuple] = []
    cb = LambdaCallback(
        setup=lambda trainer, task, stage: calls.append(("setup", stage)),
        on_train_batch_end=lambda trainer, task, outputs, batch, batch_idx: calls.append(("batch", batch_idx)),
        on_validation_epoch_end=lambda trainer, task: calls.append(("val", trainer.global_step)),
        on_fit_end=lambda trainer, task: calls.append(("fit_end", trainer.global_step)),
    )
    Trainer(**quiet(max_epochs=1, callbacks=[cb])).fit(
        Regression(), loader(regression_data(24), 8), loader(regression_data(8), 8)
    )
    assert calls == [("setup", "fit"), ("batch", 0), ("batch", 1), ("batch", 2), ("val", 3), ("fit_end", 3)]


def test_lambda_callback_rejects_unknown_hooks() -> None:
    with pytest.raises(ValueError, match=r"\['on_epoch_end'\].*'on_train_epoch_end'"):
        LambdaCallback(on_epoch_end=lambda trainer, task: None)
    with pytest.raises(TypeError, match="on_fit_start"):
        LambdaCallback(on_fit_start="not callable")  # type: ignore[arg-type]


def test_lambda_hook_names_match_the_callback_class() -> None:
    hooks = [
        name
        for name, value in vars(Callback).items()
        if callable(value) and not name.startswith("_") and name not in ("state_dict", "load_state_dict")
    ]
    assert list(HOOK_NAMES) == hooks
    assert not set(HOOK_NAMES) & set(vars(LambdaCallback))  # no hook of its own: the given ones are the instance's


def test_lambda_callback_resolves_to_the_given_hooks_only() -> None:
    """Only ``on_train_batch_end`` given: the per-epoch hook table (trainer/hooks.py) holds it and nothing
    else, so a fit calls it once per batch and no other per-batch hook of the callback."""
    calls: list[tuple] = []
    cb = LambdaCallback(
        on_train_batch_end=lambda trainer, task, outputs, batch, batch_idx: calls.append((batch_idx, trainer._hooks))
    )
    assert {name for name in HOOK_NAMES if name in vars(cb)} == {"on_train_batch_end"}
    Trainer(**quiet(max_epochs=1, callbacks=[cb])).fit(Regression(), loader(regression_data(24), 8))
    assert [batch_idx for batch_idx, _ in calls] == [0, 1, 2]
    for resolved in (TrainHooks("trainer", Regression(), [cb]), calls[0][1]):  # by hand, and the fit's own table
        assert [h.func for h in resolved.on_train_batch_end] == [cb.hooks["on_train_batch_end"]]
        for name in TRAIN_BATCH_HOOKS:
            if name != "on_train_batch_end":
                assert getattr(resolved, name) == (), name  # not in the table: never called


# ---------------------------------------------------------------------------------------------- loggers and errors
class StepValue(Regression):
    def training_step(self, batch, batch_idx):
        self.log("global_step_value", float(self.global_step))  # logged before this step's optimizer step
        return super().training_step(batch, batch_idx)


def test_tensorboard_events_hold_logging_steps_and_values(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    Trainer(**quiet(max_epochs=2, log_every_n_steps=2, logger=logger)).fit(StepValue(), loader(regression_data(), 16))
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("global_step_value")]
    # 4 steps per epoch, 8 in all; the 2nd, 4th, ... are logging steps, logged at 1, 3, 5, 7 as in Lightning 2.6.6
    # (the 0-based index of the step), with the value logged during that step: global_step before it, the same.
    assert scalars == [(s, float(s)) for s in (1, 3, 5, 7)]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 3, 5, 7]


def test_logging_a_non_scalar_tensor_names_the_metric() -> None:
    class Bad(Regression):
        def training_step(self, batch, batch_idx):
            self.log("per_sample", batch[0][:, 0])
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match=r"self\.log\('per_sample', \.\.\.\) got a tensor of shape \(8,\)"):
        Trainer(**quiet(max_steps=1)).fit(Bad(), loader(regression_data(), 8))
