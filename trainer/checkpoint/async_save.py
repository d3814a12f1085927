"""Async checkpoint saves: stage on the main thread, write and commit in the background, finish at a step boundary.

``ModelCheckpoint(async_save=True)`` saves through an :class:`AsyncCheckpointer`. One save has three parts:

``stage()``
    On the main thread, at the step boundary, now: this rank's tensors copied into CPU buffers reused
    across saves (:class:`~trainer.checkpoint.dcp_io.ReusedStaging`), so later optimizer steps cannot change what
    is written.
    Training continues as soon as it returns; with the wait for a save still in flight, this is the whole
    time the loop is blocked.
``write(staged)``
    On the checkpointer's worker thread: the same write as a synchronous save (trainer/checkpoint/store.py):
    data files, checksums gathered, rank 0 writes keel.pt and the manifest and renames the folder into
    place, then (rank 0) ModelCheckpoint's commit: the ``last`` pointer swap and pruning. Its collectives run
    on a gloo group of their own (:func:`trainer.distributed.comm.checkpoint_group`), never on the training
    group.
``commit()`` (optional)
    On the main thread again, at a later step boundary (:meth:`AsyncCheckpointer.poll`, called from
    ``ModelCheckpoint.on_train_batch_end``: no collective, no host-device sync) or when waited on
    (:meth:`AsyncCheckpointer.wait`), after ``write`` returned, and never when it raised: for what must run
    on the training thread (keel's saves need nothing there).

At most one save is in flight: :meth:`AsyncCheckpointer.submit` first waits for (and finishes) the
previous one. An error raised by ``write`` or ``commit`` is re-raised on the main thread at the next
``poll``/``wait``/``submit``. The outcome of a save is agreed by every rank (:meth:`AsyncCheckpointer.vote`),
so a failed save fails at the same step boundary on every rank. Preemption, exception and end-of-fit paths
wait, so a run never exits with a save half done.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

STILL_WRITING_S = 120.0  # a WARNING this often while a wait for the save in flight lasts


@dataclass
class SaveTimes:
    """Seconds one save spent in each part (``blocked`` = the main thread: stage + the wait for an
    earlier save in flight; ``background``: write on the worker thread)."""

    what: str
    blocked: float = 0.0
    background: float = 0.0
    commit: float = 0.0


@dataclass
class _Job:
    what: str
    commit: Callable[[], None] | None
    times: SaveTimes
    thread: threading.Thread | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    polls: int = 0  # poll() calls while this save was in flight (the main thread)
    voting: bool = False  # the worker thread is in AsyncCheckpointer.vote's collective; poll() waits for it
    refused_at: int | None = None  # a save every rank refused: the poll at which every rank raises it
    lock: threading.Condition = field(default_factory=threading.Condition)


class AsyncCheckpointer:
    """Runs checkpoint writes on a worker thread, one at a time; commits on the caller's thread.

    Not thread-safe by itself: ``submit``, ``poll`` and ``wait`` are called from the training (main)
    thread only. ``history`` keeps the :class:`SaveTimes` of the last 100 saves (benchmarks read it).
    """

    def __init__(self, name: str = "keel-checkpoint-writer") -> None:
        self.name = name
        self._job: _Job | None = None
        self.history: list[SaveTimes] = []

    @property
    def in_flight(self) -> bool:
        """True from ``submit`` until the save is committed (or its error reported)."""
        return self._job is not None

    def submit(
        self,
        stage: Callable[[], Any],
        write: Callable[[Any], None],
        commit: Callable[[], None] | None = None,
        *,
        what: str = "checkpoint",
    ) -> SaveTimes:
        """Wait for the save in flight (committing it), run ``stage()`` here, start ``write(staged)`` on
        the worker thread and return. ``commit()`` runs later on this thread, after ``write`` returned.

        Raises:
            BaseException: whatever the previous save's ``write``/``commit`` raised (it is reported once),
                or whatever ``stage`` raises (nothing is started then).
        """
        start = time.perf_counter()
        self.wait()
        staged = stage()
        times = SaveTimes(what)
        job = _Job(what, commit, times)
        job.thread = threading.Thread(target=self._work, args=(job, write, staged), name=self.name, daemon=True)
        del staged  # the worker holds the only reference: memory is freed as soon as the write ends
        self._job = job
        job.thread.start()
        times.blocked = time.perf_counter() - start
        return times

    def poll(self) -> bool:
        """At a step boundary: commit the save in flight if its write is done. Never blocks (beyond the
        commit itself: a pointer swap and unlinks), with two exceptions for a save whose write calls
        :meth:`vote`: while this rank's worker thread is in the vote's all-reduce, and, when every rank
        refused the save, at the poll the vote chose for the end of the write (its clean-up). Returns True
        when a save was committed now.

        Raises:
            BaseException: the error of a failed background write or commit (reported once).
        """
        job = self._job
        if job is None:
            return False
        with job.lock:
            job.lock.wait_for(lambda: not job.voting)  # the verdict decides this poll; a vote is one all-reduce
            job.polls += 1
            polls, refused_at = job.polls, job.refused_at
        if refused_at is not None:
            if polls < refused_at:
                return False
            job.done.wait()
        elif not job.done.is_set():
            return False
        self._finish(job)
        return True

    def vote(self, collective: Callable[[int], tuple[bool, int]]) -> bool:
        """On the worker thread, inside ``write``: the verdict on this save that every rank agrees on.

        ``collective(polls)`` is a collective of every rank's worker thread (an all-reduce on the checkpoint
        group) returning ``(verdict, the largest poll count of any rank)``, where ``polls`` is this rank's
        count of :meth:`poll` calls on this save, read while :meth:`poll` waits for the vote. When the
        verdict is False (``write`` raises next), every rank raises at the same poll: the first one that no
        rank had reached when it voted. Every rank's main thread must poll at the same step boundaries
        (``ModelCheckpoint.on_train_batch_end`` does), so all ranks raise at the same step, none left to die
        in the next step's collective. Returns the verdict.
        """
        job = self._job
        assert job is not None, "vote() runs inside the write of the save in flight"
        with job.lock:
            job.voting = True
            polls = job.polls
        refused_at = None
        try:
            verdict, last = collective(polls)
            if not verdict:
                refused_at = last + 1
            return verdict
        finally:
            with job.lock:
                job.refused_at, job.voting = refused_at, False
                job.lock.notify_all()

    def wait(self, *, raise_errors: bool = True) -> bool:
        """Block until the save in flight is written, then commit it. Returns True when one was committed.
        With ``raise_errors=False`` (an exception is already propagating) a failure is logged instead.
        """
        job = self._job
        if job is None:
            return False
        waited = 0.0
        while not job.done.wait(STILL_WRITING_S):  # never silent: a store that stopped answering stalls this
            waited += STILL_WRITING_S
            log.warning(
                "Waiting for the background save of %s, still writing after %.0f s: its storage is slow or does "
                "not answer (an upload to a store that hangs has no deadline of its own). "
                "Trainer(watchdog_timeout=...) ends a rank that stops making progress.",
                job.what,
                waited,
            )
        try:
            self._finish(job)
        except BaseException as exc:
            if raise_errors:
                raise
            log.error("The background checkpoint save of %s failed: %s", job.what, exc)
            return False
        return True

    # ------------------------------------------------------------------ internals
    def _work(self, job: _Job, write: Callable[[Any], None], staged: Any) -> None:
        start = time.perf_counter()
        try:
            write(staged)
        except BaseException as exc:  # re-raised on the main thread (CheckpointException is a BaseException)
            job.error = exc
        finally:
            del staged
            job.times.background = time.perf_counter() - start
            job.done.set()

    def _finish(self, job: _Job) -> None:
        self._job = None
        if job.thread is not None:
            job.thread.join()
        if job.error is not None:
            error, job.error = job.error, None
            raise error
        start = time.perf_counter()
        if job.commit is not None:
            job.commit()
        job.times.commit = time.perf_counter() - start
        self.history = (self.history + [job.times])[-100:]


def cpu_copy(obj: Any) -> Any:
    """A copy of keel.pt's small state (RNG, schedulers, loop, callbacks) that later steps cannot change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, cpu_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj) if not hasattr(obj, "_fields") else obj
    return copy.deepcopy(obj)
