"""Sharded checkpoints: one folder per save, every rank writes its own shards (docs/design.md section 8).

Layout of ``epoch=0-step=4.ckpt/`` (a folder; the name keeps ModelCheckpoint's suffix)::

    .metadata             DCP's index of every tensor shard (written last by DCP, on rank 0)
    __<rank>_0.distcp     each rank's shards of the model and optimizer states
    keel.pt               rank 0: everything else (loop state, per-rank RNG, schedulers, scaler,
                          callbacks, hparams, options, format version, world size); a plain
                          ``torch.save`` file read with ``weights_only=True``

Crash safety: the folder is written under a temporary name in the same parent (DCP fsyncs every file;
rank 0 adds ``keel.pt``, fsyncs it and the folder), renamed into place only when all of it is durable,
and the parent is fsynced; the ``last`` pointer is swapped after that. A crash at any point leaves the
previous checkpoint and ``last`` untouched (at worst a ``.name.tmp-*`` folder to delete), and nothing is
ever written into a committed folder.

Safe loading: DCP reads ``.metadata`` with plain ``pickle``, so a crafted file could run code during
``dcp.load``. :class:`SafeFileSystemReader` reads it with an unpickler that admits only DCP's own
metadata classes (and ``torch.Size``, dtypes, layouts, paths): a crafted one is refused, naming the file.

Model and optimizer states go through ``torch.distributed.checkpoint.state_dict`` (FQN-keyed), which works
for plain and FSDP modules alike, so a folder saved at N ranks loads at M ranks, under FSDP, DDP or a single
process (DCP reshards), and :func:`read_model_state` turns it into a plain state dict without any process
group.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import pickle
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.checkpoint.files import K_FORMAT, CheckpointError, CheckpointIO, CheckpointSaveError, _fsync_dir, _os_error
from trainer.data.transfer import tensors_in
from trainer.distributed import comm

if TYPE_CHECKING:  # pragma: no cover
    from trainer.checkpoint.async_save import AsyncCheckpointer

log = logging.getLogger(__name__)

KEEL_FILE = "keel.pt"
METADATA_FILE = ".metadata"
K_MODEL = "model"
K_OPTIMIZERS = "optimizers"

# What a real .metadata pickle refers to (torch 2.4 - 2.13); anything else is refused.
_ALLOWED_GLOBALS: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}


class UnsafeCheckpointError(RuntimeError):
    """A sharded checkpoint's metadata refers to something other than DCP's own classes."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, handle: Any, path: str) -> None:
        super().__init__(handle)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"Checkpoint metadata {self.path!r} refers to {module}.{name}, which is not one of DCP's metadata "
            "classes; keel refuses to load it (a crafted .metadata file could run code)."
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, but ``.metadata`` is read through an allow-listed unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle, os.fspath(path)).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def is_sharded(path: str | os.PathLike) -> bool:
    """True for a sharded checkpoint folder (it holds ``keel.pt``)."""
    return Path(path).is_dir() and (Path(path) / KEEL_FILE).is_file()


