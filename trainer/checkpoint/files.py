"""The checkpoint file layer: keys, errors, plain files written atomically and loaded safely, the pointer.

Everything in a save is either a plain ``torch.save`` file (``keel.pt``, a weights file) read back with
``torch.load(weights_only=True)``, DCP's files (trainer/checkpoint/store.py writes them, reader.py reads
them through an allow-list), or JSON. Nothing in a checkpoint can run code when it is loaded.

Files are written to a temporary name in the same folder, fsynced, renamed over the target and the folder
is fsynced, so a crash leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from trainer.storage import AnyPath, RemotePath, as_path, describe_error, is_url

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 1: one file per save (DDP) or a folder without a manifest (FSDP); 2: a folder with keel.json
KEEL_VERSION = "0.1.0"

# Keys of a checkpoint: the dict the on_save_checkpoint / on_load_checkpoint hooks see (Lightning's names
# where Lightning has one), and of the state objects the Checkpointer saves.
K_FORMAT = "keel_format_version"
K_KEEL_VERSION = "keel_version"
K_WORLD_SIZE = "world_size"
K_STATE_DICT = "state_dict"
K_OPTIMIZERS = "optimizer_states"
K_SCHEDULERS = "lr_schedulers"
K_SCALER = "grad_scaler"
K_LOOP = "loop"
K_CALLBACKS = "callbacks"
K_RNG = "rng_states"
K_STREAMS = "stream_positions"  # per rank: where a training loader that saves its own position stands
K_OPTIONS = "trainer_options"
K_DATAMODULE = "datamodule"
K_HPARAMS = "hyper_parameters"
K_GLOBAL_BATCH = "global_batch"  # trainer/data/global_batch.py: the run's samples per optimizer step
K_CLASSES = "state_classes"  # {key: [class names]} of the optimizers and schedulers, checked before loading
K_IDENTITY = "identity"  # {save_id, run, step, epoch, world_size}: the same in keel.pt and keel.json
# Weights shaped as the task's state dict that a callback's on_save_checkpoint adds (Lightning's WeightAveraging
# moves the training weights to "current_model_state" and saves the averaged ones as "state_dict"): written by DCP
# beside the model, sharded as it is, and read back beside it (callbacks/weight_averaging.py).
K_CURRENT_MODEL = "current_model_state"
K_AVERAGED_MODEL = "averaged_model_state"
REQUIRED_KEYS = (K_FORMAT, K_STATE_DICT)

MANIFEST_NAME = "keel.json"  # a save's commit marker (trainer/checkpoint/store.py)
POINTER_NAME = "last"  # JSON in the checkpoint folder: {"last": name, "history": [names, newest first]}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: missing, truncated, corrupt, unsafe, foreign, or of an unknown format."""


class CorruptCheckpointError(CheckpointError):
    """A save that is damaged (a truncated, corrupt or missing part), unsafe (a pickle that is not plain data)
    or foreign (a part of another save). ``ckpt_path="last"`` falls back to the previous committed save."""


class StoreReadError(CheckpointError):
    """A save on object storage that could not be read because the store failed (a refused connection, a timeout,
    a 5xx answer, a refused permission): not damage, so ``ckpt_path="last"`` never falls back past it to an older
    save (that would silently lose progress); the resume stops and is run again once the store answers."""

    objects: tuple[tuple[str, str], ...] = ()  # (URL, the store's error) of each object that could not be read

    @classmethod
    def of(cls, folder: Any, failed: list[str]) -> StoreReadError:
        """The error for ``folder``, whose parts ``failed`` ("NAME could not be read from the store (...)")."""
        return cls(
            f"Checkpoint {str(folder)!r} could not be verified: {'; '.join(failed)}. Nothing was loaded; run again "
            "once the store answers."
        )

    @classmethod
    def reading(cls, path: Any, exc: BaseException) -> StoreReadError:
        """The error for the object ``path`` of a save, whose read failed with ``exc`` (the store's own error)."""
        path = as_path(path)
        error = cls.of(path.parent, [f"{path.name} could not be read from the store ({describe_error(exc)})"])
        error.objects = ((str(path), describe_error(exc)),)
        return error

    def naming(self, save: Any) -> StoreReadError:
        """This error, naming the save ``save`` and each object that failed by its name inside it."""
        inside = [(url[len(str(save)) + 1 :], cause) for url, cause in self.objects if url.startswith(f"{save}/")]
        if not inside or len(inside) != len(self.objects):
            return self
        error = StoreReadError.of(
            save, [f"{name} could not be read from the store ({cause})" for name, cause in inside]
        )
        error.objects = self.objects
        return error


