"""Lightning's module tree, as keel fills it: which of Lightning's public names keel has in each module (and the
keel object behind each), and, for every other public name and module, what to use instead.

Paths are Lightning's, relative to ``lightning.pytorch`` (``"callbacks.model_checkpoint"``); ``fabric`` and ``data``
are ``lightning.fabric`` and ``lightning.data``. The top of the tree (``lightning``, ``lightning.pytorch``) is the
``callbacks.lightning`` package itself. tests/fixtures/lightning_public_names.txt lists Lightning 2.6.6's public
names; tests/unit/test_lightning_imports.py checks that each one either resolves here or has its message below.
"""

from __future__ import annotations

# Lightning's name -> keel's object, as "module:attribute" (imported on first use: callbacks.lightning_cli, for
# one, is imported only when a program asks for the CLI). A target that does not exist counts as lacking.
TARGETS: dict[str, str] = {
    # the core
    "LightningModule": "trainer.module:TaskModule",
    "LightningDataModule": "trainer.module:DataModule",
    "DataHooks": "trainer.module:DataHooks",
    "HyperparametersMixin": "trainer.module:HyperparametersMixin",
    "AttributeDict": "trainer.module:AttributeDict",
    "Trainer": "callbacks.lightning:Trainer",
    "seed_everything": "trainer.lifecycle:seed_everything",
    # callbacks
    "Callback": "trainer.callback:Callback",
    "ModelCheckpoint": "callbacks.lightning:ModelCheckpoint",
    "EarlyStopping": "callbacks.early_stopping:EarlyStopping",
    "LearningRateMonitor": "callbacks.lr_monitor:LearningRateMonitor",
    "ModelSummary": "callbacks.model_summary:ModelSummary",
    "RichModelSummary": "callbacks.lightning:RichModelSummary",
    "ProgressBar": "trainer.observability.progress:ProgressBar",
    "TQDMProgressBar": "trainer.observability.progress:ProgressBar",
    "RichProgressBar": "callbacks.lightning:RichProgressBar",
    "Timer": "callbacks.timer:Timer",
    "LambdaCallback": "callbacks.lambda_function:LambdaCallback",
    "ThroughputMonitor": "callbacks.throughput:ThroughputMonitor",
    "GradientAccumulationScheduler": "callbacks.gradient_accumulation:GradientAccumulationScheduler",
    "BaseFinetuning": "callbacks.finetuning:BaseFinetuning",
    "BackboneFinetuning": "callbacks.finetuning:BackboneFinetuning",
    "multiplicative": "callbacks.finetuning:multiplicative",
    "StochasticWeightAveraging": "callbacks.weight_averaging:StochasticWeightAveraging",
    "WeightAveraging": "callbacks.weight_averaging:WeightAveraging",
    "EMAWeightAveraging": "callbacks.weight_averaging:EMAWeightAveraging",
    # the tuner
    "Tuner": "callbacks.tuner:Tuner",
    "BasePredictionWriter": "callbacks.prediction_writer:BasePredictionWriter",
    "WriteInterval": "callbacks.prediction_writer:WriteInterval",
    # loggers
    "Logger": "trainer.loggers:Logger",
    "CSVLogger": "callbacks.lightning:CSVLogger",
    "TensorBoardLogger": "callbacks.lightning:TensorBoardLogger",
    "WandbLogger": "trainer.loggers:WandbLogger",
    "MLFlowLogger": "trainer.loggers:MLFlowLogger",
    "rank_zero_experiment": "callbacks.lightning._extras:rank_zero_experiment",
    # strategies
    "Strategy": "trainer.distributed.strategy:Strategy",
    "SingleDeviceStrategy": "callbacks.lightning._strategies:SingleDeviceStrategy",
    "DDPStrategy": "callbacks.lightning._strategies:DDPStrategy",
    "FSDPStrategy": "callbacks.lightning._strategies:FSDPStrategy",
    "ModelParallelStrategy": "callbacks.lightning._strategies:ModelParallelStrategy",
    "ParallelStrategy": "callbacks.lightning:ParallelStrategy",
    # profilers
    "Profiler": "trainer.observability.profiler:Profiler",
    "PassThroughProfiler": "trainer.observability.profiler:PassThroughProfiler",
    "SimpleProfiler": "trainer.observability.profiler:SimpleProfiler",
    "PyTorchProfiler": "trainer.observability.profiler:PyTorchProfiler",
    # the command line (callbacks/lightning_cli.py)
    **{
        name: f"callbacks.lightning_cli:{name}"
        for name in (
            "LightningCLI",
            "LightningArgumentParser",
            "SaveConfigCallback",
            "ArgsType",
            "LRSchedulerCallable",
            "OptimizerCallable",
            "ReduceLROnPlateau",
            "instantiate_class",
            "instantiate_module",
        )
    },
    # utilities
    "rank_zero_only": "trainer.observability.rank_zero:rank_zero_only",
    "rank_zero_info": "trainer.observability.rank_zero:rank_zero_info",
    "rank_zero_warn": "trainer.observability.rank_zero:rank_zero_warn",
    "rank_zero_debug": "trainer.observability.rank_zero:rank_zero_debug",
    **{
        name: f"callbacks.lightning._extras:{name}"
        for name in (
            "grad_norm",
            "MisconfigurationException",
            "PossibleUserWarning",
            "STEP_OUTPUT",
            "TRAIN_DATALOADERS",
            "EVAL_DATALOADERS",
            "LRSchedulerTypeUnion",
            "LRSchedulerType",
            "LRSchedulerPLType",
            "LRSchedulerConfigType",
            "OptimizerConfig",
            "OptimizerLRSchedulerConfig",
            "OptimizerLRScheduler",
            "MODULE_OPTIMIZERS",
            "is_overridden",
            "get_torchvision_model",
        )
    },
}

