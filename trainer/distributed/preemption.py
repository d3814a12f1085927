"""Preemption and Ctrl-C: SIGTERM / SIGUSR1 / SIGINT set a flag; the Trainer acts on it at a step boundary.

Handlers only set a flag (docs/design.md section 10). At the next check the ranks agree with one tiny
all-reduce (max of the flags), save a checkpoint and exit: with :data:`PREEMPTED_EXIT_CODE` after SIGTERM or
SIGUSR1, so that torchrun (``--max-restarts``) or SLURM (``--requeue``) starts the job again, which resumes from
``ckpt_path="last"``; with :data:`INTERRUPTED_EXIT_CODE` after Ctrl-C (SIGINT on any rank). A second Ctrl-C
raises ``KeyboardInterrupt`` at once; one that follows the first within :data:`FORWARDED_WITHIN` seconds is the
same keypress forwarded by a launcher (torchrun's agent passes the terminal's SIGINT on to its workers, which the
terminal already signalled), not a second one. In a single process the flag is read on every step (no
collective); in a distributed run on logging steps, where a collective happens anyway, or every
``preemption_check_interval`` steps when set.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from trainer.distributed import comm

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a program stopped by Ctrl-C
SIGNALS = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None), signal.SIGINT) if s is not None
)
FORWARDED_WITHIN = 1.0  # seconds: a SIGINT this soon after the first is the launcher passing it on
PREEMPT, INTERRUPT = 1.0, 2.0  # the flags the ranks agree on (the largest wins: Ctrl-C on any rank)


class PreemptionWatcher:
    """Installs the signal handlers for the duration of ``fit`` (main thread only)."""

    def __init__(self) -> None:
        self.requested = False
        self.interrupted = False  # Ctrl-C (SIGINT) rather than a preemption signal
        self.announced = False
        self.signal_name: str | None = None
        self._interrupted_at: float | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}  # signal.signal's

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._interrupted_at is not None and now - self._interrupted_at > FORWARDED_WITHIN:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now, without the save
            if self._interrupted_at is None:
                self._interrupted_at, self.interrupted = now, True
        self.requested = True  # nothing else: the loop acts on it at a step boundary
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def announce(self, global_step: int, *, next_check: str) -> None:
        """Once per process, at the first step boundary after the signal: say that it arrived and when the
        run saves (logging is not safe inside a signal handler, so the loop calls this)."""
        self.announced = True
        log.warning(
            "%s received at step %d: the run saves and stops %s%s.",
            self.signal_name,
            global_step,
            next_check,
            " (press Ctrl-C again to stop at once, without saving)" if self.interrupted else "",
        )

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("Trainer.fit runs outside the main thread: preemption signals are not handled.")
            return
        self.requested = self.interrupted = self.announced = False
        self.signal_name = self._interrupted_at = None
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
        """True when any rank got a signal (then :attr:`interrupted` says whether any got Ctrl-C). Collective
        when ``world_size > 1``: all ranks call it at the same step."""
        if world_size == 1:
            return self.requested
        flag = torch.tensor([INTERRUPT if self.interrupted else PREEMPT if self.requested else 0.0], device=device)
        comm.all_reduce(flag, "max")
        agreed = float(flag.item())
        self.interrupted = self.interrupted or agreed == INTERRUPT
        return agreed > 0

    @property
    def exit_code(self) -> int:
        return INTERRUPTED_EXIT_CODE if self.interrupted else PREEMPTED_EXIT_CODE


class CarriedFlags:
    """The ranks agree on a preemption signal or Ctrl-C at every optimizer step, without a host sync.

    Each step every rank sends ``[a signal, a Ctrl-C]`` (its own, 0 or 1) to be summed across ranks. Under DDP with
    automatic optimization they ride on the step's gradients (``on_gradients``: they are the gradient of a parameter
    of DDP's adapter, :class:`trainer.distributed.strategy._Carry`; no collective of their own); elsewhere
    (FSDP, manual optimization) they go in one small asynchronous all-reduce per step. Where the sums are known when
    the step ends (DDP's all-reduce on the CPU) the ranks decide at that step; otherwise each step boundary reads the
    previous step's sums (its all-reduce, and on CUDA its copy to pinned host memory, long done by then), so every
    rank still decides at the same step, one step after the signal. Measured alternative: a per-step all-reduce
    waited for at once cost 1.5 ms a step on a 2-core CPU machine.
    """

    def __init__(
        self, watcher: PreemptionWatcher, device: torch.device, *, on_gradients: bool, carrier: Any = None
    ) -> None:
        self.watcher = watcher
        self.carrier = carrier  # on_gradients: the parameter whose reduced gradient holds the step's sums
        self.device = device
        self.on_gradients = on_gradients
        self.cuda = device.type == "cuda"
        self.lagged = self.cuda or not on_gradients  # the sums of a step are read at the next boundary
        self.outgoing = torch.zeros(2, pin_memory=self.cuda)  # this rank's flags, host side
        self.received = [torch.zeros(2, pin_memory=self.cuda) for _ in range(2)]  # the sums, one slot per step parity
        for host in self.received:
            host.keel_host_buffer = True  # type: ignore[attr-defined]  # read on the host, never a device read
        self.events: list[Any] = [None, None]
        self.pending: list[Any] = [None, None]  # the separate all-reduce's futures
        self.arrived = [False, False]
        self.slot = 0  # where this step's sums go

    def pack(self, like: torch.Tensor) -> tuple[int, torch.Tensor]:
        """This rank's flags on ``like``'s device and dtype, and the slot their sums go to."""
        self.outgoing[0] = 1.0 if self.watcher.requested else 0.0
        self.outgoing[1] = 1.0 if self.watcher.interrupted else 0.0
        return self.slot, self.outgoing.to(device=like.device, dtype=like.dtype, non_blocking=True)

    def unpack(self, slot: int, sums: torch.Tensor) -> None:
        """Keep the reduced flags of a step (called when its all-reduce completes)."""
        self.received[slot].copy_(sums, non_blocking=True)
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self.events[slot] = event
        self.arrived[slot] = True

    def decide(self) -> bool:
        """At an optimizer-step boundary, on every rank: True when any rank had a signal (then the watcher's
        ``interrupted`` says whether any had Ctrl-C). The same answer on every rank at the same step."""
        carrier = self.carrier
        if carrier is not None and (sums := carrier.grad) is not None:  # this step's, reduced with the gradients
            self.unpack(self.slot, sums)
            carrier.grad = None
        read = 1 - self.slot if self.lagged else self.slot
        if not self.on_gradients:
            self._send()
        self.slot = 1 - self.slot
        return self._read(read)

    def _send(self) -> None:
        slot, flags = self.pack(torch.empty(0, device=self.device))
        self.pending[slot] = comm.all_reduce_future(flags).then(lambda done: self.unpack(slot, done.value()[0]))

    def _read(self, slot: int) -> bool:
        if (future := self.pending[slot]) is not None:
            future.wait()  # the previous step's: done long ago
            self.pending[slot] = None
        if not self.arrived[slot]:
            return False
        self.arrived[slot] = False
        if (event := self.events[slot]) is not None:
            event.synchronize()  # the previous step's copy: finished long ago, so this does not stall
        preempt, interrupt = self.received[slot].tolist()
        if interrupt > 0:
            self.watcher.interrupted = True
        return preempt > 0 or interrupt > 0

    def drain(self) -> None:
        """The end of training: wait for the last step's all-reduce (every rank sent it)."""
        for slot, future in enumerate(self.pending):
            if future is not None:
                future.wait()
                self.pending[slot] = None
