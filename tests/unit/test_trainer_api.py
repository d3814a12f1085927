"""Single-process behaviour of the Trainer and TaskModule API, each checked against a reference."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from models import Regression, loader, make_net, quiet, regression_data
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from trainer import Callback, DataModule, Trainer
from trainer.step.optim import parse_optimizers


class Recorder(Callback):
    def __init__(self) -> None:
        self.outputs: list = []
        self.val_epochs = 0
        self.steps_at_val: list[int] = []

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.outputs.append(outputs)

    def on_validation_epoch_end(self, trainer, task) -> None:
        if not trainer.sanity_checking:
            self.val_epochs += 1
            self.steps_at_val.append(trainer.global_step)


def test_dict_step_output_reaches_callbacks_detached() -> None:
    class DictTask(Regression):
        def training_step(self, batch, batch_idx):
            x, y = batch
            pred = self(x)
            return {"loss": F.mse_loss(pred, y), "pred_mean": pred.mean()}

    rec = Recorder()
    Trainer(**quiet(max_steps=3, callbacks=[rec])).fit(DictTask(), loader(regression_data(), 8))
    assert len(rec.outputs) == 3
    for out in rec.outputs:
        assert set(out) == {"loss", "pred_mean"}
        assert not out["pred_mean"].requires_grad and not out["loss"].requires_grad


def test_validate_and_test_return_batch_size_weighted_means() -> None:
    task = Regression()
    val = regression_data(23, seed=3)
    trainer = Trainer(**quiet(max_steps=2))
    trainer.fit(task, loader(regression_data(), 8))
    (metrics,) = trainer.validate(task, loader(val, 5))  # batches 5,5,5,5,3
    x, y = val.tensors
    with torch.no_grad():
        expected = (
            sum(F.mse_loss(task(x[i : i + 5]), y[i : i + 5]).item() * len(x[i : i + 5]) for i in range(0, 23, 5)) / 23
        )
    assert math.isclose(metrics["val/loss"], expected, rel_tol=1e-6)
    assert float(trainer.callback_metrics["val/loss"]) == pytest.approx(expected, rel=1e-6)
    (test_metrics,) = trainer.test(task, loader(val, 7))
    assert math.isclose(test_metrics["test/loss"], expected, rel_tol=1e-5)


def test_predict_returns_outputs_in_dataset_order() -> None:
    task = Regression()
    data = regression_data(11)
    predictions = Trainer(**quiet()).predict(task, loader(data, 4))
    assert [p.shape[0] for p in predictions] == [4, 4, 3]
    with torch.no_grad():
        assert torch.allclose(torch.cat(predictions), task(data.tensors[0]), atol=1e-6)


def test_datamodule_is_set_up_with_the_stage() -> None:
    class DM(DataModule):
        def __init__(self) -> None:
            super().__init__()
            self.stages: list[str] = []

        def setup(self, stage: str) -> None:
            self.stages.append(stage)

        def train_dataloader(self):
            return loader(regression_data(), 8)

        def val_dataloader(self):
            return loader(regression_data(16, seed=2), 8)

    dm = DM()
    trainer = Trainer(**quiet(max_epochs=1))
    trainer.fit(Regression(), datamodule=dm)
    trainer.validate(datamodule=dm)
    assert dm.stages == ["fit", "validate"]
    assert "val/loss" in trainer.callback_metrics
    with pytest.raises(ValueError, match="either dataloaders or a datamodule"):
        trainer.fit(Regression(), loader(regression_data(), 8), datamodule=dm)


def test_task_dataloader_hooks_are_used() -> None:
    class WithData(Regression):
        def train_dataloader(self):
            return loader(regression_data(), 16)

    trainer = Trainer(**quiet(max_epochs=2))
    trainer.fit(WithData())
    assert trainer.global_step == 8


def test_run_state_properties() -> None:
    task = Regression()
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        _ = task.trainer
    seen = {}

    class Probe(Callback):
        def on_train_batch_end(self, trainer, t, outputs, batch, batch_idx) -> None:
            seen.update(
                step=t.global_step,
                epoch=t.current_epoch,
                device=t.device,
                rank=t.global_rank,
                world=t.world_size,
                trainer=t.trainer,
            )

    trainer = Trainer(**quiet(max_epochs=2, callbacks=[Probe()]))
    trainer.fit(task, loader(regression_data(), 32))
    assert seen == dict(step=4, epoch=1, device=torch.device("cpu"), rank=0, world=1, trainer=trainer)


def test_limits_fast_dev_run_and_validation_schedule() -> None:
    rec = Recorder()
    trainer = Trainer(**quiet(max_epochs=3, limit_train_batches=0.5, check_val_every_n_epoch=2, callbacks=[rec]))
    trainer.fit(Regression(), loader(regression_data(), 8), loader(regression_data(16), 8))
    assert trainer.global_step == 3 * 4 and rec.val_epochs == 1 and rec.steps_at_val == [8]

    rec = Recorder()
    trainer = Trainer(**quiet(max_epochs=2, limit_train_batches=3, val_check_interval=2, callbacks=[rec]))
    trainer.fit(Regression(), loader(regression_data(), 8), loader(regression_data(16), 8))
    assert trainer.global_step == 6 and rec.steps_at_val == [2, 4, 6]

    rec = Recorder()
    trainer = Trainer(**quiet(max_epochs=5, fast_dev_run=True, callbacks=[rec]))
    trainer.fit(Regression(), loader(regression_data(), 8), loader(regression_data(16), 8))
    assert trainer.global_step == 1 and rec.val_epochs == 1

    trainer = Trainer(**quiet(max_epochs=100, max_steps=5))
    trainer.fit(Regression(), loader(regression_data(), 8))
    assert trainer.global_step == 5


def test_sanity_check_runs_but_publishes_nothing() -> None:
    calls = []

    class Counting(Regression):
        def validation_step(self, batch, batch_idx):
            calls.append(self.trainer.sanity_checking)
            return super().validation_step(batch, batch_idx)

    trainer = Trainer(**quiet(max_steps=1, num_sanity_val_steps=2, check_val_every_n_epoch=None))
    trainer.fit(Counting(), loader(regression_data(), 8), loader(regression_data(40), 8))
    assert calls == [True, True]
    assert "val/loss" not in trainer.callback_metrics


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_equals_hand_written(algorithm: str) -> None:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for x, y in loader(regression_data(), 10):
        F.mse_loss(net(x), y).backward()
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
        else:
            torch.nn.utils.clip_grad_value_(net.parameters(), 0.01)
        opt.step()
        opt.zero_grad(set_to_none=True)
    task = Regression()
    clip = 0.1 if algorithm == "norm" else 0.01
    Trainer(**quiet(max_epochs=1, gradient_clip_val=clip, gradient_clip_algorithm=algorithm)).fit(
        task, loader(regression_data(), 10)
    )
    for name, value in net.state_dict().items():
        assert torch.allclose(task.net.state_dict()[name], value, atol=1e-7, rtol=0), name


def test_accumulation_equals_big_batch_with_short_last_window() -> None:
    """10 batches of 4 with k=4 == batches of 16, 16, 8: the last window of 2 is averaged over 2."""
    data = regression_data(40, dtype=torch.float64)
    net = make_net(dtype=torch.float64)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for x, y in loader(data, 16):
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    task = Regression(dtype=torch.float64)
    trainer = Trainer(**quiet(max_epochs=1, accumulate_grad_batches=4, precision="64"))
    trainer.fit(task, loader(data, 4))
    assert trainer.global_step == 3
    for name, value in net.state_dict().items():
        assert torch.allclose(task.net.state_dict()[name], value, atol=1e-12, rtol=0), name


class Stream(IterableDataset):
    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        return iter(zip(*self.data.tensors))


def test_unknown_length_loader_accumulates_like_a_known_one() -> None:
    """An iterable without len(): the short last window is corrected by k/n before the step."""
    data = regression_data(40, dtype=torch.float64)
    known = Regression(dtype=torch.float64)
    Trainer(**quiet(max_epochs=1, accumulate_grad_batches=4, precision="64")).fit(known, loader(data, 4))
    streamed = Regression(dtype=torch.float64)
    with pytest.warns(UserWarning, match="IterableDataset|exact"):
        Trainer(**quiet(max_epochs=1, accumulate_grad_batches=4, precision="64")).fit(
            streamed, DataLoader(Stream(data), batch_size=4)
        )
    for name, value in known.net.state_dict().items():
        assert torch.allclose(streamed.net.state_dict()[name], value, atol=1e-12, rtol=0), name


def test_num_items_loss_is_normalised_by_the_global_count() -> None:
    """Token-weighted: a per-item sum over micro-batches of different sizes == one big batch mean."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g, dtype=torch.float64), torch.randn(32, 1, generator=g, dtype=torch.float64)
    mask = (torch.rand(32, generator=g) < 0.6).to(torch.float64)  # variable "tokens" per micro-batch

    class Summed(Regression):
        def training_step(self, batch, batch_idx):
            xb, yb, mb = batch
            per_item = ((self(xb) - yb) ** 2).squeeze(1) * mb
            return {"loss": per_item.sum(), "num_items": int(mb.sum().item())}

    ref = Regression(dtype=torch.float64)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    per_item = ((ref(x) - y) ** 2).squeeze(1) * mask
    (per_item.sum() / mask.sum()).backward()
    opt.step()
    task = Summed(dtype=torch.float64)
    trainer = Trainer(**quiet(max_steps=1, accumulate_grad_batches=4, precision="64", log_every_n_steps=1))
    trainer.fit(task, DataLoader(TensorDataset(x, y, mask), batch_size=8))
    for name, value in ref.net.state_dict().items():
        assert torch.allclose(task.net.state_dict()[name], value, atol=1e-12, rtol=0), name
    assert trainer.progress_bar_metrics["loss"] == pytest.approx(
        float((per_item.sum() / mask.sum()).detach()), rel=1e-12
    )


