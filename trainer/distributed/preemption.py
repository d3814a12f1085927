"""Preemption: SIGTERM / SIGUSR1 set a flag; the Trainer acts on it at a step boundary.

Handlers only set a flag (docs/design.md section 10). At the next check the ranks agree with one tiny
all-reduce (max of the flags), save a checkpoint and exit with :data:`PREEMPTED_EXIT_CODE` so that
torchrun (``--max-restarts``) or SLURM (``--requeue``) starts the job again, which resumes from
``ckpt_path="last"``. In a single process the flag is read on every step (no collective); in a
distributed run on logging steps, where a collective happens anyway, or every
``preemption_check_interval`` steps when set.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from trainer.distributed import comm

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"
SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None)


class PreemptionWatcher:
    """Installs the signal handlers for the duration of ``fit`` (main thread only)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}  # signal.signal's

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # nothing else: the loop acts on it at a step boundary
        self.signal_name = signal.Signals(signum).name

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("Trainer.fit runs outside the main thread: preemption signals are not handled.")
            return
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def due(self, global_step: int, *, interval: int, device: torch.device, world_size: int) -> bool:
        """Checked after every optimizer step: every step in one process (no collective); in a
        distributed run only every ``interval`` steps, where all ranks check together."""
        if world_size == 1:
            return self.requested
        if global_step % interval != 0:
            return False
        return self.agreed(device, world_size=world_size)

    def agreed(self, device: torch.device, *, world_size: int) -> bool:
        """True when any rank got a signal. Collective when ``world_size > 1``: all ranks call it at the same step."""
        if world_size == 1:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        comm.all_reduce(flag, "max")
        return bool(flag.item() > 0)