def _finish(tmp: Path, target: Path, keel_state: dict[str, Any]) -> None:
    """Rank 0, once every rank's shards are durable: add keel.pt (fsynced), fsync the folder, rename it
    into place (:func:`_commit`)."""
    with open(tmp / KEEL_FILE, "wb") as handle:
        torch.save(keel_state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_dir(tmp)
    _commit(tmp, target)


def save(
    state: dict[str, Any],
    path: str | os.PathLike,
    *,
    model_key: str,
    optimizers_key: str,
    task: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    is_writer: bool,
) -> None:
    """Write ``state`` as the folder ``path``. A collective: every rank calls it.

    ``state[model_key]`` / ``state[optimizers_key]`` are replaced by the task's and optimizers' states
    in ``torch.distributed.checkpoint.state_dict`` form (each rank's shards); the rest goes to
    ``keel.pt`` (rank 0).

    Raises:
        CheckpointSaveError: the folder could not be written (an OSError naming it, the bytes needed and free,
            and that the previous checkpoint is intact).
    """
    target = Path(path)
    tmp_name = comm.broadcast_object(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}" if is_writer else None)
    tmp = target.parent / str(tmp_name)
    if is_writer:
        target.parent.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    tensors = {
        K_MODEL: get_model_state_dict(task),
        K_OPTIMIZERS: [get_optimizer_state_dict(task, o) for o in optimizers],
    }
    rest = {k: v for k, v in state.items() if k not in (model_key, optimizers_key)}
    try:
        # DCP's own error type derives from BaseException: catch it here and say what happened.
        dcp.save(tensors, storage_writer=FileSystemWriter(tmp, sync_files=True))
        if is_writer:
            _finish(tmp, target, rest)
    except BaseException as exc:
        if is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise _save_error(target, tensors, exc) from exc
    comm.barrier()


def save_async(
    state: dict[str, Any],
    path: str | os.PathLike,
    *,
    model_key: str,
    optimizers_key: str,
    task: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    is_writer: bool,
    checkpointer: AsyncCheckpointer,
    commit: Callable[[], None] | None,
) -> None:
    """:func:`save` in the background. A collective: every rank calls it at the same step boundary.

    ``checkpointer`` (trainer/checkpoint/async_save.py) first waits for the save in flight; then every rank
    stages its shards to CPU memory (``dcp.async_save``: the loop is blocked only for that copy) and the
    write runs on DCP's thread, on a gloo group of its own (:func:`trainer.distributed.comm.checkpoint_group`). DCP's
    coordinator writes ``.metadata`` only after every rank's shards are written, so when rank 0's future
    is done all of them are durable: rank 0 then adds ``keel.pt`` and renames the folder into place, and
    ``commit`` (the pointer swap, pruning) runs at a later step boundary on the main thread.
    """
    target = Path(path)
    group = comm.checkpoint_group()
    tmp_name = comm.broadcast_object(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}" if is_writer else None)
    tmp = target.parent / str(tmp_name)
    if is_writer:
        target.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        K_MODEL: get_model_state_dict(task),
        K_OPTIMIZERS: [get_optimizer_state_dict(task, o) for o in optimizers],
    }
    rest = {k: v for k, v in state.items() if k not in (model_key, optimizers_key)}
    stager = checkpointer.__dict__.setdefault("dcp_stager", ReusedStaging())

    def stage() -> Any:
        future = dcp.async_save(
            tensors, storage_writer=FileSystemWriter(tmp, sync_files=True), process_group=group, async_stager=stager
        )
        return future, _cpu_copy(rest) if is_writer else None

    params = [name for name, p in task.named_parameters() if p.is_floating_point()]

    def write(staged: Any) -> None:
        future, keel_state = staged
        try:
            future.result()
            # Non-finite weights are refused on the staged copy, here in the background (a pass over the
            # weights costs as much as the copy), as the one-file path does; every rank votes on the
            # checkpoint group, so all agree, and a refusal is raised at the same step on every rank
            # (AsyncCheckpointer.vote). Nothing is committed: rank 0 removes the folder.
            local = _staged_finite(stager, params)
            finite = checkpointer.vote(lambda polls: _agree_finite(local, polls))
        except BaseException as exc:
            if is_writer:
                shutil.rmtree(tmp, ignore_errors=True)
            raise _save_error(target, tensors, exc) from exc
        if not finite:
            if is_writer:
                shutil.rmtree(tmp, ignore_errors=True)
            raise FloatingPointError(
                f"Refusing to write checkpoint {str(target)!r}: the weights hold NaN or inf (a non-finite step got "
                "through). The last good checkpoint is kept."
            )
        try:
            if is_writer:
                _finish(tmp, target, keel_state)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _save_error(target, tensors, exc) from exc

    checkpointer.submit(stage, write, commit if is_writer else None, what=str(target))


class ReusedStaging(AsyncStager):
    """DCP's staging of this rank's shards to CPU memory, into the buffers of the previous async save.

    DCP's default stager allocates a fresh CPU copy on every save; allocating and first touching it was
    most of the time an async FSDP save blocked the loop (benchmarks/fsdp.py), as for the one-file path,
    whose :class:`~trainer.checkpoint.async_save.CpuStager` reuses its buffers the same way. The buffers are
    free again when the next save stages: the checkpointer waits for the save in flight first. One copy of
    the shards (pinned on CUDA) stays in memory between saves; a different layout (optimizer state that
    appeared, a resized parameter) allocates anew. Blocking: the copy is done when :meth:`stage` returns.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict, _create_cpu_state_dict

        cuda = any(t.device.type == "cuda" for t in tensors_in(state_dict))
        staged = None
        if self._buffers is not None:
            try:
                staged = _copy_state_dict(state_dict, self._buffers, non_blocking=cuda)
            except (CompanionMismatch, RuntimeError):  # another structure, or a tensor of another shape
                staged = None
        if staged is None:
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=cuda)
            staged = _copy_state_dict(state_dict, self._buffers, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()  # the copies are complete before training changes the weights
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        self._buffers = None


def _staged_finite(stager: ReusedStaging, params: list[str]) -> bool:
    """Whether this rank's staged shards of every parameter are finite (this rank only: see _agree_finite)."""
    model = (stager._buffers or {}).get(K_MODEL, {})
    local = [t.to_local() if hasattr(t, "to_local") else t for t in (model.get(n) for n in params) if t is not None]
    local = [t for t in local if t.numel()]
    return not local or bool(torch.isfinite(torch.stack(torch._foreach_norm(local, ord=math.inf))).all())


