"""Where a fit's time goes, wired into the run: the phase clock of every rank, the diagnosis made of every rank's
times on logging steps, throughput (samples, tokens, MFU), the time budget at the end of fit
(``<run dir>/efficiency.json``) and the job's goodput across restarts (``<run dir>/goodput.jsonl``).

The numbers and words come from :mod:`trainer.observability.phases` and :mod:`trainer.observability.goodput`; this
module adds what needs other ranks and the run: host names (one gather at fit start), the end-of-fit gather and
the run directory. The loop hands it what it reads (the task, the strategy, the step); it never sees the Trainer.
See docs/slow-runs.md.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

import torch

from trainer.distributed import comm
from trainer.distributed.launcher import run_identity
from trainer.observability import goodput
from trainer.observability.phases import DeviceTimeline, Diagnosis, PhaseClock

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from trainer.distributed.strategy import Strategy

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

    def __init__(
        self,
        *,
        task: nn.Module,
        strategy: Strategy,
        device: torch.device,
        precision: str,
        folder: str | None,
        speaks: bool,
        step: int,
        micro_batch: int | None,
        load_s: float,
    ) -> None:
        """``folder``: the run directory (rank 0's, where the files go), ``speaks``: this rank logs (rank 0),
        ``micro_batch``: the training loader's batch size (None when it has none), ``load_s``: the seconds the
        checkpoint it resumed from took to load."""
        hosts = comm.all_gather_object(socket.gethostname())
        manual = not getattr(task, "automatic_optimization", True)
        self.task, self.strategy, self.speaks, self.micro_batch = task, strategy, speaks, micro_batch
        self.diagnosis = Diagnosis(
            hosts=hosts,
            # FSDP gathers parameters in the forward; under manual optimization the whole step (backward and its
            # all-reduce too) is timed as the forward.
            forward_waits=strategy.name == "fsdp" or manual,
            backward_waits=strategy.sync_mark is None or manual,
        )
        self.folder = folder
        self.clash_warned = False
        self.ledger = goodput.Ledger(self.folder, run_identity())
        self.ledger.start(step=step, load_s=load_s, attempt=restart_count(), world_size=len(hosts))
        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "64": torch.float64}.get(precision)
        self.peak = device_peak_flops(device, dtype or torch.float32)
        # A fresh phase clock from this step (split at the strategy's gradient sync where it can tell; on CUDA with
        # the device's times from timing events).
        timeline = DeviceTimeline(lambda: torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else None
        self.clock = PhaseClock(step, sync=strategy.sync_mark, device=timeline)

    def update(
        self, rows: list[list[float]], logged: dict[str, float], *, step: int, accumulate: int
    ) -> dict[str, float]:
        """A logging step (``step``, with ``accumulate`` micro-batches per optimizer step): the interval's ``perf/``
        metrics (for the loggers and ``callback_metrics``, where the progress bar finds them), less any name the
        task logged itself (``logged``: the task's value stays, with one warning); the goodput ledger's line."""
        metrics = self._update(rows, step=step, accumulate=accumulate)
        clash = sorted(metrics.keys() & logged.keys())
        if clash and not self.clash_warned:
            self.clash_warned = True
            if self.speaks:
                log.warning(
                    "The task logs %s, a name keel uses for its own throughput metrics (docs/slow-runs.md); the "
                    "task's value is kept and keel's is not logged. Rename the task's metric to see keel's.",
                    ", ".join(clash),
                )
        return {k: v for k, v in metrics.items() if k not in logged}

    def _update(self, rows: list[list[float]], *, step: int, accumulate: int) -> dict[str, float]:
        metrics = self.diagnosis.update(rows, speak=self.speaks)
        if not metrics:
            return {}
        self.ledger.progress(step, self.diagnosis.seconds[0])
        per_second = metrics["perf/steps_per_s"]
        k, replicas, task = accumulate, self.strategy.data_parallel_size, self.task
        if self.micro_batch:  # samples per optimizer step, all ranks together
            metrics["perf/samples_per_s"] = per_second * replicas * self.micro_batch * k
        tokens = getattr(task, "tokens_per_batch", None)  # one micro-batch of one rank
        if tokens:
            metrics["perf/tokens_per_s"] = per_second * k * replicas * float(tokens)
        flops = getattr(task, "flops_per_batch", None)  # Lightning's name: one micro-batch of one rank, fwd + bwd
        if flops and self.peak:
            metrics["perf/mfu"] = per_second * k * float(flops) / self.peak
        return metrics

    def finish(self, step: int) -> None:
        """The end of fit (at ``step``): every rank's times since the last logging step (one collective); rank 0
        logs the time budget and the goodput, and writes ``efficiency.json`` when the run has a run directory."""
        clock = self.clock
        self.diagnosis.add(comm.all_gather_object(clock.take(step, wait=True)))
        clock.device = None  # nothing reads the device's times after fit: no events pile up in validate/predict
        if not self.speaks:
            return
        log.info("%s", self.diagnosis.budget_line())
        if self.folder is None:
            return
        self.ledger.progress(step, self.diagnosis.seconds[0], end=True)
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