def store_failed(path: Any, exc: BaseException) -> bool:
    """Whether ``exc``, raised while ``path`` was read, is the store's failure rather than the object's absence or
    damage: on object storage, anything its client raises but ``FileNotFoundError`` (keel's own refusals aside)."""
    return is_url(path) and not isinstance(exc, (FileNotFoundError, CheckpointError))


def read_object(path: AnyPath) -> bytes | None:
    """The bytes of ``path`` (None when it is absent), read in one request on object storage. Raises
    :class:`StoreReadError` when the store fails, so that what the bytes hold is judged only on bytes read."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except Exception as exc:
        if store_failed(path, exc):
            raise StoreReadError.reading(path, exc) from exc
        raise


class CheckpointSaveError(OSError):
    """A checkpoint that could not be written (disk full, no permission, ...). An ``OSError`` with the
    cause's ``errno``; the message names the file, the bytes needed and free, and the previous
    checkpoint, which is intact (only a temporary file or folder was written, and it was removed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    @classmethod
    def for_file(
        cls,
        target: AnyPath,
        state: Any,
        cause: OSError,
        *,
        temporary: bool = True,
        files: list[int] | None = None,
    ) -> CheckpointSaveError:
        """The error for ``target`` (a file or a folder) whose write of ``state`` (its tensors, or their bytes) failed
        with ``cause``. ``files``: the sizes of the files the write makes (default: one file holding ``state``);
        each takes whole blocks of the filesystem, so the space named is what the files take on the disk, never
        less (a save of small files needs several times its tensors' bytes)."""
        needed = state if isinstance(state, int) else tensor_bytes(state)
        if isinstance(target, RemotePath):
            return cls.for_object(target, needed, cause)
        folder = target.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        try:
            free = human_bytes(shutil.disk_usage(folder).free)
        except OSError:
            free = "unknown"
        sizes = files if files is not None else [needed if isinstance(state, int) else plain_file_bytes(state)]
        block = block_size(folder)
        taken = on_disk(sizes, block)
        try:
            previous = read_pointer(target.parent) or []
        except CheckpointError:
            previous = []
        if previous:
            kept = (
                f"the previous checkpoint {str(target.parent / previous[0])!r} is intact "
                "(ckpt_path='last' resumes from it)"
            )
        elif target.exists():
            kept = f"the existing {str(target)!r} is intact"
        else:
            kept = "no earlier checkpoint was touched"
        code = errno.errorcode.get(cause.errno or 0, "")
        reason = f"{cause.strerror or cause}" + (f" ({code})" if code else "")
        if cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            hint = " Free space, or point ModelCheckpoint(dirpath=...) at a larger disk."
        elif cause.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            hint = " Make the folder writable by this user, or choose another ModelCheckpoint(dirpath=...)."
        else:
            hint = ""
        error = cls(
            f"Could not write checkpoint {str(target)!r}: {reason}. It needs about {human_bytes(taken)} on disk "
            f"({needed:,} bytes of tensors, in {len(sizes)} file{'s' if len(sizes) != 1 else ''} of whole "
            f"{block:,}-byte blocks, with their metadata); {free} free in {str(folder)!r}. Nothing was replaced: "
            f"{'the temporary files were removed' if temporary else 'nothing was written'} and {kept}.{hint}"
        )
        error.errno, error.strerror, error.filename = cause.errno, cause.strerror, str(target)
        return error

    @classmethod
    def for_object(cls, target: RemotePath, needed: int, cause: BaseException | str) -> CheckpointSaveError:
        """The error for a save on object storage whose write failed with ``cause`` (any exception: the
        store's client raises its own classes). The previous committed save is not touched by a failed one."""
        try:
            previous = read_pointer(target.parent) or []
        except Exception:  # the store may be the thing that failed
            previous = []
        kept = (
            f"the previous checkpoint {str(target.parent / previous[0])!r} is intact (ckpt_path='last' resumes from it)"
            if previous
            else "no earlier checkpoint was touched"
        )
        error = cls(
            f"Could not write checkpoint {str(target)!r} ({human_bytes(needed)} of tensors) to object storage: "
            f"{cause if isinstance(cause, str) else describe_error(cause)}. Nothing was committed (the save has no "
            f"{MANIFEST_NAME}, so resume, pruning "
            f"and 'best' ignore what was written) and {kept}. Check that the store answers and that the "
            "credentials may write there."
        )
        error.errno = getattr(cause, "errno", None)
        error.strerror = cause if isinstance(cause, str) else describe_error(cause)
        error.filename = str(target)
        return error


def refuse_non_finite(finite: bool, path: str | os.PathLike, step: Any) -> None:
    """Raise ``FloatingPointError`` for a save of non-finite weights (nothing is written then)."""
    if not finite:
        raise FloatingPointError(
            f"Refusing to write checkpoint {os.fspath(path)!r} at step {step}: the weights hold NaN or inf (a "
            "non-finite step got through). The last good checkpoint is kept."
        )


def tensor_bytes(obj: Any, *, whole: bool = False) -> int:
    """Sum of ``nbytes`` of the tensors in a (nested) state: the size estimate of its files. A sharded tensor
    (DTensor) counts its local shard, or with ``whole`` the whole tensor: then every rank's answer is the size of
    the save all ranks write together (a replicated tensor is written once)."""
    if isinstance(obj, torch.Tensor):
        if whole or not hasattr(obj, "to_local"):
            return obj.nelement() * obj.element_size()
        local = obj.to_local()
        return local.nelement() * local.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, whole=whole) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, whole=whole) for v in obj)
    return 0