def _agree_finite(ok: bool, polls: int) -> tuple[bool, int]:
    """Every rank's verdict and the largest poll count (one all-reduce on the checkpoint group: every rank's
    checkpoint thread calls it for the same save, through AsyncCheckpointer.vote)."""
    group = comm.checkpoint_group()
    if group is None:
        return ok, polls
    flags = torch.tensor([0 if ok else 1, polls], dtype=torch.int64)
    tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=group)
    refused, last = flags.tolist()
    return refused == 0, last


def _cpu_copy(obj: Any) -> Any:
    """A copy of keel.pt's small state (RNG, schedulers, loop, callbacks) that later steps cannot change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _save_error(target: Path, tensors: dict[str, Any], exc: BaseException) -> BaseException:
    """A failed folder write, explained: the OSError of whichever rank failed (DCP collects every rank's
    failures in a CheckpointException, a BaseException), with the bytes needed (this rank's shards) and free."""
    causes = [exc] + [
        failure[0] if isinstance(failure, tuple) else failure for failure in getattr(exc, "failures", {}).values()
    ]
    for cause in causes:
        found = _os_error(cause) if isinstance(cause, BaseException) else None
        if found is not None:
            return CheckpointSaveError.for_file(target, tensors, found)
    return RuntimeError(
        f"Writing sharded checkpoint {os.fspath(target)!r} failed ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else ''}); the previous checkpoint is intact."
    )


def _commit(tmp: Path, target: Path) -> None:
    """Rename the finished folder into place (a re-save of the same name swaps the old one out first)."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_keel_state(path: str | os.PathLike) -> dict[str, Any]:
    """``keel.pt`` of a sharded checkpoint (``weights_only=True``), after checking that ``.metadata``
    exists and is safe. Raises what :meth:`CheckpointIO.load` raises for a file."""
    folder = Path(path)
    metadata = folder / METADATA_FILE
    if not metadata.is_file():
        raise CheckpointError(f"Sharded checkpoint {str(folder)!r} has no {METADATA_FILE}: it was not committed.")
    try:
        with open(metadata, "rb") as handle:
            _MetadataUnpickler(handle, str(metadata)).load()
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from exc
    except Exception as exc:
        raise CheckpointError(
            f"Sharded checkpoint metadata {str(metadata)!r} is truncated or corrupt ({type(exc).__name__}: {exc})."
        ) from exc
    return CheckpointIO().load(folder / KEEL_FILE, required=(K_FORMAT,))


def load(path: str | os.PathLike, task: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[Any, Any]:
    """Read the model (and, when ``optimizers`` is not empty, their) states from the folder into this
    run's layout (this rank's shards under FSDP; whole tensors otherwise). A collective when a process
    group exists. Returns ``(model_state, optimizer_states)`` for :func:`apply`."""
    tensors: dict[str, Any] = {K_MODEL: get_model_state_dict(task)}
    if optimizers:
        tensors[K_OPTIMIZERS] = [get_optimizer_state_dict(task, o) for o in optimizers]
    try:
        dcp.load(tensors, storage_reader=SafeFileSystemReader(os.fspath(path)))
    except BaseException as exc:  # CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(
            f"Sharded checkpoint {os.fspath(path)!r} could not be loaded into "
            f"{type(task).__name__} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})."
        ) from exc
    return tensors[K_MODEL], tensors.get(K_OPTIMIZERS, [])


def apply(
    task: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    model_state: dict[str, Any],
    optimizer_states: list[dict[str, Any]],
    *,
    strict: bool = True,
) -> None:
    """Load what :func:`load` returned into the task and the optimizers."""
    set_model_state_dict(task, model_state, options=StateDictOptions(strict=strict))
    for optimizer, state in zip(optimizers, optimizer_states):
        set_optimizer_state_dict(task, optimizer, state)


def read_model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The task's weights from a sharded folder as one plain state dict of CPU tensors: no process group,
    any world size at save time (for ``export_weights`` and ``load_from_checkpoint``)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    read_keel_state(path)  # committed and safe, or a CheckpointError naming the problem
    tensors: dict[str, Any] = {}
    _load_state_dict(
        tensors,
        storage_reader=SafeFileSystemReader(os.fspath(path)),
        planner=_EmptyStateDictLoadPlanner(keys={K_MODEL}),
        no_dist=True,
    )
    return {k: v for k, v in tensors[K_MODEL].items()}
