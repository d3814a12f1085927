"""The checkpoint file layer: top-level keys, errors, atomic one-file writes, safe loading, the pointer.

What a checkpoint holds and how a run is restored is trainer/checkpoint/state.py; one folder of shards is
trainer/checkpoint/sharded.py; background writes are trainer/checkpoint/async_save.py. All of them use this
module, and it imports none of them (no import circle between the checkpoint modules).

Files are written to a temporary name in the same folder, fsynced, renamed over the target and the
folder is fsynced, so a crash leaves either the old file or the new one, never a torn one. Loading
always uses ``torch.load(weights_only=True)``: a checkpoint can never run code.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
KEEL_VERSION = "0.1.0"

# Top-level checkpoint keys.
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
K_OPTIONS = "trainer_options"
K_DATAMODULE = "datamodule"
K_HPARAMS = "hyper_parameters"
K_GLOBAL_BATCH = "global_batch"  # trainer/data/global_batch.py: the run's samples per optimizer step
REQUIRED_KEYS = (K_FORMAT, K_STATE_DICT)


POINTER_NAME = "last"  # JSON in the checkpoint folder: {"last": name, "history": [names, newest first]}


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read: missing, truncated, corrupt, unsafe, or of an unknown format."""


class CheckpointSaveError(OSError):
    """A checkpoint that could not be written (disk full, no permission, ...). An ``OSError`` with the
    cause's ``errno``; the message names the file, the bytes needed and free, and the previous
    checkpoint, which is intact (only a temporary file was written, and it was removed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    @classmethod
    def for_file(cls, target: Path, state: Any, cause: OSError, *, temporary: bool = True) -> CheckpointSaveError:
        """The error for ``target`` (a file or a folder) whose write of ``state`` failed with ``cause``;
        ``temporary``: a temporary file or folder had been created (and was removed)."""
        needed = tensor_bytes(state)
        folder = target.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        try:
            free = _human(shutil.disk_usage(folder).free)
        except OSError:
            free = "unknown"
        previous = read_pointer(target.parent) if target.parent.is_dir() else []
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
            f"Could not write checkpoint {str(target)!r}: {reason}. It needs about {_human(needed)} "
            f"({needed:,} bytes of tensors); {free} free in {str(folder)!r}. Nothing was replaced: "
            f"{'the temporary file was removed' if temporary else 'nothing was written'} and {kept}.{hint}"
        )
        error.errno, error.strerror, error.filename = cause.errno, cause.strerror, str(target)
        return error


def tensor_bytes(obj: Any) -> int:
    """Sum of ``nbytes`` of the tensors in a (nested) checkpoint state: the size estimate of its file."""
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write: the first one raised (the deepest in ``exc``'s cause/context
    chain; a failed write is often followed by another one when the file is closed)."""
    found: OSError | None = None
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            break
        if isinstance(current, OSError) and not isinstance(current, CheckpointSaveError):
            found = current
        current = current.__cause__ or current.__context__
    return found


def _fsync_dir(path: Path) -> None:
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


class CheckpointIO:
    """Atomic save and safe load of one checkpoint file."""

    def save(self, state: dict[str, Any], path: str | os.PathLike, *, is_writer: bool) -> None:
        """Write ``state`` to ``path`` atomically (only where ``is_writer``).

        Raises:
            CheckpointSaveError: the write failed (disk full, no permission, ...); it names the file, the
                bytes needed and free, and the previous checkpoint, which is intact.
        """
        if not is_writer:
            return
        target = Path(path)
        tmp_name: str | None = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            with os.fdopen(fd, "wb") as handle:
                os.fchmod(handle.fileno(), 0o666 & ~_UMASK)  # mkstemp makes 0600; the usual file mode instead
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp_name, target)
        except BaseException as exc:
            if tmp_name is not None:
                with_suppressed_unlink(tmp_name)
            cause = _os_error(exc)
            if cause is None:
                raise
            # Raised from the OSError itself: torch's "enforce fail ... unexpected pos" after it is noise.
            raise CheckpointSaveError.for_file(target, state, cause, temporary=tmp_name is not None) from cause
        _fsync_dir(target.parent)

    def load(self, path: str | os.PathLike, *, required: tuple[str, ...] = REQUIRED_KEYS) -> dict[str, Any]:
        """Load with ``weights_only=True``. Raises :class:`CheckpointError` naming the file and the cause.
        ``required``: the top-level keys the file must hold (a sharded folder's keel.pt has no weights)."""
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"Checkpoint {str(path)!r} does not exist.")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            text = str(exc)
            if "weights_only" in text or "Unsupported global" in text or "GLOBAL" in text:
                raise CheckpointError(
                    f"Checkpoint {str(path)!r} contains pickled objects that are not plain tensors and "
                    "containers; keel refuses to load it (weights_only=True) so that nothing in it can run. "
                    f"Detail: {text.splitlines()[0] if text else type(exc).__name__}"
                ) from exc
            raise CheckpointError(
                f"Checkpoint {str(path)!r} is truncated or corrupt ({type(exc).__name__}: "
                f"{text.splitlines()[0] if text else ''})."
            ) from exc
        if not isinstance(state, dict) or any(k not in state for k in required):
            raise CheckpointError(
                f"{str(path)!r} is not a keel checkpoint (missing "
                f"{[k for k in required if not isinstance(state, dict) or k not in state]})."
            )
        if state[K_FORMAT] > FORMAT_VERSION:
            raise CheckpointError(
                f"Checkpoint {str(path)!r} has format version {state[K_FORMAT]}, newer than this keel "
                f"({FORMAT_VERSION}); upgrade keel to load it."
            )
        return state


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once at import: os.umask is process-wide, so never toggle it while saving


def with_suppressed_unlink(name: str) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass


# ---------------------------------------------------------------------- the ``last`` pointer
def read_pointer(directory: str | os.PathLike) -> list[str]:
    """Checkpoint file names recorded by the ``last`` pointer in ``directory``, newest first."""
    pointer = Path(directory) / POINTER_NAME
    try:
        data = json.loads(pointer.read_text())
        return [str(n) for n in data.get("history", [data["last"]])]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def write_pointer(path: str | os.PathLike) -> None:
    """Record the committed checkpoint ``path`` as the newest in its folder's ``last`` pointer (kept
    history: 20). Swapped atomically (temporary file, fsync, rename): a crash leaves the old pointer."""
    directory = Path(path).parent
    history = [Path(path).name] + [n for n in read_pointer(directory) if n != Path(path).name]
    fd, tmp = tempfile.mkstemp(prefix=".last.", dir=directory)
    try:
        with os.fdopen(fd, "w") as handle:
            os.fchmod(handle.fileno(), 0o666 & ~_UMASK)  # the checkpoints' mode, not mkstemp's 0600
            json.dump({"last": history[0], "history": history[:20]}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, directory / POINTER_NAME)
    except BaseException:
        with_suppressed_unlink(tmp)
        raise
