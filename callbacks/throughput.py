"""ThroughputMonitor: samples/s, items/s, step time and the fraction of time spent waiting for data."""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainer.callback import Callback
from trainer.data.transfer import infer_batch_size
from trainer.distributed import comm

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

SAMPLES_PER_SEC = "throughput/samples_per_sec"
ITEMS_PER_SEC = "throughput/items_per_sec"
STEP_TIME = "throughput/step_time"
DATA_WAIT_FRACTION = "throughput/data_wait_fraction"


@dataclass
class _StepRecord:
    """One optimizer step: wall time (data wait included), the part spent waiting, global samples,
    and the local ``num_items`` (a device tensor, a number, or None when the step output had none)."""

    seconds: float
    wait: float
    samples: int
    items: torch.Tensor | float | None


class ThroughputMonitor(Callback):
    """Measures training throughput with ``time.perf_counter`` and logs it on logging steps.

    Timeline of one micro-batch, as the hooks see it: the time from one ``on_train_batch_end`` to the
    next ``on_train_batch_start`` is spent fetching the batch (the loader's ``next`` and the transfer to
    the device happen there), the rest computing. An optimizer step's wall time is the sum over its
    micro-batches of the time since the previous ``on_train_batch_end`` (the first micro-batch of an
    epoch counts from ``on_train_epoch_start``, so the loader's start-up is data wait; time spent in
    validation is excluded).

    At each logging step (``trainer.is_logging_step``) it logs, over the last ``window`` optimizer steps:

    * ``throughput/samples_per_sec``: global samples (each micro-batch's first dimension times
      ``trainer.world_size``, as the progress bar counts them) per second of wall time;
    * ``throughput/items_per_sec``: global ``num_items`` per second, when ``training_step`` returns a
      dict with ``num_items`` (tokens, say). It may be a device tensor: it is summed on the device and
      read only here, then summed over ranks (one ``all_gather_object``, on every rank, at every logging
      step when ``world_size > 1``);
    * ``throughput/step_time``: mean wall seconds per optimizer step;
    * ``throughput/data_wait_fraction``: the share of that wall time spent waiting for data.

    Host-device sync: none on other steps. On CUDA it calls ``torch.cuda.synchronize`` at logging steps
    only, before reading the clock, so the window between two logging steps contains all the device
    work queued in it (a single step's time measures host dispatch; the window's sums are exact when
    ``window`` is a multiple of ``log_every_n_steps``).

    Timing is local to each rank; rank 0's numbers are the ones written (``trainer.log_metrics``).

    Args:
        window: Number of most recent optimizer steps the logged values average over (>= 1).

    Raises:
        ValueError: ``window`` is not an integer >= 1.
    """

    def __init__(self, window: int = 50) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"ThroughputMonitor(window={window!r}): expected an integer >= 1.")
        self.window = window
        self._records: collections.deque[_StepRecord] = collections.deque(maxlen=window)
        self.last_values: dict[str, float] = {}  # the values most recently logged
        self._reset_step()
        self._last_end: float | None = None

    def _reset_step(self) -> None:
        self._seconds = 0.0
        self._wait = 0.0
        self._samples = 0
        self._items: torch.Tensor | float | None = None

    # ------------------------------------------------------------------ clock
    def on_train_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._records.clear()
        self._reset_step()

    def on_train_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._last_end = time.perf_counter()

    def on_validation_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        # Validation inside fit runs between a step's on_train_batch_end and the next batch: not data wait.
        self._last_end = time.perf_counter()

    def on_train_batch_start(self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._wait += now - self._last_end

    def on_train_batch_end(
        self, trainer: Trainer, task: TaskModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        logging_step = trainer.is_logging_step
        if logging_step and trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)  # the only sync: logging steps (docs/design.md section 11)
        now = time.perf_counter()
        if self._last_end is not None:
            self._seconds += now - self._last_end
        self._last_end = now
        self._samples += (infer_batch_size(batch) or 0) * trainer.world_size
        num_items = outputs.get("num_items") if isinstance(outputs, dict) else None
        if num_items is not None:
            # Stays on the device: a tensor add queues work, it does not read the value.
            self._items = num_items if self._items is None else self._items + num_items
        if trainer.optimizer_stepped:
            self._records.append(_StepRecord(self._seconds, self._wait, self._samples, self._items))
            self._reset_step()
        if logging_step:
            self._log(trainer)

    # ------------------------------------------------------------------ logging step
    def compute(self, trainer: Trainer) -> dict[str, float]:
        """The window's throughput metrics. Reads ``num_items`` (a sync) and, with several ranks, gathers
        it (a collective): call it on every rank at the same point, on logging steps only."""
        records = list(self._records)
        seconds = sum(r.seconds for r in records)
        item_values = [r.items for r in records if r.items is not None]
        local_items: float | None = None
        if item_values:
            tensors = [
                torch.as_tensor(v, dtype=torch.float64).reshape(()) for v in item_values if isinstance(v, torch.Tensor)
            ]
            numbers = [float(v) for v in item_values if not isinstance(v, torch.Tensor)]
            local_items = sum(numbers) + (float(torch.stack(tensors).sum()) if tensors else 0.0)  # one host read
        if trainer.world_size > 1:
            # Collective on every rank (even those without num_items), on logging steps only.
            gathered = [v for v in comm.all_gather_object(local_items) if v is not None]
            global_items = sum(gathered) if gathered else None
        else:
            global_items = local_items
        if not records or seconds <= 0:
            return {}
        metrics = {
            SAMPLES_PER_SEC: sum(r.samples for r in records) / seconds,
            STEP_TIME: seconds / len(records),
            DATA_WAIT_FRACTION: sum(r.wait for r in records) / seconds,
        }
        if global_items is not None:
            metrics[ITEMS_PER_SEC] = global_items / seconds
        return metrics

    def _log(self, trainer: Trainer) -> None:
        metrics = self.compute(trainer)
        if metrics:
            self.last_values = metrics
            trainer.log_metrics(metrics)
