"""Tests for trainer/observability/progress.py with a fake trainer (a SimpleNamespace holding what the bar reads)."""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trainer.observability import progress as progress_mod
from trainer.observability.progress import ProgressBar


class TTYStream(io.StringIO):
    """A StringIO that claims to be a terminal."""

    def isatty(self) -> bool:
        return True


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_trainer(**overrides: Any) -> SimpleNamespace:
    values: dict[str, Any] = dict(
        is_global_zero=True,
        world_size=1,
        global_step=0,
        current_epoch=0,
        num_training_batches=8,
        max_steps=-1,
        max_epochs=2,
        accumulate_grad_batches=2,
        progress_bar_metrics={},
        callback_metrics={},
        sanity_checking=False,
        num_sanity_val_batches=[2],
        num_val_batches=[3, 1],
        num_test_batches=[None],
    )
    values.update(overrides)
    values.setdefault("strategy", SimpleNamespace(data_parallel_size=values["world_size"]))  # no tensor parallelism
    return SimpleNamespace(**values)


def run_epoch(
    bar: ProgressBar,
    trainer: SimpleNamespace,
    *,
    batch_size: int = 4,
    clock: FakeClock | None = None,
    metrics_at_step: Any = None,
    end_epoch: bool = True,
) -> None:
    """Drives one epoch through the hooks the way the Trainer calls them (accumulation included)."""
    bar.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
    for batch_idx in range(trainer.num_training_batches):
        if clock is not None:
            clock.t += 0.5
        batch = (torch.zeros(batch_size, 3), torch.zeros(batch_size, dtype=torch.long))
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            trainer.global_step += 1
            if metrics_at_step is not None:
                trainer.progress_bar_metrics.update(metrics_at_step(trainer.global_step))
        bar.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, batch, batch_idx)  # type: ignore[arg-type]
    if end_epoch:
        bar.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
        trainer.current_epoch += 1


