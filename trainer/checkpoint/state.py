"""Checkpoint content, crash-safe writes and safe loading (docs/design.md section 8).

A checkpoint is one file (rank 0 writes it; all ranks pass a barrier), or, under a sharded strategy
(FSDP), one folder in which every rank writes its shards (trainer/checkpoint/sharded.py). Its top-level keys are the
constants below. Files are written to a temporary name in the same folder, fsynced, renamed over the
target and the folder is fsynced, so a crash leaves either the old file or the new one, never a torn
one. Loading always uses ``torch.load(weights_only=True)``: a checkpoint can never run code.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from trainer.checkpoint.files import (
    FORMAT_VERSION,
    K_CALLBACKS,
    K_DATAMODULE,
    K_FORMAT,
    K_GLOBAL_BATCH,
    K_HPARAMS,
    K_KEEL_VERSION,
    K_LOOP,
    K_OPTIMIZERS,
    K_OPTIONS,
    K_RNG,
    K_SCALER,
    K_SCHEDULERS,
    K_STATE_DICT,
    K_WORLD_SIZE,
    KEEL_VERSION,
    CheckpointError,
    CheckpointIO,
    read_pointer,
)
from trainer.data import global_batch as elastic
from trainer.distributed import comm

if TYPE_CHECKING:  # pragma: no cover
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- RNG states
def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"python": _python_state_to_safe(random.getstate()), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        # get_state() returns the legacy tuple by default (numpy types it as that tuple or a dict).
        kind, keys, pos, has_gauss, cached = cast("tuple[str, Any, int, int, float]", np.random.get_state())
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
        "epoch_finished": trainer._epoch_finished,
        "samples_consumed": trainer._epoch_samples,
        "batches_done": trainer._epoch_batches_done,
    }
    rng = comm.all_gather_object(_rng_state(trainer.device))
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
    hparams = task.hparams
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
        from trainer.checkpoint import sharded as sharded_checkpoint

        assert task is not None  # assemble() needs it
        sharded_checkpoint.save(
            state,
            path,
            model_key=K_STATE_DICT,
            optimizers_key=K_OPTIMIZERS,
            task=task,
            optimizers=trainer.optimizers,
            is_writer=trainer.is_global_zero,
        )
    else:
        trainer._checkpoint_io.save(state, path, is_writer=trainer.is_global_zero)
    comm.barrier(trainer.device)


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
            log.warning(
                "hparams[%r] (%s) is not a plain value; it is kept in memory but not saved in checkpoints.",
                key,
                type(value).__name__,
            )
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
        from trainer.checkpoint import sharded as sharded_checkpoint

        return sharded_checkpoint.read_keel_state(path)
    return CheckpointIO().load(path)


def load_with_weights(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint (file or sharded folder, saved at any world size) with ``state[K_STATE_DICT]`` as one
    plain state dict of CPU tensors; no process group needed."""
    state = load_meta(path)
    if Path(path).is_dir():
        from trainer.checkpoint import sharded as sharded_checkpoint

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
        from trainer.checkpoint import sharded as sharded_checkpoint

        state[K_STATE_DICT], state[K_OPTIMIZERS] = sharded_checkpoint.load(
            path, task, trainer.optimizers if full else []
        )
    task.on_load_checkpoint(state)
    for cb in trainer.callbacks:
        cb.on_load_checkpoint(trainer, task, state)
    if folder:
        sharded_checkpoint.apply(
            task, trainer.optimizers if full else [], state[K_STATE_DICT], state[K_OPTIMIZERS] if full else []
        )
    else:
        trainer.strategy.load_model_state_dict(task, state[K_STATE_DICT], strict=True)
    log.info("Restored weights from %s.", path)
    if not full:
        return
    for name in (K_OPTIMIZERS, K_SCHEDULERS, K_LOOP):
        if name not in state:
            raise CheckpointError(
                f"Checkpoint {path!r} has no {name!r}: it holds weights only and cannot resume a fit."
            )
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
        log.warning(
            "Checkpoint state for callbacks %s has no matching callback in this run; it is ignored.",
            sorted(saved_callbacks),
        )
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
        log.warning(
            "Checkpoint was saved with world size %d, resuming on %d (micro-batch %s): the data cursor "
            "resumes at sample %d of epoch %d.",
            saved_world_size,
            trainer.world_size,
            batch_size,
            trainer._epoch_samples,
            trainer.current_epoch,
        )


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
    assert callback.dirpath is not None  # set in the callback's setup, before any checkpoint is restored
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
        best = comm.broadcast_object(best)
        if not best:
            raise ValueError(
                'ckpt_path="best": no best checkpoint is known (no monitored ModelCheckpoint save '
                f"in {callback.dirpath})."
            )
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
    return comm.broadcast_object(chosen)
