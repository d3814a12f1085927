"""Where a fit's time goes, wired into the run: the phase clock of every rank, the diagnosis made of every rank's
times on logging steps, throughput (samples, tokens, MFU), the time budget at the end of fit
(``<run dir>/efficiency.json``) and the job's goodput across restarts (``<run dir>/goodput.jsonl``).

The numbers and words come from :mod:`trainer.observability.phases` and :mod:`trainer.observability.goodput`; this
module adds what needs the Trainer and other ranks: host names (one gather at fit start), the end-of-fit gather
and the run directory. See docs/slow-runs.md.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

import torch

from trainer.data import global_batch
from trainer.distributed import comm
from trainer.distributed.launcher import run_identity
from trainer.observability import goodput
from trainer.observability.phases import DeviceTimeline, Diagnosis, PhaseClock
from trainer.storage import local_dir

if TYPE_CHECKING:  # pragma: no cover
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

# Dense peak FLOP/s of one device by the compute dtype, for MFU: a device name's part -> {dtype: FLOP/s}, from the
# makers' data sheets (without sparsity). A device not listed logs no MFU.
PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 67e12},
    "H100": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 67e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
    "L40S": {torch.bfloat16: 362.05e12, torch.float16: 362.05e12, torch.float32: 91.6e12},
    "A10G": {torch.bfloat16: 70e12, torch.float16: 70e12, torch.float32: 31.2e12},
}


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The listed peak of ``device`` computing in ``dtype`` (:data:`PEAK_FLOPS`); None when it is not listed."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for part, peaks in PEAK_FLOPS.items():
        if part in name:
            return peaks.get(dtype)
    return None


def restart_count() -> int:
    """Which attempt of the job this process is: torchrun's restart count, else SLURM's requeue count."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class Efficiency:
    """A fit's accounting on one rank. Every rank reads the same rows and computes the same metrics; rank 0 speaks
    and writes the files."""

    def __init__(self, trainer: Trainer, *, load_s: float) -> None:
        hosts = comm.all_gather_object(socket.gethostname())
        task = trainer.task
        manual = task is not None and not task.automatic_optimization
        self.diagnosis = Diagnosis(
            hosts=hosts,
            # FSDP gathers parameters in the forward; under manual optimization the whole step (backward and its
            # all-reduce too) is timed as the forward.
            forward_waits=trainer.strategy.name == "fsdp" or manual,
            backward_waits=trainer.strategy.sync_mark is None or manual,
        )
        self.folder = local_dir(trainer.log_dir) if trainer.loggers and trainer.is_global_zero else None
        self.clash_warned = False
        self.ledger = goodput.Ledger(self.folder, run_identity())
        self.ledger.start(
            step=trainer.global_step, load_s=load_s, attempt=restart_count(), world_size=trainer.world_size
        )
        precision = trainer.options.precision
        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "64": torch.float64}.get(precision)
        self.peak = device_peak_flops(trainer.device, dtype or torch.float32)

    def update(self, trainer: Trainer, rows: list[list[float]], logged: dict[str, float]) -> dict[str, float]:
        """A logging step: the interval's ``perf/`` metrics (for the loggers and ``callback_metrics``, where
        the progress bar finds them), less any name the task logged itself (``logged``: the task's value stays,
        with one warning); the goodput ledger's line."""
        metrics = self._update(trainer, rows)
        clash = sorted(metrics.keys() & logged.keys())
        if clash and not self.clash_warned:
            self.clash_warned = True
            if trainer.is_global_zero:
                log.warning(
                    "The task logs %s, a name keel uses for its own throughput metrics (docs/slow-runs.md); the "
                    "task's value is kept and keel's is not logged. Rename the task's metric to see keel's.",
                    ", ".join(clash),
                )
        return {k: v for k, v in metrics.items() if k not in logged}

    def _update(self, trainer: Trainer, rows: list[list[float]]) -> dict[str, float]:
        metrics = self.diagnosis.update(rows, speak=trainer.is_global_zero)
        if not metrics:
            return {}
        self.ledger.progress(trainer.global_step, self.diagnosis.seconds[0])
        per_second = metrics["perf/steps_per_s"]
        k, replicas = trainer.accumulate_grad_batches, trainer.strategy.data_parallel_size
        samples = global_batch.checkpoint_record(trainer)[global_batch.R_SAMPLES]
        if samples:
            metrics["perf/samples_per_s"] = per_second * samples
        task = trainer.task
        tokens = getattr(task, "tokens_per_batch", None)  # one micro-batch of one rank
        if tokens:
            metrics["perf/tokens_per_s"] = per_second * k * replicas * float(tokens)
        flops = getattr(task, "flops_per_batch", None)  # Lightning's name: one micro-batch of one rank, fwd + bwd
        if flops and self.peak:
            metrics["perf/mfu"] = per_second * k * float(flops) / self.peak
        return metrics

    def finish(self, trainer: Trainer, clock: PhaseClock) -> None:
        """The end of fit: every rank's times since the last logging step (one collective); rank 0 logs the time
        budget and the goodput, and writes ``efficiency.json`` when the run has a run directory."""
        self.diagnosis.add(comm.all_gather_object(clock.take(trainer.global_step, wait=True)))
        clock.device = None  # nothing reads the device's times after fit: no events pile up in validate/predict
        if not trainer.is_global_zero:
            return
        log.info("%s", self.diagnosis.budget_line())
        if self.folder is None:
            return
        self.ledger.progress(trainer.global_step, self.diagnosis.seconds[0], end=True)
        budget: dict[str, Any] = self.diagnosis.budget()
        budget["goodput"] = job = goodput.account(goodput.read(self.folder))
        if job["restarts"]:
            log.info(
                "Goodput of the job: %.1f%% over %d restart(s), %d step(s) recomputed, %.1f s restarting "
                "(python -m trainer.doctor goodput %s).",
                100 * job["goodput"],
                job["restarts"],
                job["steps_recomputed"],
                job["restart_s"],
                self.folder,
            )
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, "efficiency.json"), "w") as f:
            f.write(json.dumps(budget, indent=1) + "\n")


def start(trainer: Trainer, load_s: float) -> tuple[PhaseClock, Efficiency]:
    """A fresh phase clock from this step (split at the strategy's gradient sync where it can tell; on CUDA with
    the device's times from timing events) and the accounting of this fit; ``load_s``: the seconds the checkpoint
    it resumed from took to load."""
    efficiency = Efficiency(trainer, load_s=load_s)
    device = None
    if trainer.device.type == "cuda":
        device = DeviceTimeline(lambda: torch.cuda.Event(enable_timing=True))
    return PhaseClock(trainer.global_step, sync=trainer.strategy.sync_mark, device=device), efficiency
