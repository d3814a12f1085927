"""The console progress bar: a tqdm bar on a terminal, periodic log lines everywhere else.

The Trainer adds a :class:`ProgressBar` unless ``enable_progress_bar=False`` or a callback with
``is_progress_bar = True`` is already in the list. Like every callback it runs on every rank; only
global rank 0 draws or logs anything (docs/design.md section 7).

It never waits for a device: the numbers it shows come from ``trainer.progress_bar_metrics`` (host
floats the Trainer refreshes on logging steps), from the ``perf/`` entries of ``trainer.callback_metrics``
(CPU tensors the Trainer makes from host floats on logging steps, docs/slow-runs.md) and from batch
shapes, so it adds no host-device sync to any step (docs/design.md section 11). tqdm is imported when
the first bar is drawn.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import shutil
import sys
import time
from typing import IO, TYPE_CHECKING, Any

from trainer.callback import Callback
from trainer.data.transfer import infer_batch_size

if TYPE_CHECKING:  # pragma: no cover
    from tqdm import tqdm

    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

_now = time.monotonic  # module-level so tests can substitute a clock


def _compact(value: float) -> str:
    """A rate at 4 significant digits, thousands and millions shortened: ``3013``, ``12.35k``, ``1.235M``."""
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= 10 * scale:
            return f"{value / scale:.4g}{unit}"
    return f"{value:.4g}"


# keel's shares are shown as percentages, its rates shortened: the postfix stays short enough for the bar
_PERCENT = {"data_wait": "{:.0%}", "mfu": "{:.1%}"}


def _format_metrics(metrics: dict[str, float]) -> str:
    """``"loss=0.6931 val/acc=0.5 data_wait=3% tokens/s=12.35k"``: the task's values with 4 significant digits."""
    shown = []
    for name, value in metrics.items():
        if name in _PERCENT:
            text = _PERCENT[name].format(value)
        elif name.endswith("/s"):
            text = _compact(value)
        else:
            text = f"{value:.4g}"
        shown.append(f"{name}={text}")
    return " ".join(shown)


# keel's own numbers shown after the task's: the name in the bar for each perf/ metric (docs/slow-runs.md)
_PERF_SHOWN = {"perf/data_wait_frac": "data_wait", "perf/tokens_per_s": "tokens/s", "perf/mfu": "mfu"}


def _shown_metrics(trainer: Trainer) -> dict[str, float]:
    """The task's bar metrics, then keel's perf/ metrics of the last logging step by their short names (samples/s
    the bar counts itself)."""
    logged = trainer.callback_metrics
    bar = trainer.progress_bar_metrics  # a task's own name wins, as for the perf/ names themselves
    perf = {short: float(logged[name]) for name, short in _PERF_SHOWN.items() if name in logged and short not in bar}
    return {**bar, **perf}


