"""Where each rank's time goes, always on: per-rank phase times, and the diagnosis rank 0 makes of them.

Every rank keeps a :class:`PhaseClock`: the Trainer already marks the phases of a step for the watchdog (``data``
while it waits for the next batch, ``training_step``, ``backward``, ``optimizer_step``, the logging step's
reduction, callbacks, evaluation, checkpoints), and each mark now also reads a monotonic clock
(``time.perf_counter``) and adds the time since the previous one to that phase's total: no device sync, no
collective. Where the strategy tells when the backward launched its gradient all-reduce (DDP), the backward is
split there into computing (``backward``) and waiting for the sync (``sync``). On a logging step each rank's totals
since the last one ride on the collective the step already makes (:func:`trainer.metrics.exchange_step`'s small
all-reduce, in one slot per rank), so every rank holds every rank's times; :class:`Diagnosis` turns them into
metrics (``perf/...``) and, when one rank is slower than the others in a phase that waits for nobody for several
intervals, or when the whole job is data-, checkpoint- or communication-bound, one WARNING that says so, once a
run for each distinct diagnosis. See docs/slow-runs.md.

On a GPU the step's kernels run after the Python that launches them: a phase's time is the host's (launches,
waits in a collective or a sync), which is what a slow loader or a straggler costs the other ranks.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

log = logging.getLogger(__name__)

#: The phases a rank's time is split into, in the order of the per-rank rows exchanged on logging steps.
PHASES = ("data", "forward", "backward", "sync", "optimizer", "logging", "checkpoint", "evaluation", "other")
_DATA, _FORWARD, _BACKWARD, _SYNC, _OPTIMIZER, _CHECKPOINT, _OTHER = 0, 1, 2, 3, 4, 6, len(PHASES) - 1
# On CUDA the device's times replace the host's (launches) for these phases in the diagnosis.
_ON_DEVICE = (_FORWARD, _BACKWARD, _SYNC, _OPTIMIZER)
# The watchdog's phase names (trainer/distributed/watchdog.py) -> the phase they start.
_OF = {
    "data": 0,
    "training_step": 1,
    "backward": 2,
    "optimizer_step": 4,
    "metrics_reduction": 5,
    "checkpoint": 6,
    "validation_step": 7,
    "test_step": 7,
    "predict_step": 7,
}
#: Per rank on a logging step: the phase seconds since the last one, then the optimizer steps they cover; on CUDA
#: the row goes on with the device's seconds per phase (:class:`DeviceTimeline`).
ROW = len(PHASES) + 1
_ZEROS = (0.0,) * len(PHASES)
_STEPS = len(PHASES)


class SyncMark(Protocol):
    """When this rank's backward finished computing gradients, after its last gradient all-reduce was launched
    (``time.perf_counter``), written by a strategy that can tell (``Strategy.sync_mark``: DDP's, from an autograd
    engine callback) from whichever thread runs the backward; on CUDA also ``event``, a timing event recorded on the
    compute stream there (None elsewhere)."""

    at: float
    event: Event | None


class Event(Protocol):
    """What :class:`DeviceTimeline` needs of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: Any, /) -> float: ...  # milliseconds to ``end``, an event of the same kind


class DeviceTimeline:
    """The device's seconds per phase, from timing events recorded on the compute stream at the phase marks.

    On a GPU the host launches kernels and runs ahead; its phase times are launch times and waits. The time from
    the event recorded when a phase starts to the next one is what the device's stream spent on that phase's work
    (or idle waiting for it). :meth:`mark` records one event (reused from a pool: no allocation on the hot path);
    :meth:`read` adds up the intervals whose events have completed without waiting for the others (they count in
    the next read), or waits for all of them (``wait``: the end of fit).

    The events between two reads are bounded (:attr:`LIMIT`, a few steps' worth of marks whatever the logging
    interval): at the limit a mark first folds the completed ones into the totals, and if the host is still that
    far ahead of the device, waits for the oldest (the host was going to wait for the device soon anyway)."""

    __slots__ = ("_free", "_last", "_new", "_pending", "totals")
    LIMIT = 256

    def __init__(self, new_event: Callable[[], Event]) -> None:
        self._new = new_event
        self.totals = [0.0] * len(PHASES)
        self._pending: deque[tuple[int, Event]] = deque()  # (the phase that starts at the event, the event)
        self._free: list[Event] = []
        self._last: tuple[int, Event] | None = None  # the newest event read: where its phase's interval starts

    def fresh(self) -> Event:
        """An event not in use (the pool's, or a new one)."""
        return self._free.pop() if self._free else self._new()

    def mark(self, phase: int) -> None:
        if len(self._pending) >= self.LIMIT:
            self._fold(wait=False)
            while len(self._pending) >= self.LIMIT:
                self._pending[0][1].synchronize()
                self._fold(wait=False)
        event = self.fresh()
        event.record()
        self._pending.append((phase, event))

    def adopt(self, phase: int, event: Event) -> None:
        """An event someone else recorded (the sync mark's) starts ``phase`` here: it becomes this timeline's."""
        self._pending.append((phase, event))

    def read(self, *, wait: bool = False) -> list[float]:
        """The device's seconds per phase since the last read, as far as its stream has got."""
        self._fold(wait=wait)
        totals, self.totals = self.totals, [0.0] * len(PHASES)
        return totals

    def _fold(self, *, wait: bool) -> None:
        """Add the intervals of the completed events (all of them with ``wait``) to the totals."""
        while self._pending:
            phase, event = self._pending[0]
            if wait:
                event.synchronize()
            elif not event.query():
                break
            self._pending.popleft()
            if self._last is not None:
                started, at = self._last
                self.totals[started] += max(0.0, at.elapsed_time(event) / 1e3)
                self._free.append(at)
            self._last = (phase, event)


