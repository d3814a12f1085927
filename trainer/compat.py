"""What Lightning code expects of keel's objects, kept out of the loop (docs/porting.md).

* :class:`TrainerAttributes`: the Trainer's read-only, Lightning-named attributes (``trainer.model``,
  ``num_devices``, ``ckpt_path``, ``min_epochs`` / ``min_steps`` through ``should_stop``, ...), a base
  class of the Trainer so that trainer.py holds only the loop;
* how a step method is called (:func:`takes_batch_idx`: ``training_step(self, batch)`` without
  ``batch_idx`` is decided once per stage, never per step), and which TaskModule hooks keep keel's
  default (:func:`keel_default` / :func:`is_keel_default`);
* ``trainer.fit(torch.compile(task))``: :func:`unwrap_compiled` and :func:`compile_step`;
* :func:`warn_uncalled_hooks`: a Lightning hook keel never calls is named in a warning at the start of a
  stage, never ignored in silence;
* :func:`fit_validation`: which validation loaders ``fit`` runs (none without ``validation_step``, none
  with ``limit_val_batches=0``), as Lightning decides.

Nothing here imports the Trainer: what a function needs comes in as arguments (tests/unit/test_layout.py).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from trainer.data.loaders import limit_batches
from trainer.distributed import comm
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

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- step methods and default hooks
def takes_batch_idx(step: Callable[..., Any], *, extra: int = 0) -> bool:
    """Whether ``step`` (a bound ``*_step`` method) takes ``batch_idx`` after ``batch``: Lightning calls
    ``training_step(batch)`` when the method has a single parameter. Read once per stage by the caller.

    ``extra`` counts further positional arguments the caller passes after ``batch_idx``
    (``dataloader_idx``: 1); only their absence changes the call, never their presence.
    """
    try:
        params = list(inspect.signature(step).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: assume Lightning's full signature
        return True
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2


# ---------------------------------------------------------------------- dataloader_idx (evaluation and predict)
# Lightning's name for each stage's loaders in its messages ("You provided multiple `val_dataloader`, ...").
_DATALOADER_PREFIX = {"validation": "val", "test": "test", "predict": "predict"}


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """``fn``'s parameters (``self`` already bound), or None when Python cannot tell (a builtin)."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _names_dataloader_idx(fn: Callable[..., Any]) -> bool:
    """Lightning's ``is_param_in_hook_signature(fn, "dataloader_idx")``: a parameter of that name, or ``*args``."""
    params = _parameters(fn)
    return params is None or any(p.name == "dataloader_idx" or p.kind == p.VAR_POSITIONAL for p in params)


def _requires_dataloader_idx(fn: Callable[..., Any]) -> bool:
    params = _parameters(fn)
    return params is not None and any(p.name == "dataloader_idx" and p.default is p.empty for p in params)


def check_task_dataloader_idx(task: TaskModule, stage: str, names: Iterable[str], *, many: bool) -> None:
    """Lightning's check of the task's step and batch hooks (``names``, those the task overrides) before an
    evaluation or predict run (``stage``: "validation", "test" or "predict"), with Lightning's messages: with
    several loaders each must take ``dataloader_idx``; with one, none may require it.

    Raises:
        RuntimeError: naming the method and the fix, as Lightning 2.6 does.
    """
    prefix = _DATALOADER_PREFIX[stage]
    for name in names:
        fn = getattr(task, name)
        where = f"`{type(task).__name__}.{name}()`"
        if many and not _names_dataloader_idx(fn):
            raise RuntimeError(
                f"You provided multiple `{prefix}_dataloader`, but no `dataloader_idx` argument in {where}. Try "
                "adding `dataloader_idx=0` to its signature."
            )
        if not many and _requires_dataloader_idx(fn):
            raise RuntimeError(
                f"You provided only a single `{prefix}_dataloader`, but have included `dataloader_idx` in {where}. "
                "Either remove the argument or give it a default value i.e. `dataloader_idx=0`."
            )


def check_callback_dataloader_idx(callback: Callback, name: str, stage: str, *, leading: int, many: bool) -> None:
    """Whether ``callback.<name>`` accepts the call Lightning makes: ``(trainer, task, [outputs,] batch,
    batch_idx)`` with one loader, ``dataloader_idx`` as one more positional argument with several
    (``leading``: the positional arguments before ``dataloader_idx``). Lightning itself calls the hook and
    fails with Python's TypeError; keel says so before the run starts, with the fix.

    Raises:
        RuntimeError: naming the callback, the hook and the fix.
    """
    fn = getattr(callback, name)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: let the call tell
        return
    try:
        signature.bind(*range(leading + many))
    except TypeError:
        prefix, where = _DATALOADER_PREFIX[stage], f"{type(callback).__name__}.{name}{signature}"
        if many:
            raise RuntimeError(
                f"You provided multiple `{prefix}_dataloader`: {where} is called with `dataloader_idx` as its last "
                "positional argument (as Lightning does), but does not take it. Add `dataloader_idx=0` to its "
                "signature."
            ) from None
        raise RuntimeError(
            f"You provided only a single `{prefix}_dataloader`: {where} is called without `dataloader_idx` (as "
            "Lightning does), but requires it. Give it a default value, `dataloader_idx=0`."
        ) from None