_RANK_ZERO = ("rank_zero_only", "rank_zero_info", "rank_zero_warn", "rank_zero_debug")
_TYPES = (
    "STEP_OUTPUT",
    "TRAIN_DATALOADERS",
    "EVAL_DATALOADERS",
    "LRSchedulerTypeUnion",
    "LRSchedulerType",
    "LRSchedulerPLType",
    "LRSchedulerConfigType",
    "OptimizerConfig",
    "OptimizerLRSchedulerConfig",
    "OptimizerLRScheduler",
)

# Lightning's module -> the names keel has there (each a TARGETS key).
PROVIDED: dict[str, tuple[str, ...]] = {
    "callbacks": (
        "Callback",
        "ModelCheckpoint",
        "EarlyStopping",
        "LearningRateMonitor",
        "ModelSummary",
        "RichModelSummary",
        "ProgressBar",
        "TQDMProgressBar",
        "RichProgressBar",
        "Timer",
        "LambdaCallback",
        "ThroughputMonitor",
        "GradientAccumulationScheduler",
        "BaseFinetuning",
        "BackboneFinetuning",
        "StochasticWeightAveraging",
        "WeightAveraging",
        "EMAWeightAveraging",
        "BasePredictionWriter",
    ),
    "callbacks.callback": ("Callback",),
    "callbacks.early_stopping": ("EarlyStopping",),
    "callbacks.finetuning": ("BaseFinetuning", "BackboneFinetuning", "multiplicative"),
    "callbacks.gradient_accumulation_scheduler": ("GradientAccumulationScheduler",),
    "callbacks.lambda_function": ("LambdaCallback",),
    "callbacks.lr_monitor": ("LearningRateMonitor",),
    "callbacks.model_checkpoint": ("ModelCheckpoint",),
    "callbacks.model_summary": ("ModelSummary",),
    "callbacks.prediction_writer": ("BasePredictionWriter", "WriteInterval"),
    "callbacks.progress": ("ProgressBar", "RichProgressBar", "TQDMProgressBar"),
    "callbacks.progress.progress_bar": ("ProgressBar",),
    "callbacks.progress.rich_progress": ("RichProgressBar",),
    "callbacks.progress.tqdm_progress": ("TQDMProgressBar",),
    "callbacks.rich_model_summary": ("RichModelSummary",),
    "callbacks.stochastic_weight_avg": ("StochasticWeightAveraging",),
    "callbacks.throughput_monitor": ("ThroughputMonitor",),
    "callbacks.timer": ("Timer",),
    "callbacks.weight_averaging": ("WeightAveraging", "EMAWeightAveraging"),
    "cli": (
        "LightningCLI",
        "LightningArgumentParser",
        "SaveConfigCallback",
        "ArgsType",
        "LRSchedulerCallable",
        "OptimizerCallable",
        "ReduceLROnPlateau",
        "instantiate_class",
        "instantiate_module",
        "LRSchedulerType",
        "LRSchedulerTypeUnion",
    ),
    "core": ("LightningModule", "LightningDataModule"),
    "core.datamodule": ("LightningDataModule",),
    "core.hooks": ("DataHooks",),
    "core.mixins": ("HyperparametersMixin",),
    "core.mixins.hparams_mixin": ("HyperparametersMixin",),
    "core.module": ("LightningModule", "MODULE_OPTIMIZERS"),
    "fabric": ("seed_everything",),
    "loggers": ("Logger", "CSVLogger", "TensorBoardLogger", "WandbLogger", "MLFlowLogger"),
    "loggers.csv_logs": ("CSVLogger",),
    "loggers.logger": ("Logger", "rank_zero_experiment"),
    "loggers.mlflow": ("MLFlowLogger",),
    "loggers.tensorboard": ("TensorBoardLogger",),
    "loggers.wandb": ("WandbLogger",),
    "profilers": ("Profiler", "PassThroughProfiler", "SimpleProfiler", "PyTorchProfiler"),
    "profilers.base": ("PassThroughProfiler",),
    "profilers.profiler": ("Profiler",),
    "profilers.pytorch": ("PyTorchProfiler",),
    "profilers.simple": ("SimpleProfiler",),
    "strategies": (
        "Strategy",
        "SingleDeviceStrategy",
        "DDPStrategy",
        "FSDPStrategy",
        "ModelParallelStrategy",
        "ParallelStrategy",
    ),
    "strategies.ddp": ("DDPStrategy",),
    "strategies.fsdp": ("FSDPStrategy",),
    "strategies.model_parallel": ("ModelParallelStrategy",),
    "strategies.parallel": ("ParallelStrategy",),
    "strategies.single_device": ("SingleDeviceStrategy",),
    "strategies.strategy": ("Strategy",),
    "trainer": ("Trainer", "seed_everything"),
    "trainer.trainer": ("Trainer",),
    "tuner": ("Tuner",),
    "tuner.batch_size_scaling": (),  # Lightning's modules of private helpers: importable, nothing public in them
    "tuner.lr_finder": (),
    "tuner.tuning": ("Tuner",),
    "utilities": (*_RANK_ZERO, "AttributeDict", "grad_norm"),
    "utilities.exceptions": ("MisconfigurationException",),
    "utilities.grads": ("grad_norm",),
    "utilities.model_helpers": ("is_overridden", "get_torchvision_model"),
    "utilities.parsing": ("AttributeDict",),
    "utilities.rank_zero": _RANK_ZERO,
    "utilities.types": _TYPES,
    "utilities.warnings": ("PossibleUserWarning",),
}