class PhaseClock:
    """This rank's seconds per phase since the last :meth:`take`. :meth:`enter` is the only call on the hot path:
    one clock read and one addition. The training loop's plain epoch marks phases without the call: it adds the
    time since :attr:`since` to ``totals[current]`` and sets both, as :meth:`enter` does. With a :class:`SyncMark`
    (``sync``), a backward that launched an all-reduce is split there: the time before is ``backward`` (computing
    gradients), the time after is ``sync`` (waiting for the last all-reduce to finish, which is where a rank waits
    for a slower one). With a :class:`DeviceTimeline` (``device``, on CUDA) each mark also records an event on the
    compute stream, and the sync mark's event splits the device's backward the same way."""

    __slots__ = ("_steps_at", "current", "device", "since", "sync", "totals")
    # Indices into :attr:`totals` of the phases the training loop marks inline (Trainer._plain_epoch).
    DATA, FORWARD, BACKWARD, OPTIMIZER, OTHER = _DATA, _FORWARD, _BACKWARD, _OPTIMIZER, _OTHER

    def __init__(
        self, global_step: int = 0, sync: SyncMark | None = None, device: DeviceTimeline | None = None
    ) -> None:
        self.totals = [0.0] * len(PHASES)
        self.current, self.since, self._steps_at, self.sync = _OTHER, time.perf_counter(), global_step, sync
        self.device = device
        if device is not None:
            device.mark(_OTHER)

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        device = self.device
        if self.current == _BACKWARD and self.sync is not None and (at := self.sync.at) > self.since:
            self.totals[_BACKWARD] += at - self.since
            self.totals[_SYNC] += now - at
            if device is not None and (event := self.sync.event) is not None:
                device.adopt(_SYNC, event)  # recorded by the hook in this backward: its last launch
                self.sync.event = device.fresh()
        else:
            self.totals[self.current] += now - self.since
        self.since, self.current = now, _OF.get(phase, _OTHER)
        if device is not None:
            device.mark(self.current)

    def take(self, global_step: int, *, wait: bool = False) -> list[float]:
        """The totals since the last take (closing the current phase there) and the optimizer steps they span,
        as one row of :data:`ROW` numbers, then with a device timeline the device's seconds per phase as far as
        its stream has got (all of them with ``wait``); the totals restart at zero."""
        now = time.perf_counter()
        self.totals[self.current] += now - self.since
        self.since = now
        totals = self.totals
        row = [*totals, float(global_step - self._steps_at)]
        totals[:] = _ZEROS  # in place: the training loop holds this list
        self._steps_at = global_step
        if self.device is not None:
            self.device.mark(self.current)  # closes the interval on the device too
            row += self.device.read(wait=wait)
        return row