def keel_default(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a TaskModule hook whose default the loop replaces with its own behaviour unless overridden
    (``on_validation_model_train``: the loop restores each submodule's training mode itself)."""
    fn._keel_default = True  # type: ignore[attr-defined]
    return fn


def is_keel_default(bound: Callable[..., Any]) -> bool:
    """True when ``bound`` (a bound hook) is keel's own default, not a user's override."""
    return bool(getattr(bound, "_keel_default", False))


# ---------------------------------------------------------------------- torch.compile
def unwrap_compiled(model: Any) -> tuple[Any, Any | None]:
    """``(task, dynamo context)`` for ``torch.compile(task)``, ``(model, None)`` for anything else.

    Lightning's idiom ``trainer.fit(torch.compile(model))``: keel trains the task itself (so
    checkpoints hold its plain ``state_dict`` keys, hooks and ``self.log`` see the task) and compiles the
    training step with the same settings (:func:`compile_step`).
    """
    # A compiled model means torch.compile imported dynamo. ``torch._dynamo`` here would import it (1.3 s on a
    # 2-core CPU) into a process that compiles nothing: a fit pays that anyway (torch's Optimizer constructor
    # imports it), validate / test / predict from a fresh process no longer do.
    optimized = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    if optimized is not None and isinstance(model, optimized):
        return model._orig_mod, model.dynamo_ctx
    return model, None


def compile_step(model: torch.nn.Module, dynamo_ctx: Any | None) -> torch.nn.Module:
    """The module the loop calls for ``training_step``, compiled with the user's ``torch.compile``
    settings (its backend and mode) when the task came compiled; unchanged otherwise. Like Lightning,
    the compiled region is the wrapped training step (after DDP's wrapping, so DDP's optimizer splits
    the graph at bucket boundaries)."""
    if dynamo_ctx is None:
        return model
    return torch._dynamo.eval_frame.OptimizedModule(model, dynamo_ctx)


# ---------------------------------------------------------------------- hooks keel never calls
# Lightning hooks (module or callback) that keel deliberately does not call, with what to do instead.
UNCALLED_HOOKS: dict[str, str] = {
    "configure_callbacks": "pass the callbacks to Trainer(callbacks=[...]).",
    "configure_gradient_clipping": "use Trainer(gradient_clip_val=..., gradient_clip_algorithm=...), or clip "
    "in on_before_optimizer_step.",
    "optimizer_step": "keel steps the optimizers itself; change the step in on_before_optimizer_step, or use "
    "manual optimization (self.automatic_optimization = False).",
    "optimizer_zero_grad": "keel zeroes gradients with set_to_none=True after each step; use "
    "on_before_zero_grad to act just before it.",
    "lr_scheduler_step": "return the scheduler config from configure_optimizers; for a custom schedule use "
    "manual optimization and call sch.step() yourself.",
    "backward": "use on_before_backward / on_after_backward, or manual optimization (self.manual_backward).",
    "on_validation_model_zero_grad": "keel evaluates under torch.no_grad(); gradients are untouched.",
    "configure_sharded_model": "build the model in __init__ (or in configure_model where keel has it).",
}
# The hooks of automatic optimization: under manual optimization (automatic_optimization = False) Lightning 2.6.6
# calls none of them either (of UNCALLED_HOOKS only `backward`, from manual_backward), so a task that defines one
# there loses nothing under keel and is not warned.
AUTOMATIC_OPTIMIZATION_HOOKS = frozenset(
    ("optimizer_step", "optimizer_zero_grad", "lr_scheduler_step", "configure_gradient_clipping")
)
_WARNED: set[tuple[type, str]] = set()


def warn_uncalled_hooks(task: TaskModule, callbacks: Iterable[Callback]) -> list[str]:
    """Warn once per class for each Lightning hook in :data:`UNCALLED_HOOKS` that ``task`` or a callback
    defines: keel will never call it (nor the task's :data:`AUTOMATIC_OPTIMIZATION_HOOKS` under manual
    optimization, where Lightning does not call them either). Returns the warnings issued (for tests)."""
    issued = []
    manual = not getattr(task, "automatic_optimization", True)
    for obj in [task, *callbacks]:
        cls = type(obj)
        for name, instead in UNCALLED_HOOKS.items():
            if (cls, name) in _WARNED or not callable(getattr(obj, name, None)) or _keel_owned(cls, name):
                continue
            if manual and obj is task and name in AUTOMATIC_OPTIMIZATION_HOOKS:
                continue
            _WARNED.add((cls, name))
            message = f"{cls.__name__}.{name} is a Lightning hook that keel never calls: {instead}"
            warnings.warn(message, UserWarning, stacklevel=3)
            issued.append(message)
    return issued


def _keel_owned(cls: type, name: str) -> bool:
    """True when ``name`` comes from keel's own classes (nn.Module's ``optimizer_step`` does not exist,
    but e.g. a keel base could define one), not from the user's."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass.__module__.split(".")[0] in ("trainer", "callbacks", "torch")
    return True


# ---------------------------------------------------------------------- validation in fit
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


# ---------------------------------------------------------------------- the Trainer's Lightning attributes
class TrainerAttributes:
    """Read-only Lightning-named attributes of the Trainer (a base class of ``Trainer``; they read its
    public state, so trainer.py holds only the loop). ``should_stop`` honours ``min_epochs`` / ``min_steps``
    as Lightning does: a stop request before both are met waits until they are (logged once)."""

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
    state: TrainState
    checkpointer: Checkpointer
    accumulation_schedule: AccumulationSchedule
    _train: AdaptedLoader | None
    _eval_loop: EvaluationLoop
    _stop_requested: bool = False
    _min_logged: bool = False
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

    # ------------------------------------------------------------------ stopping
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
        return self.state_stage == "fit" and not self.sanity_checking

    @property
    def validating(self) -> bool:
        return self.state_stage == "validate" or (self.state_stage == "fit" and self.sanity_checking)

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
