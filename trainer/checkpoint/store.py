"""Writing and committing a save: one folder per save, for every strategy (docs/design.md section 8).

Layout of ``epoch=0-step=4.ckpt/`` (a folder; the name keeps ModelCheckpoint's suffix)::

    __<rank>_0.distcp   DCP's data files: the model and optimizer tensors (and the model-shaped weights of
                        MODEL_SHAPED_KEYS a callback adds). Every rank writes one; a
                        tensor every rank holds (DDP) is written once, by whichever rank DCP's planner
                        picks to balance the bytes; a sharded tensor (FSDP) by each rank, its shard.
                        Each also holds the save's identity (item ``identity_<rank>``)
    .metadata           DCP's index of every item (rank 0, once all data files are written)
    keel.pt             rank 0: everything else (loop state, per-rank RNG, schedulers, scaler, callbacks,
                        datamodule, hparams, options, class names, the save's identity); a plain
                        ``torch.save`` file read back with ``weights_only=True``
    lightning.pt      only with ``ModelCheckpoint(lightning_file=True)`` (``callbacks.lightning``'s
                        default) under DDP or one device: Lightning's keys in one plain file
    keel.json           the manifest, written last: format, identity (save id, run, step, epoch, world
                        size) and the size and CRC32 of every other file, computed while it was written

Commit protocol on a filesystem: every file is written under a temporary folder name beside the target and
fsynced; once every rank's data files are durable (a gather of their checksums on the checkpoint group), rank 0
writes keel.pt and the manifest, fsyncs the folder, renames it into place and fsyncs the parent. The ``last``
pointer is swapped after that (ModelCheckpoint's commit). A crash at any point leaves the previous save and the
pointer untouched; the temporary folder it leaves is removed by the next successful save.

On object storage (no rename: an s3fs "move" is a copy and a delete) the marker is the commit: every rank's data
objects and keel.pt go under a prefix of their own inside the save, ``<save>/<save id>/``; once every object is
written and confirmed (each upload completed, then one listing checks every size), rank 0 writes the manifest
``<save>/keel.json`` last, naming that prefix (``"data"``). A save without its manifest does not exist for resume,
pruning or ``best``; a re-save of the same name writes a new prefix and only its manifest switches to it, so the
previous one stays loadable until then; the prefixes the manifest does not name are removed after it is written.
Pruning removes the manifest first, then the rest. Filesystems keep the rename protocol: it is proven there, and it
keeps the layout Lightning programs open (``<save>/lightning.pt``).

Synchronous and asynchronous saves run the same two functions, :func:`_stage` on the main thread and
:func:`_write` on the main thread or the checkpointer's worker thread; only the thread differs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.async_save import AsyncCheckpointer, cpu_copy
from trainer.checkpoint.files import (
    FORMAT_VERSION,
    ITEM_BYTES,
    K_AVERAGED_MODEL,
    K_CLASSES,
    K_CURRENT_MODEL,
    K_FORMAT,
    K_HPARAMS,
    K_IDENTITY,
    K_KEEL_VERSION,
    K_LOOP,
    K_OPTIMIZERS,
    K_STATE_DICT,
    KEEL_VERSION,
    METADATA_ITEM_BYTES,
    CheckpointSaveError,
    fsync_dir,
    leaves,
    os_error,
    plain_file_bytes,
    refuse_non_finite,
    tensor_bytes,
    write_atomic,
)
from trainer.distributed import comm
from trainer.storage import AnyPath, RemotePath, as_path

log = logging.getLogger(__name__)

KEEL_FILE = "keel.pt"
MANIFEST_FILE = "keel.json"
METADATA_FILE = ".metadata"
LIGHTNING_FILE = "lightning.pt"
# Its earlier name, which a program globbing **/*.ckpt for its checkpoints found as one more: saves that hold it are
# still read.
LIGHTNING_FILE_NAMES = (LIGHTNING_FILE, "lightning.ckpt")
DCP_KEYS = {K_STATE_DICT: "model", K_OPTIMIZERS: "optimizers"}  # checkpoint key -> DCP top-level key
# Model-shaped weights that on_save_checkpoint hooks may add: DCP writes them too (each rank its shard), and a load
# reads whichever the save holds into tensors shaped as the model's (trainer/checkpoint/reader.py).
MODEL_SHAPED_KEYS = {K_CURRENT_MODEL: "current_model", K_AVERAGED_MODEL: "averaged_model"}
_LEFTOVER = re.compile(
    r"^\..+\.(tmp-[0-9a-f]{8}|old-[0-9a-f]{8}|[a-z0-9_]{8}\.tmp)$"
)  # what a killed save leaves behind
# The temporary folders of this process's saves being written: a commit's sweep of leftovers never removes them.
_LIVE: set[str] = set()


_DCP_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"
# DCP in one process without a process group warns on every call, from whichever thread runs it (an async
# save's is DCP's own), that it assumes one process: it does, so the warning is silenced for good.
warnings.filterwarnings("ignore", message=_DCP_ONE_PROCESS)


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """The same, where a caller (pytest) reset the warning filters since this module was imported."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DCP_ONE_PROCESS)
        yield