class Diagnosis:
    """Rank 0's reading of every rank's phase rows, one logging interval at a time.

    A rank is *slow in a phase* when its seconds per step there exceed the fastest rank's by more than
    ``min_excess`` seconds and by more than ``min_share`` of the slowest rank's step; only phases that wait for no
    other rank count (:attr:`judged`: the loader; the forward unless ``forward_waits``; the backward unless
    ``backward_waits``, i.e. where its sync is split out), since a rank that waits in a collective is waiting for
    someone else. The job is *data-bound* (or *checkpoint-bound*) when every rank spends more than ``bound_share``
    of its time waiting for data (or blocked by saves), and *communication-bound* when no rank is slow and every
    rank spends more than that waiting in the gradient sync; a job-wide verdict also needs the median wait above
    ``min_excess`` seconds a step (a balanced toy run waiting 1 ms a step is healthy). A verdict holds once it has
    held for ``patience`` intervals in a row; the warning comes when the verdict changes to one not warned about
    before in the run (a verdict that comes and goes is said once)."""

    def __init__(
        self,
        *,
        hosts: Sequence[str] | None = None,
        forward_waits: bool = False,
        backward_waits: bool = True,
        patience: int = 3,
        min_excess: float = 0.005,
        min_share: float = 0.1,
        bound_share: float = 0.3,
    ) -> None:
        self.hosts = list(hosts) if hosts is not None else None
        self.forward_waits, self.backward_waits = forward_waits, backward_waits
        self.patience, self.min_excess, self.min_share, self.bound_share = patience, min_excess, min_share, bound_share
        self.history: list[str | None] = []  # per interval: what the verdict is about (rank and phase), or None
        self.seconds: list[list[float]] = []  # per rank, per phase: the seconds of every interval read
        self.device_seconds: list[list[float]] = []  # the same on the device's stream (CUDA; zeros elsewhere)
        self.steps = 0.0
        self.said: str | None = None  # what the last warning was about
        self.spoken: set[str] = set()  # every verdict warned about: each once a run, however often it comes back
        self.warnings: list[str] = []  # every warning given, in order

    @property
    def judged(self) -> list[tuple[int, str]]:
        """The phases that wait for no other rank, judged rank against rank: ``(index, name)``."""
        own = [(_DATA, "data wait")]
        if not self.forward_waits:
            own.append((_FORWARD, "forward"))
        if not self.backward_waits:
            own.append((_BACKWARD, "backward"))
        return own

    def update(self, rows: Sequence[Sequence[float]], *, speak: bool = True) -> dict[str, float]:
        """Read one interval (``rows[r]``: rank r's :meth:`PhaseClock.take`): the metrics to log, and a WARNING
        when the verdict changes (``speak``: this rank logs it; every rank reads the same rows and keeps the same
        verdicts). Empty when no optimizer step happened in the interval."""
        self.add(rows)
        steps = max((row[_STEPS] for row in rows), default=0.0)
        if steps <= 0:
            return {}
        per_step = [[t / steps for t in row[:_STEPS]] for row in rows]
        walls = [sum(r) for r in per_step]
        wall = max(walls)
        if wall <= 0:
            return {}
        data = [r[_DATA] for r in per_step]
        if all(sum(row[ROW:]) > 0 for row in rows):  # on CUDA: the device's compute phases, not the launches
            for r, row in zip(per_step, rows):
                for p in _ON_DEVICE:
                    r[p] = row[ROW + p] / steps
        slowest = max(range(len(rows)), key=lambda r: walls[r] - self._waits(per_step[r]))
        metrics = {
            "perf/steps_per_s": 1.0 / wall,
            "perf/data_wait_frac": statistics.fmean(d / w for d, w in zip(data, walls) if w > 0),
            "perf/slowest_rank": float(slowest),
        }
        self._judge(self._verdict(per_step, walls), speak)
        return metrics

    def add(self, rows: Sequence[Sequence[float]]) -> None:
        """Count ``rows`` into the fit's totals (:meth:`budget`) without judging them."""
        if len(self.seconds) != len(rows):
            self.seconds = [[0.0] * len(PHASES) for _ in rows]
            self.device_seconds = [[0.0] * len(PHASES) for _ in rows]
        for total, device, row in zip(self.seconds, self.device_seconds, rows):
            for p, t in enumerate(row[:_STEPS]):
                total[p] += t
            for p, t in enumerate(row[ROW:]):
                device[p] += t
        self.steps += max((row[_STEPS] for row in rows), default=0.0)

    def budget(self) -> dict[str, object]:
        """The fit's time budget: every rank's seconds per phase, the slowest rank's shares (the rank with the most
        time in phases that wait for nobody), the steps, the fit's wall time (the longest rank's) and the diagnoses
        given (``efficiency.json``)."""
        walls = [sum(r) for r in self.seconds]
        # In step with each other every rank takes the same wall time: the slowest is the one that waited least.
        own = [w - self._waits(r) for w, r in zip(walls, self.seconds)]
        slowest = max(range(len(own)), key=own.__getitem__) if own else 0
        wall = max(walls, default=0.0)
        return {
            "phases": list(PHASES),
            "steps": int(self.steps),
            "wall_s": wall,
            "slowest_rank": slowest,
            "hosts": self.hosts,
            "share_of_slowest": {
                p: (self.seconds[slowest][i] / walls[slowest] if walls and walls[slowest] else 0.0)
                for i, p in enumerate(PHASES)
            },
            "per_rank_seconds": [dict(zip(PHASES, r)) for r in self.seconds],
            "diagnoses": list(self.warnings),
            **(
                {"per_rank_device_seconds": [dict(zip(PHASES, r)) for r in self.device_seconds]}
                if any(any(r) for r in self.device_seconds)
                else {}
            ),
        }

    def budget_line(self) -> str:
        """``Time budget of fit: 120 steps in 31.4 s; the slowest rank, 1 on node-b: data 3%, forward 40%, ...``."""
        b = self.budget()
        share = cast("dict[str, float]", b["share_of_slowest"])
        shares = ", ".join(f"{p} {100 * f:.0f}%" for p, f in share.items())
        rank = cast(int, b["slowest_rank"])
        where = f"{rank}" + (f" on {self.hosts[rank]}" if self.hosts else "")
        return f"Time budget of fit: {b['steps']} steps in {b['wall_s']:.1f} s; the slowest rank, {where}: {shares}"

    def _waits(self, phases: Sequence[float]) -> float:
        """The seconds a step of this rank spends where it may wait for another rank (all but the judged phases)."""
        return sum(phases) - sum(phases[p] for p, _ in self.judged)

    def _verdict(self, per_step: list[list[float]], walls: list[float]) -> tuple[str, str] | None:
        """``(what it is about, the sentence)``: ``("data-bound", ...)`` or ``("rank 1 data wait", ...)``; None if
        nothing is wrong. A job-wide cause (every rank waiting for data, blocked by saves) comes first; then the
        slowest rank in a phase that waits for nobody; then, with nobody slow, every rank waiting in the gradient
        sync (communication-bound)."""
        wall = max(walls)

        def median(phase: int) -> float:
            return statistics.median(r[phase] for r in per_step)

        def every_rank(phase: int) -> bool:  # and long enough to matter: a toy run's 1 ms sync is not a finding
            shares = all(w > 0 and r[phase] / w > self.bound_share for r, w in zip(per_step, walls))
            return shares and median(phase) > self.min_excess

        if every_rank(_DATA):
            return "data-bound", (
                f"every rank waits for data ({median(_DATA) * 1e3:.0f} ms a step, median; the step takes "
                f"{wall * 1e3:.0f} ms): the job is data-bound; raise the loaders' num_workers, prefetch, or make "
                "the dataset cheaper to read"
            )
        if every_rank(_CHECKPOINT):
            return "checkpoint-bound", (
                f"saving checkpoints blocks every rank {median(_CHECKPOINT) * 1e3:.0f} ms a step (median; the step "
                f"takes {wall * 1e3:.0f} ms): the job is checkpoint-bound; save less often (ModelCheckpoint's "
                "every_n_train_steps or train_time_interval), or save asynchronously (async_save=True) so that "
                "training goes on while the files are written"
            )
        worst: tuple[float, int, int, str] | None = None
        for phase, name in self.judged:
            times = [r[phase] for r in per_step]
            fastest = min(times)
            for rank, t in enumerate(times):
                excess = t - fastest
                if excess > self.min_excess and excess > self.min_share * wall and (worst is None or excess > worst[0]):
                    worst = (excess, rank, phase, name)
        if worst is None:
            if not self.backward_waits and every_rank(_SYNC):
                one_machine = self.hosts is not None and len(set(self.hosts)) == 1
                check = (
                    "the ranks share one machine, so no network is involved"
                    if one_machine
                    else "check the interconnect (python -m trainer.doctor measures its bandwidth; NCCL_SOCKET_IFNAME "
                    "or NCCL_IB_* under NCCL, GLOO_SOCKET_IFNAME under gloo, on the wrong interface)"
                )
                return "communication-bound", (
                    f"every rank waits {median(_SYNC) * 1e3:.0f} ms a step for the gradient all-reduce to finish "
                    f"after its backward (median; the step takes {wall * 1e3:.0f} ms) and no rank is slower than "
                    f"the others: the job is communication-bound; {check}; sync less often "
                    "(accumulate_grad_batches), or put more work on each rank (a larger micro-batch)"
                )
            return None
        _, rank, phase, name = worst
        times = [r[phase] for r in per_step]
        where = f"rank {rank}" + (f" on {self.hosts[rank]}" if self.hosts else "")
        if phase == _DATA:
            cause = "its loader is the bottleneck; raise num_workers or check that node's disk and CPU"
        else:
            cause = "its compute is slower (another job on its GPU or CPU, a throttled device, a larger batch)"
        return (
            f"rank {rank} {name}",
            f"{where}: {name} {times[rank] * 1e3:.0f} ms/step vs median {median(phase) * 1e3:.0f} ms: {cause}",
        )

    def _judge(self, verdict: tuple[str, str] | None, speak: bool) -> None:
        about = verdict[0] if verdict is not None else None
        self.history.append(about)
        recent = self.history[-self.patience :]
        if len(recent) < self.patience or any(v != about for v in recent) or about == self.said:
            return
        self.said = about
        if verdict is not None and about not in self.spoken:
            self.spoken.add(verdict[0])
            self.warnings.append(verdict[1])
            if speak:
                log.warning("Slow run: %s.", verdict[1])