def _format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=max(0, int(round(seconds)))))


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ProgressBar(Callback):
    """Shows training progress on global rank 0.

    On a terminal (``stream.isatty()``): one tqdm bar per training epoch counting micro-batches
    (total ``trainer.num_training_batches``, unknown when None), described ``"Epoch E"``, with a postfix
    of ``step``, the ``trainer.progress_bar_metrics``, keel's ``data_wait``, ``tokens/s`` and ``mfu`` when
    logged, and ``samples/s``; the ETA is tqdm's. The counter
    moves every micro-batch, the postfix is rebuilt every ``refresh_rate`` micro-batches. Validation and
    test get their own transient bar (``leave=False``).

    Elsewhere (CI, a file): no bar; an INFO log line every ``log_every_n_steps_when_not_tty`` optimizer
    steps, ``epoch E step S/total | loss=0.6931 | 123.4 samples/s | eta 0:01:02``; ``/total`` and the
    ETA appear when the number of optimizer steps is known (``max_steps``, or the epoch length times
    ``max_epochs``).

    samples/s counts the global throughput: the first tensor's first dimension of each micro-batch
    (``infer_batch_size``) times ``trainer.world_size``.

    Args:
        refresh_rate: Rebuild the bar's postfix every this many micro-batches (>= 1).
        log_every_n_steps_when_not_tty: Log a progress line every this many optimizer steps when the
            stream is not a terminal (>= 1).
        stream: Where the bar goes; ``sys.stderr`` (looked up when a bar starts) when None.

    Raises:
        ValueError: ``refresh_rate`` or ``log_every_n_steps_when_not_tty`` is not an integer >= 1.
    """

    is_progress_bar = True

    def __init__(
        self,
        refresh_rate: int = 1,
        log_every_n_steps_when_not_tty: int = 50,
        stream: IO[str] | None = None,
    ) -> None:
        for name, value in (
            ("refresh_rate", refresh_rate),
            ("log_every_n_steps_when_not_tty", log_every_n_steps_when_not_tty),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ProgressBar {name}={value!r} is invalid; expected an integer >= 1.")
        self.refresh_rate = refresh_rate
        self.log_every_n_steps_when_not_tty = log_every_n_steps_when_not_tty
        self._stream = stream
        self._train_bar: tqdm | None = None
        self._eval_bar: tqdm | None = None
        # Throughput over the epoch (bar) and over the last log window (log lines).
        self._epoch_batches = 0
        self._epoch_samples = 0
        self._epoch_start = 0.0
        self._window_samples = 0
        self._window_start = 0.0
        # ETA: optimizer steps done since on_train_start, and when it ran.
        self._run_start = 0.0
        self._run_start_step = 0
        self._last_logged_step = -1
        self._log_lines = False  # stream is not a terminal: log lines instead of a bar

    @property
    def stream(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stderr

    @property
    def is_tty(self) -> bool:
        return _is_tty(self.stream)

    # ------------------------------------------------------------------ training
    def on_train_start(self, trainer: Trainer, task: TaskModule) -> None:
        if not trainer.is_global_zero:
            return
        self._run_start = self._window_start = _now()
        self._run_start_step = self._last_logged_step = trainer.global_step
        self._window_samples = 0

    def on_train_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        if not trainer.is_global_zero:
            return
        self._epoch_batches = self._epoch_samples = 0
        self._epoch_start = _now()
        self._log_lines = not self.is_tty
        if not self._log_lines:
            self._close_train_bar()
            self._train_bar = self._new_bar(
                desc=f"Epoch {trainer.current_epoch}", total=trainer.num_training_batches, leave=True
            )

    def on_train_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        samples = (infer_batch_size(batch) or 0) * trainer.strategy.data_parallel_size  # shapes only: no sync
        self._epoch_batches += 1
        self._epoch_samples += samples
        self._window_samples += samples
        bar = self._train_bar
        if bar is not None:
            if self._epoch_batches == 1 and batch_idx > 0:  # resumed mid-epoch: start the count there
                bar.n = bar.last_print_n = bar.initial = batch_idx
            if self._epoch_batches % self.refresh_rate == 0:
                bar.set_postfix_str(self._postfix(trainer), refresh=False)
            bar.update(1)  # tqdm redraws at most every mininterval
        elif self._log_lines:
            self._maybe_log_line(trainer, batch_idx)

    def _postfix(self, trainer: Trainer) -> str:
        parts = [f"step={trainer.global_step}"]
        if shown := _shown_metrics(trainer):
            parts.append(_format_metrics(shown))
        elapsed = _now() - self._epoch_start
        if elapsed > 0 and self._epoch_samples:
            parts.append(f"samples/s={_compact(self._epoch_samples / elapsed)}")
        return " ".join(parts)

    def _maybe_log_line(self, trainer: Trainer, batch_idx: int) -> None:
        """Logs one line when an optimizer step that is a multiple of the interval just finished (after batch
        ``batch_idx`` of the epoch)."""
        step = trainer.global_step
        if step == self._last_logged_step or step % self.log_every_n_steps_when_not_tty != 0:
            return  # not a step end (micro-batch inside a window), or not a logging step
        self._last_logged_step = step
        now = _now()
        total = self._total_steps(trainer, batch_idx)
        parts = [f"epoch {trainer.current_epoch} step {step}" + (f"/{total}" if total is not None else "")]
        if shown := _shown_metrics(trainer):
            parts.append(_format_metrics(shown))
        window = now - self._window_start
        if window > 0 and self._window_samples:
            parts.append(f"{_compact(self._window_samples / window)} samples/s")
        steps_done = step - self._run_start_step
        if total is not None and steps_done > 0 and now > self._run_start:
            parts.append(f"eta {_format_eta((total - step) * (now - self._run_start) / steps_done)}")
        log.info(" | ".join(parts))
        self._window_start, self._window_samples = now, 0

    @staticmethod
    def _total_steps(trainer: Trainer, batch_idx: int | None = None) -> int | None:
        """Optimizer steps of the whole run when known: ``max_steps``, or the steps taken so far plus those left
        (the rest of this epoch after batch ``batch_idx``, None: all of it; then the remaining epochs; a short last
        accumulation window is a step), whichever comes first. Counted from where the run is, not from step 0, so
        that a run resumed at another world size (a different number of batches an epoch) shows its real end."""
        candidates: list[int] = []
        if trainer.max_steps != -1:
            candidates.append(trainer.max_steps)
        batches, epochs = trainer.num_training_batches, trainer.max_epochs
        if batches is not None and epochs is not None and epochs != -1:
            k = trainer.accumulate_grad_batches
            per_epoch = math.ceil(batches / k)
            left = per_epoch if batch_idx is None else math.ceil(max(batches - batch_idx - 1, 0) / k)
            candidates.append(trainer.global_step + left + per_epoch * max(epochs - trainer.current_epoch - 1, 0))
        return min(candidates) if candidates else None

    def on_train_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        if trainer.is_global_zero:
            if self._train_bar is not None:
                self._train_bar.set_postfix_str(self._postfix(trainer), refresh=False)
            self._close_train_bar()

    # ------------------------------------------------------------------ evaluation
    def on_validation_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._start_eval_bar(trainer, "Sanity checking" if trainer.sanity_checking else "Validation")

    def on_validation_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._eval_bar is not None:
            self._eval_bar.update(1)

    def on_validation_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._close_eval_bar()

    def on_test_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._start_eval_bar(trainer, "Testing")

    def on_test_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._eval_bar is not None:
            self._eval_bar.update(1)

    def on_test_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        self._close_eval_bar()

    def _start_eval_bar(self, trainer: Trainer, desc: str) -> None:
        if trainer.is_global_zero and self.is_tty:
            self._close_eval_bar()
            counts = {
                "Sanity checking": trainer.num_sanity_val_batches,
                "Validation": trainer.num_val_batches,
                "Testing": trainer.num_test_batches,
            }.get(desc, [])
            known = [c for c in counts if c is not None]
            total = sum(known) if counts and len(known) == len(counts) else None
            self._eval_bar = self._new_bar(desc=desc, total=total, leave=False)

    # ------------------------------------------------------------------ closing
    def on_exception(self, trainer: Trainer, task: TaskModule, exception: BaseException) -> None:
        self._close_all()

    def teardown(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        self._close_all()

    def _new_bar(self, *, desc: str, total: int | None, leave: bool) -> tqdm:
        from tqdm import tqdm

        # The bar is trimmed to the terminal's width: tqdm follows a real terminal as it resizes; a stream without
        # one (a terminal emulator's pipe, a notebook) gets COLUMNS or the process's terminal, else 80 columns.
        try:
            os.get_terminal_size(self.stream.fileno())
            follow, ncols = True, None
        except (AttributeError, OSError, ValueError):
            follow, ncols = False, shutil.get_terminal_size().columns
        return tqdm(total=total, desc=desc, leave=leave, file=self.stream, dynamic_ncols=follow, ncols=ncols, unit="it")

    def _close_train_bar(self) -> None:
        if self._train_bar is not None:
            self._train_bar.close()
            self._train_bar = None

    def _close_eval_bar(self) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None

    def _close_all(self) -> None:
        self._close_eval_bar()
        self._close_train_bar()