def manifest_body(identity: dict[str, Any], files: dict[str, list[int]], data: str = "") -> dict[str, Any]:
    """The manifest: format, identity, every file's [size, crc32], and on object storage ``data``, the prefix
    inside the save that holds the files; its own checksum over all of that."""
    body: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "keel_version": KEEL_VERSION,
        "identity": identity,
        "files": files,
    }
    if data:
        body["data"] = data
    return dict(body, crc32=zlib.crc32(json.dumps(body, sort_keys=True).encode()))


def save(
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    identity: dict[str, Any],
    on_save: Callable[[dict[str, Any]], None],
    finite: Callable[[], bool],
    checkpointer: AsyncCheckpointer | None = None,
    commit: Callable[[], None] | None = None,
    lightning_file: bool = False,
    check: Callable[[], None] | None = None,
) -> None:
    """Write ``state`` (name -> object with ``state_dict()``) as the save folder ``path``. A collective:
    every rank calls it at the same point. ``identity``: the save's run, step, epoch, world size (a fresh
    save id is added); ``on_save(checkpoint)``: the ``on_save_checkpoint`` hooks; ``finite()``: whether the
    weights are finite (one reduction, the same on every rank); ``commit`` (rank 0): runs once the folder
    is committed (the pointer swap and pruning); ``check`` (rank 0) runs just before the commit and may refuse
    it (the run's claim on the folder). With ``checkpointer`` the write and ``commit`` run on its worker
    thread, and the save is reported done (or its error raised) at a later step boundary.

    Raises:
        FloatingPointError: the weights hold NaN or inf; nothing is written.
        CheckpointSaveError: the folder could not be written (disk full, ...): an OSError naming it, the bytes
            needed and free, and that the previous save is intact.
    """
    target = as_path(path)
    is_writer = comm.get_rank() == 0
    refuse_non_finite(finite(), target, identity.get("step"))
    if checkpointer is not None:
        checkpointer.wait()  # the save in flight first: its collectives come before this one's
    identity = dict(identity, save_id=comm.broadcast_object(uuid.uuid4().hex))
    if isinstance(target, RemotePath):  # the save's own prefix inside it (see the module docstring)
        tmp: AnyPath = target / identity["save_id"][:8]
    else:
        tmp = target.parent / f".{target.name}.tmp-{identity['save_id'][:8]}"
    if is_writer:
        target.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = {key: obj.state_dict() for key, obj in state.items()}  # RNG: a gather, on every rank
    checkpoint[K_FORMAT], checkpoint[K_KEEL_VERSION], checkpoint[K_IDENTITY] = FORMAT_VERSION, KEEL_VERSION, identity
    checkpoint[K_CLASSES] = {k: obj.classes() for k, obj in state.items() if hasattr(obj, "classes")}
    on_save(checkpoint)
    dcp_keys = {**DCP_KEYS, **MODEL_SHAPED_KEYS}
    tensors = {name: checkpoint.pop(key) for key, name in dcp_keys.items() if key in checkpoint}
    tensors[f"identity_{comm.get_rank()}"] = json.dumps(identity, sort_keys=True)  # in this rank's data file
    extras = _lightning_extras(checkpoint) if lightning_file and is_writer else None
    job = _Save(target, tmp, tensors, checkpoint if is_writer else None, extras, check)
    live = str(tmp) if isinstance(tmp, RemotePath) else os.path.realpath(tmp)
    _LIVE.add(live)
    if checkpointer is None:
        try:
            _write(job, _stage(job, None), None)  # ends with every rank agreeing on the outcome: no barrier needed
            if commit is not None and is_writer:
                commit()
        finally:
            _LIVE.discard(live)
        return

    def write(staged: Any) -> None:
        try:
            _write(job, staged, checkpointer)
            if commit is not None and is_writer:
                commit()  # the pointer swap and pruning (removing a GiB folder takes ~0.3 s): off the training thread
        finally:
            _LIVE.discard(live)

    try:
        checkpointer.submit(lambda: _stage(job, checkpointer), write, what=str(target))
    except BaseException:
        _LIVE.discard(live)  # nothing was started
        raise