@pytest.fixture
def no_tensor_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any read of a tensor's value (a host-device sync on GPU) fails the test."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the progress bar read a tensor's value")

    for name in ("item", "__float__", "__int__", "__bool__", "tolist", "__format__", "__repr__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)


@pytest.mark.parametrize(
    "kwargs", [{"refresh_rate": 0}, {"refresh_rate": -1}, {"refresh_rate": 1.5}, {"log_every_n_steps_when_not_tty": 0}]
)
def test_invalid_arguments_name_the_option(kwargs: dict[str, Any]) -> None:
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        ProgressBar(**kwargs)


def test_is_progress_bar_marker() -> None:
    assert ProgressBar.is_progress_bar is True


def test_not_tty_logs_every_n_steps(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, no_tensor_reads: None
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(progress_mod, "_now", clock)
    stream = io.StringIO()
    bar = ProgressBar(log_every_n_steps_when_not_tty=2, stream=stream)
    trainer = make_trainer(world_size=2)
    caplog.set_level(logging.INFO, logger="trainer.observability.progress")
    bar.on_train_start(trainer, None)  # type: ignore[arg-type]
    for _ in range(2):  # 2 epochs x 8 micro-batches, accumulate 2 -> 8 steps
        run_epoch(bar, trainer, clock=clock, metrics_at_step=lambda s: {"loss": 1.0 / s, "val/acc": 0.123456})
    bar.teardown(trainer, None, "fit")  # type: ignore[arg-type]

    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.observability.progress"]
    assert len(lines) == 4  # steps 2, 4, 6, 8
    assert stream.getvalue() == ""  # no bar on a non-terminal
    # Each step: 2 micro-batches of 0.5 s with 4 samples x 2 ranks each -> 16 samples/s; 1 s per step.
    assert lines[0] == "epoch 0 step 2/8 | loss=0.5 val/acc=0.1235 | 16 samples/s | eta 0:00:06"
    assert lines[1].startswith("epoch 0 step 4/8 | loss=0.25 ")
    assert lines[2].startswith("epoch 1 step 6/8 ")
    assert lines[3].endswith("| 16 samples/s | eta 0:00:00")


def test_not_tty_total_from_max_steps_and_unknown_total(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_mod, "_now", FakeClock())
    caplog.set_level(logging.INFO, logger="trainer.observability.progress")
    trainer = make_trainer(max_steps=3, accumulate_grad_batches=1, num_training_batches=4)
    bar = ProgressBar(log_every_n_steps_when_not_tty=1, stream=io.StringIO())
    bar.on_train_start(trainer, None)  # type: ignore[arg-type]
    run_epoch(bar, trainer)
    assert caplog.records[0].getMessage().startswith("epoch 0 step 1/3")  # min(max_steps, 4 x 2 epochs)

    caplog.clear()
    trainer = make_trainer(max_epochs=-1, accumulate_grad_batches=1, num_training_batches=None)
    bar = ProgressBar(log_every_n_steps_when_not_tty=1, stream=io.StringIO())
    bar.on_train_start(trainer, None)  # type: ignore[arg-type]
    bar.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
    trainer.global_step = 1
    bar.on_train_batch_end(trainer, None, {}, {"x": torch.zeros(2)}, 0)  # type: ignore[arg-type]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("epoch 0 step 1 ") or line == "epoch 0 step 1"
    assert "/" not in line.split("|")[0] and "eta" not in line


def test_total_steps_counts_short_last_window() -> None:
    trainer = make_trainer(num_training_batches=7, accumulate_grad_batches=2, max_epochs=3)
    assert ProgressBar._total_steps(trainer) == 12  # ceil(7 / 2) x 3


def test_total_after_a_resume_at_another_world_size_is_where_the_run_ends(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved on 2 ranks at step 42 (28 steps an epoch; half of epoch 1 done), resumed on 1 rank: the epoch now has 56
    batches and resumes at batch 28, so the run ends at step 70. Counting every epoch at today's length said 112."""
    monkeypatch.setattr(progress_mod, "_now", FakeClock())
    caplog.set_level(logging.INFO, logger="trainer.observability.progress")
    trainer = make_trainer(
        global_step=42, current_epoch=1, num_training_batches=56, accumulate_grad_batches=1, max_epochs=2
    )
    bar = ProgressBar(log_every_n_steps_when_not_tty=1, stream=io.StringIO())
    bar.on_train_start(trainer, None)  # type: ignore[arg-type]
    bar.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
    for batch_idx in (28, 29):
        trainer.global_step += 1
        bar.on_train_batch_end(trainer, None, {}, (torch.zeros(8, 3),), batch_idx)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("epoch 1 step 43/70") and lines[1].startswith("epoch 1 step 44/70")


def test_non_zero_rank_does_nothing(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, no_tensor_reads: None
) -> None:
    caplog.set_level(logging.DEBUG)
    for stream in (io.StringIO(), TTYStream()):
        bar = ProgressBar(log_every_n_steps_when_not_tty=1, stream=stream)
        trainer = make_trainer(is_global_zero=False)
        bar.on_train_start(trainer, None)  # type: ignore[arg-type]
        run_epoch(bar, trainer, end_epoch=False)
        assert bar._train_bar is None
        bar.on_validation_epoch_start(trainer, None)  # type: ignore[arg-type]
        bar.on_validation_batch_end(trainer, None, None, torch.zeros(2), 0)  # type: ignore[arg-type]
        bar.on_validation_epoch_end(trainer, None)  # type: ignore[arg-type]
        bar.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
        bar.teardown(trainer, None, "fit")  # type: ignore[arg-type]
        assert stream.getvalue() == ""
    assert not [r for r in caplog.records if r.name == "trainer.observability.progress"]


def test_tty_bar_writes_and_closes_at_epoch_end(caplog: pytest.LogCaptureFixture, no_tensor_reads: None) -> None:
    caplog.set_level(logging.INFO, logger="trainer.observability.progress")
    stream = TTYStream()
    bar = ProgressBar(refresh_rate=2, stream=stream)
    trainer = make_trainer(progress_bar_metrics={"loss": 0.693147})
    bar.on_train_start(trainer, None)  # type: ignore[arg-type]
    run_epoch(bar, trainer, end_epoch=False)
    tqdm_bar = bar._train_bar
    assert tqdm_bar is not None and tqdm_bar.n == 8 and tqdm_bar.total == 8
    assert tqdm_bar.desc.startswith("Epoch 0")
    bar.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
    assert bar._train_bar is None and tqdm_bar.disable  # closed
    text = stream.getvalue()
    assert "Epoch 0" in text and "8/8" in text
    assert "step=4" in text and "loss=0.6931" in text and "samples/s=" in text
    assert not [r for r in caplog.records if r.name == "trainer.observability.progress"]  # a bar, not log lines


def test_tty_postfix_refreshes_every_refresh_rate_batches(no_tensor_reads: None) -> None:
    stream = TTYStream()
    bar = ProgressBar(refresh_rate=3, stream=stream)
    trainer = make_trainer(num_training_batches=None, accumulate_grad_batches=1)
    bar.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
    assert bar._train_bar is not None and bar._train_bar.total is None  # unknown length
    postfixes = []
    for batch_idx in range(6):
        trainer.global_step += 1
        bar.on_train_batch_end(trainer, None, {}, torch.zeros(2, 1), batch_idx)  # type: ignore[arg-type]
        postfixes.append(bar._train_bar.postfix)
    assert not postfixes[0] and not postfixes[1]  # no postfix before the first refresh
    assert "step=3" in postfixes[2] and postfixes[3] == postfixes[4] == postfixes[2]
    assert "step=6" in postfixes[5]
    bar.on_exception(trainer, None, RuntimeError("boom"))  # type: ignore[arg-type]
    assert bar._train_bar is None


def test_tty_resume_mid_epoch_starts_count_at_batch(no_tensor_reads: None) -> None:
    bar = ProgressBar(stream=TTYStream())
    trainer = make_trainer(num_training_batches=10, accumulate_grad_batches=1)
    bar.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
    for batch_idx in range(6, 10):
        bar.on_train_batch_end(trainer, None, {}, torch.zeros(2, 1), batch_idx)  # type: ignore[arg-type]
    assert bar._train_bar is not None and bar._train_bar.n == 10
    bar.teardown(trainer, None, "fit")  # type: ignore[arg-type]
    assert bar._train_bar is None


def test_validation_bar_is_transient_and_only_on_tty(no_tensor_reads: None) -> None:
    stream = TTYStream()
    bar = ProgressBar(stream=stream)
    trainer = make_trainer(sanity_checking=True)
    bar.on_validation_epoch_start(trainer, None)  # type: ignore[arg-type]
    val_bar = bar._eval_bar
    assert val_bar is not None and val_bar.desc.startswith("Sanity checking") and val_bar.leave is False
    for batch_idx in range(3):
        bar.on_validation_batch_end(trainer, None, None, torch.zeros(2), batch_idx)  # type: ignore[arg-type]
    assert val_bar.n == 3
    bar.on_validation_epoch_end(trainer, None)  # type: ignore[arg-type]
    assert bar._eval_bar is None and val_bar.disable
    assert "Sanity checking" in stream.getvalue()

    plain = io.StringIO()
    bar = ProgressBar(stream=plain)
    bar.on_validation_epoch_start(make_trainer(), None)  # type: ignore[arg-type]
    assert bar._eval_bar is None
    bar.on_validation_batch_end(make_trainer(), None, None, torch.zeros(2), 0)  # type: ignore[arg-type]
    bar.on_validation_epoch_end(make_trainer(), None)  # type: ignore[arg-type]
    assert plain.getvalue() == ""


def test_default_stream_is_stderr_looked_up_late(monkeypatch: pytest.MonkeyPatch) -> None:
    bar = ProgressBar()
    replacement = io.StringIO()
    monkeypatch.setattr("sys.stderr", replacement)
    assert bar.stream is replacement and bar.is_tty is False


# ---------------------------------------------------------------------- the run summary
def test_every_fit_ends_with_a_summary_of_the_logged_values_at_4_digits(caplog, tmp_path) -> None:
    from models import Regression, loader, quiet, regression_data

    from trainer import Trainer

    task = Regression()
    trainer = Trainer(**quiet(max_steps=4, log_every_n_steps=2, default_root_dir=str(tmp_path)))
    with caplog.at_level(logging.INFO, logger="trainer.trainer"):
        trainer.fit(task, loader(regression_data(), 8))
    block = caplog.text[caplog.text.index("keel run summary") :]
    assert "logs             - (no logger)" in block and "last checkpoint  -" in block
    assert "trained          4 steps, " in block
    logged = {k: v for k, v in trainer.logged_metrics.items() if k != "epoch"}
    assert logged  # the values the loggers (here none) would have received at step 4
    for name, value in logged.items():
        assert f"  {name:<30} {value:.4g}\n" in block + "\n"
    assert "  epoch " not in block  # epoch has its own line


def test_the_summary_can_be_turned_off_and_says_when_nothing_was_logged(caplog) -> None:
    from models import Regression, loader, quiet, regression_data

    from trainer import Trainer
    from trainer.observability import summary

    trainer = Trainer(**quiet(max_steps=1, log_every_n_steps=50))
    with caplog.at_level(logging.INFO, logger="trainer.trainer"):
        trainer.fit(Regression(), loader(regression_data(), 8))
    assert "metrics          - (none logged: no logging step ran; see log_every_n_steps)" in caplog.text
    caplog.clear()
    trainer.summary_on_fit_end = False
    with caplog.at_level(logging.INFO, logger="trainer.trainer"):
        trainer.fit(Regression(), loader(regression_data(), 8))
    assert "keel run summary" not in caplog.text
    assert summary.of_fit(trainer, 1.0)["run_dir"] == trainer.default_root_dir


def test_the_evaluation_bar_counts_to_the_batches_it_will_run_and_keels_numbers_are_short() -> None:
    from trainer.observability.progress import _format_metrics

    stream = io.StringIO()
    stream.isatty = lambda: True  # type: ignore[method-assign]
    bar = ProgressBar(stream=stream)
    trainer = make_trainer()
    totals = {}
    for start, desc in ((bar.on_validation_epoch_start, "Validation"), (bar.on_test_epoch_start, "Testing")):
        start(trainer, None)  # type: ignore[arg-type]
        totals[desc] = bar._eval_bar.total
    trainer.sanity_checking = True
    bar.on_validation_epoch_start(trainer, None)  # type: ignore[arg-type]
    totals["Sanity checking"] = bar._eval_bar.total
    bar._close_all()
    assert totals == {"Validation": 4, "Testing": None, "Sanity checking": 2}  # a loader without len(): no total
    shown = {"train/loss": 0.000123456, "data_wait": 0.0006681, "mfu": 0.41234, "tokens/s": 123456.0}
    assert _format_metrics(shown) == "train/loss=0.0001235 data_wait=0% mfu=41.2% tokens/s=123.5k"


def test_each_distinct_warning_is_shown_once_per_run_even_when_a_library_resets_the_registry() -> None:
    import warnings

    from trainer.observability import rank_zero

    shown: list[str] = []
    rank_zero._SHOWN_WARNINGS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # what a library's catch_warnings() block leaves behind: no dedup by Python
        warnings.showwarning = rank_zero._show_once(lambda message, *rest: shown.append(str(message)))
        for _ in range(12):
            warnings.warn("a view of a sharded parameter", UserWarning, stacklevel=1)
        warnings.warn("another warning", UserWarning, stacklevel=1)
        warnings.warn("a view of a sharded parameter", FutureWarning, stacklevel=1)  # another category: shown
        assert shown == ["a view of a sharded parameter", "another warning", "a view of a sharded parameter"]
        rank_zero._SHOWN_WARNINGS.clear()  # what a new Trainer (a new run) does
        warnings.warn("another warning", UserWarning, stacklevel=1)
    assert shown[-1] == "another warning" and len(shown) == 4


@pytest.mark.parametrize("columns", [60, 130])
def test_the_bar_fits_the_terminal_width_whatever_the_task_logs(columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))  # what tqdm reads where the stream has no terminal size of its own
    stream = TTYStream()
    bar = ProgressBar(stream=stream)
    metrics = {"train/loss": 0.6931, "val/acc": 0.1235, "val/loss": 2.25, "a_long_metric_name": 12345.678}
    trainer = make_trainer(
        progress_bar_metrics=metrics, callback_metrics={"perf/data_wait_frac": torch.tensor(0.0006681)}
    )
    bar.on_train_start(trainer, None)  # type: ignore[arg-type]
    run_epoch(bar, trainer)
    drawn = [line for line in stream.getvalue().replace("\n", "\r").split("\r") if line.strip()]
    assert drawn and max(len(line) for line in drawn) <= columns, max(drawn, key=len)
    if columns >= 130:  # the task's first value is kept, the tail cut
        assert any("train/loss=0.6931" in line for line in drawn)


def test_a_recorded_failure_prints_one_line_unless_full_tracebacks_are_asked_for(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from trainer.observability import failures

    try:
        raise ValueError("bad batch\nsecond line")
    except ValueError as exc:
        error, tb = exc, exc.__traceback__
    monkeypatch.setattr(sys, "excepthook", lambda *args: print("python's traceback", file=sys.stderr))
    monkeypatch.setattr(failures, "_installed", False)
    path = failures.record(error, rank=1, run_dir=str(tmp_path))
    assert path == str(tmp_path / "failure-rank1.log") and "second line" in (tmp_path / "failure-rank1.log").read_text()
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    sys.excepthook(ValueError, error, tb)
    line = capsys.readouterr().err
    assert line.startswith("keel: rank 1 failed: ValueError: bad batch (test_progress.py:") and line.endswith(
        f"traceback in {path}\n"
    )
    monkeypatch.setenv("KEEL_FULL_TRACEBACK", "1")
    sys.excepthook(ValueError, error, tb)
    assert capsys.readouterr().err == "python's traceback\n"
    assert failures.record(KeyboardInterrupt(), rank=1, run_dir=str(tmp_path)) is None  # not a failure


def test_the_failure_log_of_a_run_without_a_run_directory_never_lands_in_the_current_directory(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No logger and no default_root_dir: the temporary folder (the console line names it), not the folder the
    program happened to be started in; with default_root_dir, there; with a logger, its run directory."""
    from trainer import Trainer
    from trainer.loggers import CSVLogger

    monkeypatch.chdir(tmp_path)
    bare = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert bare._known_run_dir() is None
    rooted = Trainer(logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path / "root"))
    assert rooted._known_run_dir() == str(tmp_path / "root")
    logged = Trainer(logger=CSVLogger(str(tmp_path / "logs")), enable_checkpointing=False)
    assert logged._known_run_dir() is None  # the version is not picked yet: the temporary folder too
    logged = Trainer(logger=CSVLogger(str(tmp_path / "logs"), version=3), enable_checkpointing=False)
    assert logged._known_run_dir() == logged.loggers[0].log_dir == str(tmp_path / "logs" / "keel_logs" / "version_3")
    import tempfile

    from trainer.observability import failures

    monkeypatch.setattr(failures, "install", lambda: None)  # the hook is another test's subject
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    path = failures.record(ValueError("bad batch"), rank=1, run_dir=bare._known_run_dir())
    assert path == str(tmp_path / "tmp" / "keel-failures" / "failure-rank1.log")
    assert not list(tmp_path.glob("failure-rank*"))