# ------------------------------------------------------------------ what keel lacks, and what to use instead
_TUNER = (
    "keel runs the searches before `fit`, not as callbacks inside it: `Tuner(trainer).lr_find(model, ...)` / "
    "`.scale_batch_size(model, ...)` (`callbacks.lightning.pytorch.tuner`), then `trainer.fit(model, ...)`."
)
_XLA = "keel runs on CPU and CUDA only."
_PARALLEL = (
    "keel runs DDP, FSDP2 and FSDP2 x tensor parallelism: `Trainer(strategy='ddp')`, `strategy='fsdp'` or "
    "`ModelParallelStrategy` (docs/fsdp.md)."
)
_LOGGERS = (
    "keel's loggers are `TensorBoardLogger`, `CSVLogger`, `WandbLogger` and `MLFlowLogger`; for another tracker, "
    "subclass `trainer.loggers.Logger` (`log_metrics`, `log_hyperparams`)."
)
_HOOKS = "keel's hooks are methods of `LightningModule` (`trainer.TaskModule`) and `Callback`: override them there."
_INTERNAL = (
    "it is one of Lightning's internal helpers, which keel does not copy: write the few lines with torch or the "
    "standard library."
)
_WARNINGS = "keel warns with Python's own categories (`UserWarning`, `DeprecationWarning`): filter those."
_COMBINED = (
    "`validate` / `test` / `predict` take a list of loaders (`dataloader_idx` tells them apart); `fit` takes one "
    "training loader: combine datasets in one loader."
)
_FABRIC = "write the loop with torch and `trainer.distributed.comm` (collectives), or use `Trainer`."