class _Save:
    """One save in progress: where it goes and what it holds."""

    def __init__(
        self,
        target: AnyPath,
        tmp: AnyPath,
        tensors: dict[str, Any],
        rest: dict[str, Any] | None,
        extras: Any,
        check: Callable[[], None] | None,
    ) -> None:
        self.target, self.tmp, self.tensors, self.rest, self.extras = target, tmp, tensors, rest, extras
        self.check = check
        self.nbytes = tensor_bytes(tensors, whole=True)  # the whole save (every rank's part), for a failure's message
        self.items = leaves(tensors)  # DCP items of this rank, each a record of its own in its data file
        from trainer.checkpoint import dcp_io  # on the first save: importing DCP takes 0.6 s (dcp_io's docstring)

        self.writer, self.fs = dcp_io.writer(tmp)


def _file_sizes(job: _Save) -> list[int]:
    """The size of every file of a save, for a failure's message (trainer/checkpoint/files.py rounds each up to the
    filesystem's blocks), at most what they take: a DCP data file per rank (its share of the tensors, and a record of
    its own for each item), .metadata, rank 0's keel.pt and lightning.pt (rank 0's message counts them), the
    manifest."""
    world = comm.get_world_size()
    sizes = [job.nbytes // world + ITEM_BYTES * job.items for _ in range(world)]
    sizes.append(METADATA_ITEM_BYTES * (job.items + 2))
    if job.rest is not None:
        sizes.append(plain_file_bytes(job.rest))
    if job.extras is not None:
        sizes.append(plain_file_bytes(job.extras))
    sizes.append(1024 + 128 * len(sizes))  # keel.json: a line per file
    return sizes


def _lightning_extras(checkpoint: dict[str, Any]) -> dict[str, Any]:
    loop = checkpoint.get(K_LOOP, {})
    return {
        "epoch": int(loop.get("epoch", 0)),
        "global_step": int(loop.get("global_step", 0)),
        K_HPARAMS: checkpoint.get(K_HPARAMS, {}),
        "pytorch-lightning_version": f"keel-{KEEL_VERSION}",
        K_FORMAT: FORMAT_VERSION,
    }


def _stage(job: _Save, checkpointer: AsyncCheckpointer | None) -> Any:
    """Main thread. Synchronous: nothing (DCP reads the live tensors while it writes). Asynchronous: this
    rank's tensors copied to CPU buffers reused across saves (``dcp.async_save``'s stager; the loop is
    blocked only for that copy), the write started on DCP's thread on the checkpoint group, and a copy of
    keel.pt's small state that later steps cannot change."""
    if checkpointer is None:
        return None
    from trainer.checkpoint import dcp_io

    stager = checkpointer.__dict__.setdefault("dcp_stager", dcp_io.ReusedStaging())
    with quiet_dcp():
        future = dcp_io.dcp.async_save(
            job.tensors, storage_writer=job.writer, process_group=comm.checkpoint_group(), async_stager=stager
        )
    if job.extras is not None:
        job.extras[K_STATE_DICT] = stager.staged("model")
    job.rest = cpu_copy(job.rest) if job.rest is not None else None
    job.tensors = {}  # the staged copy is DCP's now; the live tensors are free to change
    return future


def _write(job: _Save, future: Any, checkpointer: AsyncCheckpointer | None) -> None:
    """Write and commit (main thread, or the worker thread with ``checkpointer``). Every rank: its data
    files; then a gather of every rank's checksums and errors; then rank 0 writes keel.pt, the Lightning
    file and the manifest and renames the folder into place; then every rank agrees on the outcome (with
    ``checkpointer``, a vote: all ranks raise a failure at the same step boundary)."""
    group = comm.checkpoint_group() if checkpointer is not None else None
    error: BaseException | None = None
    try:
        if future is None:
            if job.extras is not None:
                job.extras[K_STATE_DICT] = job.tensors.get("model", {})
            from trainer.checkpoint import dcp_io

            with quiet_dcp():
                dcp_io.dcp.save(job.tensors, storage_writer=job.writer)
        else:
            future.result()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        error = exc
    parts: list[tuple[dict[str, list[int]], str]] = comm.all_gather_object(
        (dict(job.fs.written), _describe(error)), group=group
    )
    failed = [text for _, text in parts if text]
    if not failed and job.rest is not None:  # rank 0
        try:
            _finish(job, {name: size_crc for files, _ in parts for name, size_crc in files.items()})
        except BaseException as exc:
            error, failed = exc, [_describe(exc)]
    mine = failed[0] if failed else ""
    if checkpointer is None:
        failed = [text for text in comm.all_gather_object(mine, group=group) if text]
    else:
        outcome: list[str] = []

        def agree(polls: int) -> tuple[bool, int]:
            gathered: list[tuple[str, int]] = comm.all_gather_object((mine, polls), group=group)
            outcome.extend(text for text, _ in gathered if text)
            return not outcome, max(p for _, p in gathered)

        checkpointer.vote(agree)
        failed = outcome
    if failed:
        if job.rest is not None:
            _remove_quietly(job.tmp)
        raise _save_error(job, error, failed[0])


def _describe(error: BaseException | None) -> str:
    if error is None:
        return ""
    cause = os_error(error)
    if cause is not None:
        return f"OSError:{cause.errno}:{cause.strerror or cause}"
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"


def _save_error(job: _Save, error: BaseException | None, text: str) -> BaseException:
    """A failed save, explained: this rank's OSError, or another rank's (rebuilt from its description)."""
    cause = os_error(error) if error is not None else None
    if cause is None and text.startswith("OSError:"):
        _, code, reason = text.split(":", 2)
        cause = OSError(int(code) if code.isdigit() else None, reason)
    if isinstance(job.target, RemotePath):
        return CheckpointSaveError.for_object(job.target, job.nbytes, cause if cause is not None else text)
    if cause is not None:
        return CheckpointSaveError.for_file(job.target, job.nbytes, cause, files=_file_sizes(job))
    return RuntimeError(
        f"Writing checkpoint {str(job.target)!r} failed ({text}); nothing was committed and the previous "
        "checkpoint is intact."
    )


def _finish(job: _Save, files: dict[str, list[int]]) -> None:
    """Rank 0, once every rank's data files are durable: keel.pt, the Lightning file, the manifest (each
    fsynced), then the folder is renamed into place (on object storage: the manifest, written last, commits)."""
    assert job.rest is not None
    if job.check is not None:
        job.check()
    if not isinstance(job.target, RemotePath):  # on object storage one listing checks everything, below
        _check_shared(job, files)
    identity = job.rest[K_IDENTITY]
    rest = job.rest
    files[KEEL_FILE] = _checksum(write_atomic(job.tmp / KEEL_FILE, lambda h: torch.save(rest, h)), job.tmp / KEEL_FILE)
    if job.extras is not None and any(hasattr(v, "device_mesh") for v in job.extras[K_STATE_DICT].values()):
        log.warning(
            "ModelCheckpoint(lightning_file=True): %s holds sharded (FSDP) weights, so no %s is written; "
            "best_model_path names the folder (export_weights writes one plain file).",
            job.target,
            LIGHTNING_FILE,
        )
    elif job.extras is not None:
        extras = job.extras
        path = job.tmp / LIGHTNING_FILE
        files[LIGHTNING_FILE] = _checksum(write_atomic(path, lambda h: torch.save(extras, h)), path)
    if isinstance(job.target, RemotePath):
        _check_shared(job, files)  # every object confirmed by one listing before the marker
        body = json.dumps(manifest_body(identity, files, data=job.tmp.name), sort_keys=True, indent=1).encode()
        write_atomic(job.target / MANIFEST_FILE, lambda h: h.write(body))
        for entry in job.target.iterdir():  # what an earlier save of this name, or a killed one, left
            if entry.name not in (MANIFEST_FILE, job.tmp.name):
                _remove_quietly(entry)
        return
    body = json.dumps(manifest_body(identity, files), sort_keys=True, indent=1).encode()
    assert isinstance(job.tmp, Path) and isinstance(job.target, Path)
    write_atomic(job.tmp / MANIFEST_FILE, lambda h: h.write(body))
    fsync_dir(job.tmp)
    commit_folder(job.tmp, job.target)


def _check_shared(job: _Save, files: dict[str, list[int]]) -> None:
    """Every file the ranks wrote is where rank 0 sees it (with its size, on object storage)."""
    if isinstance(job.tmp, RemotePath):
        listed = job.tmp.files()
        unseen = sorted(name for name, (size, _) in files.items() if listed.get(name) != size)
        if unseen:
            raise RuntimeError(
                f"Checkpoint {str(job.target)!r}: the store does not list {unseen} with the sizes written; nothing "
                "was committed. (A store that lists objects late is not supported: keel needs read-after-write "
                "consistency, which AWS S3 and most S3-compatible stores give.)"
            )
        return
    unseen = sorted(name for name in files if not (job.tmp / name).is_file())
    if unseen:
        raise RuntimeError(
            f"Checkpoint folder {str(job.tmp.parent)!r} is not shared by every rank: rank 0 cannot see {unseen}, "
            "which other ranks wrote. Put ModelCheckpoint(dirpath=...) on storage every node mounts."
        )


def _checksum(crc: int, path: AnyPath) -> list[int]:
    return [path.stat().st_size, crc]


def commit_folder(tmp: Path, target: Path) -> None:
    """Rename the finished folder into place (a re-save of the same name swaps the old one out first),
    then remove what killed saves left in the folder (temporary folders and files), never the temporary folder of
    a save this process is still writing."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    for entry in target.parent.iterdir():
        if _LEFTOVER.match(entry.name) and os.path.realpath(entry) not in _LIVE:  # never a save still being written
            remove_save(entry)


def _remove_quietly(path: AnyPath) -> None:
    try:
        if isinstance(path, RemotePath):
            path.rmtree()
        else:
            shutil.rmtree(path, ignore_errors=True)
    except Exception as exc:  # the store may be what failed
        log.warning("Could not remove %s: %s", path, exc)


def remove_save(path: str | os.PathLike) -> None:
    """Delete a save (a folder, or a weights-only file), its manifest first: a save half removed is
    uncommitted, never a damaged candidate. A failure is logged, not raised."""
    target = as_path(path)
    try:
        if isinstance(target, RemotePath):
            try:
                (target / MANIFEST_FILE).unlink()
            except FileNotFoundError:
                pass
            target.rmtree()
        elif target.is_dir() and not target.is_symlink():
            (target / MANIFEST_FILE).unlink(missing_ok=True)
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
    except Exception as exc:
        log.warning("Could not remove old checkpoint %s: %s", target, exc)
