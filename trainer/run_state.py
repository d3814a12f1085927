"""The run's checkpoint state: what the Trainer hands to its strategy to save, and how a run is restored.

:func:`checkpoint_state` names every object a save holds (model, optimizers, schedulers, scaler, the loop's
:class:`TrainState`, callbacks, datamodule, per-rank RNG, options, hyperparameters);
``Strategy.save_checkpoint`` / ``load_checkpoint`` write and read them (trainer/checkpoint/). This module
is the only place that reads the Trainer's run state for a checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from trainer.checkpoint.files import (
    FORMAT_VERSION,
    K_CALLBACKS,
    K_DATAMODULE,
    K_FORMAT,
    K_HPARAMS,
    K_KEEL_VERSION,
    K_LOOP,
    K_OPTIMIZERS,
    K_OPTIONS,
    K_RNG,
    K_SCALER,
    K_SCHEDULERS,
    K_STATE_DICT,
    K_STREAMS,
    K_WORLD_SIZE,
    KEEL_VERSION,
    CheckpointError,
    CorruptCheckpointError,
    refuse_non_finite,
    save_file,
)
from trainer.checkpoint.reader import resolve_best, resolve_last
from trainer.checkpoint.stateful import (
    CallbackStates,
    ModelState,
    OptimizerStates,
    RNGStates,
    SchedulerStates,
    Value,
    plain,
    plain_hparams,
)
from trainer.data import global_batch as elastic
from trainer.distributed import comm
from trainer.distributed import watchdog as wd
from trainer.lifecycle import resume_seed
from trainer.loggers.logger import run_identity
from trainer.storage import location

if TYPE_CHECKING:  # pragma: no cover
    from trainer.checkpoint.async_save import AsyncCheckpointer
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)


class TrainState:
    """The loop's position: step, epoch, whether the epoch had finished, the data cursor (samples and
    micro-batches of the epoch consumed), the world size and the global batch it was saved at."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "global_step": t.global_step,
            "epoch": t.current_epoch,
            "epoch_finished": t._epoch_finished,
            "samples_consumed": t._epoch_samples,
            "batches_done": t._epoch_batches_done,
            "world_size": t.strategy.data_parallel_size,  # the replicas that split the data (the world without TP)
            "global_batch": elastic.checkpoint_record(t),
        }

    def load_state_dict(self, loop: dict[str, Any]) -> None:
        t = self.trainer
        t.global_step = int(loop["global_step"])
        if loop["epoch_finished"]:
            t.current_epoch = int(loop["epoch"]) + 1
            t._epoch_batches_done = t._epoch_samples = 0
        else:
            t.current_epoch = int(loop["epoch"])
            t._epoch_samples = int(loop["samples_consumed"])
            batch_size = getattr(t._train.loader, "batch_size", None) if t._train is not None else None
            replicas = t.strategy.data_parallel_size
            per_step = (batch_size or 1) * replicas
            done, saved_world = int(loop["batches_done"]), int(loop.get("world_size", replicas))
            if saved_world == replicas and t._epoch_samples in (0, done * per_step):
                t._epoch_batches_done = done
            else:
                # Another world size or micro-batch size: the global cursor stays exact; batch indices restart from it.
                t._epoch_batches_done = -(-t._epoch_samples // per_step)
                log.warning(
                    "Checkpoint was saved with %d data-parallel replica(s), resuming on %d (micro-batch %s): the "
                    "data cursor resumes at sample %d of epoch %d.",
                    saved_world,
                    replicas,
                    batch_size,
                    t._epoch_samples,
                    t.current_epoch,
                )
        elastic.check_resume(t, loop.get("global_batch"), path=str(t.ckpt_path))


class StreamPositions:
    """Every rank's position in a training stream (trainer/data/streams.py), gathered like the RNG states: a
    list indexed by rank, None where the loader saves no position. Loaded after :class:`TrainState`."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> list[Any]:
        t = self.trainer
        stream = t._train.stream if t._train is not None else None
        mine = stream.state_dict(t._epoch_batches_done, t._epoch_finished) if stream is not None else None
        return comm.all_gather_object(mine)

    def load_state_dict(self, positions: list[Any]) -> None:
        t = self.trainer
        stream = t._train.stream if t._train is not None else None
        saved = [p for p in positions or [] if p is not None]
        if stream is None:
            if saved:
                raise ValueError(
                    f"{t.ckpt_path} was saved while training from a stream ({saved[0]['loader']}), but this run's "
                    "training loader saves no position: resume with the loader the run was saved with."
                )
            return
        if not saved:
            return  # a save without positions (map-style data then, or an older keel): plan_epoch warns
        mid_epoch = t._epoch_batches_done > 0
        if len(positions) == t.world_size:
            stream.load_state_dict(positions[t.global_rank])
        elif stream.reshardable:
            stream.load_state_dict(saved[0])  # LitData re-splits the remaining samples of rank 0's position
        elif mid_epoch:
            why = (
                f"{t.ckpt_path} was saved mid-epoch at world size {len(positions)} by {saved[0]['loader']}, which "
                f"cannot continue its stream at world size {t.world_size}"
            )
            if t.options.stream_reshard == "error":
                raise ValueError(
                    f"{why}. Resume at world size {len(positions)}, or pass stream_reshard='restart_epoch' to start "
                    f"epoch {t.current_epoch} again (its samples are seen twice)."
                )
            log.warning("%s: epoch %d starts again (stream_reshard='restart_epoch').", why, t.current_epoch)


def checkpoint_state(trainer: Trainer, *, full: bool = True) -> dict[str, Any]:
    """Checkpoint key -> object with ``state_dict()`` / ``load_state_dict()``. ``full=False``: the weights
    only (validate / test / predict from a checkpoint)."""
    task = trainer.task
    assert task is not None
    state: dict[str, Any] = {K_STATE_DICT: ModelState(trainer.strategy, task)}
    if not full:
        return state

    def fallback_seed() -> int:  # a rank the save did not have
        return (trainer.options.seed or 0) + 1_000_003 * (trainer.global_rank + 1) + trainer.global_step

    state.update(
        {
            K_OPTIMIZERS: OptimizerStates(trainer.strategy, task, trainer.optimizers),
            K_SCHEDULERS: SchedulerStates([c.scheduler for c in trainer.lr_scheduler_configs]),
            K_SCALER: trainer._precision,
            K_CALLBACKS: CallbackStates(trainer.callbacks),
        }
    )
    if trainer.datamodule is not None:
        state[K_DATAMODULE] = trainer.datamodule
    state[K_LOOP] = TrainState(trainer)
    state[K_STREAMS] = StreamPositions(trainer)  # after the loop: it reads where the loop resumes
    state[K_RNG] = RNGStates(trainer.device, trainer.global_rank, fallback_seed)
    sampler = trainer._train.sampler if trainer._train is not None else None  # resumes with the saved seed
    state[K_OPTIONS] = Value(plain(trainer.options.resolved()), lambda saved: resume_seed(trainer, saved, sampler))
    if task.hparams:
        state[K_HPARAMS] = Value(plain_hparams(dict(task.hparams)))
    return state


def save(
    trainer: Trainer,
    path: str | os.PathLike,
    *,
    weights_only: bool = False,
    checkpointer: AsyncCheckpointer | None = None,
    on_commit: Any = None,
    lightning_file: bool = False,
) -> None:
    """``Trainer.save_checkpoint``: the whole run as one save folder, or ``weights_only``: one plain file
    (weights, hyperparameters, step and epoch). A collective: every rank calls it."""
    path = location(path, "save_checkpoint(path)")
    task = trainer.task
    assert task is not None, "save_checkpoint needs a task (call it during or after fit)"
    trainer._beat(wd.PHASE_CHECKPOINT)
    trainer._nonfinite.check(f"before saving checkpoint {os.fspath(path)!r}")  # never a checkpoint after a NaN step

    def on_save(checkpoint: dict[str, Any]) -> None:
        task.on_save_checkpoint(checkpoint)
        for cb in trainer.callbacks:
            cb.on_save_checkpoint(trainer, task, checkpoint)

    if not weights_only:
        identity = {
            "run": run_identity() or "",
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "world_size": trainer.world_size,
        }
        trainer.strategy.save_checkpoint(
            path,
            checkpoint_state(trainer),
            identity=identity,
            on_save=on_save,
            checkpointer=checkpointer,
            commit=on_commit,
            lightning_file=lightning_file,
        )
        return
    refuse_non_finite(trainer.strategy.weights_finite(task), path, trainer.global_step)
    checkpoint: dict[str, Any] = {
        K_FORMAT: FORMAT_VERSION,
        K_KEEL_VERSION: KEEL_VERSION,
        K_STATE_DICT: trainer.strategy.full_model_state_dict(task),
        K_LOOP: TrainState(trainer).state_dict(),
        K_OPTIONS: plain(trainer.options.resolved()),
        K_WORLD_SIZE: trainer.world_size,
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }
    if task.hparams:
        checkpoint[K_HPARAMS] = plain_hparams(dict(task.hparams))
    on_save(checkpoint)
    if trainer.is_global_zero:
        save_file(checkpoint, path)
    comm.barrier(trainer.device)
    if on_commit is not None and trainer.is_global_zero:
        on_commit()


def restore(trainer: Trainer, ckpt_path: str | None, *, full: bool) -> float:
    """Load ``ckpt_path`` (a path, ``"last"`` or ``"best"``) into the trainer: the whole run (``full``, fit)
    or the weights; the seconds it took. ``"last"`` falls back to the previous committed save when the newest
    is damaged. No checkpoint (None, or ``"last"`` before the first save): ``Trainer(initial_weights=...)``."""
    if ckpt_path is None:
        return initial_weights(trainer)
    began = time.perf_counter()
    if ckpt_path not in ("last", "best"):
        ckpt_path = location(ckpt_path, "ckpt_path")
    candidates = _candidates(trainer, ckpt_path)
    if not candidates:
        log.info("ckpt_path='last': no checkpoint saved yet; starting from scratch.")
        initial_weights(trainer)
        return time.perf_counter() - began
    task = trainer.task
    assert task is not None
    state = checkpoint_state(trainer, full=full)
    required = (K_OPTIMIZERS, K_SCHEDULERS, K_LOOP) if full else ()

    def on_load(checkpoint: dict[str, Any]) -> None:
        task.on_load_checkpoint(checkpoint)
        for cb in trainer.callbacks:
            cb.on_load_checkpoint(trainer, task, checkpoint)

    for i, path in enumerate(candidates):
        trainer._ckpt_path = path  # Lightning's trainer.ckpt_path
        try:
            trainer.strategy.load_checkpoint(path, state, on_load=on_load, required=required)
        except CorruptCheckpointError as exc:
            if ckpt_path not in ("last", "best") or i + 1 == len(candidates):
                raise
            log.warning(
                "%s Falling back to the next candidate for ckpt_path=%r, %s.", exc, ckpt_path, candidates[i + 1]
            )
            continue
        break
    trainer._initial_weights_of = task  # a later stage keeps these weights (initial_weights is not read over them)
    log.info("Restored %s from %s.", "the run" if full else "the weights", trainer._ckpt_path)
    if full:
        log.info("Resumed at global step %d, epoch %d.", trainer.global_step, trainer.current_epoch)
    return time.perf_counter() - began


def initial_weights(trainer: Trainer) -> float:
    """``Trainer(initial_weights=...)`` into the task, once per task (a later stage keeps what it trained); the
    seconds it took. Not called when a checkpoint is restored: its weights win."""
    opts, task = trainer.options, trainer.task
    if opts.initial_weights is None or task is None or trainer._initial_weights_of is task:
        return 0.0
    from trainer.checkpoint.initial import load_initial_weights

    began = time.perf_counter()
    load_initial_weights(
        task, opts.initial_weights, rename=opts.initial_weights_rename, strict=opts.initial_weights_strict
    )
    trainer._initial_weights_of = task
    return time.perf_counter() - began


def _candidates(trainer: Trainer, ckpt_path: str) -> list[str]:
    """The saves to try, in order, decided on rank 0 and broadcast (an error on rank 0 is raised everywhere)."""
    if ckpt_path not in ("last", "best"):
        return [str(ckpt_path)]
    callback = trainer.checkpoint_callback
    if callback is None:
        raise ValueError(f'ckpt_path="{ckpt_path}" needs a ModelCheckpoint callback (enable_checkpointing=True).')
    assert callback.dirpath is not None  # set in the callback's setup, before any checkpoint is restored
    found: list[str] | str = []
    if trainer.is_global_zero:
        try:
            if ckpt_path == "last":
                found = resolve_last(callback.dirpath)
            else:
                found = resolve_best(callback.dirpath, callback.state_key, callback.best_k_models, callback.mode)
                if not found:
                    found = f'ckpt_path="best": no best checkpoint is known (no monitored save in {callback.dirpath}).'
        except CheckpointError as exc:
            found = str(exc)
    found = comm.broadcast_object(found)
    if isinstance(found, str):
        raise (CheckpointError if ckpt_path == "last" else ValueError)(found)
    return found
