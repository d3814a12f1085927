"""Checkpoint content, crash-safe writes and safe loading (DESIGN.md section 8).

A checkpoint is one file (rank 0 writes it; all ranks pass a barrier), or, under a sharded strategy
(FSDP), one folder in which every rank writes its shards (trainer/sharded_checkpoint.py). Its top-level keys are the
constants below. Files are written to a temporary name in the same folder, fsynced, renamed over the
target and the folder is fsynced, so a crash leaves either the old file or the new one, never a torn
one. Loading always uses ``torch.load(weights_only=True)``: a checkpoint can never run code.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer import dist, elastic

if TYPE_CHECKING:  # pragma: no cover
    from trainer.trainer import Trainer

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
K_GLOBAL_BATCH = "global_batch"  # trainer/elastic.py: the run's samples per optimizer step
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
            kept = f"the previous checkpoint {str(target.parent / previous[0])!r} is intact (ckpt_path='last' resumes from it)"
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
                f"{str(path)!r} is not a keel checkpoint (missing {[k for k in required if not isinstance(state, dict) or k not in state]})."
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


# ---------------------------------------------------------------------- RNG states
def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"python": _python_state_to_safe(random.getstate()), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _python_state_to_safe(state: tuple) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
        except ImportError:  # pragma: no cover
            pass
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------- assemble / restore
def assemble(trainer: Trainer) -> dict[str, Any]:
    """The whole run state. Collective: every rank calls it (RNG states are gathered to every rank)."""
    task = trainer.task
    assert task is not None
    loop = {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "epoch_finished": bool(getattr(trainer, "_epoch_finished", False)),
        "samples_consumed": trainer._epoch_samples,
        "batches_done": trainer._epoch_batches_done,
    }
    rng = dist.all_gather_object(_rng_state(trainer.device))
    state: dict[str, Any] = {
        K_FORMAT: FORMAT_VERSION,
        K_KEEL_VERSION: KEEL_VERSION,
        K_WORLD_SIZE: trainer.world_size,
        K_STATE_DICT: trainer.strategy.model_state_dict(task),
        K_OPTIMIZERS: [trainer.strategy.optimizer_state_dict(o) for o in trainer.optimizers],
        K_SCHEDULERS: [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        K_SCALER: trainer._precision.state_dict(),
        K_LOOP: loop,
        K_RNG: rng,
        K_OPTIONS: _plain(trainer.options.resolved()),
        K_CALLBACKS: {},
        K_GLOBAL_BATCH: elastic.checkpoint_record(trainer),
    }
    for cb in trainer.callbacks:
        cb_state = cb.state_dict()
        if cb_state:
            state[K_CALLBACKS][cb.state_key] = cb_state
    if trainer.datamodule is not None:
        state[K_DATAMODULE] = trainer.datamodule.state_dict()
    hparams = getattr(task, "hparams", None)
    if hparams:
        state[K_HPARAMS] = _plain_hparams(dict(hparams))
    task.on_save_checkpoint(state)
    for cb in trainer.callbacks:
        cb.on_save_checkpoint(trainer, task, state)
    return state


def save(trainer: Trainer, path: str | os.PathLike, *, weights_only: bool = False) -> None:
    """``Trainer.save_checkpoint``: refuse non-finite weights, assemble (collective), write on rank 0,
    then a barrier so no rank runs ahead of the commit. ``weights_only`` leaves out the optimizer,
    scheduler, scaler, callback, datamodule and RNG state (Lightning's ``save_weights_only``).

    Raises:
        FloatingPointError: the weights hold NaN or inf; such a checkpoint is never written.
    """
    task = trainer.task
    if task is not None:
        if not trainer.strategy.weights_finite(task):  # the same answer on every rank
            raise FloatingPointError(
                f"Refusing to write checkpoint {os.fspath(path)!r} at step {trainer.global_step}: the weights hold "
                "NaN or inf (a non-finite step got through). The last good checkpoint is kept."
            )
    state = assemble(trainer)
    if weights_only:
        for key in (K_OPTIMIZERS, K_SCHEDULERS, K_SCALER, K_RNG, K_CALLBACKS, K_DATAMODULE):
            state.pop(key, None)
    if trainer.strategy.sharded:
        from trainer import sharded_checkpoint

        sharded_checkpoint.save(state, path, model_key=K_STATE_DICT, optimizers_key=K_OPTIMIZERS, task=task,
                                optimizers=trainer.optimizers, is_writer=trainer.is_global_zero)
    else:
        trainer._checkpoint_io.save(state, path, is_writer=trainer.is_global_zero)
    dist.barrier(trainer.device)


def _plain(value: Any) -> Any:
    """Options reduced to types that ``weights_only`` loading accepts."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _plain_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters that survive ``weights_only`` loading (containers of str/int/float/bool/None)."""
    out = {}
    for key, value in hparams.items():
        if _is_plain(value):
            out[str(key)] = value
        else:
            log.warning("hparams[%r] (%s) is not a plain value; it is kept in memory but not saved in checkpoints.",
                        key, type(value).__name__)
    return out


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's state without loading sharded weights: the whole file, or a folder's ``keel.pt``
    (after checking its metadata). Raises :class:`CheckpointError` naming the problem."""
    if Path(path).is_dir():
        from trainer import sharded_checkpoint

        return sharded_checkpoint.read_keel_state(path)
    return CheckpointIO().load(path)


def load_with_weights(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint (file or sharded folder, saved at any world size) with ``state[K_STATE_DICT]`` as one
    plain state dict of CPU tensors; no process group needed."""
    state = load_meta(path)
    if Path(path).is_dir():
        from trainer import sharded_checkpoint

        state[K_STATE_DICT] = sharded_checkpoint.read_model_state(path)
    return state


def export_weights(ckpt_path: str | os.PathLike, out_path: str | os.PathLike) -> None:
    """Write the task weights of a keel checkpoint (a file, or a sharded folder saved at any world size)
    as one plain ``state_dict`` file, without a process group.

    The result loads with bare PyTorch: ``model.load_state_dict(torch.load(out_path, weights_only=True))``.
    """
    state = load_with_weights(ckpt_path)
    CheckpointIO().save(dict(state[K_STATE_DICT]), out_path, is_writer=True)


def restore(trainer: Trainer, ckpt_path: str, *, full: bool) -> None:
    """Load ``ckpt_path`` into the trainer. ``full`` restores the run (fit); otherwise weights only."""
    path = resolve_ckpt_path(trainer, ckpt_path)
    if path is None:
        return
    trainer._ckpt_path = path  # Lightning's trainer.ckpt_path
    task = trainer.task
    assert task is not None
    folder = Path(path).is_dir()
    state = load_meta(path)
    if folder:  # the sharded weights, read into this run's layout (collective), applied after the hooks
        from trainer import sharded_checkpoint

        state[K_STATE_DICT], state[K_OPTIMIZERS] = sharded_checkpoint.load(path, task, trainer.optimizers if full else [])
    task.on_load_checkpoint(state)
    for cb in trainer.callbacks:
        cb.on_load_checkpoint(trainer, task, state)
    if folder:
        sharded_checkpoint.apply(task, trainer.optimizers if full else [], state[K_STATE_DICT],
                                 state[K_OPTIMIZERS] if full else [])
    else:
        trainer.strategy.load_model_state_dict(task, state[K_STATE_DICT], strict=True)
    log.info("Restored weights from %s.", path)
    if not full:
        return
    for name in (K_OPTIMIZERS, K_SCHEDULERS, K_LOOP):
        if name not in state:
            raise CheckpointError(f"Checkpoint {path!r} has no {name!r}: it holds weights only and cannot resume a fit.")
    if len(state[K_OPTIMIZERS]) != len(trainer.optimizers):
        raise CheckpointError(
            f"Checkpoint {path!r} holds {len(state[K_OPTIMIZERS])} optimizer state(s) but configure_optimizers "
            f"returned {len(trainer.optimizers)}."
        )
    if not folder:
        for optimizer, opt_state in zip(trainer.optimizers, state[K_OPTIMIZERS]):
            trainer.strategy.load_optimizer_state_dict(optimizer, opt_state)
    if len(state[K_SCHEDULERS]) != len(trainer.lr_scheduler_configs):
        raise CheckpointError(
            f"Checkpoint {path!r} holds {len(state[K_SCHEDULERS])} scheduler state(s) but configure_optimizers "
            f"returned {len(trainer.lr_scheduler_configs)}."
        )
    for config, sched_state in zip(trainer.lr_scheduler_configs, state[K_SCHEDULERS]):
        config.scheduler.load_state_dict(sched_state)
    trainer._precision.load_state_dict(state.get(K_SCALER, {}))
    saved_callbacks = dict(state.get(K_CALLBACKS, {}))
    for cb in trainer.callbacks:
        cb_state = saved_callbacks.pop(cb.state_key, None)
        if cb_state is not None:
            cb.load_state_dict(cb_state)
    if saved_callbacks:
        log.warning("Checkpoint state for callbacks %s has no matching callback in this run; it is ignored.",
                    sorted(saved_callbacks))
    if trainer.datamodule is not None and K_DATAMODULE in state:
        trainer.datamodule.load_state_dict(state[K_DATAMODULE])
    loop = state[K_LOOP]
    restore_loop(trainer, loop, saved_world_size=int(state.get(K_WORLD_SIZE, trainer.world_size)))
    elastic.check_resume(trainer, state.get(K_GLOBAL_BATCH), path=str(path))
    rng = state.get(K_RNG) or []
    if trainer.global_rank < len(rng):
        _set_rng_state(rng[trainer.global_rank], trainer.device)
    else:
        # A rank that did not exist when the checkpoint was saved: seed it deterministically.
        seed = (trainer.options.seed or 0) + 1_000_003 * (trainer.global_rank + 1) + loop["global_step"]
        random.seed(seed)
        torch.manual_seed(seed)
    log.info("Resumed at global step %d, epoch %d.", trainer.global_step, trainer.current_epoch)


def restore_loop(trainer: Trainer, loop: dict[str, Any], *, saved_world_size: int) -> None:
    """Set the step clock and the data cursor from a checkpoint's loop state."""
    trainer.global_step = int(loop["global_step"])
    if loop["epoch_finished"]:
        trainer.current_epoch = int(loop["epoch"]) + 1
        trainer._epoch_batches_done = trainer._epoch_samples = 0
        return
    trainer.current_epoch = int(loop["epoch"])
    trainer._epoch_samples = int(loop["samples_consumed"])
    batch_size = getattr(trainer._train.loader, "batch_size", None) if trainer._train is not None else None
    per_step = (batch_size or 1) * trainer.world_size
    done = int(loop["batches_done"])
    if saved_world_size == trainer.world_size and trainer._epoch_samples in (0, done * per_step):
        trainer._epoch_batches_done = done
    else:
        # Another world size or micro-batch size: the global cursor stays exact; batch indices restart from it.
        trainer._epoch_batches_done = -(-trainer._epoch_samples // per_step)
        log.warning("Checkpoint was saved with world size %d, resuming on %d (micro-batch %s): the data cursor "
                    "resumes at sample %d of epoch %d.", saved_world_size, trainer.world_size, batch_size,
                    trainer._epoch_samples, trainer.current_epoch)


def resolve_ckpt_path(trainer: Trainer, ckpt_path: str) -> str | None:
    """``"last"`` / ``"best"`` / a path -> a file to load (decided on rank 0, broadcast), or None.

    ``"last"`` is a no-op on a first run (nothing saved yet) and skips unreadable files with a warning,
    falling back to the previous checkpoint recorded in the ``last`` pointer.
    """
    if ckpt_path not in ("last", "best"):
        return str(ckpt_path)
    callback = trainer.checkpoint_callback
    if callback is None:
        raise ValueError(f'ckpt_path="{ckpt_path}" needs a ModelCheckpoint callback (enable_checkpointing=True).')
    if ckpt_path == "best":
        best = callback.best_model_path
        if not best and trainer.is_global_zero:
            # A fresh process: the callback's state lives in the last checkpoint.
            for name in read_pointer(callback.dirpath):
                try:
                    state = load_meta(os.path.join(callback.dirpath, name))
                except Exception:
                    continue
                best = state.get("callbacks", {}).get(callback.state_key, {}).get("best_model_path", "")
                break
        best = dist.broadcast_object(best)
        if not best:
            raise ValueError('ckpt_path="best": no best checkpoint is known (no monitored ModelCheckpoint save '
                             f"in {callback.dirpath}).")
        return best
    chosen: str | None = None
    if trainer.is_global_zero:
        directory = callback.dirpath
        for name in read_pointer(directory):
            candidate = os.path.join(directory, name)
            try:
                load_meta(candidate)
            except Exception as exc:
                log.warning("Skipping checkpoint %s for ckpt_path='last': %s", candidate, exc)
                continue
            chosen = candidate
            break
        if chosen is None:
            log.info("ckpt_path='last': no checkpoint in %s yet; starting from scratch.", directory)
    return dist.broadcast_object(chosen)