ITEM_BYTES = 1664  # what one DCP item adds to a data file beside its tensor's bytes (a torch.save record of its own)
METADATA_ITEM_BYTES = 256  # what one DCP item adds to .metadata


def leaves(obj: Any) -> int:
    """The values of a (nested) state: at most the items DCP writes, each a record of its own."""
    if isinstance(obj, dict):
        return sum(leaves(v) for v in obj.values())
    if isinstance(obj, list):
        return sum(leaves(v) for v in obj)
    return 1


class _Counter:
    """A file that keeps only the count of the bytes written to it."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: Any) -> int:
        count = memoryview(data).nbytes
        self.size += count
        return count

    def flush(self) -> None:
        """Nothing to flush."""


def plain_file_bytes(state: Any) -> int:
    """The size of ``state`` written as one plain ``torch.save`` file: serialized into a counter (a failed write's
    message; a weights file of a large model takes a few seconds), else its tensors' bytes."""
    counter = _Counter()
    try:
        torch.save(state, counter)  # type: ignore[arg-type]  # a file: what torch.save calls is write()
    except Exception:  # an unpicklable value: the write itself failed on it
        return tensor_bytes(state, whole=True)
    return counter.size


def block_size(folder: str | os.PathLike) -> int:
    """The block of the filesystem that holds ``folder`` (``f_frsize``, else ``f_bsize``): the unit a file's
    bytes take on it. 4096 where it cannot be read."""
    try:
        stat = os.statvfs(folder)
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        return 4096
    return int(stat.f_frsize or stat.f_bsize or 4096)


