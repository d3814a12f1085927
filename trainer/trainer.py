"""The Trainer: owns the DDP-wrapped task, the loops, precision, accumulation, data sharding and state.

Read :meth:`Trainer._train_epoch` and :meth:`Trainer._optimizer_step` for the whole training step:
``loss.backward()`` and ``optimizer.step()`` are visible there (DESIGN.md section 5).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import inspect
import logging
import math
import os
import random
import re
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from trainer import dist
from trainer.accumulation import AccumulationSchedule, MicroBatch, StepNormaliser, micro_batches
from trainer.callback import Callback
from trainer.checkpoint import CheckpointIO
from trainer.data import AdaptedLoader, ResumableDistributedSampler, adapt_eval_loader, adapt_train_loader
from trainer.loggers import Logger, default_loggers
from trainer.metrics import MetricCollector
from trainer.module import DataModule, TaskModule
from trainer.optim import SchedulerConfig, parse_optimizers
from trainer.options import TrainerOptions, check_lightning_keywords
from trainer.precision import Precision
from trainer.preemption import PREEMPTED_EXIT_CODE, PreemptionWatcher
from trainer.rank_zero import configure_logging
from trainer.transfer import infer_batch_size, move_to_device
from trainer import watchdog as wd

log = logging.getLogger(__name__)


class _StepAdapter(nn.Module):
    """What DDP wraps: its ``forward`` is the task's ``training_step``, so DDP's gradient hooks see the
    parameters the step used, while the user's ``forward`` stays untouched (DESIGN.md section 3)."""

    def __init__(self, task: TaskModule) -> None:
        super().__init__()
        self.task = task

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return self.task.training_step(batch, batch_idx)


_DDP_BUFFER_SYNC_ARG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)

_OWNED_GROUP_EXIT_HOOK = False


def _destroy_owned_group_at_exit() -> None:
    global _OWNED_GROUP_EXIT_HOOK
    if not _OWNED_GROUP_EXIT_HOOK:
        atexit.register(_exit_teardown)
        _OWNED_GROUP_EXIT_HOOK = True


def _exit_teardown() -> None:
    """Destroy the group while the interpreter is fully alive, then collect the objects that still hold
    it (DDP reducers, pending work), so no backend thread outlives them into interpreter shutdown."""
    dist.destroy_process_group()
    gc.collect()


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's global generators (CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is optional
        pass


