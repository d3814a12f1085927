"""The Trainer's Lightning-named attributes (``trainer.model``, ``num_devices``, ``ckpt_path``, ``max_steps``,
``checkpoint_callback``, ...): :class:`TrainerAttributes`, a base class of the Trainer, so that trainer.py holds the
loop. They read the Trainer's public state; none writes it. Part of the callback API: what a callback or a task
reads from ``trainer``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from trainer.data.loaders import limit_batches
from trainer.step.accumulation import estimate_stepping_batches

if TYPE_CHECKING:  # pragma: no cover
    from trainer.callback import Callback
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.model_checkpoint import ModelCheckpoint
    from trainer.data.loaders import AdaptedLoader
    from trainer.distributed.launcher import DistEnv
    from trainer.distributed.strategy import Strategy
    from trainer.evaluation import EvaluationLoop, PredictionRecord
    from trainer.loggers.logger import Logger
    from trainer.module import TaskModule
    from trainer.observability.profiler import Profiler
    from trainer.options import TrainerOptions
    from trainer.state import TrainState
    from trainer.step.accumulation import AccumulationSchedule


class TrainerAttributes:
    """Read-only Lightning-named attributes of the Trainer (a base class of ``Trainer``; they read its
    public state, so trainer.py holds only the loop; ``should_stop``, a decision of the loop, is there)."""

    options: TrainerOptions
    env: DistEnv
    device: torch.device
    strategy: Strategy
    task: TaskModule | None
    loggers: list[Logger]
    callbacks: list[Callback]
    profiler: Profiler  # the profiler option resolved (TrainerOptions.__post_init__)
    state_stage: str | None
    sanity_checking: bool
    _fit_evaluating: bool
    state: TrainState
    checkpointer: Checkpointer
    accumulation_schedule: AccumulationSchedule
    _train: AdaptedLoader | None
    _eval_loop: EvaluationLoop
    default_log_name: str = "keel_logs"  # the folder of the default logger (logger=True) under default_root_dir

    @property
    def estimated_stepping_batches(self) -> int | float:
        """Optimizer steps this ``fit`` will take (for LR schedules), from ``max_steps``, ``max_epochs``, the
        training loader's length after ``limit_train_batches`` and the accumulation schedule. ``inf``
        when neither limit bounds it. Available from ``configure_optimizers`` on."""
        if self._train is None:
            raise RuntimeError("estimated_stepping_batches is known once fit() has its training dataloader.")
        opts = self.options
        return estimate_stepping_batches(
            self.accumulation_schedule,
            batches=limit_batches(
                self._train.loader, opts.limit_train_batches, "limit_train_batches", fast_dev_run=opts.fast_dev_run
            ),
            epochs=1 if opts.fast_dev_run else opts.max_epochs,
            max_steps=opts.max_steps,
            drop_incomplete=opts.drop_incomplete_accumulation,
        )

    # ------------------------------------------------------------------ building the model
    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager[None]:
        """Lightning's ``trainer.init_module``: the layers built inside the block start on the meta device (no
        memory) when ``empty_init`` is True, or is None and the strategy shards the model (FSDP); otherwise on this
        rank's device, in the run's dtype (float64 under precision ``"64"``). keel shards a meta-device model first
        and then materialises each rank's part, initialised by ``TaskModule.init_weights`` (each module's
        ``reset_parameters()`` by default), so unlike Lightning's ``empty_init=True`` the weights are never left
        uninitialised. Use it in ``configure_model`` (``with self.trainer.init_module(empty_init=True):``) or around
        the task's construction."""
        sharded = getattr(self.strategy, "name", None) == "fsdp"
        meta = bool(empty_init) or (empty_init is None and sharded)
        dtype = torch.float64 if self.options.precision == "64" else None
        return _building(torch.device("meta") if meta else self.device, dtype)

    # ------------------------------------------------------------------ what runs
    @property
    def predict_loop(self) -> PredictionRecord:
        """What the current (or last) ``predict`` keeps for prediction writers, with the attribute names of
        Lightning's ``trainer.predict_loop`` (``predictions``, ``current_batch_indices``, ``epoch_batch_indices``)."""
        return self._eval_loop.prediction

    @property
    def model(self) -> TaskModule | None:
        """The task being run (Lightning's ``trainer.model``; keel's wrappers stay internal, so this is the
        unwrapped task, also under DDP)."""
        return self.task

    @property
    def lightning_module(self) -> TaskModule | None:
        return self.task

    @property
    def train_dataloader(self) -> Any:
        """The training loader of the current (or last) fit, as this rank iterates it: keel's rebuild with its
        sharding sampler, or the program's own loader where keel used it as-is. None before the first fit."""
        return None if self._train is None else self._train.loader

    @property
    def ckpt_path(self) -> str | None:
        """The checkpoint file the current (or last) stage restored from (``"last"`` / ``"best"`` resolved)."""
        return self.checkpointer.loaded_path

    @property
    def global_step(self) -> int:
        """Optimizer steps taken in this run (one per training iteration under manual optimization); read-only,
        as in Lightning: the loop's :class:`~trainer.state.TrainState` is the only writer."""
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        """The epoch being trained (the number of finished epochs), read-only as in Lightning."""
        return self.state.current_epoch

    @property
    def precision(self) -> str:
        return self.options.precision

    # ------------------------------------------------------------------ where it runs
    @property
    def num_devices(self) -> int:
        """Processes (devices) per node, as started by the launcher."""
        return self.env.local_world_size

    @property
    def num_nodes(self) -> int:
        return max(1, self.env.world_size // max(1, self.env.local_world_size))

    # ------------------------------------------------------------------ files
    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str:
        """The run directory: the first logger's versioned folder, else ``default_root_dir``."""
        if self.loggers:
            return self.loggers[0].log_dir
        return self.default_root_dir

    @property
    def default_root_dir(self) -> str:
        import os

        return self.options.default_root_dir or os.getcwd()

    # ------------------------------------------------------------------ limits
    @property
    def max_epochs(self) -> int | None:
        return self.options.max_epochs

    @property
    def max_steps(self) -> int:
        return self.options.max_steps

    @property
    def min_epochs(self) -> int | None:
        return self.options.min_epochs

    @property
    def min_steps(self) -> int | None:
        return self.options.min_steps

    @property
    def log_every_n_steps(self) -> int:
        return self.options.log_every_n_steps

    @property
    def val_check_interval(self) -> int | float | None:
        return self.options.val_check_interval

    @property
    def check_val_every_n_epoch(self) -> int | None:
        return self.options.check_val_every_n_epoch

    @property
    def num_sanity_val_steps(self) -> int:
        return self.options.num_sanity_val_steps

    @property
    def fast_dev_run(self) -> bool | int:
        return self.options.fast_dev_run

    @property
    def limit_train_batches(self) -> int | float:
        return self.options.limit_train_batches

    @property
    def limit_val_batches(self) -> int | float:
        return self.options.limit_val_batches

    @property
    def limit_test_batches(self) -> int | float:
        return self.options.limit_test_batches

    @property
    def gradient_clip_val(self) -> float | None:
        return self.options.gradient_clip_val

    # ------------------------------------------------------------------ state
    @property
    def training(self) -> bool:
        """Lightning's: the training loop runs (not fit's sanity check, not the validation fit runs)."""
        return self.state_stage == "fit" and not self.sanity_checking and not self._fit_evaluating

    @property
    def validating(self) -> bool:
        """Lightning's: a validation loop runs (``validate``, or fit's own; its sanity check is ``sanity_checking``)."""
        return self.state_stage == "validate" or (
            self.state_stage == "fit" and self._fit_evaluating and not self.sanity_checking
        )

    @property
    def testing(self) -> bool:
        return self.state_stage == "test"

    @property
    def predicting(self) -> bool:
        return self.state_stage == "predict"

    # ------------------------------------------------------------------ callbacks by kind
    # The callbacks that say is_model_checkpoint are keel's ModelCheckpoint or subclasses of it (typed so).
    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        return cast(
            "ModelCheckpoint | None",
            next((cb for cb in self.callbacks if getattr(cb, "is_model_checkpoint", False)), None),
        )

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        return cast("list[ModelCheckpoint]", [cb for cb in self.callbacks if getattr(cb, "is_model_checkpoint", False)])

    @property
    def early_stopping_callback(self) -> Callback | None:
        return next((cb for cb in self.callbacks if getattr(cb, "is_early_stopping", False)), None)

    @property
    def progress_bar_callback(self) -> Callback | None:
        return next((cb for cb in self.callbacks if getattr(cb, "is_progress_bar", False)), None)


@contextlib.contextmanager
def _building(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """Tensors made inside are on ``device`` and, when given, floating-point ones in ``dtype``."""
    previous = torch.get_default_dtype()
    with device:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)