def on_disk(sizes: list[int], block: int) -> int:
    """What files of ``sizes`` take on a filesystem of ``block``-byte blocks: each a whole number of blocks."""
    return sum(-(-max(int(size), 0) // block) * block for size in sizes)


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write: the first one raised (the deepest in ``exc``'s cause/context
    chain; a failed write is often followed by another one when the file is closed), also inside DCP's
    CheckpointException, which holds every rank's failure in ``failures``."""
    found: OSError | None = None
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            break
        if isinstance(current, OSError) and not isinstance(current, CheckpointSaveError):
            found = current
        for failure in getattr(current, "failures", {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if found is None and isinstance(inner, BaseException) and inner is not current:
                found = os_error(inner)
        current = current.__cause__ or current.__context__
    return found


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once at import: os.umask is process-wide, so never toggle it while saving


def write_atomic(target: AnyPath, write: Any, *, state: Any = None) -> int:
    """Write a file through ``write(handle)`` to a temporary name beside ``target``, fsync, rename it over
    ``target``, fsync the folder. Returns the file's CRC32. On object storage the object is uploaded under its
    name: it appears whole when the upload completes, or not at all.

    Raises:
        CheckpointSaveError: the write failed (disk full, no permission, ...); ``target`` is untouched.
    """
    if isinstance(target, RemotePath):
        return _write_object(target, write, state)
    tmp_name: str | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as raw:
            os.fchmod(raw.fileno(), 0o666 & ~_UMASK)  # mkstemp makes 0600; the usual file mode instead
            handle = HashingWriter(raw)
            write(handle)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp_name, target)
    except BaseException as exc:
        if tmp_name is not None:
            remove_quietly(tmp_name)
        cause = os_error(exc)
        if cause is None:
            raise
        # Raised from the OSError itself: torch's "enforce fail ... unexpected pos" after it is noise.
        raise CheckpointSaveError.for_file(target, state, cause, temporary=tmp_name is not None) from cause
    fsync_dir(target.parent)
    return handle.crc


def _write_object(target: RemotePath, write: Any, state: Any) -> int:
    try:
        with target.open("wb") as raw:
            handle = HashingWriter(raw)
            write(handle)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointSaveError.for_file(target, state, exc) from exc  # type: ignore[arg-type]
    return handle.crc


class HashingWriter:
    """A binary file wrapper that keeps the CRC32 and size of every byte written through it (the checksum
    is computed while writing: zlib's CRC32 runs at several GB/s and releases the GIL)."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.crc, self.size = raw, 0, 0

    def write(self, data: Any) -> int:
        written = self.raw.write(data)
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view[:written] if written is not None else view, self.crc)
        self.size += len(view) if written is None else written
        return len(view) if written is None else written

    def __getattr__(self, name: str) -> Any:  # tell, seek, flush, fileno, close: the file's own
        return getattr(self.raw, name)

    def writable(self) -> bool:
        return True


def save_file(state: dict[str, Any], path: str | os.PathLike) -> None:
    """A plain ``torch.save`` file written atomically (a weights file, ``export_weights``). Raises
    :class:`CheckpointSaveError` naming the file, the bytes needed and free."""
    write_atomic(as_path(path), lambda handle: torch.save(state, handle), state=state)


def unreadable(path: Any, exc: Exception) -> CorruptCheckpointError:
    """The error for a plain file ``torch.load(weights_only=True)`` refused or could not read: one holding pickled
    objects that could run code, or a truncated or corrupt one, naming the file and the cause."""
    text = str(exc)
    first = text.splitlines()[0] if text else type(exc).__name__
    if "weights_only" in text or "Unsupported global" in text or "GLOBAL" in text:
        return CorruptCheckpointError(
            f"Checkpoint {str(path)!r} contains pickled objects that are not plain tensors and "
            f"containers; keel refuses to load it (weights_only=True) so that nothing in it can run. "
            f"Detail: {first}"
        )
    return CorruptCheckpointError(f"Checkpoint {str(path)!r} is truncated or corrupt ({type(exc).__name__}: {first}).")


def verify_records(path: AnyPath, source: Any) -> None:
    """Check every record of a ``torch.save`` file (a zip archive) against the CRC32 it was written with: a plain
    file (a weights-only save, ``export_weights``' output, a keel.pt) is verified when it is read, as a save folder
    is by its manifest. One sequential read of the file. A file in torch's legacy (non-zip) format has no
    checksums and is left to ``torch.load``.

    Raises:
        CorruptCheckpointError: naming the file and the damaged record.
    """
    if isinstance(source, io.BytesIO):
        source.seek(0)
    try:
        with zipfile.ZipFile(source) as archive:
            bad = archive.testzip()
    except zipfile.BadZipFile as exc:
        head = source.getvalue()[:2] if isinstance(source, io.BytesIO) else Path(source).read_bytes()[:2]
        if head != b"PK":
            return  # the legacy format
        raise CorruptCheckpointError(f"Checkpoint {str(path)!r} is damaged: {exc} (a torn copy?).") from exc
    finally:
        if isinstance(source, io.BytesIO):
            source.seek(0)
    if bad is not None:
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r} is damaged: its record {bad!r} does not match the CRC32 it was written with "
            "(a flipped bit or a torn copy). Use another copy of the file."
        )


def load_file(path: str | os.PathLike, *, required: tuple[str, ...] = REQUIRED_KEYS) -> dict[str, Any]:
    """A plain file with ``torch.load(weights_only=True)``: nothing in it can run code. Raises
    :class:`CheckpointError` naming the file and the cause. ``required``: the top-level keys it must hold."""
    path = as_path(path)
    source: Any = path
    if isinstance(path, RemotePath):  # read first: what the store fails to give is not a damaged file
        data = read_object(path)
        if data is None:
            raise CheckpointError(f"Checkpoint {str(path)!r} does not exist.")
        source = io.BytesIO(data)
    elif not path.is_file():
        raise CheckpointError(f"Checkpoint {str(path)!r} does not exist.")
    try:
        verify_records(path, source)
        state = torch.load(source, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:
        raise unreadable(path, exc) from exc
    missing = [k for k in required if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{str(path)!r} is not a keel checkpoint (missing {missing}).")
    if isinstance(state, dict) and int(state.get(K_FORMAT, 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"Checkpoint {str(path)!r} has format version {state[K_FORMAT]}, newer than this keel "
            f"({FORMAT_VERSION}); upgrade keel to load it."
        )
    return state


def remove_quietly(name: str | os.PathLike) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass


# ---------------------------------------------------------------------- the ``last`` pointer
def check_entry(name: Any, pointer: AnyPath) -> str:
    """A pointer entry: a plain name of a save inside the pointer's folder. Anything else (a path, ``..``,
    an absolute path, a hidden temporary name) is refused: a pointer never leads out of its folder."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or name.startswith(".")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name == POINTER_NAME
    ):
        raise CheckpointError(
            f"The pointer {str(pointer)!r} names {name!r}, which is not the plain name of a save in its folder; "
            "keel follows a pointer only to a save inside that folder."
        )
    return name


def read_pointer(directory: str | os.PathLike) -> list[str] | None:
    """Save names recorded by the ``last`` pointer in ``directory``, newest first; None when there is no
    pointer (a first run).

    Raises:
        CheckpointError: the pointer exists but cannot be read, is not keel's JSON, or names anything but
            a plain name inside ``directory``.
        StoreReadError: on object storage, the store failed (not a damaged pointer: never replaced or skipped).
    """
    pointer = as_path(directory) / POINTER_NAME
    read: bytes | None = None
    if isinstance(pointer, RemotePath):  # one read: fsspec's exists() answers False when the store fails
        read = read_object(pointer)
        if read is None:
            return None
    elif not pointer.exists() and not pointer.is_symlink():
        return None
    try:
        data = json.loads(read if read is not None else pointer.read_text())
        names = data.get("history", [data["last"]]) if isinstance(data, dict) else None
        if not isinstance(names, list) or not names:
            raise ValueError("no 'last' entry")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"The pointer {str(pointer)!r} cannot be read ({type(exc).__name__}: {exc}).") from exc
    return [check_entry(n, pointer) for n in names]


def write_pointer(path: str | os.PathLike) -> None:
    """Record the committed save ``path`` as the newest in its folder's ``last`` pointer (kept history:
    20). Swapped atomically (temporary file, fsync, rename): a crash leaves the old pointer. A pointer
    that cannot be read is replaced (with a warning): the saves in the folder are the record."""
    directory, name = as_path(path).parent, as_path(path).name
    pointer = directory / POINTER_NAME
    try:
        previous = read_pointer(directory) or []
    except StoreReadError as exc:  # the store failed: the pointer is not replaced by one that lost its history
        raise _pointer_error(pointer, name, [], exc) from exc
    except CheckpointError as exc:
        log.warning("%s It is replaced by a pointer to %s.", exc, name)
        previous = []
    history = [name] + [n for n in previous if n != name]
    if (
        isinstance(pointer, Path) and pointer.is_dir() and not pointer.is_symlink()
    ):  # not a pointer: moved aside (kept for a look), not deleted
        aside = directory / f"{POINTER_NAME}.not-a-pointer-{os.getpid()}"
        log.warning("%s is a folder, not keel's pointer; it is moved to %s.", pointer, aside)
        os.replace(pointer, aside)
    body = json.dumps({"last": history[0], "history": history[:20]}).encode()
    try:
        write_atomic(pointer, lambda handle: handle.write(body))
    except CheckpointSaveError as exc:  # its message is a save's ("needs about ..."): say what failed instead
        raise _pointer_error(pointer, name, previous, exc.__cause__ or exc) from exc


def _pointer_error(pointer: AnyPath, name: str, previous: list[str], cause: BaseException) -> CheckpointSaveError:
    """The error for a swap of the ``last`` pointer to ``name`` that failed with ``cause``."""
    code = errno.errorcode.get(getattr(cause, "errno", None) or 0, "")
    reason = (
        f"{cause.strerror or cause}" + (f" ({code})" if code else "")
        if isinstance(cause, OSError) and not isinstance(cause, CheckpointSaveError)
        else describe_error(cause)
    )
    still = f"it still names {previous[0]!r}" if previous else "it was not changed"
    error = CheckpointSaveError(
        f"The `last` pointer {str(pointer)!r} could not be swapped to {name!r}: {reason}. The old pointer is intact "
        f"({still})."
    )
    error.errno = getattr(cause, "errno", None)
    error.strerror, error.filename = reason, str(pointer)
    return error
