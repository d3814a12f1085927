"""The Trainer: the fit loop and the optimizer step, over one parallelism seam.

Read :meth:`Trainer._train_epoch` (the fit loop) and :meth:`Trainer._training_micro_batch` /
:meth:`Trainer._optimizer_step` (one step): ``backward`` and ``optimizer.step`` are visible there,
through the precision plugin (docs/design.md section 5). How the task is replicated or sharded is the
:class:`~trainer.distributed.strategy.Strategy`'s business; the loop never asks which one runs. Evaluation and
predict loops are in :mod:`trainer.evaluation`, manual optimization in :mod:`trainer.step.optim`, saving and
resuming in :class:`~trainer.checkpoint.checkpointer.Checkpointer`; the loop's position is its
:class:`~trainer.state.TrainState`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, cast

import torch

from trainer import lifecycle
from trainer.attributes import TrainerAttributes
from trainer.callback import Callback, check_callbacks
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.hf import StateDictSource, export_source
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.compat import compile_step, is_keel_default
from trainer.data import global_batch as elastic
from trainer.data import stages
from trainer.data.loaders import AdaptedLoader, EpochPlan, plan_epoch, warn_if_unsharded
from trainer.data.transfer import BatchCopier
from trainer.distributed import comm, launcher
from trainer.distributed import watchdog as wd
from trainer.distributed.preemption import CarriedFlags, PreemptionWatcher
from trainer.distributed.selection import select_strategy
from trainer.distributed.strategy import NO_CONTEXT, StepAdapter, Strategy
from trainer.evaluation import EvaluationLoop, log_results
from trainer.hooks import BatchTransfer, TrainHooks
from trainer.loggers.local import default_loggers
from trainer.loggers.logger import Logger
from trainer.metrics import MetricCollector, logged_step, logger_row
from trainer.module import DataModule, TaskModule, check_stage_inputs
from trainer.observability import failures
from trainer.observability import summary as run_summary
from trainer.observability.efficiency import Efficiency
from trainer.observability.phases import PhaseClock
from trainer.observability.progress import ProgressBar
from trainer.observability.rank_zero import configure_logging
from trainer.options import TrainerOptions, check_lightning_keywords
from trainer.state import TrainState
from trainer.step.accumulation import (
    HALF_DTYPES,
    AccumulationSchedule,
    MicroBatch,
    StepNormaliser,
    finite_on_all_ranks,
    micro_batches,
)
from trainer.step.nonfinite import NonFiniteGuard
from trainer.step.optim import ManualOptimization, SchedulerConfig, parse_optimizers, step_schedulers
from trainer.step.precision import Precision
from trainer.storage import local_dir

log = logging.getLogger(__name__)

_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(TrainerOptions))
_OPTION_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(TrainerOptions) if f.default is not dataclasses.MISSING
}


class Trainer(TrainerAttributes):
    """Runs ``fit`` / ``validate`` / ``test`` / ``predict`` for a :class:`~trainer.TaskModule`.

    The same script runs as one process, under ``torchrun --nproc-per-node N`` (one or many nodes) and
    under ``srun``: the launcher is detected from the environment and the process group is created on
    the first call that needs it (nccl on CUDA, gloo on CPU). A group the Trainer created is destroyed
    when the interpreter exits, whether the script ends normally or with an exception (an atexit
    handler; a group the user created is left alone). It is not torn down when a loop raises, because
    re-creating the default group in the same process races with the old group's rendezvous keys: a
    caught exception leaves the group usable for the next ``fit``/``test`` call.

    Every option is a keyword argument with its type and default; what each does is in
    :class:`~trainer.options.TrainerOptions` and docs/options.md. A misspelled option raises ``ValueError`` naming it
    and the closest valid ones; an invalid value raises ``ValueError`` naming the option, the value and the valid
    choices, before any process group exists.
    """

    def __new__(cls, *args: Any, **options: Any) -> Trainer:
        """Refuses a misspelled or unsupported option by name before anything is built (with "did you mean" and
        Lightning's options keel does not have explained), and records which options the call named."""
        if cls.__init__ is Trainer.__init__:
            if args:
                raise TypeError("Trainer takes its options as keywords: Trainer(max_epochs=3, ...).")
            if set(options) - _OPTION_NAMES:
                TrainerOptions.from_kwargs(options)  # raises, naming each unknown option
        trainer = super().__new__(cls)
        trainer.__dict__["_named_options"] = set(options) & _OPTION_NAMES
        return trainer

    def __init__(
        self,
        *,
        max_epochs: int | None = None,
        max_steps: int = -1,
        min_epochs: int | None = None,
        min_steps: int | None = None,
        accumulate_grad_batches: int | dict = 1,
        global_batch_size: int | dict | None = None,
        drop_incomplete_accumulation: bool = False,
        precision: str = "32",
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        limit_train_batches: int | float = 1.0,
        limit_val_batches: int | float = 1.0,
        limit_test_batches: int | float = 1.0,
        limit_predict_batches: int | float = 1.0,
        num_sanity_val_steps: int = 2,
        fast_dev_run: bool | int = False,
        log_every_n_steps: int = 50,
        seed: int | None = 0,
        deterministic: bool = False,
        benchmark: bool | None = None,
        accelerator: str = "auto",
        devices: int | str = "auto",
        num_nodes: int | None = None,
        strategy: Any = "auto",
        default_root_dir: str | None = None,
        callbacks: list[Any] | None = None,
        logger: Any = True,
        profiler: Any = None,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        enable_model_summary: bool = True,
        memory_plan: bool = False,
        sync_batchnorm: bool = False,
        process_group_timeout: float = 1800.0,
        init_timeout: float = 300.0,
        watchdog_timeout: float | None = None,
        on_nonfinite: str = "error",
        uneven_batches: str = "truncate",
        predict_return: str = "all_ranks",
        preemption_check_interval: int | None = None,
        stream_reshard: str = "error",
        initial_weights: str | None = None,
        initial_weights_rename: Any = None,
        initial_weights_strict: bool = True,
    ) -> None:
        # Every option is a keyword with its type and default; TrainerOptions is the one source (a test compares
        # them). An option the call did not name (Trainer.__new__ records them) is left to TrainerOptions, which
        # resolves some later (seed: the program's seed_everything).
        named = self.__dict__.pop("_named_options", set())
        values = {k: v for k, v in locals().items() if k in _OPTION_NAMES}
        self.options = TrainerOptions.from_kwargs(
            {k: v for k, v in values.items() if k in named or v is not _OPTION_DEFAULTS.get(k)}
        )
        opts = self.options
        self.env = launcher.detect_env()
        # Where this process sits in the job (fixed for the Trainer's life; Lightning's names).
        self.global_rank, self.local_rank, self.node_rank = self.env.rank, self.env.local_rank, self.env.node_rank
        self.world_size, self.is_global_zero = self.env.world_size, self.env.rank == 0
        check_lightning_keywords(opts, self.env)  # devices / num_nodes / strategy against the launcher
        configure_logging(self.env.rank, self.env.world_size)
        lifecycle.seed_at_construction(opts.seed, self.env.rank)  # a task built after the Trainer is repeatable
        self.device = comm.select_device(cast("comm.Accelerator", opts.accelerator), self.env)  # checked in options
        self._precision = Precision(opts.precision, self.device)
        self._device_copies = self.device.type != "cpu" or self._precision.param_dtype is not None
        self._moves_batches = self._device_copies  # per fit: also when a batch-transfer hook is overridden
        # How the task is replicated or sharded (trainer/distributed/strategy.py); chosen before any process group.
        self.strategy: Strategy = select_strategy(opts, self.env, self.device)
        self.callbacks: list[Callback] = check_callbacks(
            lifecycle.with_default_callbacks(
                check_callbacks(opts.callbacks),
                progress_bar=ProgressBar if opts.enable_progress_bar else None,
                checkpoint=ModelCheckpoint if opts.enable_checkpointing else None,
                memory_plan=_memory_plan if opts.memory_plan else None,
            )
        )
        # fast_dev_run is a smoke test: no logger (as logger=False) and no periodic save (ModelCheckpoint.save).
        self.loggers: list[Logger] = (
            [] if opts.fast_dev_run else default_loggers(opts.logger, opts.default_root_dir, name=self.default_log_name)
        )
        self.profiler = opts.profiler  # a trainer.observability.profiler.Profiler; PassThroughProfiler when off
        self.state = TrainState()  # the step clock, the epoch, the data cursor: saved with every checkpoint
        self.checkpointer = Checkpointer(  # what a save holds; the stage's objects are tracked as they are built
            strategy=self.strategy,
            options=opts,
            state=self.state,
            scaler=self._precision,
            callbacks=self.callbacks,
            device=self.device,
            rank=self.global_rank,
            world_size=self.world_size,
            before_save=self._before_save,
            on_save=self._on_save_checkpoint,
            on_load=self._on_load_checkpoint,
        )
        self.optimizer_stepped = False  # True during on_train_batch_end right after an optimizer step
        self._fit_evaluating = False  # fit runs its validation loop (or its sanity check)
        self._resumes_last = False  # the fit was given ckpt_path="last"
        self._step_open = False  # from an optimizer step to the end of its batch, validation included (log_metrics)
        self._step_loss: torch.Tensor | None = None  # optimised loss of the last step (on device)
        self.should_stop = False
        self.state_stage: str | None = None
        self.sanity_checking = False
        self.task: TaskModule | None = None
        self.datamodule: DataModule | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self._params: list[torch.Tensor] = []
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self._model: torch.nn.Module | None = None  # what strategy.setup returned: runs training_step
        self._run_step: Callable[[Any, int], Any] | None  # declared only: set with _model, the callable the loop runs
        self._train: AdaptedLoader | None = None
        self._hooks: TrainHooks | None = None  # the epoch's overridden per-batch hooks (trainer/hooks.py)
        self._val_every_batches: int | None = None  # the epoch's fractional val_check_interval in batches, if any
        self._cadence: _Cadence | None = None  # what every batch end checks, read once per epoch
        self._phases = PhaseClock()  # where each rank's time goes (observability); with its accounting in fit:
        self._efficiency: Efficiency
        self.num_training_batches: int | None = None
        self.num_val_batches: list[int | None] = []  # per validation loader of the current fit
        self.num_sanity_val_batches: list[int | None] = []  # per loader of the last sanity check
        self.num_test_batches: list[int | None] = []  # per loader of the last test run
        self._metrics = MetricCollector(replica_ranks=self.strategy.tensor_parallel_size)
        # k as a function of (epoch, global_step). Replace it (e.g. callbacks.GradientAccumulationScheduler
        # does in setup) to change accumulation; a change lands at the next optimizer-step boundary.
        self.accumulation_schedule = AccumulationSchedule(opts.accumulate_grad_batches)
        self.callback_metrics: dict[str, torch.Tensor] = self._metrics.live  # on_step values land after every step
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self._owns_group = False
        self._nonfinite = NonFiniteGuard(
            enabled=opts.on_nonfinite == "error", world_size=self.world_size, device=self.device
        )
        self._skip_nonfinite = opts.on_nonfinite == "skip"
        self._dynamo_ctx: Any = None  # torch.compile settings when fit() got torch.compile(task)
        self._preemption = PreemptionWatcher()
        self._carried: CarriedFlags | None = None  # set per fit: the flags carried on DDP's all-reduce
        self._continues_run = False  # fit(ckpt_path="last"): continue the newest run directory, not a new version
        # False: fit(ckpt_path="last") never continues another process's run directory (a sweep's jobs are runs of
        # their own; a restart of the same job still finds its own by the launcher's marker).
        self.continue_run_directory = True
        # Rank 0 logs where the run's files are and its final metrics when fit ends (the recipes print their own,
        # with the test results, and set this to False).
        self.summary_on_fit_end = True
        self._watchdog: wd.Watchdog | None = None
        self._manual: ManualOptimization | None = None  # built per fit (TaskModule.optimizers() wraps with it)
        self._manual_mode = False  # task.automatic_optimization is False for this fit
        self._check_sharding = False
        self._logged_options = False
        self._eval_loop = EvaluationLoop(
            device=self.device,
            precision=self._precision,
            metrics=self._metrics,
            beat=self._beat,
            strategy=self.strategy,
        )

    # ------------------------------------------------------------------ public properties (more in attributes.py)
    # A stop request (should_stop = True) waits for min_epochs / min_steps, as in Lightning (logged once).
    _stop_requested: bool = False
    _min_logged: bool = False

    @property
    def should_stop(self) -> bool:
        """Set True (by a callback, on every rank) to stop at the next optimizer-step boundary; reads True
        only once ``min_epochs`` and ``min_steps`` are met."""
        if not self._stop_requested:
            return False
        opts = self.options
        if (opts.min_steps is None or self.global_step >= opts.min_steps) and (
            opts.min_epochs is None or self.current_epoch >= opts.min_epochs
        ):
            return True
        if not self._min_logged:
            self._min_logged = True
            log.info(
                "Trainer was signaled to stop but the required min_epochs=%r or min_steps=%r has not been met. "
                "Training will continue...",
                opts.min_epochs,
                opts.min_steps,
            )
        return False

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._stop_requested = bool(value)
        if not value:
            self._min_logged = False

    @property
    def accumulate_grad_batches(self) -> int:
        """Micro-batches of the current optimizer step: ``accumulation_schedule`` at the step clock."""
        return self.accumulation_schedule.k(epoch=self.current_epoch, global_step=self.global_step)

    @property
    def is_logging_step(self) -> bool:
        """True during ``on_train_batch_end`` of a micro-batch that completed a logging step."""
        return self.optimizer_stepped and self._logging_due()

    def _logging_due(self) -> bool:
        return bool(self.options.fast_dev_run) or self.global_step % self.options.log_every_n_steps == 0

    def _window_k(self) -> int:
        """``accumulate_grad_batches`` for the window starting now; keel's constant schedule costs no call."""
        schedule = self.accumulation_schedule
        if type(schedule) is AccumulationSchedule and schedule.constant is not None:
            return schedule.constant
        return schedule.k(epoch=self.current_epoch, global_step=self.global_step)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Send host-side scalars (already agreed across ranks) to every logger; rank 0 writes. For callbacks that
        measure something themselves (the task uses ``self.log``). ``step`` defaults to Lightning's axis
        (:func:`trainer.metrics.logged_step`): ``global_step - 1`` from an optimizer step to the end of its batch."""
        self.logged_metrics.update(metrics)
        if self.is_global_zero:
            at = logged_step(self.global_step, in_fit_step=self._step_open) if step is None else step
            for logger in self.loggers:
                logger.log_metrics(dict(metrics), step=at)

    # ------------------------------------------------------------------ public entry points
    def fit(
        self,
        model: TaskModule,
        train_dataloaders: Iterable | None = None,
        val_dataloaders: Iterable | Sequence[Iterable] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | None = None,
    ) -> None:
        """Train ``model`` (a TaskModule, or ``torch.compile(task)``; Lightning's parameter name). A DataModule
        may come second, as in Lightning. ``ckpt_path`` resumes from a checkpoint file, or ``"last"`` / ``"best"``."""
        # The loggers continue the newest run directory (a rerun of the same command), unless told not to.
        self._continues_run = ckpt_path == "last" and self.continue_run_directory
        self._resumes_last = ckpt_path == "last"  # what Ctrl-C's message tells to run again
        start = time.monotonic()
        self._run(
            "fit",
            model,
            datamodule,
            functools.partial(self._fit, ckpt_path=ckpt_path),  # a partial adds no frame to a save's or load's stack
            loaders=(train_dataloaders, val_dataloaders),
        )
        if self.summary_on_fit_end and self.is_global_zero:
            log.info("%s", run_summary.format_summary(run_summary.of_fit(self, time.monotonic() - start)))

    def validate(
        self,
        model: TaskModule | None = None,
        dataloaders: Iterable | Sequence[Iterable] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
    ) -> list[dict[str, float]]:
        """Run the validation loop once. Returns one dict of epoch metrics per dataloader (reduced over
        all ranks: means weighted by batch size), the same on every rank; ``verbose`` logs them (rank 0)."""
        return self._evaluate_stage("validate", model, dataloaders, datamodule, ckpt_path, verbose)

    def test(
        self,
        model: TaskModule | None = None,
        dataloaders: Iterable | Sequence[Iterable] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
    ) -> list[dict[str, float]]:
        """Run the test loop once; returns (and with ``verbose`` logs) metrics like :meth:`validate`."""
        return self._evaluate_stage("test", model, dataloaders, datamodule, ckpt_path, verbose)

    def predict(
        self,
        model: TaskModule | None = None,
        dataloaders: Iterable | Sequence[Iterable] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | None = None,
        return_predictions: bool | None = None,
    ) -> list[Any] | None:
        """Run ``predict_step`` over the data and return the per-batch outputs (moved to CPU) in dataset order.

        Each rank predicts a contiguous shard; the shards are gathered in rank order, so the list is in
        dataset order. With ``predict_return="all_ranks"`` (default) every rank returns the whole list;
        with ``"rank_zero"`` rank 0 returns it and other ranks return None. With several dataloaders the
        result is a list of such lists. ``return_predictions=False`` (Lightning's) keeps and gathers nothing and
        returns None everywhere (a prediction writer callback still gets every output).
        """
        return self._run(
            "predict",
            model,
            datamodule,
            lambda given: self._predict(given, ckpt_path, return_predictions),
            loaders=(dataloaders,),
        )

    def save_checkpoint(
        self, filepath: str | os.PathLike, weights_only: bool = False, storage_options: Any = None
    ) -> None:
        """Write a checkpoint of the whole run state as the save folder ``filepath`` (every rank writes its part;
        all ranks must call). ``weights_only``: one plain file with the weights, hyperparameters, step and
        epoch (Lightning's; cannot resume a fit). ``storage_options``: Lightning's, for its CheckpointIO plugins,
        which keel does not have: it must be None.

        Raises:
            FloatingPointError: a training loss since the last check, or the weights, hold NaN or inf; such a
                checkpoint is never written.
            ValueError: ``storage_options`` given.
        """
        if storage_options is not None:
            raise ValueError(
                "save_checkpoint(storage_options=...) is for Lightning's CheckpointIO plugins, which keel does not "
                "have: drop the argument (object storage credentials come from the URL's fsspec configuration)."
            )
        self.checkpointer.save(filepath, weights_only=weights_only)

    def export_weights(
        self,
        path: str | os.PathLike,
        *,
        rename: Callable[[str], str | None] | None = None,
        max_shard_size: int = 5 * 10**9,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Write the task's weights as they are now (after ``fit``, or in a hook) in the forms of
        :func:`trainer.export_weights`: a Hugging Face folder (a folder, or a path without a suffix), one
        ``.safetensors`` file, or one plain state-dict file (``.pt``). Every rank must call it (sharded weights
        are gathered); rank 0 writes, holding the whole model in its CPU memory, and every rank raises if the write
        failed. To export a saved checkpoint shard by shard without a process group, use
        ``trainer.export_weights(ckpt, out)`` or ``python -m trainer export CKPT OUT``.

        Raises:
            RuntimeError: no task yet (call it after ``fit``), or rank 0's write failed (on the other ranks).
            CheckpointSaveError, ValueError: on rank 0, as :func:`trainer.export_weights` raises them.
        """
        task = self.task
        if task is None:
            raise RuntimeError(
                "Trainer.export_weights needs the task: call it after fit() (or validate/test/predict), or export a "
                "checkpoint with trainer.export_weights(ckpt_path, out_path)."
            )
        state = self.strategy.full_model_state_dict(task)  # a collective when sharded; the whole model on rank 0
        error: BaseException | None = None
        if self.is_global_zero:
            try:
                source = StateDictSource(state, f"{type(task).__name__}'s weights (Trainer.export_weights)")
                export_source(source, path, rename=rename, max_shard_size=max_shard_size, dtype=dtype)
            except Exception as exc:  # every rank learns it below: none is left waiting in the next collective
                error = exc
        failed = comm.broadcast_object(f"{type(error).__name__}: {error}" if error is not None else "")
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"Trainer.export_weights: rank 0 could not write {os.fspath(path)!r}: {failed}")

    def _loader_source(self) -> DataModule | TaskModule:
        """Where a stage's ``*_dataloader()`` hooks are: the datamodule when there is one, else the task."""
        assert self.task is not None  # set for the whole stage (Trainer._run)
        return self.datamodule if self.datamodule is not None else self.task

    def _before_save(self, path: str) -> None:
        self._beat(wd.PHASE_CHECKPOINT)
        self._nonfinite.check(f"before saving checkpoint {path!r}")  # never a checkpoint after a NaN step
        self.state.data_parallel_size = self.strategy.data_parallel_size
        # A save in on_train_epoch_end resumes at the next epoch: record the accumulation in force there.
        epoch = self.current_epoch + (1 if self.state.epoch_finished else 0)
        self.state.global_batch = elastic.checkpoint_record(
            self.options.global_batch_size,
            micro=elastic.micro_batch_of(self._train.loader if self._train is not None else None),
            k=self.accumulation_schedule.k(epoch=epoch, global_step=self.global_step),
            replicas=self.strategy.data_parallel_size,
        )

    def _on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        task = self.task
        assert task is not None
        task.on_save_checkpoint(checkpoint)
        for cb in self.callbacks:
            cb.on_save_checkpoint(self, task, checkpoint)

    def _on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        task = self.task
        assert task is not None
        task.on_load_checkpoint(checkpoint)
        for cb in self.callbacks:
            cb.on_load_checkpoint(self, task, checkpoint)

    # ------------------------------------------------------------------ stage plumbing
    def _run(
        self,
        stage: str,
        task: TaskModule | None,
        datamodule: DataModule | None,
        body: Callable[..., Any],
        *,
        loaders: tuple[Any, ...],
    ) -> Any:
        task, datamodule, loaders, self._dynamo_ctx = check_stage_inputs(
            stage, task if task is not None else self.task, datamodule, loaders
        )
        self._owns_group = lifecycle.init_process_group(self) or self._owns_group
        self.task, self.datamodule, self.state_stage = task, datamodule, stage
        task._trainer = self
        if datamodule is not None:
            datamodule._trainer = self
        self._metrics.reset()
        try:
            self._setup_stage(stage)
            self._watchdog = lifecycle.start_watchdog(self)
            self._beat(wd.PHASE_SETUP)
            result = body(*loaders)
        except BaseException as exc:
            if self.world_size > 1:  # one console line per rank at exit; the traceback in the run directory
                failures.record(exc, rank=self.global_rank, run_dir=self._known_run_dir())
            lifecycle.handle_failure(self, task, exc, lambda: self._teardown_stage(stage, failed=True))
            raise
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()
                self._watchdog = None
        self._teardown_stage(stage, failed=False)
        return result

    def _known_run_dir(self) -> str | None:
        """Where this run's files go, for its failure logs: the first logger's run directory once picked (no
        collective: safe while failing), else ``default_root_dir`` when the user set it. None without either (no
        logger, no ``default_root_dir``): the failure log then goes to the temporary folder, never into the current
        directory of whatever program called fit."""
        if not self.loggers:
            return self.options.default_root_dir
        try:
            return self.loggers[0].log_dir
        except RuntimeError:
            return None

    def _beat(self, phase: str) -> None:
        """This rank enters ``phase``: its phase clock reads the time (always), the watchdog and the profiler hear."""
        self._phases.enter(phase)
        if self._watchdog is not None:
            self._watchdog.beat(phase, self.global_step)
        if self.profiler.enabled:  # profiling off (the default): this check is its whole cost
            self.profiler.transition(phase)

    def _setup_stage(self, stage: str) -> None:
        if not self._logged_options and self.is_global_zero:
            changed = self.options.changed()
            log.info("Trainer options: %s", ", ".join(f"{k}={v!r}" for k, v in changed.items()) or "the defaults")
            log.debug("All Trainer options: %s", self.options.resolved())
            self._logged_options = True
        lifecycle.setup_stage(self, stage)
        assert self.task is not None
        if stage == "fit" and self.is_global_zero:
            lifecycle.warn_unseeded_task(self.task, self.options.seed)
        # configure_model, then the task on its device in its dtype; how (whole, or sharded first and materialised
        # shard by shard) is the strategy's business.
        self.strategy.prepare_model(self.task, dtype=self._precision.param_dtype)

    def _teardown_stage(self, stage: str, *, failed: bool) -> None:
        try:
            lifecycle.teardown_stage(self, stage, failed=failed)
        finally:
            if stage == "fit":  # after the callbacks' teardown: every save of the fit is committed
                self.checkpointer.release()
            self._model = self._run_step = self._hooks = self._metrics.batch = None
            self.__dict__.pop("_beat", None)  # the method again (fit bound the phase clock's mark)
            self.strategy.teardown()
            self.state_stage = None

    # ------------------------------------------------------------------ fit
    def _fit(self, train_dataloaders: Any, val_dataloaders: Any, ckpt_path: str | None) -> None:
        task = self.task
        assert task is not None
        opts = self.options
        self._train = stages.train_loader(
            self._loader_source(), train_dataloaders, strategy=self.strategy, seed=opts.seed
        )
        schedule = elastic.configure(  # global_batch_size -> accumulation at this world size
            opts.global_batch_size, self._train.loader, replicas=self.strategy.data_parallel_size
        )
        if schedule is not None:
            self.accumulation_schedule = schedule
        pinned = bool(getattr(self._train.loader, "pin_memory", False))
        copier = BatchCopier(self.device, float_dtype=self._precision.param_dtype, overlap=pinned)
        transfer = BatchTransfer.resolve(  # None unless the task or datamodule overrides a batch-transfer hook
            task, self.datamodule, device=self.device, float_dtype=self._precision.param_dtype, move=copier
        )
        self._copy_batch = copier if transfer is None else functools.partial(transfer, dataloader_idx=0)
        self._moves_batches = self._device_copies or transfer is not None
        val_loaders, self.num_val_batches = fit_validation(  # none without validation_step or with limit 0
            task,
            stages.eval_loaders(
                self._loader_source(), "validate", val_dataloaders, strategy=self.strategy, seed=opts.seed
            ),
            lambda v: stages.batch_limit(opts, v.loader, "limit_val_batches"),
            self.device,
        )
        self._check_sharding = self.strategy.data_parallel_size > 1 and self._train.sampler is None
        self._configure_model_and_optimizers()
        self._carried = self._carry_preemption_flags()
        self.state.reset()
        self.should_stop = self._step_open = False
        self._nonfinite.reset()
        self.checkpointer.track(
            task,
            datamodule=self.datamodule,
            optimizers=self.optimizers,
            schedulers=[c.scheduler for c in self.lr_scheduler_configs],
            stream=self._train.stream,
            sampler=self._train.sampler,
        )
        self.checkpointer.begin(ckpt_path)  # the run's identity, and its claim on the checkpoint folder
        load_s = self.checkpointer.load(ckpt_path, full=True)
        resumed = self.state.continue_at(
            micro_batch=getattr(self._train.loader, "batch_size", None), replicas=self.strategy.data_parallel_size
        )
        if resumed is not None:
            elastic.check_resume(
                resumed.get("global_batch"),
                option=opts.global_batch_size,
                micro=elastic.micro_batch_of(self._train.loader),
                k=self.accumulate_grad_batches,
                replicas=self.strategy.data_parallel_size,
                step=self.global_step,
                path=str(self.ckpt_path),
            )
        self._efficiency = Efficiency(  # the run's time, from this step
            task=task,
            strategy=self.strategy,
            device=self.device,
            precision=opts.precision,
            folder=local_dir(self.log_dir) if self.loggers and self.is_global_zero else None,
            speaks=self.is_global_zero,
            step=self.global_step,
            micro_batch=elastic.micro_batch_of(self._train.loader),
            load_s=load_s,
        )
        self._phases = self._efficiency.clock
        if self._watchdog is None and not self.profiler.enabled:  # only the clock listens: a beat is its mark
            self._beat = self._phases.enter  # type: ignore[method-assign]  # removed when the stage ends
        if self.is_global_zero:
            own_summary = any(getattr(cb, "is_model_summary", False) for cb in self.callbacks)
            self._log_fit_start(summary=opts.enable_model_summary and not own_summary)
        task.on_fit_start()
        for cb in self.callbacks:
            cb.on_fit_start(self, task)
        if val_loaders and opts.num_sanity_val_steps != 0 and not opts.fast_dev_run and self.global_step == 0:
            self.sanity_checking = True
            try:
                limit = None if opts.num_sanity_val_steps == -1 else opts.num_sanity_val_steps
                self._evaluate("validate", val_loaders, limit_override=limit)
            finally:
                self.sanity_checking = False
        task.on_train_start()
        for cb in self.callbacks:
            cb.on_train_start(self, task)
        max_epochs = 1 if opts.fast_dev_run else opts.max_epochs
        if resumed is not None and self._done_training(max_epochs) and self.is_global_zero:
            self._log_nothing_left(max_epochs)
        self._preemption.install()
        try:
            while not self._done_training(max_epochs):
                self._train_epoch(val_loaders)
                if self.should_stop:
                    break
        finally:
            self._preemption.uninstall()
        if self._carried is not None:
            self._carried.drain()  # the last step's flags: every rank sent them
        self._nonfinite.check("at the end of fit")
        self._efficiency.finish(self.global_step)  # the time budget, efficiency.json, the goodput ledger
        task.on_train_end()
        for cb in self.callbacks:
            cb.on_train_end(self, task)
        task.on_fit_end()
        for cb in self.callbacks:
            cb.on_fit_end(self, task)

    def _log_fit_start(self, *, summary: bool) -> None:
        """Rank 0, at the start of ``fit``: the model summary line (when ``summary``) and the hyperparameters
        (the resolved Trainer options, and the task's ``hparams`` unless ``save_hyperparameters(logger=False)``)."""
        task = self.task
        assert task is not None
        if summary:
            params = list(task.parameters())
            total = sum(p.numel() for p in params)
            trainable = sum(p.numel() for p in params if p.requires_grad)
            size_mb = sum(p.numel() * p.element_size() for p in params) / 2**20
            log.info(
                "%s: %s parameters (%s trainable), %.2f MB.",
                type(task).__name__,
                f"{total:,}",
                f"{trainable:,}",
                size_mb,
            )
        hparams: dict[str, Any] = {"trainer": self.options.resolved()}
        if task.hparams and task._log_hyperparams:
            hparams["task"] = dict(task.hparams)
        for logger in self.loggers:
            logger.log_hyperparams(hparams)
            logger.log_graph(task)  # Lightning's order: the hyperparameters, then the graph

    def _log_nothing_left(self, max_epochs: int | None) -> None:
        """A resumed run that is already complete says so, and how to train on (a rerun of a finished command)."""
        steps = self.options.max_steps
        name, value = ("max_steps", steps) if steps != -1 and self.global_step >= steps else ("max_epochs", max_epochs)
        log.info(
            "Nothing left to train: the run already reached %s=%s at step %d. Raise %s to train on, or pass "
            "ckpt_path=None (ckpt_path=null on a Hydra command line) or a new default_root_dir for a fresh run.",
            name,
            value,
            self.global_step,
            name,
        )

    def _done_training(self, max_epochs: int | None) -> bool:
        if self.options.max_steps != -1 and self.global_step >= self.options.max_steps:
            return True
        return max_epochs is not None and max_epochs != -1 and self.current_epoch >= max_epochs

    def _configure_model_and_optimizers(self) -> None:
        """Wrap (or shard) the task through the strategy, then build the optimizers on what it made."""
        task = self.task
        assert task is not None
        opts = self.options
        self._manual_mode = not task.automatic_optimization
        self._model = model = compile_step(self.strategy.setup(task, manual=self._manual_mode), self._dynamo_ctx)
        self._run_step = model.run_step if type(model) is StepAdapter else model  # unwrapped: the step itself
        self.optimizers, self.lr_scheduler_configs = parse_optimizers(task.configure_optimizers())
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        # Every parameter the optimizers update (clipping and gradient rescaling act on these).
        self._params = [p for o in self.optimizers for group in o.param_groups for p in group["params"]]
        self._manual = ManualOptimization(
            task=task,
            # the epoch's overridden hooks; outside an epoch (a manual step in on_fit_start) those in force now
            hooks=lambda: self._hooks or TrainHooks(self, task, self.callbacks),
            strategy=self.strategy,
            precision=self._precision,
            clip_val=opts.gradient_clip_val,
            clip_algorithm=opts.gradient_clip_algorithm,
            beat=self._beat,
        )

    def _start_train_epoch(self, train: AdaptedLoader) -> tuple[EpochPlan, TrainHooks]:
        """Sampler epoch, resume cursor, and (for loaders keel does not shard) agreement between ranks; then
        the epoch-start hooks and the per-batch hooks resolved for this epoch."""
        task, opts = self.task, self.options
        assert task is not None
        plan = plan_epoch(
            train,
            epoch=self.current_epoch,
            batches_done=self.state.batches_done,
            samples_done=self.state.samples_done,
            limit=lambda loader: stages.batch_limit(self.options, loader, "limit_train_batches"),
            replicas=self.strategy.data_parallel_size,
            device=self.device,
            uneven=cast('Literal["error", "truncate"]', opts.uneven_batches),  # checked in options
        )
        self.state.batches_done, self.state.samples_done = plan.start, plan.samples_done
        self.num_training_batches = plan.num_batches
        self._val_every_batches = val_check_batches(opts, plan.num_batches, epoch=self.current_epoch)
        task.train()
        self._metrics.stage = "train"
        task.on_train_epoch_start()
        for cb in self.callbacks:
            cb.on_train_epoch_start(self, task)
        self._params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]  # + groups hooks added
        self._hooks = hooks = TrainHooks(self, task, self.callbacks)  # the overridden per-batch hooks, in order
        return plan, hooks

    def _train_epoch(self, val_loaders: list[AdaptedLoader]) -> None:
        """One epoch: micro-batches grouped into optimizer steps, validation and logging on the step clock."""
        train = self._train
        assert train is not None and self._model is not None
        plan, hooks = self._start_train_epoch(train)
        opts = self.options
        self._cadence = _Cadence(
            log_every=1 if opts.fast_dev_run else opts.log_every_n_steps,
            max_steps=opts.max_steps,
            val_every=self._val_every_batches if val_loaders else None,  # a fractional val_check_interval
            val_loaders=val_loaders,
            preempt_every=opts.preemption_check_interval or opts.log_every_n_steps,
            multi_rank=self.world_size > 1,
            agrees=self.world_size > 1 or self._carried is not None,
            ends=hooks.on_train_batch_end,
        )
        normaliser = StepNormaliser(world_size=self.world_size, device=self.device)
        self._beat(wd.PHASE_DATA)  # the first batch: its loader's workers start
        if self._runs_plain(plan):
            completed = self._plain_epoch(plan, normaliser)
        else:
            completed = self._general_epoch(plan, normaliser)
        normaliser.report_zero_steps(self.current_epoch)  # device-decided zero-item steps: one read per epoch
        self._epoch_end(val_loaders, completed=completed)

    def _runs_plain(self, plan: EpochPlan) -> bool:
        """Whether this epoch's steps are all plain, decided once: one batch a step (a constant
        ``accumulate_grad_batches=1``, a known epoch length), automatic optimization with one optimizer and no
        ``on_before_optimizer_step`` / ``on_before_zero_grad`` hooks, plain precision (no autocast, no scaler), no
        clipping, ``on_nonfinite`` not ``"skip"``, nothing but the phase clock hearing the marks (no watchdog,
        profiler or device timeline) and no sharding check pending. :meth:`_plain_epoch` runs such an epoch."""
        schedule, precision, opts, hooks = self.accumulation_schedule, self._precision, self.options, self._hooks
        if self.strategy.has_sync_context and self.strategy.gradient_sync(True) is not NO_CONTEXT:
            return False  # every micro-batch syncs its gradients: a context to enter would cost every step
        return (
            type(schedule) is AccumulationSchedule
            and schedule.constant == 1
            and plan.num_batches is not None
            and plan.agree is None
            and not (self._manual_mode or self._skip_nonfinite or opts.drop_incomplete_accumulation)
            and len(self.optimizers) == 1
            and hooks is not None
            and not (hooks.on_before_optimizer_step or hooks.on_before_zero_grad)
            and opts.gradient_clip_val is None
            and "_beat" in self.__dict__  # bound to the phase clock's mark: no watchdog or profiler listens
            and self._phases.device is None
            and precision.backward is torch.Tensor.backward
            and not precision.autocasts
            and precision.scaler is None
            and not self._check_sharding
        )

    def _plain_epoch(self, plan: EpochPlan, normaliser: StepNormaliser) -> bool:
        """The training epoch of :meth:`_runs_plain`: the same steps, hooks and checks as :meth:`_general_epoch` and
        :meth:`_optimizer_step`, with what the step needs read once into locals, the phase clock marked inline, and
        no micro-batch objects. A ``training_step`` that returns anything but a scalar loss (a dict, ``num_items``,
        a half-precision loss) takes the general step's handling for that step. Returns whether the epoch's data
        was exhausted."""
        hooks, clock, state, metrics, nonfinite = self._hooks, self._phases, self.state, self._metrics, self._nonfinite
        assert hooks is not None and plan.num_batches is not None
        run_step, copy = self._run_step, self._copy_batch if self._moves_batches else None
        assert run_step is not None
        starts, before_backward, after_backward = (
            hooks.on_train_batch_start,
            hooks.on_before_backward,
            hooks.on_after_backward,
        )
        (optimizer,), schedulers, sync = self.optimizers, self.lr_scheduler_configs, clock.sync
        totals, now, last, per_batch = clock.totals, time.perf_counter, plan.num_batches - 1, plan.samples_per_batch
        data, forward, backward, optimizing, other = (
            clock.DATA,
            clock.FORWARD,
            clock.BACKWARD,
            clock.OPTIMIZER,
            clock.OTHER,
        )
        tensor, half = torch.Tensor, HALF_DTYPES
        for batch_idx, batch in zip(range(plan.start, plan.num_batches), plan.batches):
            t = now()  # the phase clock: the loader's time ends, the training step's begins
            totals[clock.current] += t - clock.since
            clock.since, clock.current = t, forward
            self._step_open = False  # a new batch: Lightning's logging counter has moved on
            if copy is not None:
                batch = copy(batch)
            metrics.batch = batch  # self.log reads its size only when it needs one
            for hook in starts:
                hook(batch, batch_idx)
            try:
                output = run_step(batch, batch_idx)
            except RuntimeError as exc:
                self.strategy.raise_explained(exc)  # a wrapper error it can explain, else re-raise as is
                raise
            if isinstance(output, tensor) and not output.ndim and output.requires_grad and output.dtype not in half:
                step_loss = output.detach()
                outputs: dict[str, Any] = {"loss": step_loss}
                for hook in before_backward:
                    hook(output)
                t = now()
                totals[forward] += t - clock.since
                clock.since, clock.current = t, backward
                output.backward()
                for hook in after_backward:
                    hook()
                if sync is None:
                    t = now()
                    totals[backward] += t - clock.since
                    clock.since, clock.current = t, optimizing
                else:  # DDP: the backward is split where its last all-reduce was launched
                    clock.enter(wd.PHASE_OPTIMIZER_STEP)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                state.global_step += 1
                if schedulers:
                    step_schedulers(schedulers, "step", state.global_step, self.callback_metrics)
                self._step_loss = step_loss
                nonfinite.record(state.global_step, step_loss)  # a list append: read on logging steps
                stepped = True
            else:  # a dict, num_items, a half-precision loss: what the general step does with it
                micro = MicroBatch(batch_idx, batch, 1, 1, True, batch_idx == last)
                outputs = self._backward_output(output, micro, normaliser)
                stepped = self._optimizer_step(*normaliser.finish())
            state.batches_done = batch_idx + 1
            state.samples_done += per_batch
            t = now()  # the optimizer step ends; the batch-end hooks begin
            totals[clock.current] += t - clock.since
            clock.since, clock.current = t, other
            if self._end_batch(outputs, batch, batch_idx, stepped=stepped, step_end=True):
                return batch_idx == last
            t = now()  # next: fetching the next batch
            totals[clock.current] += t - clock.since
            clock.since, clock.current = t, data
        return True

    def _general_epoch(self, plan: EpochPlan, normaliser: StepNormaliser) -> bool:
        """Any training epoch: accumulation windows, manual optimization, mixed precision, clipping, a loader of
        unknown length, a watchdog or profiler listening. Returns whether the epoch's data was exhausted."""
        opts, state = self.options, self.state
        drop_incomplete = opts.drop_incomplete_accumulation
        unusual = drop_incomplete or self._manual_mode  # a window may end without an automatic optimizer step
        samples_per_batch = plan.samples_per_batch
        for micro in micro_batches(
            plan.batches,
            start_idx=plan.start,
            num_batches=plan.num_batches,
            accumulate=self._window_k,
            drop_incomplete=drop_incomplete,
            agree=plan.agree,
        ):
            self._step_open = False  # a new batch: Lightning's logging counter has moved on
            if self._check_sharding:
                self._check_sharding = False
                warn_if_unsharded(micro.batch, self._train.loader if self._train else None)
            outputs = self._training_micro_batch(micro, normaliser)
            state.batches_done = micro.batch_idx + 1
            state.samples_done += samples_per_batch
            stepped = False
            if micro.is_step_end:
                if unusual:
                    stepped = self._end_unusual_window(micro, normaliser)
                else:
                    stepped = self._optimizer_step(*normaliser.finish())
            self._beat(wd.PHASE_CALLBACKS)
            if self._end_batch(outputs, micro.batch, micro.batch_idx, stepped=stepped, step_end=micro.is_step_end):
                return micro.is_epoch_end
            self._beat(wd.PHASE_DATA)  # next: fetching the next batch (validation and the preemption check are not)
        return True

    def _end_batch(self, outputs: Any, batch: Any, batch_idx: int, *, stepped: bool, step_end: bool) -> bool:
        """After a batch's backward, and its optimizer step when ``stepped``: the logging step, the batch-end hooks,
        validation on its schedule and, at a step's end, the preemption check and the stop conditions. True: the
        epoch stops here. The caller marks the callbacks phase before and the data phase after."""
        cadence, state = self._cadence, self.state
        assert cadence is not None
        self.optimizer_stepped = self._step_open = stepped
        if stepped and state.global_step % cadence.log_every == 0:
            self._log_step_metrics()  # a logging step: the only place step metrics are read
        for hook in cadence.ends:
            hook(outputs, batch, batch_idx)
        self.optimizer_stepped = False
        if cadence.val_every is not None:  # a fraction of the epoch: by batch, inside an accumulation window too
            if (batch_idx + 1) % cadence.val_every == 0:
                self._evaluate("validate", cadence.val_loaders)
        elif stepped and cadence.val_loaders and self.val_check_due:
            self._evaluate("validate", cadence.val_loaders)
        if step_end:
            if cadence.agrees or self._preemption.requested:  # several ranks, or a signal here
                self._check_preemption(stepped)
            # should_stop (callbacks) takes effect at an optimizer-step boundary, never inside a window.
            if (self._stop_requested and self.should_stop) or (
                cadence.max_steps != -1 and state.global_step >= cadence.max_steps
            ):
                return True
        return False

    def _check_preemption(self, stepped: bool) -> None:
        """At a step's end: a signal seen here is announced, and where the ranks agree on one (every step when the
        flags ride on the gradients, else every ``preemption_check_interval`` steps) every rank saves and exits."""
        self._beat(wd.PHASE_PREEMPTION_CHECK)
        preemption, cadence, step = self._preemption, self._cadence, self.state.global_step
        assert cadence is not None
        if preemption.requested and not preemption.announced:
            preemption.announce(step, next_check=self._next_preemption_check(cadence.preempt_every))
        carried = self._carried
        if carried is not None:  # the flags rode on this step's gradient all-reduce: agreed at every step
            if stepped and carried.decide():
                self._save_and_exit()
        elif (
            stepped
            and (preemption.requested or (cadence.multi_rank and step % cadence.preempt_every == 0))
            and preemption.due(step, device=self.device, world_size=self.world_size, interval=cadence.preempt_every)
        ):
            self._save_and_exit()

    def _carry_preemption_flags(self) -> CarriedFlags | None:
        """With several ranks the ranks agree on a signal at every step (:class:`CarriedFlags`): under DDP with
        automatic optimization the flags ride on the gradient all-reduce, elsewhere (sharded strategies, manual
        optimization) on one small asynchronous all-reduce a step. With ``preemption_check_interval`` given: every
        that many steps, with one small all-reduce waited for."""
        mark = self.strategy.sync_mark
        carried = None
        if self.world_size > 1 and self.options.preemption_check_interval is None:
            on_gradients = mark is not None and not self._manual_mode
            carrier = getattr(mark, "carrier", None) if on_gradients else None
            carried = CarriedFlags(self._preemption, self.device, on_gradients=on_gradients, carrier=carrier)
        if mark is not None:
            mark.flags = carried if carried is not None and carried.on_gradients else None
        return carried

    def _next_preemption_check(self, every: int) -> str:
        if self.world_size == 1:
            return "now"
        if self._carried is not None:
            return "at the next step boundary, where the ranks agree"
        return f"at step {(self.global_step // every + 1) * every}, where the ranks agree"

    def _save_and_exit(self) -> None:
        """At the step boundary where the ranks agreed on a signal: save (the ModelCheckpoint's forced save, or
        a plain checkpoint in the run directory) and exit: after a preemption signal with ``PREEMPTED_EXIT_CODE``
        so that the launcher restarts the job, after Ctrl-C with 130. Every rank calls it (saving is collective);
        rank 0 logs one line."""
        watcher = self._preemption
        suffix = "-interrupted" if watcher.interrupted else "-preempted"
        callback = self.checkpoint_callback
        if callback is not None:
            path = callback.save(self, suffix=suffix, force=True)
        else:
            path = os.path.join(self.log_dir, "checkpoints", f"{suffix[1:]}-step={self.global_step}.ckpt")
            self.save_checkpoint(path)
        if self.is_global_zero:
            what = "Stopped by Ctrl-C" if watcher.interrupted else f"Preempted ({watcher.signal_name or 'a signal'})"
            if not watcher.interrupted:
                then = "the launcher restarts the job: ckpt_path='last' resumes it"
            elif self._resumes_last:
                then = "run the same command again: its ckpt_path='last' resumes it"
            else:  # this fit started a new run: the same command would start another one
                then = (
                    "to continue it, run with ckpt_path='last' (ckpt_path=last on a Hydra command line); the same "
                    "command starts a new run"
                )
            log.warning(
                "%s at step %d: saved %s; exiting with code %d (%s).",
                what,
                self.global_step,
                path,
                watcher.exit_code,
                then,
            )
        raise SystemExit(watcher.exit_code)

    def _end_unusual_window(self, micro: MicroBatch, normaliser: StepNormaliser) -> bool:
        """The end of a window under manual optimization or ``drop_incomplete_accumulation``; True: a step."""
        if self.options.drop_incomplete_accumulation and micro.window_len is None and normaliser.ran < micro.accumulate:
            for optimizer in self.optimizers:  # unknown-length epoch ended inside a window: discard it
                optimizer.zero_grad(set_to_none=True)
            normaliser.reset()
            return False
        if self._manual_mode:
            self._precision.update()
            self.state.global_step += 1  # one training iteration (whatever number of optimizer calls) is one step
            self._nonfinite.record(self.global_step, self._step_loss)
            return True
        return self._optimizer_step(*normaliser.finish())

    @property
    def val_check_due(self) -> bool:
        """True in ``on_train_batch_end`` of a batch after which ``val_check_interval`` schedules validation: right
        after an optimizer step (an int), or after every ``max(1, int(batches * fraction))`` batches (a fraction)."""
        interval = self.options.val_check_interval
        if self.state_stage != "fit" or interval is None:
            return False
        if isinstance(interval, float):
            every = self._val_every_batches
            return every is not None and self.state.batches_done % every == 0
        return self.global_step % interval == 0

    def _training_micro_batch(self, micro: MicroBatch, normaliser: StepNormaliser) -> dict[str, Any]:
        """Forward and backward of one micro-batch; gradients sync only on the step's last one."""
        self._beat(wd.PHASE_TRAINING_STEP)
        batch = micro.batch
        if (
            self._moves_batches
        ):  # CUDA, float64 batches or transfer hooks; else a CPU batch is used as the loader made it
            batch = micro.batch = self._copy_batch(batch)
        self._metrics.batch = batch  # self.log reads its size only when it needs one
        hooks = self._hooks
        assert hooks is not None
        for hook in hooks.on_train_batch_start:
            hook(batch, micro.batch_idx)
        if self._manual_mode:
            assert self._manual is not None and self._model is not None
            outputs, loss = self._manual.training_step(self._model, batch, micro.batch_idx, sync=micro.is_step_end)
            if loss is not None:
                self._step_loss = loss
            return outputs
        # Forward AND backward inside the strategy's sync context: on every micro-batch but the step's
        # last, gradients accumulate locally and the wrapper reduces them once per optimizer step.
        if not self.strategy.has_sync_context:  # one process: nothing to enter
            return self._forward_backward(batch, micro, normaliser)
        with self.strategy.gradient_sync(micro.is_step_end):
            return self._forward_backward(batch, micro, normaliser)

    def _forward_backward(self, batch: Any, micro: MicroBatch, normaliser: StepNormaliser) -> dict[str, Any]:
        precision, run_step = self._precision, self._run_step
        assert run_step is not None
        try:
            if precision.autocasts:  # the forward only: backward runs outside autocast
                with precision.autocast():
                    output = run_step(batch, micro.batch_idx)
            else:
                output = run_step(batch, micro.batch_idx)
        except RuntimeError as exc:
            self.strategy.raise_explained(exc)  # a wrapper error it can explain, else re-raise as is
            raise
        return self._backward_output(output, micro, normaliser)

    def _backward_output(self, output: Any, micro: MicroBatch, normaliser: StepNormaliser) -> dict[str, Any]:
        """Check what ``training_step`` returned, divide it for accumulation, run the backward hooks and backward;
        the detached outputs for the batch-end hooks."""
        hooks = self._hooks
        assert hooks is not None
        scaled, outputs = normaliser.take(output, micro)  # checks what the step returned, divides for accumulation
        for hook in hooks.on_before_backward:
            hook(scaled)
        self._beat(wd.PHASE_BACKWARD)
        backward = self._precision.backward  # a local: the interpreter calls it without a method lookup
        backward(scaled)
        for hook in hooks.on_after_backward:
            hook()
        return outputs

    def _optimizer_step(
        self, grad_factor: float | torch.Tensor | None, step_loss: torch.Tensor | None, skip: bool
    ) -> bool:
        """Complete the step (what ``StepNormaliser.finish`` returned for its window): normalise, unscale, hook, clip,
        step, schedule, zero. False if skipped."""
        self._beat(wd.PHASE_OPTIMIZER_STEP)
        if skip or (self._skip_nonfinite and not finite_on_all_ranks(step_loss, self.world_size)):
            return self._skip_step(step_loss, skip)
        precision, hooks, optimizers = self._precision, self._hooks, self.optimizers
        assert hooks is not None
        scaling = precision.scaler is not None  # 16-mixed: unscale before the hooks and clipping see gradients
        if scaling:
            for optimizer in optimizers:
                precision.unscale(optimizer)
        if grad_factor is not None:
            self.strategy.scale_gradients(self._params, grad_factor)
        if hooks.on_before_optimizer_step:
            for optimizer in optimizers:
                for hook in hooks.on_before_optimizer_step:
                    hook(optimizer)
        clip = self.options.gradient_clip_val
        if clip is not None:
            self.strategy.clip_gradients(self._params, clip, self.options.gradient_clip_algorithm)
        optimizer_step = precision.optimizer_step
        for optimizer in optimizers:
            optimizer_step(optimizer)
        if scaling:
            precision.update()
        for optimizer in optimizers:
            for hook in hooks.on_before_zero_grad:
                hook(optimizer)
            optimizer.zero_grad(set_to_none=True)
        state = self.state
        state.global_step += 1
        if self.lr_scheduler_configs:
            step_schedulers(self.lr_scheduler_configs, "step", state.global_step, self.callback_metrics)
        self._step_loss = step_loss
        self._nonfinite.record(state.global_step, step_loss)  # a list append: read on logging steps, epoch ends, saves
        return True

    def _skip_step(self, step_loss: torch.Tensor | None, no_items: bool) -> bool:
        """A step that does not update: zero items on every rank, or a non-finite loss under 'skip'."""
        if no_items:
            log.warning(
                "Step %d saw zero items (num_items) on every rank; the optimizer step is skipped.", self.global_step
            )
        else:
            log.warning(
                "Non-finite loss at step %d: the optimizer step is skipped on every rank (on_nonfinite='skip').",
                self.global_step + 1,
            )
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return False

    def _log_step_metrics(self) -> None:
        """Logging step: ONE host read for the step metrics and the non-finite verdict and, with several
        ranks, two small collectives that also carry the verdict (docs/design.md section 11). Preemption is
        agreed later, after ``on_train_batch_end``, so a signal that arrives during those hooks is acted
        on at this step."""
        pending = self._nonfinite.pending()  # the losses kept since the last check (device)
        if self._step_loss is not None:
            self._metrics.log_loss(self._step_loss)
        self._beat(wd.PHASE_METRICS_REDUCTION)
        local, kept = self._metrics.read_step(also=pending)
        bad = self._nonfinite.judge(kept)  # this rank's first non-finite loss, if any
        values, to_logger, to_bar, (any_bad,) = self._metrics.exchange_step(
            local, device=self.device, flags=(float(bad[0] != float("inf")),), row=self._phases.take(self.global_step)
        )
        if any_bad:
            self._nonfinite.fail(bad, f"at logging step {self.global_step}")  # raises on every rank
        perf = self._efficiency.update(
            self._metrics.rows, values, step=self.global_step, accumulate=self.accumulate_grad_batches
        )  # the same on every rank
        if values := {**values, **perf}:  # the loggers get perf/ with the task's own row, never a row of its own
            self._publish(values, {**to_logger, **perf} if to_logger else {}, to_bar)
        self._beat(wd.PHASE_CALLBACKS)  # next: the batch-end hooks

    def _publish(self, values: dict[str, float], to_logger: dict[str, float], to_bar: dict[str, float]) -> None:
        self.callback_metrics.update({k: torch.scalar_tensor(v, dtype=torch.float64) for k, v in values.items()})
        self.progress_bar_metrics.update(to_bar)
        if to_logger and not self.sanity_checking:  # Lightning's step axis and keys (trainer/metrics.py)
            self.log_metrics(*logger_row(to_logger, self.current_epoch, self.global_step, self.state_stage == "fit"))

    def _epoch_end(self, val_loaders: list[AdaptedLoader], *, completed: bool) -> None:
        """End of an epoch, or of training in the middle of one (``completed=False``: max_steps or
        should_stop). Then the epoch counter and the data cursor stay where they are, so a checkpoint
        written in ``on_train_epoch_end`` resumes at the right sample."""
        opts = self.options
        self._nonfinite.check(f"at the end of epoch {self.current_epoch}")
        every = opts.check_val_every_n_epoch
        due = every is not None and (not completed or (self.current_epoch + 1) % every == 0)
        if val_loaders and validates_at_epoch_end(opts.val_check_interval) and due:
            self._evaluate("validate", val_loaders)
        task = self.task
        assert task is not None
        state = self.state
        state.epoch_finished, self._step_open, self._metrics.batch = completed, False, None  # no batch in flight
        task.on_train_epoch_end()
        # Training metrics logged with on_epoch=True (and in the hook above), reduced over ranks.
        self._publish(*self._metrics.reduce_epoch())
        if completed and not self._manual_mode:
            # Before the callbacks' hook, so a checkpoint saved there holds the stepped scheduler.
            step_schedulers(self.lr_scheduler_configs, "epoch", self.current_epoch + 1, self.callback_metrics)
        for cb in self.callbacks:
            cb.on_train_epoch_end(self, task)
        state.epoch_finished = False
        if completed:
            state.current_epoch += 1
            state.batches_done = state.samples_done = 0

    # ------------------------------------------------------------------ evaluation (trainer/evaluation.py)
    def _evaluate_stage(
        self,
        stage: Literal["validate", "test"],
        model: TaskModule | None,
        dataloaders: Any,
        datamodule: DataModule | None,
        ckpt_path: str | None,
        verbose: bool,
    ) -> list[dict[str, float]]:
        def body(given: Any) -> list[dict[str, float]]:
            loaders = self._stage_loaders(stage, given, ckpt_path)
            return log_results(stage, self._evaluate(stage, loaders), verbose=verbose and self.is_global_zero)

        return self._run(stage, model, datamodule, body, loaders=(dataloaders,))

    def _stage_loaders(self, stage: str, dataloaders: Any, ckpt_path: str | None) -> list[AdaptedLoader]:
        """validate / test / predict: the sharded loaders, and the weights of ``ckpt_path`` when given."""
        loaders = stages.eval_loaders(
            self._loader_source(), stage, dataloaders, strategy=self.strategy, seed=self.options.seed, required=True
        )
        assert self.task is not None
        self.checkpointer.track(self.task, datamodule=self.datamodule)
        self.checkpointer.load(ckpt_path, full=False)
        return loaders

    def _evaluate(
        self, stage: Literal["validate", "test"], loaders: list[AdaptedLoader], *, limit_override: int | None = None
    ) -> list[dict[str, float]]:
        name = "limit_val_batches" if stage == "validate" else "limit_test_batches"
        limits = [
            stages.batch_limit(self.options, a.loader, name) if limit_override is None else limit_override
            for a in loaders
        ]
        # What each loader will run, where known (Lightning's names; the progress bar's totals).
        counts = [_bounded(limit, a.loader) for limit, a in zip(limits, loaders)]
        if self.sanity_checking:
            self.num_sanity_val_batches = counts
        elif stage == "validate":
            self.num_val_batches = counts
        else:
            self.num_test_batches = counts
        publish, sanity = (None if self.sanity_checking else self._publish), self.sanity_checking
        self._fit_evaluating = self.state_stage == "fit"  # training is False while fit validates (Lightning's flags)
        try:
            return self._eval_loop.run(
                self,
                cast(TaskModule, self.task),
                self.callbacks,
                stage,
                loaders,
                limits,
                publish=publish,
                sanity=sanity,
            )
        finally:
            self._fit_evaluating = False

    def _predict(self, dataloaders: Any, ckpt_path: str | None, keep: bool | None) -> list[Any] | None:
        loaders = self._stage_loaders("predict", dataloaders, ckpt_path)
        limits = [stages.batch_limit(self.options, a.loader, "limit_predict_batches") for a in loaders]
        gather = None if keep is False else self.options.predict_return
        assert self.task is not None
        return self._eval_loop.predict(self, self.task, self.callbacks, loaders, limits, gather=gather)


@dataclasses.dataclass(slots=True)
class _Cadence:
    """What the end of every training batch checks, read once per epoch (``Trainer._end_batch``)."""

    log_every: int  # a logging step every this many optimizer steps
    max_steps: int  # -1: no limit
    val_every: int | None  # a fractional val_check_interval, in batches; None: validation on the step clock
    val_loaders: list[AdaptedLoader]
    preempt_every: int  # the ranks agree on a preemption signal every this many steps (unless the flags ride along)
    multi_rank: bool
    agrees: bool  # the ranks may agree on a preemption signal at a step's end (several ranks)
    ends: tuple[Callable[..., Any], ...]  # the on_train_batch_end hooks the task and callbacks override


def _bounded(limit: int | None, loader: Any) -> int | None:
    """The batches a loader runs under ``limit``: the smaller of the two where both are known."""
    try:
        length: int | None = len(loader)
    except TypeError:
        length = None
    if limit is None or length is None:
        return limit if length is None else length
    return min(limit, length)


def _memory_plan() -> Callback:
    """The memory plan's callback, imported when ``memory_plan`` is on: the planner's public face builds a Trainer
    (trainer/memory/__init__.py), so the loop imports it only here, and ``import trainer`` never does."""
    from trainer.memory.callback import MemoryPlan

    return MemoryPlan()


# ---------------------------------------------------------------------- when fit validates
def fit_validation(
    task: TaskModule,
    loaders: list[AdaptedLoader],
    limit: Callable[[AdaptedLoader], int | None],
    device: torch.device | None = None,
) -> tuple[list[AdaptedLoader], list[int | None]]:
    """The validation loaders ``fit`` runs and their batch limits, decided as Lightning does:

    * loaders but no ``validation_step``: validation is skipped, with a warning (Lightning: "You passed in
      a val_dataloader but have no validation_step. Skipping val loop.");
    * ``limit_val_batches=0`` (every loader limited to 0 batches): no validation and no sanity check.

    The second is agreed by every rank (one all-reduce on ``device`` in a distributed run): a rank whose shard of a
    small validation set is empty still runs validation with the others (their collectives need it).
    """
    if loaders and is_keel_default(task.validation_step):
        warnings.warn(
            f"{type(task).__name__} got validation data but defines no validation_step: validation is "
            "skipped (as in Lightning). Implement validation_step(batch, batch_idx) to run it.",
            UserWarning,
            stacklevel=3,
        )
        return [], []
    limits = [limit(loader) for loader in loaders]
    if not loaders:
        return [], []
    batches = torch.tensor([float(any(n != 0 for n in limits))], device=device)
    if device is not None and comm.get_world_size() > 1:
        comm.all_reduce(batches, "max")
    return (loaders, limits) if batches.item() else ([], [])


def validates_at_epoch_end(interval: int | float | None) -> bool:
    """Whether ``val_check_interval`` leaves validation to the epoch ends: None, or Lightning's default 1.0."""
    return interval is None or (isinstance(interval, float) and interval == 1.0)


def val_check_batches(options: TrainerOptions, num_batches: int | None, *, epoch: int) -> int | None:
    """For a fractional ``val_check_interval`` (a float below 1.0), the number of training batches between
    validation runs in ``epoch``, as Lightning 2.6.6 counts them: ``max(1, int(num_batches * fraction))`` of the
    epoch's batches after ``limit_train_batches``, counted from the epoch's start (also under gradient
    accumulation, where a run can fall inside a window), in the epochs ``check_val_every_n_epoch`` selects; None
    in other epochs, and for an int, None or 1.0 (keel's step and epoch-end schedules).

    Raises:
        ValueError: a fraction below 1.0 and a training loader of unknown length (Lightning's rule).
    """
    interval = options.val_check_interval
    if not isinstance(interval, float) or interval == 1.0:
        return None
    if num_batches is None:
        raise ValueError(
            f"Trainer(val_check_interval={interval!r}) is a fraction of the training epoch, whose length is unknown "
            "(the training loader has no len(): an IterableDataset). Use an int val_check_interval (every N optimizer "
            "steps), 1.0 (epoch ends), or limit_train_batches=N (an int) to give the epoch a length."
        )
    every = options.check_val_every_n_epoch
    if every is not None and (epoch + 1) % every != 0:
        return None
    return max(1, int(num_batches * interval))
