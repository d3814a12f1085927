"""Async checkpoint saves: stage on the main thread, write and commit in the background, finish at a step boundary.

``ModelCheckpoint(async_save=True)`` saves through an :class:`AsyncCheckpointer`. One save has three parts:

``stage()``
    On the main thread, at the step boundary, now. Returns the payload to write: a copy that later
    optimizer steps cannot change (for one file: every tensor copied to CPU, see :class:`CpuStager`).
    Training continues as soon as it returns; with the wait for a save still in flight, this is the
    whole time the loop is blocked.
``write(staged)``
    On the checkpointer's worker thread: write, fsync, rename into place, fsync the folder, and then the
    commit: the ``last`` pointer swap, then pruning of what it replaces (:func:`save_async` does all of
    it; unlinking a GiB file alone takes 0.3 s, kept off the loop). Everything it writes carries a
    temporary name until its own atomic rename, so a SIGKILL here leaves the previous checkpoint as
    ``last``. It must not touch the training process group (DDP: only rank 0 writes one file, so no
    collective is needed; FSDP, trainer/checkpoint/sharded.py: DCP on a gloo group of its own, whose
    coordinator finishes only when every rank's shards are durable; rank 0 then renames the folder, and
    swaps the pointer in ``commit``).
``commit()`` (optional)
    On the main thread again, at a later step boundary (:meth:`AsyncCheckpointer.poll`, called from
    ``ModelCheckpoint.on_train_batch_end``: no collective, no host-device sync) or when waited on
    (:meth:`AsyncCheckpointer.wait`), after ``write`` returned, and never when it raised: for what must
    happen on the training thread. A ``ready`` predicate (polled without blocking) can hold it back
    until, e.g., every rank reported done.

At most one save is in flight: :meth:`AsyncCheckpointer.submit` first waits for (and finishes) the
previous one. An error raised by ``write`` or ``commit`` is re-raised on the main thread at the next
``poll``/``wait``/``submit``: the save is reported done, or failed, at a step boundary. A save that every
rank votes to refuse (:meth:`AsyncCheckpointer.vote`: the sharded save's non-finite check) fails at the same
step boundary on every rank. Preemption, exception and end-of-fit paths wait, so a run never exits with a
save in flight.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)


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
    ready: Callable[[], bool] | None
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
        ready: Callable[[], bool] | None = None,
    ) -> SaveTimes:
        """Wait for the save in flight (committing it), run ``stage()`` here, start ``write(staged)`` on
        the worker thread and return. ``commit()`` runs later on this thread, after ``write`` returned and
        ``ready()`` (when given; polled without blocking) is True.

        Raises:
            BaseException: whatever the previous save's ``write``/``commit`` raised (it is reported once),
                or whatever ``stage`` raises (nothing is started then).
        """
        start = time.perf_counter()
        self.wait()
        staged = stage()
        times = SaveTimes(what)
        job = _Job(what, commit, ready, times)
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
        elif not job.done.is_set() or (job.error is None and job.ready is not None and not job.ready()):
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
        job.done.wait()
        if job.ready is not None and job.error is None:
            while not job.ready():
                time.sleep(0.005)
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


# ---------------------------------------------------------------------- staging
class CpuStager:
    """Copies checkpoint states to CPU memory that later training cannot change, reusing the buffers of
    the previous copy (its write is over by then: :meth:`AsyncCheckpointer.submit` waits first), so a
    save costs one ``copy_`` per tensor and no fresh allocation (about half of a ``clone``'s time on
    CPU). It keeps that one copy of the state between saves; :meth:`release` frees it.

    Every tensor is copied (a tensor seen twice, e.g. tied weights, once, and shared), dicts, lists and
    tuples are rebuilt, plain values kept. CUDA tensors go to pinned memory without blocking, then one
    synchronize.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, list[torch.Tensor]] = {}
        self._last: list[torch.Tensor] = []

    def stage(self, obj: Any) -> Any:
        pool, self._buffers, self._last = self._pool(), {}, []
        cuda: list[bool] = []
        out = self._stage(obj, {}, pool, cuda)
        if cuda and torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    def release(self) -> None:
        self._buffers, self._last = {}, []

    def _pool(self) -> dict[tuple, list[torch.Tensor]]:
        pool: dict[tuple, list[torch.Tensor]] = {}
        for t in self._last:
            pool.setdefault((t.dtype, tuple(t.shape), t.is_pinned()), []).append(t)
        for values in pool.values():
            values.reverse()  # pop() hands them out in the order they were made
        return pool

    def _stage(
        self, obj: Any, memo: dict[tuple, torch.Tensor], pool: dict[tuple, list[torch.Tensor]], cuda: list[bool]
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            strided = t.layout == torch.strided
            key = (
                (t.device, t.dtype, t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                if strided and t.numel()
                else None
            )
            if key is not None and key in memo:
                return memo[key]
            on_cuda = t.device.type == "cuda"
            free = pool.get((t.dtype, tuple(t.shape), on_cuda)) if strided else None
            if free:
                out = free.pop()
                out.copy_(t, non_blocking=on_cuda)
            elif on_cuda:
                out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                out.copy_(t, non_blocking=True)
            else:
                out = t.to("cpu", copy=True)
            cuda.extend([True] if on_cuda else [])
            if strided and out.is_contiguous():
                self._last.append(out)
            if key is not None:
                memo[key] = out
            return out
        if isinstance(obj, dict):  # OrderedDict (state_dict()) stays an OrderedDict; other kinds become dicts
            items = [(k, self._stage(v, memo, pool, cuda)) for k, v in obj.items()]
            return collections.OrderedDict(items) if isinstance(obj, collections.OrderedDict) else dict(items)
        if isinstance(obj, list):
            return [self._stage(v, memo, pool, cuda) for v in obj]
        if isinstance(obj, tuple):
            items = [self._stage(v, memo, pool, cuda) for v in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
        if obj is None or isinstance(
            obj, (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
        ):
            return obj
        return copy.deepcopy(obj)


def stage_to_cpu(obj: Any) -> Any:
    """A CPU copy of ``obj`` that later training cannot change (see :class:`CpuStager`; no buffer reuse)."""
    return CpuStager().stage(obj)


# ---------------------------------------------------------------------- the one-file (DDP) save
def save_async(trainer: Trainer, path: str, checkpointer: AsyncCheckpointer, commit: Callable[[], None] | None) -> None:
    """``Trainer.save_checkpoint`` in the background: assemble the state (collective: every rank calls
    this), then rank 0 stages a CPU copy and hands the write to ``checkpointer``; ``commit`` (rank 0: the
    pointer swap and pruning) runs on the worker thread once the file is durable. No barrier: other
    ranks have nothing in flight and continue at once. Non-finite weights are refused as by
    ``Trainer.save_checkpoint``, but
    checked on the staged copy in the background (a full pass over the weights is as slow as the copy):
    the FloatingPointError is raised at the next step boundary, and nothing is written.

    The FSDP sharded-folder save plugs in here: every rank stages its shards (DCP ``async_save`` on the
    checkpoint's own gloo group), ``write`` waits for its future, rank 0 adds the keel file and renames
    the folder once every rank is done.
    """
    from trainer.checkpoint import state as ckpt
    from trainer.checkpoint.files import K_OPTIMIZERS, K_STATE_DICT
    from trainer.distributed.watchdog import PHASE_CHECKPOINT

    trainer._beat(PHASE_CHECKPOINT)  # as Trainer.save_checkpoint does
    # on_nonfinite="error": a NaN loss since the last check stops here; one host read (+ one collective in
    # DDP), on every rank.
    trainer._nonfinite.check(f"before saving checkpoint {path!r}")
    if trainer.strategy.sharded:  # every rank writes its shards: trainer/checkpoint/sharded.py
        from trainer.checkpoint import sharded as sharded_checkpoint

        task = trainer.task  # non-finite weights: refused on the staged copy, in the background (as below)
        assert task is not None  # assemble() needs it
        checkpointer.wait()  # the save in flight first: its DCP collectives come before this one's
        sharded_checkpoint.save_async(
            ckpt.assemble(trainer),
            path,
            model_key=K_STATE_DICT,
            optimizers_key=K_OPTIMIZERS,
            task=task,
            optimizers=trainer.optimizers,
            is_writer=trainer.is_global_zero,
            checkpointer=checkpointer,
            commit=commit,
        )
        return
    state = ckpt.assemble(trainer)
    if not trainer.is_global_zero:
        return
    task, io, step = trainer.task, trainer._checkpoint_io, trainer.global_step
    params = [name for name, _ in task.named_parameters()] if task is not None else []
    stager = checkpointer.__dict__.setdefault("cpu_stager", CpuStager())

    def write(staged: dict[str, Any]) -> None:
        _refuse_non_finite(staged[K_STATE_DICT], params, path, step)
        io.save(staged, path, is_writer=True)
        if commit is not None:
            commit()  # only now that the file is durable: the pointer swap, then pruning

    checkpointer.submit(lambda: stager.stage(state), write, what=str(path))


def _refuse_non_finite(weights: dict[str, Any], params: list[str], path: str, step: int) -> None:
    """As ``checkpoint.save``: a checkpoint of NaN/inf weights is never written (parameters only: a buffer
    may hold -inf on purpose, an attention mask)."""
    tensors = [
        weights[n] for n in params if isinstance(weights.get(n), torch.Tensor) and weights[n].is_floating_point()
    ]
    if tensors and not bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()):
        raise FloatingPointError(
            f"Refusing to write checkpoint {path!r} at step {step}: the weights hold NaN or inf (a non-finite "
            "step got through). The last good checkpoint is kept."
        )