class _MaskedSum(Regression):
    """A summed loss over the items a mask keeps; ``num_items`` the kept count, as an int or a tensor; plain SGD
    (a step with zero gradients changes nothing)."""

    def __init__(self, as_tensor: bool) -> None:
        super().__init__(dtype=torch.float64)
        self.as_tensor = as_tensor

    def training_step(self, batch, batch_idx):
        xb, yb, mb = batch
        count = mb.sum().to(torch.int64)
        return {
            "loss": (((self(xb) - yb) ** 2).squeeze(1) * mb).sum(),
            "num_items": count if self.as_tensor else int(count),
        }

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_a_step_with_zero_items_changes_no_weight(as_tensor: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The middle batch keeps no item. With int counts the step is skipped (not counted); with tensor counts,
    which keel never reads, it is decided on the device: gradients times 0, the step counted, one warning at the
    epoch end. Either way the weights equal a run that never saw that batch."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 8, generator=g, dtype=torch.float64), torch.randn(24, 1, generator=g, dtype=torch.float64)
    mask = (torch.rand(24, generator=g) < 0.7).to(torch.float64)
    mask[0], mask[8:16], mask[16] = 1.0, 0.0, 1.0
    keep = torch.cat([torch.arange(8), torch.arange(16, 24)])
    reference = _MaskedSum(as_tensor)
    Trainer(**quiet(max_epochs=1, precision="64")).fit(
        reference, DataLoader(TensorDataset(x[keep], y[keep], mask[keep]), batch_size=8)
    )
    task = _MaskedSum(as_tensor)
    trainer = Trainer(**quiet(max_epochs=1, precision="64"))
    with caplog.at_level("WARNING"):
        trainer.fit(task, DataLoader(TensorDataset(x, y, mask), batch_size=8))
    for name, value in reference.state_dict().items():
        assert torch.equal(task.state_dict()[name], value), name
    if as_tensor:
        assert trainer.global_step == 3
        assert "1 optimizer step(s) of epoch 0 saw zero items (num_items) on every rank" in caplog.text
    else:
        assert trainer.global_step == 2
        assert "Step 1 saw zero items (num_items) on every rank; the optimizer step is skipped" in caplog.text


def test_bad_num_items_and_step_outputs_are_named() -> None:
    class Bad(Regression):
        def __init__(self, out) -> None:
            super().__init__()
            self.out = out

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return self.out(loss)

    cases = [
        (lambda loss: {"loss": loss, "num_items": 2.5}, "num_items=2.5"),
        (lambda loss: {"loss": loss, "num_items": -1}, "num_items=-1"),
        (lambda loss: {"value": loss}, "without 'loss'"),
        (lambda loss: loss.detach(), "does not require grad"),
        (lambda loss: loss.expand(3), "scalar"),
        (lambda loss: [loss], "return a scalar loss tensor"),
    ]
    for out, match in cases:
        with pytest.raises(ValueError, match=match):
            Trainer(**quiet(max_steps=1)).fit(Bad(out), loader(regression_data(), 8))


def test_configure_optimizers_forms() -> None:
    net = make_net()
    a = torch.optim.SGD(net.parameters(), lr=0.1)
    b = torch.optim.Adam(net.parameters(), lr=0.1)
    s = torch.optim.lr_scheduler.StepLR(a, 1)
    assert parse_optimizers(a) == ([a], [])
    opts, scheds = parse_optimizers(([a, b], [s]))
    assert opts == [a, b] and scheds[0].scheduler is s and scheds[0].interval == "epoch"
    opts, scheds = parse_optimizers(
        {"optimizer": a, "lr_scheduler": {"scheduler": s, "interval": "step", "frequency": 2}}
    )
    assert scheds[0].interval == "step" and scheds[0].frequency == 2
    opts, scheds = parse_optimizers([{"optimizer": a, "lr_scheduler": s}, {"optimizer": b}])
    assert opts == [a, b] and len(scheds) == 1
    for bad, match in [
        (None, "returned None"),
        ({"optimizer": a, "lr_scheduler": {"scheduler": s, "interval": "batch"}}, "interval='batch'"),
        ({"optimizer": a, "lr_scheduler": {"scheduler": s, "frequency": 0}}, "frequency=0"),
        ({"optimizer": a, "lr_scheduler": {"scheduler": s, "every": 1}}, "unknown lr_scheduler key"),
        ({"optim": a}, "unknown key"),
        ("adam", "returned str"),
        ({"optimizer": a, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(a)}, "needs a metric"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_optimizers(bad)


def test_precision_64_and_bf16_mixed_on_cpu() -> None:
    dtypes = {}

    class Probe(Regression):
        def training_step(self, batch, batch_idx):
            dtypes["param"] = next(self.parameters()).dtype
            dtypes["input"] = batch[0].dtype
            dtypes["matmul"] = self.net[0](batch[0]).dtype
            return super().training_step(batch, batch_idx)

    Trainer(**quiet(max_steps=1, precision="64")).fit(Probe(), loader(regression_data(), 8))
    assert dtypes == {"param": torch.float64, "input": torch.float64, "matmul": torch.float64}
    task = Probe()
    trainer = Trainer(**quiet(max_epochs=5, precision="bf16-mixed", log_every_n_steps=1))
    trainer.fit(task, loader(regression_data(), 8))
    assert dtypes == {"param": torch.float32, "input": torch.float32, "matmul": torch.bfloat16}
    (before,) = Trainer(**quiet()).validate(Regression(), loader(regression_data(), 64))
    (after,) = trainer.validate(task, loader(regression_data(), 64))
    assert after["val/loss"] < 0.5 * before["val/loss"]


def test_unadaptable_loader_warns_what_it_loses() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(**quiet(max_steps=2)).fit(Regression(), DataLoader(Stream(regression_data()), batch_size=8))
    assert any("resume" in str(w.message) for w in caught)


def test_only_task_modules_are_accepted() -> None:
    with pytest.raises(TypeError, match="expects a TaskModule"):
        Trainer(**quiet()).fit(torch.nn.Linear(2, 2), loader(regression_data(), 8))


def test_estimated_stepping_batches_matches_the_steps_taken() -> None:
    seen = {}

    class Probe(Regression):
        def configure_optimizers(self):
            seen["estimate"] = self.trainer.estimated_stepping_batches
            return super().configure_optimizers()

    for options in (
        dict(max_epochs=3, accumulate_grad_batches=3),
        dict(max_epochs=3, max_steps=5),
        dict(max_epochs=2, limit_train_batches=0.5),
    ):
        trainer = Trainer(**quiet(**options))
        trainer.fit(Probe(), loader(regression_data(), 8))
        assert seen["estimate"] == trainer.global_step, options


def test_validation_inside_an_epoch_does_not_close_training_epoch_metrics() -> None:
    class EpochLogged(Regression):
        def training_step(self, batch, batch_idx):
            self.log("train/count", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
            return super().training_step(batch, batch_idx)

    trainer = Trainer(**quiet(max_epochs=1, val_check_interval=2))
    trainer.fit(EpochLogged(), loader(regression_data(), 8), loader(regression_data(16), 8))
    assert float(trainer.callback_metrics["train/count"]) == 8  # all 8 batches, not those after the last validation
    (metrics,) = trainer.validate(trainer.task, loader(regression_data(16), 8))
    assert "train/count" not in metrics


def test_fast_dev_run_writes_no_logs_and_no_checkpoints(tmp_path) -> None:
    """A smoke test leaves nothing behind, as in Lightning: the default logger and ModelCheckpoint write nothing."""
    trainer = Trainer(default_root_dir=str(tmp_path), fast_dev_run=True, enable_progress_bar=False)
    trainer.fit(Regression(), loader(regression_data(), 8), loader(regression_data(16), 8))
    assert trainer.global_step == 1 and trainer.loggers == [] and trainer.checkpoint_callback is not None
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == []


def test_a_second_ctrl_c_stops_at_once_but_a_forwarded_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first SIGINT asks for a save at the next step; the same keypress passed on by a launcher within a
    second changes nothing; a second Ctrl-C after that raises KeyboardInterrupt (no save)."""
    import signal

    from trainer.distributed import preemption

    clock = [100.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    watcher = preemption.PreemptionWatcher()
    watcher._handle(signal.SIGINT, None)
    clock[0] += 0.01
    watcher._handle(signal.SIGINT, None)  # torchrun's agent forwarding the terminal's Ctrl-C
    assert watcher.requested and watcher.interrupted and watcher.exit_code == 130
    clock[0] += 2.0
    with pytest.raises(KeyboardInterrupt):
        watcher._handle(signal.SIGINT, None)
    sigterm = preemption.PreemptionWatcher()
    sigterm._handle(signal.SIGTERM, None)
    assert sigterm.requested and not sigterm.interrupted and sigterm.exit_code == 75


def test_a_task_built_after_the_trainer_draws_the_seeded_weights() -> None:
    """Trainer(seed=3) seeds the generators when it is built (seed + rank), so a task built after it starts from
    the same weights in every run; without it the weights came from torch's random default seed."""
    torch.seed()  # an unseeded process
    Trainer(seed=3, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    built = torch.nn.Linear(4, 2).weight.detach().clone()
    torch.manual_seed(3)
    assert torch.equal(built, torch.nn.Linear(4, 2).weight)


def test_a_local_dirpath_that_is_a_file_is_refused_when_fit_starts(tmp_path: Path) -> None:
    """Not an epoch later at the first save with a bare FileExistsError: at fit start, naming the file."""
    from trainer.checkpoint.model_checkpoint import ModelCheckpoint

    (tmp_path / "taken").write_text("a file")
    trainer = Trainer(
        **quiet(max_steps=4, enable_checkpointing=True), callbacks=[ModelCheckpoint(dirpath=tmp_path / "taken" / "ck")]
    )
    with pytest.raises(ValueError, match=r"'.*taken' is a file, so no checkpoint folder can be made there"):
        trainer.fit(Regression(), loader(regression_data(16), batch_size=4))
    assert trainer.global_step == 0


def test_the_options_line_names_only_what_differs_from_the_defaults(caplog: pytest.LogCaptureFixture) -> None:
    trainer = Trainer(**quiet(max_steps=2))  # sets keel's loggers to INFO on rank 0
    with caplog.at_level("DEBUG", logger="trainer"):
        trainer.fit(Regression(), loader(regression_data(16), batch_size=4))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Trainer options:")]
    assert "max_steps=2" in line and "enable_progress_bar=False" in line and "precision" not in line
    assert len(line) < 200
    assert any(r.levelname == "DEBUG" and "'precision': '32'" in r.getMessage() for r in caplog.records)


def test_third_party_info_lines_stay_off_the_console_unless_the_program_asks() -> None:
    """botocore logs every credentials lookup at INFO; with keel's loggers at INFO on rank 0 those lines leaked."""
    import logging

    from trainer.observability.rank_zero import QUIET_LIBRARIES, configure_logging

    names = (*QUIET_LIBRARIES, "trainer")
    saved = {name: logging.getLogger(name).level for name in names}
    try:
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.NOTSET)
        logging.getLogger("s3fs").setLevel(logging.DEBUG)  # the program's own choice
        configure_logging(0)
        assert not logging.getLogger("botocore.credentials").isEnabledFor(logging.INFO)
        assert logging.getLogger("trainer.trainer").isEnabledFor(logging.INFO)
        assert logging.getLogger("s3fs").level == logging.DEBUG
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def test_one_process_lines_name_no_rank_and_no_module_several_processes_both() -> None:
    """keel's console format, and the recipes' Hydra handler that uses it, follow the job's layout: one process
    prints ``HH:MM:SS INFO message``; several print ``HH:MM:SS INFO logger: [rank N] message``. A handler with a
    format of its own keeps it (with the rank tag where there are several processes)."""
    import io
    import logging

    from trainer.observability.rank_zero import configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level, logging.getLogger("trainer").level
    keel_like, own = io.StringIO(), io.StringIO()
    hydra = logging.StreamHandler(keel_like)
    hydra.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    custom = logging.StreamHandler(own)
    custom.setFormatter(logging.Formatter("%(name)s|%(message)s"))
    root.handlers[:] = [hydra, custom]
    try:
        for rank, world in ((0, 1), (0, 2), (0, 1)):  # a later Trainer in another layout updates the handlers
            configure_logging(rank, world)
            logging.getLogger("trainer.demo").info("hello %d", world)
    finally:
        root.handlers[:], level, trainer_level = saved
        root.setLevel(level)
        logging.getLogger("trainer").setLevel(trainer_level)
    lines = [line.split(" ", 1)[1] for line in keel_like.getvalue().splitlines()]  # the time left out
    assert lines == ["INFO hello 1", "INFO trainer.demo: [rank 0] hello 2", "INFO hello 1"]
    assert own.getvalue().splitlines() == [
        "trainer.demo|hello 1",
        "trainer.demo|[rank 0] hello 2",
        "trainer.demo|hello 1",
    ]


class CtrlC(Callback):
    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        import signal

        if trainer.global_step == 2:
            trainer._preemption._handle(signal.SIGINT, None)


@pytest.mark.parametrize("ckpt_path", [None, "last"])
def test_ctrl_c_says_how_to_continue_the_run_the_command_started(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, ckpt_path: str | None
) -> None:
    """A fit given ckpt_path=None started a new run: the same command would start another, so Ctrl-C's line says
    to run with ckpt_path='last' (null / last on a Hydra command line); with "last" the same command continues."""
    trainer = Trainer(
        **quiet(max_steps=6, default_root_dir=str(tmp_path), enable_checkpointing=True), callbacks=[CtrlC()]
    )
    with caplog.at_level("WARNING"), pytest.raises(SystemExit) as stopped:
        trainer.fit(Regression(), loader(regression_data(64), batch_size=4), ckpt_path=ckpt_path)
    assert stopped.value.code == 130
    line = next(r.getMessage() for r in caplog.records if "Stopped by Ctrl-C at step" in r.getMessage())
    if ckpt_path is None:
        assert line.endswith(
            "(to continue it, run with ckpt_path='last' (ckpt_path=last on a Hydra command line); the same command "
            "starts a new run)."
        ), line
    else:
        assert line.endswith("(run the same command again: its ckpt_path='last' resumes it)."), line