# Lightning's name (or "<module>.<name>" where the name alone is ambiguous) -> what to use instead. Names in a
# module keel lacks entirely are covered by that module's entry in LACKING_MODULES.
LACKING: dict[str, str] = {
    # lightning / lightning.fabric
    "Fabric": _FABRIC,
    "LightningLite": _FABRIC,
    "is_wrapped": "without Fabric nothing is wrapped by it; `trainer.model` is always the task itself.",
    # callbacks
    "BatchSizeFinder": _TUNER,
    "LearningRateFinder": _TUNER,
    "ModelPruning": "use `torch.nn.utils.prune` in your task's hooks.",
    "Checkpoint": "keel's checkpoint callback is `ModelCheckpoint` (`callbacks.lightning.ModelCheckpoint`): "
    "subclass it, or `Callback`.",
    "OnExceptionCheckpoint": "keel's saves are atomic, so the newest committed one is always intact: resume from it "
    "with `ckpt_path='last'`; on SIGTERM / SIGUSR1 keel saves and exits at a step boundary (docs/elastic.md).",
    "DeviceStatsMonitor": "log `torch.cuda.memory_allocated()` / `torch.cuda.memory_stats()` yourself, or use "
    "`callbacks.ThroughputMonitor`.",
    "SpikeDetection": "`Trainer(on_nonfinite='skip')` skips a step with a NaN/inf loss; compare the loss with its "
    "recent values in `on_train_batch_end` for other spikes.",
    "EarlyStoppingReason": "`EarlyStopping.stopping_reason` is the reason as a message (None while training goes on).",
    "get_standard_metrics": "`trainer.progress_bar_metrics` holds what the bar shows.",
    "RichProgressBarTheme": "keel draws its tqdm bar: `RichProgressBar(theme=...)` accepts and ignores a theme, so "
    "leave it out.",
    "Tqdm": "keel's bar is `TQDMProgressBar` (`trainer.observability.progress.ProgressBar`): subclass that.",
    "convert_inf": "keel's bar is `TQDMProgressBar` (`trainer.observability.progress.ProgressBar`): subclass that.",
    "Interval": "`Timer(interval=...)` takes the strings `'step'` or `'epoch'`.",
    # cli: what callbacks/lightning_cli.py does not define
    "instantiate_module": "build the object yourself, or give its `class_path` in the config for `LightningCLI`.",
    "ArgsType": "annotate with `list[str] | dict | None`.",
    "LRSchedulerCallable": "annotate with `Callable[[Optimizer], LRScheduler]`.",
    "OptimizerCallable": "annotate with `Callable[[Iterable], Optimizer]`.",
    "ReduceLROnPlateau": "use `torch.optim.lr_scheduler.ReduceLROnPlateau` and return its monitor from "
    "`configure_optimizers`.",
    "instantiate_class": "build the object yourself (`class_path` and `init_args` are jsonargparse's).",
    # core
    "ModelHooks": _HOOKS,
    "CheckpointHooks": _HOOKS,
    # loggers
    "CometLogger": _LOGGERS,
    "LitLogger": _LOGGERS,
    "NeptuneLogger": _LOGGERS,
    "ExperimentWriter": "`CSVLogger` writes `log_dir/metrics.csv` itself; subclass `CSVLogger` to change that.",
    "DummyLogger": "pass `logger=False`.",
    "merge_dicts": _INTERNAL,
    # profilers
    "AdvancedProfiler": "keel's profilers are `'simple'` and `'pytorch'` (`Trainer(profiler=...)`); run cProfile "
    "around `trainer.fit` for Python-level detail.",
    "XLAProfiler": _XLA,
    "RegisterRecordFunction": "`PyTorchProfiler` records keel's loop phases; wrap your own code in "
    "`torch.profiler.record_function`.",
    "ScheduleWrapper": "pass `torch.profiler.schedule(...)` as `PyTorchProfiler(schedule=...)`.",
    # strategies
    "DeepSpeedStrategy": _PARALLEL,
    "XLAStrategy": _XLA,
    "SingleDeviceXLAStrategy": _XLA,
    # utilities
    "CombinedLoader": _COMBINED,
    "GradClipAlgorithmType": "pass `gradient_clip_algorithm='norm'` or `'value'` as a string.",
    "LightningEnum": "use `enum.Enum` (or plain strings, as keel's options take).",
    "disable_possible_user_warnings": _WARNINGS,
    "LightningDeprecationWarning": _WARNINGS,
    "rank_zero_deprecation": "call `rank_zero_warn(message, DeprecationWarning)`.",
    "rank_prefixed_message": "keel's log lines carry their rank already (`[rank N]`).",
    "WarningCache": "Python's warnings show once per call site by default: call `rank_zero_warn`.",
    "rank_zero_module": "keel logs through the `trainer` logger: `logging.getLogger('trainer')`.",
    "find_shared_parameters": _INTERNAL,
    "set_shared_parameters": _INTERNAL,
    "is_picklable": _INTERNAL,
    "is_shared_filesystem": "keel checks the save folder itself: a save that rank 0 cannot see whole fails, naming "
    "the files (docs/checkpoints.md).",
    "measure_flops": "use `torch.utils.flop_counter.FlopCounterMode`.",
    "move_data_to_device": "keel moves each batch to the device before the step; elsewhere use `tensor.to(device)`.",
    "suggested_max_num_workers": "pick `num_workers` from `os.sched_getaffinity(0)` and the processes per node.",
    "SIGTERMException": "on SIGTERM keel saves a checkpoint at a step boundary and exits with its own exit code "
    "(docs/elastic.md); nothing is raised in your code.",
    "DistributedDataParallel": "use `torch.nn.parallel.DistributedDataParallel` (keel's DDP wrapper stays internal: "
    "`trainer.model` is the task).",
    "LRSchedulerConfig": "`trainer.lr_scheduler_configs` holds keel's configs (`scheduler`, `interval`, `frequency`, "
    "`monitor`).",
    **dict.fromkeys(
        (
            "clean_namespace",
            "collect_init_args",
            "get_init_args",
            "lightning_getattr",
            "lightning_hasattr",
            "lightning_setattr",
            "parse_class_init_keys",
        ),
        _INTERNAL,
    ),
    "save_hyperparameters": "call `self.save_hyperparameters()` in your `LightningModule`'s `__init__`.",
}