class Trainer:
    """Runs ``fit`` / ``validate`` / ``test`` / ``predict`` for a :class:`~trainer.TaskModule`.

    The same script runs as one process, under ``torchrun --nproc-per-node N`` (one or many nodes) and
    under ``srun``: the launcher is detected from the environment and the process group is created on
    the first call that needs it (nccl on CUDA, gloo on CPU). A group the Trainer created is destroyed
    when the interpreter exits, whether the script ends normally or with an exception (an atexit
    handler; a group the user created is left alone). It is not torn down when a loop raises, because
    re-creating the default group in the same process races with the old group's rendezvous keys: a
    caught exception leaves the group usable for the next ``fit``/``test`` call.

    Args:
        **options: see :class:`~trainer.options.TrainerOptions` and README "Trainer options". Invalid
            values raise ``ValueError`` naming the option, the value and the valid choices, before any
            process group exists.
    """

    def __init__(self, **options: Any) -> None:
        self.options = TrainerOptions.from_kwargs(options)
        opts = self.options
        self.env = dist.detect_env()
        check_lightning_keywords(opts, self.env)  # devices / num_nodes / strategy against the launcher
        configure_logging(self.env.rank)
        self.device = dist.select_device(opts.accelerator, self.env)  # type: ignore[arg-type]
        self._precision = Precision(opts.precision, self.device)
        self.callbacks: list[Callback] = self._check_callbacks(opts.callbacks)
        self.loggers: list[Logger] = default_loggers(opts.logger, opts.default_root_dir)
        if opts.enable_progress_bar and not any(getattr(cb, "is_progress_bar", False) for cb in self.callbacks):
            from trainer.progress import ProgressBar

            self.callbacks.append(ProgressBar())
        if opts.enable_checkpointing and not any(getattr(cb, "is_model_checkpoint", False) for cb in self.callbacks):
            from trainer.model_checkpoint import ModelCheckpoint

            self.callbacks.append(ModelCheckpoint())
        self._check_callbacks(self.callbacks)
        # Run state: the step clock, the epoch, the data cursor.
        self.global_step = 0
        self.current_epoch = 0
        self._epoch_batches_done = 0  # micro-batches of current_epoch already consumed (resume)
        self._epoch_samples = 0  # global sample cursor of current_epoch (all ranks together)
        self._epoch_finished = False  # True while on_train_epoch_end runs (a checkpoint then resumes next epoch)
        self.optimizer_stepped = False  # True during on_train_batch_end right after an optimizer step
        self._step_loss: torch.Tensor | None = None  # optimised loss of the last step (on device)
        self.should_stop = False
        self.state_stage: str | None = None
        self.sanity_checking = False
        self.task: TaskModule | None = None
        self.datamodule: DataModule | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self._params: list[torch.Tensor] = []
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self._model: nn.Module | None = None  # the adapter, or DDP(adapter)
        self._ddp: nn.parallel.DistributedDataParallel | None = None
        self._train: AdaptedLoader | None = None
        self.num_training_batches: int | None = None
        self.num_val_batches: list[int | None] = []  # per validation loader of the current fit
        self._metrics = MetricCollector()
        # k as a function of (epoch, global_step). Replace it (e.g. callbacks.GradientAccumulationScheduler
        # does in setup) to change accumulation; a change lands at the next optimizer-step boundary.
        self.accumulation_schedule = AccumulationSchedule(opts.accumulate_grad_batches)
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self._owns_group = False
        self._preemption = PreemptionWatcher()
        self._watchdog: wd.Watchdog | None = None
        self._manual = False  # task.automatic_optimization is False for this fit
        self._manual_sync = True  # manual_backward all-reduces on this micro-batch
        self._check_sharding = False
        self._checkpoint_io = CheckpointIO()
        self._logged_options = False

    # ------------------------------------------------------------------ public properties
    @property
    def global_rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def node_rank(self) -> int:
        return self.env.node_rank

    @property
    def is_global_zero(self) -> bool:
        return self.env.rank == 0

    @property
    def precision(self) -> str:
        return self.options.precision

    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str:
        """The run directory: the first logger's versioned folder, else ``default_root_dir``."""
        if self.loggers:
            return self.loggers[0].log_dir
        return self.options.default_root_dir or os.getcwd()

    @property
    def default_root_dir(self) -> str:
        return self.options.default_root_dir or os.getcwd()

    @property
    def max_epochs(self) -> int | None:
        return self.options.max_epochs

    @property
    def max_steps(self) -> int:
        return self.options.max_steps

    @property
    def accumulate_grad_batches(self) -> int:
        """Micro-batches of the current optimizer step: ``accumulation_schedule`` at the step clock."""
        return self.accumulation_schedule.k(epoch=self.current_epoch, global_step=self.global_step)

    @property
    def estimated_stepping_batches(self) -> int | float:
        """Optimizer steps this ``fit`` will take (for LR schedules), from ``max_steps``, ``max_epochs``, the
        training loader's length after ``limit_train_batches`` and the accumulation schedule. ``inf``
        when neither limit bounds it. Available from ``configure_optimizers`` on."""
        if self._train is None:
            raise RuntimeError("estimated_stepping_batches is known once fit() has its training dataloader.")
        opts = self.options
        max_steps = opts.max_steps if opts.max_steps != -1 else math.inf
        batches = self._limit(self._train.loader, opts.limit_train_batches, "limit_train_batches")
        epochs = 1 if opts.fast_dev_run else opts.max_epochs
        if batches is None or epochs in (None, -1):
            return max_steps
        total = 0
        for epoch in range(epochs):
            k = self.accumulation_schedule.k(epoch=epoch, global_step=total)
            total += batches // k if opts.drop_incomplete_accumulation else -(-batches // k)
            if total >= max_steps:
                return max_steps
        return total

    @property
    def checkpoint_callback(self) -> Callback | None:
        return next((cb for cb in self.callbacks if getattr(cb, "is_model_checkpoint", False)), None)

    @property
    def log_every_n_steps(self) -> int:
        return self.options.log_every_n_steps

    @property
    def is_logging_step(self) -> bool:
        """True during ``on_train_batch_end`` of a micro-batch that completed a logging step."""
        return self.optimizer_stepped and self._logging_due()

    def _logging_due(self) -> bool:
        return bool(self.options.fast_dev_run) or self.global_step % self.options.log_every_n_steps == 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Send host-side scalars (already agreed across ranks) to every logger; rank 0 writes.

        For callbacks that measure something themselves (learning rates, throughput). Values logged by
        the task go through ``self.log`` instead.
        """
        self.logged_metrics.update(metrics)
        if self.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics(dict(metrics), step=self.global_step if step is None else step)

    @property
    def lightning_module(self) -> TaskModule | None:
        return self.task

    @property
    def training(self) -> bool:
        return self.state_stage == "fit" and not self.sanity_checking

    # ------------------------------------------------------------------ public entry points
    def fit(
        self,
        model: TaskModule,
        train_dataloaders: Iterable | None = None,
        val_dataloaders: Iterable | Sequence[Iterable] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | None = None,
    ) -> None:
        """Train ``model`` (a TaskModule; Lightning's parameter name). ``ckpt_path`` resumes from a checkpoint
        file, or ``"last"`` / ``"best"``."""
        self._run("fit", model, datamodule, lambda: self._fit(train_dataloaders, val_dataloaders, ckpt_path),
                  loaders=(train_dataloaders, val_dataloaders))

    def validate(
        self,
        model: TaskModule | None = None,
        dataloaders: Iterable | Sequence[Iterable] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | None = None,
    ) -> list[dict[str, float]]:
        """Run the validation loop once. Returns one dict of epoch metrics per dataloader (reduced over
        all ranks: means weighted by batch size), the same on every rank."""
        return self._run("validate", model, datamodule, lambda: self._evaluate_stage("validate", dataloaders, ckpt_path),
                         loaders=(dataloaders,))

    def test(
        self,
        model: TaskModule | None = None,
        dataloaders: Iterable | Sequence[Iterable] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | None = None,
    ) -> list[dict[str, float]]:
        """Run the test loop once; returns metrics like :meth:`validate`."""
        return self._run("test", model, datamodule, lambda: self._evaluate_stage("test", dataloaders, ckpt_path),
                         loaders=(dataloaders,))

    def predict(
        self,
        model: TaskModule | None = None,
        dataloaders: Iterable | Sequence[Iterable] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | None = None,
    ) -> list[Any] | None:
        """Run ``predict_step`` over the data and return the per-batch outputs (moved to CPU) in dataset order.

        Each rank predicts a contiguous shard; the shards are gathered in rank order, so the list is in
        dataset order. With ``predict_return="all_ranks"`` (default) every rank returns the whole list;
        with ``"rank_zero"`` rank 0 returns it and other ranks return None. With several dataloaders the
        result is a list of such lists.
        """
        return self._run("predict", model, datamodule, lambda: self._predict(dataloaders, ckpt_path), loaders=(dataloaders,))

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write a checkpoint of the whole run state to ``path`` (rank 0 writes; all ranks must call).

        Raises:
            FloatingPointError: the weights hold NaN or inf; such a checkpoint is never written.
        """
        self._beat(wd.PHASE_CHECKPOINT)
        task = self.task
        if task is not None:
            params = [p.detach() for p in task.parameters()]
            if params and not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
                raise FloatingPointError(
                    f"Refusing to write checkpoint {os.fspath(path)!r} at step {self.global_step}: the weights hold "
                    "NaN or inf (a non-finite step got through). The last good checkpoint is kept."
                )
        state = self._checkpoint_state()
        self._checkpoint_io.save(state, path, is_writer=self.is_global_zero)
        dist.barrier(self.device)

    # ------------------------------------------------------------------ stage plumbing
    def _run(
        self,
        stage: str,
        task: TaskModule | None,
        datamodule: DataModule | None,
        body: Callable[[], Any],
        *,
        loaders: tuple[Any, ...],
    ) -> Any:
        if task is None:
            task = self.task
            if task is None:
                raise ValueError(f"Trainer.{stage}() needs a task: pass the TaskModule as the first argument.")
        if not isinstance(task, TaskModule):
            raise TypeError(f"Trainer.{stage}() expects a TaskModule, got {type(task).__name__}.")
        if datamodule is not None:
            if not isinstance(datamodule, DataModule):
                raise TypeError(f"datamodule must be a trainer.DataModule, got {type(datamodule).__name__}.")
            if any(loader is not None for loader in loaders):
                raise ValueError(
                    f"Trainer.{stage}(): pass either dataloaders or a datamodule, not both."
                )
        self._init_distributed()
        self.task, self.datamodule, self.state_stage = task, datamodule, stage
        task._trainer = self
        if datamodule is not None:
            datamodule._trainer = self
        self._metrics.reset()
        try:
            self._setup_stage(stage)
            self._start_watchdog()
            result = body()
        except BaseException as exc:
            for cb in self.callbacks:
                cb.on_exception(self, task, exc)
            self._teardown_stage(stage, failed=True)
            raise
        finally:
            self._stop_watchdog()
        self._teardown_stage(stage, failed=False)
        return result

    def _start_watchdog(self) -> None:
        """A daemon thread that dumps this rank's stacks and exits if no beat arrives in time
        (``watchdog_timeout``; default 600 s in a distributed run, off in a single process)."""
        timeout = self.options.watchdog_timeout
        if timeout is None and self.world_size > 1:
            timeout = min(600.0, self.options.process_group_timeout)
        if timeout is None:
            return
        self._watchdog = wd.Watchdog(timeout, run_dir=self.log_dir, rank=self.global_rank)
        self._watchdog.start()
        self._beat(wd.PHASE_SETUP)

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def _beat(self, phase: str) -> None:
        """Tell the watchdog which phase this rank enters (an attribute write)."""
        if self._watchdog is not None:
            self._watchdog.beat(phase, self.global_step)

    def _init_distributed(self) -> None:
        if not self.env.is_distributed or dist.is_initialized():
            if dist.is_initialized() and dist.get_world_size() != self.env.world_size:
                raise RuntimeError("A process group exists whose world size does not match the launcher's.")
            return
        timeout = datetime.timedelta(seconds=self.options.process_group_timeout)
        backend = dist.backend_for(self.device)
        if backend == "nccl":
            # NCCL's flight recorder on by default, so a collective timeout leaves a trace to read.
            for key, value in wd.nccl_flight_recorder_env_defaults(self.default_root_dir).items():
                os.environ.setdefault(key, value)
        self._owns_group = dist.init_process_group(
            self.env, backend=backend, timeout=timeout, device=self.device,
            init_timeout=datetime.timedelta(seconds=self.options.init_timeout),
        )
        if self._owns_group:
            _destroy_owned_group_at_exit()
        log.info(
            "Process group: backend=%s world_size=%d (launcher %s, %d node(s)).",
            backend, self.env.world_size, self.env.launcher,
            max(1, self.env.world_size // max(1, self.env.local_world_size)),
        )

    def _setup_stage(self, stage: str) -> None:
        opts = self.options
        task = self.task
        assert task is not None
        if not self._logged_options and self.is_global_zero:
            log.info("Trainer options: %s", self.options.resolved())
            self._logged_options = True
        if opts.seed is not None:
            seed_everything(opts.seed + self.global_rank)
        if opts.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        for logger in self.loggers:
            logger.resolve_version()  # rank 0 picks, all ranks agree (broadcast)
        if self.datamodule is not None:
            if self.env.local_rank == 0:
                self.datamodule.prepare_data()
            dist.barrier(self.device)
            self.datamodule.setup(stage)
        task.setup(stage)
        for cb in self.callbacks:
            cb.setup(self, task, stage)
        task.to(self.device)
        self._precision.convert_module(task)

    def _teardown_stage(self, stage: str, *, failed: bool) -> None:
        task = self.task
        assert task is not None
        errors: list[BaseException] = []
        for fn in [lambda: task.teardown(stage)] + [
            (lambda cb=cb: cb.teardown(self, task, stage)) for cb in self.callbacks
        ] + ([lambda: self.datamodule.teardown(stage)] if self.datamodule is not None else []):
            try:
                fn()
            except Exception as exc:  # keep tearing down; report the first error below
                errors.append(exc)
        if self.is_global_zero:
            for logger in self.loggers:
                logger.finalize("failed" if failed else "success")
        self._model = self._ddp = None
        self.state_stage = None
        if not failed:
            # Leave every stage together: no rank exits (and tears gloo down at interpreter exit) while a
            # peer is still inside the stage's last collective.
            dist.barrier(self.device)
        if errors and not failed:
            raise errors[0]

    def _check_callbacks(self, callbacks: Sequence[Any]) -> list[Callback]:
        keys: dict[str, Callback] = {}
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise ValueError(
                    f"Trainer option callbacks contains {cb!r} ({type(cb).__name__}); expected "
                    "callbacks.Callback instances."
                )
            if cb.state_dict():
                if cb.state_key in keys:
                    raise ValueError(
                        f"Two stateful callbacks share state_key {cb.state_key!r} ({type(keys[cb.state_key]).__name__} "
                        f"and {type(cb).__name__}); give each a distinct state_key."
                    )
                keys[cb.state_key] = cb
        return list(callbacks)

    # ------------------------------------------------------------------ data
    def _resolve_loaders(self, stage: str, given: Any) -> list[Any]:
        if given is None:
            source = self.datamodule if self.datamodule is not None else self.task
            given = {
                "train": source.train_dataloader,
                "validate": source.val_dataloader,
                "test": source.test_dataloader,
                "predict": source.predict_dataloader,
            }[stage]()
        if given is None:
            return []
        if isinstance(given, (list, tuple)):
            return list(given)
        return [given]

    def _limit(self, loader: Any, limit: int | float, name: str) -> int | None:
        """Number of batches to run from ``loader`` after ``limit_*_batches`` / ``fast_dev_run``."""
        fast = self.options.fast_dev_run
        if fast:
            limit = 1 if fast is True else int(fast)
        try:
            length = len(loader)
        except TypeError:
            length = None
        if isinstance(limit, int) and not isinstance(limit, bool):
            return limit if length is None else min(limit, length)
        if length is None:
            if limit == 1.0:
                return None
            raise ValueError(
                f"Trainer option {name}={limit} is a fraction, but the loader has no len(); pass an int "
                "number of batches instead."
            )
        return int(length * limit)

    # ------------------------------------------------------------------ fit
    def _fit(self, train_dataloaders: Any, val_dataloaders: Any, ckpt_path: str | None) -> None:
        task = self.task
        assert task is not None
        opts = self.options
        train_loaders = self._resolve_loaders("train", train_dataloaders)
        if len(train_loaders) != 1:
            raise ValueError(
                "Trainer.fit needs exactly one training dataloader (train_dataloaders=..., a datamodule, or "
                f"task.train_dataloader()); got {len(train_loaders)}."
            )
        self._train = adapt_train_loader(
            train_loaders[0], num_replicas=self.world_size, rank=self.global_rank, seed=opts.seed or 0
        )
        val_loaders = [
            adapt_eval_loader(loader, num_replicas=self.world_size, rank=self.global_rank, seed=opts.seed or 0)
            for loader in self._resolve_loaders("validate", val_dataloaders)
        ]
        self.num_val_batches = [self._limit(v.loader, opts.limit_val_batches, "limit_val_batches") for v in val_loaders]
        self._check_sharding = self.world_size > 1 and self._train.sampler is None
        self._configure_model_and_optimizers()
        self.global_step = self.current_epoch = self._epoch_batches_done = self._epoch_samples = 0
        self.should_stop = False
        if ckpt_path is not None:
            self._restore(ckpt_path, full=True)
        if self.is_global_zero:
            if opts.enable_model_summary and not any(getattr(cb, "is_model_summary", False) for cb in self.callbacks):
                params = list(task.parameters())
                total = sum(p.numel() for p in params)
                trainable = sum(p.numel() for p in params if p.requires_grad)
                size_mb = sum(p.numel() * p.element_size() for p in params) / 2**20
                log.info("%s: %s parameters (%s trainable), %.2f MB.", type(task).__name__, f"{total:,}",
                         f"{trainable:,}", size_mb)
            hparams: dict[str, Any] = {"trainer": self.options.resolved()}
            if task.hparams and task._log_hyperparams:
                hparams["task"] = dict(task.hparams)
            for logger in self.loggers:
                logger.log_hyperparams(hparams)
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
        self._preemption.install()
        try:
            while not self._done_training(max_epochs):
                self._train_epoch(val_loaders)
                if self.should_stop:
                    break
        finally:
            self._preemption.uninstall()
        task.on_train_end()
        for cb in self.callbacks:
            cb.on_train_end(self, task)
        task.on_fit_end()
        for cb in self.callbacks:
            cb.on_fit_end(self, task)

    def _done_training(self, max_epochs: int | None) -> bool:
        if self.options.max_steps != -1 and self.global_step >= self.options.max_steps:
            return True
        return max_epochs is not None and max_epochs != -1 and self.current_epoch >= max_epochs

    def _configure_model_and_optimizers(self) -> None:
        task = self.task
        assert task is not None
        opts = self.options
        if opts.sync_batchnorm and self.world_size > 1:
            converted = nn.SyncBatchNorm.convert_sync_batchnorm(task)
            if converted is not task:  # the task itself is never a BatchNorm layer
                raise TypeError("sync_batchnorm: the task itself must not be a BatchNorm layer.")
        self.optimizers, self.lr_scheduler_configs = parse_optimizers(task.configure_optimizers())
        adapter = _StepAdapter(task)
        self._manual = not task.automatic_optimization
        if self._manual and self.world_size > 1:
            # Manual optimization syncs gradients in manual_backward; start every rank from rank 0's state.
            for tensor in task.state_dict().values():
                dist.broadcast(tensor, 0)
            self._ddp, self._model = None, adapter
        elif self.world_size > 1:
            if not any(p.requires_grad for p in task.parameters()):
                raise ValueError(f"{type(task).__name__} has no trainable parameters; DDP has nothing to synchronise.")
            kwargs: dict[str, Any] = dict(
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=opts.find_unused_parameters,
                static_graph=opts.static_graph,
                gradient_as_bucket_view=opts.gradient_as_bucket_view,
            )
            # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (same meaning for True; False
            # still syncs once at construction, which keel wants anyway).
            kwargs[_DDP_BUFFER_SYNC_ARG] = opts.broadcast_buffers
            if opts.bucket_cap_mb is not None:
                kwargs["bucket_cap_mb"] = opts.bucket_cap_mb
            self._ddp = nn.parallel.DistributedDataParallel(adapter, **kwargs)
            self._model = self._ddp
        else:
            self._ddp = None
            self._model = adapter
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        # Every parameter the optimizers update (clipping and gradient rescaling act on these).
        self._params = [p for o in self.optimizers for group in o.param_groups for p in group["params"]]

    def _train_epoch(self, val_loaders: list[AdaptedLoader]) -> None:
        """One epoch: micro-batches grouped into optimizer steps, validation and logging on the step clock."""
        task, opts, train = self.task, self.options, self._train
        assert task is not None and train is not None and self._model is not None
        sampler = train.sampler if isinstance(train.sampler, ResumableDistributedSampler) else None
        if sampler is not None:
            sampler.set_epoch(self.current_epoch)  # also rewinds the cursor to 0
        # Whole-epoch length (before a resume cursor shortens the sampler), after limit_train_batches.
        num_batches = self._limit(train.loader, opts.limit_train_batches, "limit_train_batches")
        agree = None
        if self.world_size > 1 and sampler is None:
            # A loader keel does not shard may hold different amounts of data per rank: agree first.
            if num_batches is not None:
                num_batches = self._agree_on_batches(num_batches)
            else:
                agree = self._all_ranks_have_data
        start = self._epoch_batches_done
        if start and sampler is not None:
            sampler.set_cursor(self._epoch_samples)  # resume at the global sample cursor: nothing is re-read
        elif start:
            log.warning("Resuming mid-epoch with a loader keel cannot adapt (%s): the epoch restarts from its "
                        "first batch.", train.reason)
            start = self._epoch_batches_done = self._epoch_samples = 0
        self.num_training_batches = num_batches
        global_batch = (train.loader.batch_size or 0) * self.world_size if sampler is not None else 0
        task.train()
        self._metrics.stage = "train"
        task.on_train_epoch_start()
        for cb in self.callbacks:
            cb.on_train_epoch_start(self, task)
        normaliser = StepNormaliser(world_size=self.world_size, device=self.device)
        k_now = lambda: self.accumulate_grad_batches  # noqa: E731 - read at each window start
        completed = True  # False when training stops before the epoch's data is exhausted
        for micro in micro_batches(train.loader, start_idx=start, num_batches=num_batches, accumulate=k_now,
                                   drop_incomplete=opts.drop_incomplete_accumulation, agree=agree):
            if self._check_sharding:
                self._warn_if_unsharded(micro.batch)
            outputs = self._training_micro_batch(micro, normaliser)
            self._epoch_batches_done = micro.batch_idx + 1
            self._epoch_samples += global_batch
            stepped = False
            if micro.is_step_end:
                if opts.drop_incomplete_accumulation and micro.window_len is None and normaliser.ran < micro.accumulate:
                    for optimizer in self.optimizers:  # unknown-length epoch ended inside a window: discard it
                        optimizer.zero_grad(set_to_none=True)
                    normaliser.reset()
                elif self._manual:
                    # One training iteration (whatever number of optimizer calls) is one step.
                    self._precision.update()
                    self.global_step += 1
                    stepped = True
                else:
                    stepped = self._optimizer_step(normaliser)
            if stepped and self._logging_due():
                self._log_step_metrics()  # a logging step: the only place step metrics are read
            self.optimizer_stepped = stepped
            task.on_train_batch_end(outputs, micro.batch, micro.batch_idx)
            for cb in self.callbacks:
                cb.on_train_batch_end(self, task, outputs, micro.batch, micro.batch_idx)
            self.optimizer_stepped = False
            self._beat(wd.PHASE_DATA)  # next: fetching the next batch
            if stepped and val_loaders and self.val_check_due:
                self._evaluate("validate", val_loaders)
            if stepped and self._preemption_due():
                self._exit_preempted()
            # should_stop (callbacks) takes effect at an optimizer-step boundary, never inside a window.
            if (self.should_stop and micro.is_step_end) or self._done_training(None):
                completed = micro.is_epoch_end
                break
        self._epoch_end(val_loaders, completed=completed)

    @property
    def val_check_due(self) -> bool:
        """True right after an optimizer step at which ``val_check_interval`` schedules validation."""
        interval = self.options.val_check_interval
        return self.state_stage == "fit" and interval is not None and self.global_step % interval == 0

    def _preemption_due(self) -> bool:
        """Every step in one process; in DDP only where all ranks check together (see trainer/preemption.py)."""
        if self.world_size == 1:
            return self._preemption.requested
        interval = self.options.preemption_check_interval or self.options.log_every_n_steps
        if self.global_step % interval != 0:
            return False
        return self._preemption.agreed(self.device, world_size=self.world_size)

    def _exit_preempted(self) -> None:
        """Save at this step boundary and exit non-zero so the launcher restarts the job."""
        callback = self.checkpoint_callback
        if callback is not None:
            path = callback.save(self, suffix="-preempted", force=True)
        else:
            path = os.path.join(self.log_dir, "checkpoints", f"preempted-step={self.global_step}.ckpt")
            self.save_checkpoint(path)
        log.warning("Preempted (%s) at step %d: saved %s; exiting with code %d so the launcher restarts the "
                    "job (resume with ckpt_path='last').", self._preemption.signal_name or "signal on another rank",
                    self.global_step, path, PREEMPTED_EXIT_CODE)
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _agree_on_batches(self, num_batches: int) -> int:
        """One collective per epoch: every rank runs the same number of batches (uneven_batches)."""
        counts = torch.tensor([num_batches, -num_batches], device=self.device)
        dist.all_reduce(counts, "min")
        low, high = int(counts[0].item()), -int(counts[1].item())
        if low == high:
            return num_batches
        message = (f"Ranks have different numbers of training batches this epoch (min {low}, max {high}; this rank "
                   f"{num_batches}), from a loader keel does not shard.")
        if self.options.uneven_batches == "error":
            raise ValueError(message + " Pass a plain DataLoader so keel shards it evenly, or "
                             "uneven_batches='truncate'.")
        log.warning("%s Every rank runs %d (uneven_batches='truncate').", message, low)
        return low

    def _all_ranks_have_data(self, has_data: bool) -> bool:
        """Loader without len() in DDP: one tiny all-reduce per optimizer step (documented cost)."""
        flag = torch.tensor([1.0 if has_data else 0.0], device=self.device)
        dist.all_reduce(flag, "min")
        return bool(flag.item() > 0)

    def _warn_if_unsharded(self, batch: Any) -> None:
        """First batch of a fit from an unsharded loader in DDP: warn if every rank got the same one."""
        self._check_sharding = False
        tensors = [t for t in (batch if isinstance(batch, (list, tuple)) else [batch]) if isinstance(t, torch.Tensor)]
        fingerprint = hash(tuple(t.detach().cpu().contiguous().view(-1)[:4096].numpy().tobytes() for t in tensors))
        if len(set(dist.all_gather_object(fingerprint))) == 1:
            log.warning(
                "Every rank got the same first batch from %s: the data is probably not sharded by rank, so each "
                "rank trains on the same samples. Shard it (trainer.data.shard_iterable) or pass a plain "
                "DataLoader over a map-style dataset.", type(self._train.loader).__name__)

    def _training_micro_batch(self, micro: MicroBatch, normaliser: StepNormaliser) -> dict[str, Any]:
        """Forward and backward of one micro-batch. DDP's all-reduce runs only on the step's last one."""
        self._beat(wd.PHASE_TRAINING_STEP)
        batch = move_to_device(micro.batch, self.device, float_dtype=self._precision.param_dtype)
        micro.batch = batch
        self._metrics.batch_size = infer_batch_size(batch)
        task = self.task
        task.on_train_batch_start(batch, micro.batch_idx)
        for cb in self.callbacks:
            cb.on_train_batch_start(self, task, batch, micro.batch_idx)
        if self._manual:
            return self._manual_micro_batch(micro, batch, task)
        # no_sync on every micro-batch but the last of the step: forward AND backward inside it, so
        # gradients accumulate locally and DDP all-reduces once per optimizer step.
        sync = micro.is_step_end or self._ddp is None
        with (contextlib.nullcontext() if sync else self._ddp.no_sync()):
            with self._precision.autocast():
                try:
                    output = self._model(batch, micro.batch_idx)
                except RuntimeError as exc:
                    raise _explain_ddp_error(exc, self._model) from exc
            loss, outputs, num_items = _split_step_output(output)
            scaled = normaliser.scale(loss, num_items, micro)
            task.on_before_backward(scaled)
            for cb in self.callbacks:
                cb.on_before_backward(self, task, scaled)
            self._beat(wd.PHASE_BACKWARD)
            self._precision.backward(scaled)
            task.on_after_backward()
            for cb in self.callbacks:
                cb.on_after_backward(self, task)
        return outputs

    def _manual_micro_batch(self, micro: MicroBatch, batch: Any, task: TaskModule) -> dict[str, Any]:
        """Manual optimization: training_step does its own backward and steps; keel keeps the clock."""
        self._manual_sync = micro.is_step_end
        with self._precision.autocast():
            output = self._model(batch, micro.batch_idx)
        if isinstance(output, torch.Tensor):
            output = {"loss": output}
        outputs = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in (output or {}).items()}
        if isinstance(outputs.get("loss"), torch.Tensor):
            self._step_loss = outputs["loss"]
        return outputs

    def _manual_backward(self, loss: torch.Tensor) -> None:
        task = self.task
        task.on_before_backward(loss)
        for cb in self.callbacks:
            cb.on_before_backward(self, task, loss)
        self._beat(wd.PHASE_BACKWARD)
        self._precision.backward(loss)
        if self.world_size > 1 and self._manual_sync:
            # One all-reduce of all current gradients (flattened). Re-reducing a gradient that an earlier
            # manual_backward of this step already averaged is harmless: it is identical on every rank.
            grads = [p.grad for p in task.parameters() if p.grad is not None]
            if grads:
                flat = torch._utils._flatten_dense_tensors(grads)
                dist.all_reduce(flat, "mean")
                for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    grad.copy_(synced)
        task.on_after_backward()
        for cb in self.callbacks:
            cb.on_after_backward(self, task)

    def _manual_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        task = self.task
        self._precision.unscale(optimizer)
        task.on_before_optimizer_step(optimizer)
        for cb in self.callbacks:
            cb.on_before_optimizer_step(self, task, optimizer)
        self._clip([p for group in optimizer.param_groups for p in group["params"]])
        self._precision.optimizer_step(optimizer)

    def _clip(self, params: list[torch.Tensor]) -> None:
        """``gradient_clip_val`` by norm or value (foreach kernels; the norm stays on the device)."""
        value = self.options.gradient_clip_val
        if value is None:
            return
        if self.options.gradient_clip_algorithm == "norm":
            nn.utils.clip_grad_norm_(params, value, foreach=True)
        else:
            nn.utils.clip_grad_value_(params, value, foreach=True)

    def _optimizer_step(self, normaliser: StepNormaliser) -> bool:
        """Complete the step: normalise, unscale, hook, clip, step, schedule, zero. False if skipped."""
        opts = self.options
        self._beat(wd.PHASE_OPTIMIZER_STEP)
        grad_factor, step_loss, skip = normaliser.finish()
        normaliser.reset()
        if not skip and opts.on_nonfinite == "skip" and not self._step_loss_finite(step_loss):
            log.warning("Non-finite loss at step %d: the optimizer step is skipped on every rank (on_nonfinite='skip').",
                        self.global_step + 1)
            skip = True
        params = self._params
        if skip:
            if step_loss is None:
                log.warning("Step %d saw zero items (num_items) on every rank; the optimizer step is skipped.",
                            self.global_step)
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            return False
        for optimizer in self.optimizers:
            self._precision.unscale(optimizer)
        if grad_factor is not None:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, grad_factor)
        task = self.task
        for optimizer in self.optimizers:
            task.on_before_optimizer_step(optimizer)
            for cb in self.callbacks:
                cb.on_before_optimizer_step(self, task, optimizer)
        self._clip(params)
        for optimizer in self.optimizers:
            self._precision.optimizer_step(optimizer)
        self._precision.update()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self._step_schedulers("step", self.global_step)
        self._step_loss = step_loss
        return True

    def _step_loss_finite(self, step_loss: torch.Tensor | None) -> bool:
        """on_nonfinite='skip': one host read per step (and one all-reduce in DDP) so all ranks agree."""
        if step_loss is None:
            return True
        flag = torch.isfinite(step_loss).to(torch.float32).reshape(1)
        if self.world_size > 1:
            dist.all_reduce(flag, "min")
        return bool(flag.item() > 0)

    def _step_schedulers(self, interval: str, count: int) -> None:
        for config in self.lr_scheduler_configs:
            if config.interval != interval or count % config.frequency != 0:
                continue
            if config.monitor is not None:
                if config.monitor not in self.callback_metrics:
                    if not config.strict:
                        continue
                    raise KeyError(
                        f"lr_scheduler monitors {config.monitor!r}, which was not logged; available metrics: "
                        f"{sorted(self.callback_metrics)}."
                    )
                config.scheduler.step(float(self.callback_metrics[config.monitor]))
            else:
                config.scheduler.step()

    def _log_step_metrics(self) -> None:
        """Logging step: one host read and one collective for all step metrics (DESIGN.md section 11)."""
        if self._step_loss is not None:
            self._metrics.log("loss", self._step_loss, on_step=True, on_epoch=False, prog_bar=True, logger=False,
                              batch_size=None, reduce_fx="mean")
        if not self._metrics.has_step_metrics():
            return
        self._beat(wd.PHASE_METRICS_REDUCTION)
        values, to_logger, to_bar = self._metrics.reduce_step()
        self._publish(values, to_logger, to_bar)
        loss = values.get("loss")
        if loss is not None and not math.isfinite(loss) and self.options.on_nonfinite == "error":
            # The loss is reduced over ranks, so every rank raises here at the same step.
            raise FloatingPointError(
                f"Non-finite training loss ({loss}) at step {self.global_step} (checked on logging steps, every "
                f"{self.options.log_every_n_steps}): training stops on all ranks. Lower the learning rate, clip "
                "gradients (gradient_clip_val), check the data, or pass on_nonfinite='skip' to skip such steps."
            )

    def _publish(self, values: dict[str, float], to_logger: dict[str, float], to_bar: dict[str, float]) -> None:
        self.callback_metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()})
        self.progress_bar_metrics.update(to_bar)
        if to_logger and not self.sanity_checking:
            self.log_metrics(dict(to_logger, epoch=self.current_epoch))

    def _epoch_end(self, val_loaders: list[AdaptedLoader], *, completed: bool) -> None:
        """End of an epoch, or of training in the middle of one (``completed=False``: max_steps or
        should_stop). Then the epoch counter and the data cursor stay where they are, so a checkpoint
        written in ``on_train_epoch_end`` resumes at the right sample."""
        opts = self.options
        every = opts.check_val_every_n_epoch
        if val_loaders and opts.val_check_interval is None and every is not None and (
            not completed or (self.current_epoch + 1) % every == 0
        ):
            self._evaluate("validate", val_loaders)
        task = self.task
        self._epoch_finished = completed
        task.on_train_epoch_end()
        # Training metrics logged with on_epoch=True (and in the hook above), reduced over ranks.
        self._publish(*self._metrics.reduce_epoch())
        if completed and not self._manual:
            # Before the callbacks' hook, so a checkpoint saved there holds the stepped scheduler.
            self._step_schedulers("epoch", self.current_epoch + 1)
        for cb in self.callbacks:
            cb.on_train_epoch_end(self, task)
        self._epoch_finished = False
        if completed:
            self.current_epoch += 1
            self._epoch_batches_done = self._epoch_samples = 0

    # ------------------------------------------------------------------ evaluation
    def _evaluate_stage(self, stage: str, dataloaders: Any, ckpt_path: str | None) -> list[dict[str, float]]:
        loaders = [
            adapt_eval_loader(loader, num_replicas=self.world_size, rank=self.global_rank, seed=self.options.seed or 0)
            for loader in self._resolve_loaders(stage, dataloaders)
        ]
        if not loaders:
            raise ValueError(f"Trainer.{stage}() found no dataloader: pass dataloaders=..., a datamodule, or implement "
                             f"task.{'val' if stage == 'validate' else stage}_dataloader().")
        if ckpt_path is not None:
            self._restore(ckpt_path, full=False)
        return self._evaluate(stage, loaders)

    def _evaluate(self, stage: str, loaders: list[AdaptedLoader], *, limit_override: int | None = None) -> list[dict[str, float]]:
        """Validation or test loop. Ranks may run different batch counts: nothing here is collective until
        the epoch-end reduction, which all ranks reach once per loader."""
        task = self.task
        assert task is not None
        validating = stage == "validate"
        was_training = task.training
        task.eval()
        self._metrics.stage = stage
        limit_name = "limit_val_batches" if validating else "limit_test_batches"
        results: list[dict[str, float]] = []
        if validating:
            task.on_validation_epoch_start()
            for cb in self.callbacks:
                cb.on_validation_epoch_start(self, task)
        else:
            task.on_test_epoch_start()
            for cb in self.callbacks:
                cb.on_test_epoch_start(self, task)
        step = task.validation_step if validating else task.test_step
        many = len(loaders) > 1
        with torch.no_grad():
            for loader_idx, adapted in enumerate(loaders):
                limit = limit_override if limit_override is not None else self._limit(
                    adapted.loader, getattr(self.options, limit_name), limit_name)
                for batch_idx, batch in enumerate(adapted.loader):
                    if limit is not None and batch_idx >= limit:
                        break
                    self._beat(wd.PHASE_VALIDATION_STEP if validating else wd.PHASE_TEST_STEP)
                    batch = move_to_device(batch, self.device, float_dtype=self._precision.param_dtype)
                    self._metrics.batch_size = infer_batch_size(batch)
                    with self._precision.autocast():
                        outputs = step(batch, batch_idx, loader_idx) if many else step(batch, batch_idx)
                    if validating:
                        task.on_validation_batch_end(outputs, batch, batch_idx, loader_idx)
                        for cb in self.callbacks:
                            cb.on_validation_batch_end(self, task, outputs, batch, batch_idx, loader_idx)
                    else:
                        task.on_test_batch_end(outputs, batch, batch_idx, loader_idx)
                        for cb in self.callbacks:
                            cb.on_test_batch_end(self, task, outputs, batch, batch_idx, loader_idx)
                if loader_idx < len(loaders) - 1:
                    results.append(self._reduce_eval(loader_idx, len(loaders)))
        # The task's epoch-end hook may still log; callbacks then see the reduced epoch metrics.
        if validating:
            task.on_validation_epoch_end()
            results.append(self._reduce_eval(len(loaders) - 1, len(loaders)))
            for cb in self.callbacks:
                cb.on_validation_epoch_end(self, task)
        else:
            task.on_test_epoch_end()
            results.append(self._reduce_eval(len(loaders) - 1, len(loaders)))
            for cb in self.callbacks:
                cb.on_test_epoch_end(self, task)
        if was_training:
            task.train()
            self._metrics.stage = "train"
        return results

    def _reduce_eval(self, loader_idx: int, num_loaders: int) -> dict[str, float]:
        values, to_logger, to_bar = self._metrics.reduce_epoch()
        if num_loaders > 1:
            suffix = f"/dataloader_idx_{loader_idx}"
            values, to_logger, to_bar = ({k + suffix: v for k, v in d.items()} for d in (values, to_logger, to_bar))
        if not self.sanity_checking:
            self._publish(values, to_logger, to_bar)
        return values

    def _predict(self, dataloaders: Any, ckpt_path: str | None) -> list[Any] | None:
        task = self.task
        assert task is not None
        loaders = [
            adapt_eval_loader(loader, num_replicas=self.world_size, rank=self.global_rank, seed=self.options.seed or 0)
            for loader in self._resolve_loaders("predict", dataloaders)
        ]
        if not loaders:
            raise ValueError("Trainer.predict() found no dataloader: pass dataloaders=..., a datamodule, or "
                             "implement task.predict_dataloader().")
        if ckpt_path is not None:
            self._restore(ckpt_path, full=False)
        task.eval()
        self._metrics.stage = "predict"
        results: list[list[Any] | None] = []
        with torch.no_grad():
            for loader_idx, adapted in enumerate(loaders):
                limit = self._limit(adapted.loader, self.options.limit_predict_batches, "limit_predict_batches")
                local: list[Any] = []
                for batch_idx, batch in enumerate(adapted.loader):
                    if limit is not None and batch_idx >= limit:
                        break
                    batch = move_to_device(batch, self.device, float_dtype=self._precision.param_dtype)
                    with self._precision.autocast():
                        out = task.predict_step(batch, batch_idx) if len(loaders) == 1 else task.predict_step(batch, batch_idx, loader_idx)
                    local.append(move_to_device(out, torch.device("cpu")))
                gathered = dist.all_gather_object(local) if self.world_size > 1 else [local]
                merged = [item for rank_items in gathered for item in rank_items]
                results.append(merged if (self.is_global_zero or self.options.predict_return == "all_ranks") else None)
        for cb in self.callbacks:
            cb.on_predict_epoch_end(self, task)
        return results[0] if len(results) == 1 else results

    # ------------------------------------------------------------------ checkpoint state
    def _checkpoint_state(self) -> dict[str, Any]:
        from trainer import checkpoint as ckpt

        return ckpt.assemble(self)

    def _restore(self, ckpt_path: str, *, full: bool) -> None:
        from trainer import checkpoint as ckpt

        ckpt.restore(self, ckpt_path, full=full)



