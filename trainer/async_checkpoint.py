"""Async checkpoint saves: stage on the main thread, write in the background, commit at a step boundary.

``ModelCheckpoint(async_save=True)`` saves through an :class:`AsyncCheckpointer`. One save is three parts:

``stage()``
    On the main thread, at the step boundary, now. Returns the payload to write: a copy that later
    optimizer steps cannot change (for one file: every tensor cloned to CPU, see :func:`stage_to_cpu`).
    Training continues as soon as it returns; this is the whole time the loop is blocked.
``write(staged)``
    On the checkpointer's worker thread: write, fsync, rename into place, fsync the folder. Everything
    it writes carries a temporary name until its own atomic rename, so a SIGKILL here leaves the
    previous checkpoint as ``last``. It must not touch the training process group (for DDP only rank 0
    writes one file, so it needs no collective; FSDP writes through DCP on a gloo group of its own and
    waits there until every rank's shards are durable before the folder rename).
``commit()``
    On the main thread again, at a later step boundary (:meth:`AsyncCheckpointer.poll`, called from
    ``ModelCheckpoint.on_train_batch_end``: no collective, no host-device sync) or when waited on
    (:meth:`AsyncCheckpointer.wait`): swaps the ``last`` pointer, then prunes what it replaces. It runs
    only after ``write`` returned, and never when ``write`` raised (the previous checkpoint and every
    file it would prune stay). Whatever needs "all ranks done" goes at the end of ``write`` (a barrier on
    the checkpoint group) or in a ``ready`` predicate given to :meth:`AsyncCheckpointer.submit`.

At most one save is in flight: :meth:`AsyncCheckpointer.submit` first waits for (and commits) the
previous one. An error raised by ``write`` or ``commit`` is re-raised on the main thread at the next
``poll``/``wait``/``submit``. Preemption, exception and end-of-fit paths wait, so a run never exits with
a save in flight.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

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
        commit itself: a pointer swap and unlinks). Returns True when a save was committed now.

        Raises:
            BaseException: the error of a failed background write or commit (reported once).
        """
        job = self._job
        if job is None or not job.done.is_set() or (job.error is None and job.ready is not None and not job.ready()):
            return False
        self._finish(job)
        return True

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
def stage_to_cpu(obj: Any) -> Any:
    """A copy of a checkpoint state that later training cannot change: every tensor cloned to CPU (a
    tensor seen twice, e.g. tied weights, is cloned once and shared), dicts, lists and tuples rebuilt,
    plain values kept. CUDA tensors are copied into pinned memory without blocking, then one
    synchronize; on CPU it is one ``clone`` per tensor."""
    memo: dict[tuple, torch.Tensor] = {}
    cuda: list[bool] = []
    out = _stage(obj, memo, cuda)
    if cuda and torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def _stage(obj: Any, memo: dict[tuple, torch.Tensor], cuda: list[bool]) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        key = (t.device, t.dtype, t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride())) \
            if t.layout == torch.strided and t.numel() else None
        if key is not None and key in memo:
            return memo[key]
        if t.device.type == "cuda":
            copy = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            copy.copy_(t, non_blocking=True)
            cuda.append(True)
        else:
            copy = t.to("cpu", copy=True)
        if key is not None:
            memo[key] = copy
        return copy
    if isinstance(obj, dict):  # OrderedDict (state_dict()) stays an OrderedDict; other kinds become dicts
        items = ((k, _stage(v, memo, cuda)) for k, v in obj.items())
        return collections.OrderedDict(items) if isinstance(obj, collections.OrderedDict) else dict(items)
    if isinstance(obj, list):
        return [_stage(v, memo, cuda) for v in obj]
    if isinstance(obj, tuple):
        items = [_stage(v, memo, cuda) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)):
        return obj
    return copy.deepcopy(obj)


# ---------------------------------------------------------------------- the one-file (DDP) save
def save_async(trainer: Any, path: str, checkpointer: AsyncCheckpointer, commit: Callable[[], None] | None) -> None:
    """``Trainer.save_checkpoint`` in the background: refuse non-finite weights and assemble the state
    (collective: every rank calls this), then rank 0 stages a CPU copy and hands the write to
    ``checkpointer``; ``commit`` (rank 0: the pointer swap and pruning) runs when the file is durable.
    No barrier: other ranks have nothing in flight and continue at once.

    The FSDP sharded-folder save plugs in here: every rank stages its shards (DCP ``async_save`` on the
    checkpoint's own gloo group), ``write`` waits for its future, rank 0 adds the keel file and renames
    the folder once every rank is done.
    """
    from trainer import checkpoint as ckpt
    from trainer.watchdog import PHASE_CHECKPOINT

    if getattr(trainer.strategy, "sharded", False):  # sharded folders: synchronous until their async writer lands
        trainer.save_checkpoint(path)
        if commit is not None:
            commit()
        return
    beat = getattr(trainer, "_beat", None)
    if beat is not None:
        beat(PHASE_CHECKPOINT)  # as Trainer.save_checkpoint does
    _refuse_non_finite(trainer, path)
    state = ckpt.assemble(trainer)
    if not trainer.is_global_zero:
        return
    io = trainer._checkpoint_io
    checkpointer.submit(lambda: stage_to_cpu(state), lambda staged: io.save(staged, path, is_writer=True), commit,
                        what=str(path))


def _refuse_non_finite(trainer: Any, path: str) -> None:
    """As ``checkpoint.save``: a checkpoint of NaN/inf weights is never written (same answer on every rank)."""
    task = trainer.task
    if task is None:
        return
    check = getattr(trainer.strategy, "weights_finite", None)
    if check is not None:
        finite = check(task)
    else:
        params = [p.detach() for p in task.parameters()]
        finite = not params or bool(torch.stack([torch.isfinite(p).all() for p in params]).all())
    if not finite:
        raise FloatingPointError(
            f"Refusing to write checkpoint {path!r} at step {trainer.global_step}: the weights hold NaN or inf "
            "(a non-finite step got through). The last good checkpoint is kept."
        )