# Lightning's modules keel has nothing of (every module under one, too), and what to use instead.
LACKING_MODULES: dict[str, str] = {
    "data": "`lightning.data` is litdata's: use torch `DataLoader`s (keel shards and resumes them itself).",
    "accelerators": "keel chooses the device itself: `Trainer(accelerator=...)` with `'cpu'`, `'cuda'` or `'auto'`, "
    "one process per device started by torchrun or SLURM (`CUDA_VISIBLE_DEVICES` selects the GPUs).",
    "plugins": "there is no plugin system: precision is `Trainer(precision=...)` (`'32'`, `'64'`, `'bf16-mixed'`, "
    "`'16-mixed'`), the cluster environment is read from torchrun / SLURM, checkpoint I/O is keel's own, "
    "SyncBatchNorm is `Trainer(sync_batchnorm=True)`.",
    "loops": "keel's loops are internal: change what they do through the task's hooks and callbacks.",
    "serve": "there is no model serving: load the weights with `LightningModule.load_from_checkpoint` and serve the "
    "module with your own code.",
    "demos": "no demo models or datasets ship with keel: use your own module and data.",
    "callbacks.batch_size_finder": LACKING["BatchSizeFinder"],
    "callbacks.checkpoint": LACKING["Checkpoint"],
    "callbacks.device_stats_monitor": LACKING["DeviceStatsMonitor"],
    "callbacks.lr_finder": LACKING["LearningRateFinder"],
    "callbacks.on_exception_checkpoint": LACKING["OnExceptionCheckpoint"],
    "callbacks.pruning": LACKING["ModelPruning"],
    "callbacks.spike": LACKING["SpikeDetection"],
    "core.optimizer": "`self.optimizers()` returns keel's thin wrapper of each torch optimizer (`step()`, "
    "`zero_grad()`; `.optimizer` is the torch one); there is no closure to pass.",
    "core.saving": "hyperparameters are saved in every checkpoint (`hyper_parameters`) and by `CSVLogger` "
    "(`hparams.yaml`); read them back with `LightningModule.load_from_checkpoint`.",
    "loggers.comet": _LOGGERS,
    "loggers.litlogger": _LOGGERS,
    "loggers.neptune": _LOGGERS,
    "loggers.utilities": _INTERNAL,
    "profilers.advanced": LACKING["AdvancedProfiler"],
    "profilers.xla": _XLA,
    "strategies.deepspeed": _PARALLEL,
    "strategies.single_xla": _XLA,
    "strategies.xla": _XLA,
    "trainer.states": "keel's `Trainer` has `state_stage` (`'fit'`, `'validate'`, `'test'`, `'predict'` or None) "
    "and the flags `training`, `validating`, `testing`, `predicting`, `sanity_checking`.",
    **dict.fromkeys(
        (
            "utilities.argparse",
            "utilities.compile",
            "utilities.data",
            "utilities.imports",
            "utilities.memory",
            "utilities.parameter_tying",
            "utilities.signature_utils",
        ),
        _INTERNAL,
    ),
    "utilities.combined_loader": _COMBINED,
    "utilities.deepspeed": _PARALLEL,
    "utilities.enums": LACKING["GradClipAlgorithmType"],
    "utilities.model_registry": "upload the checkpoints that `ModelCheckpoint` writes with your registry's client.",
    "utilities.model_summary": "`callbacks.lightning.ModelSummary` (the callback) logs keel's summary table.",
    "utilities.seed": "use `torch.random.fork_rng()` to isolate the generators; seed with `seed_everything`.",
}


def lightning_name(path: str, name: str = "") -> str:
    """``path`` (and ``name`` in it) as a Lightning program spells it: ``lightning.pytorch.callbacks.X``."""
    base = "lightning" if path.split(".")[0] in ("fabric", "data") else "lightning.pytorch"
    return ".".join(part for part in (base, path, name) if part)


def lacking_module(path: str) -> str | None:
    """What to use instead of Lightning's module ``path`` when keel has nothing of it (it or a parent listed)."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        hint = LACKING_MODULES.get(".".join(parts[:end]))
        if hint is not None:
            return hint
    return None


def lacking_name(path: str, name: str) -> str | None:
    """What to use instead of Lightning's ``name`` in module ``path`` ("" for the top), if keel knows it lacks it."""
    return LACKING.get(f"{path}.{name}" if path else name) or LACKING.get(name) or lacking_module(path)


def is_module(path: str) -> bool:
    """Whether keel has Lightning's module ``path`` (some of its names)."""
    return path in PROVIDED