def _split_step_output(output: Any) -> tuple[torch.Tensor, dict[str, Any], Any]:
    """``(loss, detached outputs for callbacks, num_items)`` from what ``training_step`` returned."""
    if isinstance(output, torch.Tensor):
        loss, extras, num_items = output, {}, None
    elif isinstance(output, dict):
        if "loss" not in output:
            raise ValueError(
                f"training_step returned a dict without 'loss' (keys: {sorted(output)}); include the loss tensor."
            )
        loss, num_items = output["loss"], output.get("num_items")
        extras = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in output.items() if k not in ("loss",)}
    else:
        raise ValueError(
            f"training_step returned {type(output).__name__}; return a scalar loss tensor or a dict with 'loss'."
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"training_step's loss must be a scalar tensor; got "
            f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}."
        )
    if not loss.requires_grad:
        raise ValueError("training_step's loss does not require grad: it was computed without the task's parameters "
                         "(or under torch.no_grad()).")
    return (loss if loss.dim() == 0 else loss.reshape(())), dict(extras, loss=loss.detach()), num_items


_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def _explain_ddp_error(exc: RuntimeError, model: nn.Module) -> RuntimeError:
    """DDP's unused-parameter error, re-raised with the parameter names and the option that fixes it."""
    text = str(exc)
    if "Expected to have finished reduction in the prior iteration" not in text:
        return exc
    names = [name.removeprefix("module.task.") for name, p in model.named_parameters() if p.requires_grad]
    match = _UNUSED_INDICES.search(text)
    unused = [names[int(i)] for i in match.group(2).split()] if match else []
    listed = ", ".join(unused) if unused else "(run with TORCH_DISTRIBUTED_DEBUG=INFO to list them)"
    return RuntimeError(
        f"DDP: some parameters got no gradient in the previous step: {listed}. Make every parameter take part "
        "in the loss, freeze unused ones (requires_grad=False), or pass Trainer(find_unused_parameters=True) "
        "(or static_graph=True when the unused set never changes)."
    )
