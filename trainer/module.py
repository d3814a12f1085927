"""TaskModule and DataModule: what users subclass.

Contract (docs/design.md sections 2 and 3):

* Users own ``forward`` (inference). The Trainer never replaces it: DDP wraps an internal adapter whose
  ``forward`` calls :meth:`TaskModule.training_step`.
* Every hook below is called by the Trainer on every rank, in the same order. The base class defines
  each optional hook as a no-op, so the Trainer simply calls them; required hooks raise
  ``NotImplementedError`` with a message that names the hook.
* Module hooks run before the callbacks' hook of the same name.
* As in Lightning, ``validation_step`` / ``test_step`` / ``predict_step`` and their batch hooks get
  ``dataloader_idx`` only when the stage has several dataloaders; then they must take it (with one loader
  they must not require it). Both are checked before the run, with Lightning's messages.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from trainer.compat import keel_default, unwrap_compiled
from trainer.data.transfer import move_to_device
from trainer.step.optim import ManualOptimizer

if TYPE_CHECKING:  # pragma: no cover
    from trainer.step.optim import ManualOptimization
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

STAGES = ("fit", "validate", "test", "predict")


class AttributeDict(dict):
    """A dict whose keys are also attributes (``hparams.lr``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no hyperparameter {name!r}; saved: {sorted(self)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


class DataHooks:
    """The optional data hooks shared by TaskModule and DataModule: ``prepare_data``, the ``*_dataloader()``
    methods (None: no such data) and the batch-transfer hooks."""

    def prepare_data(self) -> None:
        """Download or build files once per node. Called on local rank 0 of every node at the start of each
        stage, before any ``setup`` (the datamodule's first, then the task's); the other ranks wait."""

    def train_dataloader(self) -> Iterable | None:
        return None

    def val_dataloader(self) -> Iterable | list[Iterable] | None:
        return None

    def test_dataloader(self) -> Iterable | list[Iterable] | None:
        return None

    def predict_dataloader(self) -> Iterable | list[Iterable] | None:
        return None

    # The batch-transfer hooks (Lightning's): called for every training, validation, test and predict batch, in
    # this order, when the task or the datamodule overrides any of them (trainer.hooks.BatchTransfer); a
    # datamodule's override wins over the task's. Training batches have dataloader_idx 0.
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch before it moves to the device (it is where the loader made it, usually the CPU);
        return the batch to use."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a batch to ``device`` and return it: every tensor in (nested) lists, tuples, named tuples, dicts and
        dataclasses. Override it for a batch of another type, and call this for the rest."""
        return move_to_device(batch, device, from_any_device=True)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch once it is on the device (augmentation on the GPU); return the batch to use."""
        return batch


class HyperparametersMixin:
    """``save_hyperparameters`` / ``hparams`` (Lightning's), shared by TaskModule and DataModule."""

    def save_hyperparameters(self, *names: str, ignore: str | list[str] | None = None, logger: bool = True) -> None:
        """Store the calling ``__init__``'s arguments in :attr:`hparams` (Lightning's name and meaning).

        Call it inside ``__init__``. ``names`` selects arguments (default: all), ``ignore`` drops some.
        Plain values (numbers, strings, bools, None and lists/dicts of them) go into checkpoints and are
        used by :meth:`load_from_checkpoint`; others (modules, ``functools.partial`` factories) stay in
        memory only, with a one-line warning when a checkpoint is written. ``logger=True`` sends them to
        the loggers at the start of ``fit``.
        """
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:  # pragma: no cover - CPython always has frames
            raise RuntimeError("save_hyperparameters() could not find its caller's arguments.")
        code, local = caller.f_code, caller.f_locals
        count = code.co_argcount + code.co_kwonlyargcount
        arg_names = [n for n in code.co_varnames[:count] if n != "self"]
        values = {n: local[n] for n in arg_names if n in local}
        if code.co_flags & inspect.CO_VARKEYWORDS:
            values.update(local.get(code.co_varnames[count + bool(code.co_flags & inspect.CO_VARARGS)], {}))
        if names:
            unknown = sorted(set(names) - set(values))
            if unknown:
                raise ValueError(f"save_hyperparameters: {unknown} are not arguments of __init__ ({sorted(values)}).")
            values = {n: values[n] for n in names}
        for name in [ignore] if isinstance(ignore, str) else (ignore or []):
            values.pop(name, None)
        self._hparams = AttributeDict(values)
        self._log_hyperparams = logger

    @property
    def hparams(self) -> AttributeDict:
        """Saved hyperparameters; attribute and key access (``self.hparams.lr``, ``self.hparams["lr"]``)."""
        return self.__dict__.setdefault("_hparams", AttributeDict())


class TaskModule(DataHooks, HyperparametersMixin, nn.Module):
    """Base class for a task: model, loss, optimizers and (optionally) data.

    Required: ``training_step`` (for ``fit``) and ``configure_optimizers``. ``validation_step``,
    ``test_step`` and ``predict_step`` are required only by the loops that use them (``predict_step``
    defaults to ``self(batch)``).

    ``training_step(batch, batch_idx)`` returns one of:

    * a scalar loss tensor: a mean over the micro-batch;
    * a dict with ``"loss"``; other entries are detached and handed to callbacks as the step output;
    * a dict with ``"loss"`` and ``"num_items"``: then ``loss`` is a SUM over ``num_items`` contributing
      items (tokens, samples) and the Trainer divides by the global count over all micro-batches of the
      step and all ranks (docs/design.md section 5).
    """

    def __init__(self) -> None:
        super().__init__()
        # Plain attribute, not a submodule or parameter; set by the Trainer while a loop runs.
        self._trainer: Trainer | None = None
        self._log_hyperparams = True
        # Lightning's switch: False means training_step calls manual_backward and optimizer.step itself.
        self.automatic_optimization = True
        self._toggled: dict[torch.nn.Parameter, bool] | None = None
        # The CPU generator's seed when the task was built: torch's unseeded default is a random 64-bit number, so a
        # value >= 2**32 means the weights drawn in __init__ come from no seed (trainer.lifecycle.warn_unseeded_task).
        self._built_with_seed = torch.initial_seed()

    # ------------------------------------------------------------------ read-only run state
    @property
    def trainer(self) -> Trainer:
        """The Trainer running this task. Raises ``RuntimeError`` when the task is not attached."""
        if self._trainer is None:
            raise RuntimeError(
                f"{type(self).__name__} is not attached to a Trainer. `self.trainer` is available inside "
                "hooks called by Trainer.fit/validate/test/predict."
            )
        return self._trainer

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (0 when not attached)."""
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def device(self) -> torch.device:
        if self._trainer is not None:
            return self._trainer.device
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def global_rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def world_size(self) -> int:
        return self._trainer.world_size if self._trainer is not None else 1

    @property
    def device_mesh(self) -> Any:
        """The strategy's ``DeviceMesh`` (Lightning's name): under ``FSDPStrategy`` (and Lightning's
        ``ModelParallelStrategy``) the ``("data_parallel", "tensor_parallel")`` mesh, ready in ``configure_model``
        for a tensor-parallel plan; None under DDP, one device, or outside a Trainer."""
        return getattr(self._trainer.strategy, "device_mesh", None) if self._trainer is not None else None

    @property
    def local_rank(self) -> int:
        return self._trainer.local_rank if self._trainer is not None else 0

    @property
    def on_gpu(self) -> bool:
        """True when the task runs on a CUDA device."""
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the first floating parameter (float32 without any)."""
        for p in self.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.float32

    @property
    def logger(self) -> Any:
        """The Trainer's first logger (None when not attached or without loggers)."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Any]:
        return list(self._trainer.loggers) if self._trainer is not None else []

    @property
    def example_input_array(self) -> Any:
        """An example input for ``forward`` (Lightning's attribute; set it in ``__init__``)."""
        return self.__dict__.get("_example_input_array")

    @example_input_array.setter
    def example_input_array(self, value: Any) -> None:
        self.__dict__["_example_input_array"] = value

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only (Lightning's ``self.print``); other ranks print nothing."""
        if self.global_rank == 0:
            print(*args, **kwargs)  # noqa: T201 - the documented rank-0 print

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's ``data`` (a tensor, or a dict/list/tuple of tensors) stacked on a new first dimension
        of size world size, a collective that every rank must call; in one process ``data`` itself, as in
        Lightning. ``sync_grads=True`` keeps the autograd graph (e.g. contrastive losses)."""
        strategy = self.trainer.strategy
        if isinstance(data, dict):
            return type(data)((k, self.all_gather(v, group, sync_grads)) for k, v in data.items())
        if isinstance(data, (list, tuple)):
            return type(data)(self.all_gather(v, group, sync_grads) for v in data)
        if not isinstance(data, torch.Tensor):
            data = torch.as_tensor(data, device=self.device)
        return strategy.all_gather(data, group=group, sync_grads=sync_grads)

    def freeze(self) -> None:
        """All parameters ``requires_grad=False`` and eval mode (Lightning's)."""
        for p in self.parameters():
            p.requires_grad_(False)
        self.eval()

    def unfreeze(self) -> None:
        """All parameters ``requires_grad=True`` and train mode."""
        for p in self.parameters():
            p.requires_grad_(True)
        self.train()

    # ------------------------------------------------------------------ manual optimization
    def optimizers(self) -> ManualOptimizer | list[ManualOptimizer]:
        """The optimizers from ``configure_optimizers``, wrapped so that ``step()`` is precision-aware
        (GradScaler under 16-mixed) and runs ``on_before_optimizer_step`` hooks. One optimizer is returned
        bare, several as a list (Lightning's convention)."""
        # _manual is built with the optimizers (Trainer._configure_model_and_optimizers).
        wrapped = [
            ManualOptimizer(o, cast("ManualOptimization", self.trainer._manual)) for o in self.trainer.optimizers
        ]
        return wrapped[0] if len(wrapped) == 1 else wrapped

    def lr_schedulers(self) -> Any:
        """The schedulers from ``configure_optimizers`` (one bare, several as a list, None without any).
        Under manual optimization the Trainer does not step them: call ``.step()`` yourself."""
        schedulers = [c.scheduler for c in self.trainer.lr_scheduler_configs]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for manual optimization: scaled under 16-mixed, and in DDP the gradients are
        averaged over ranks on the last micro-batch of each ``accumulate_grad_batches`` window (no sync on
        the others, like DDP's ``no_sync``)."""
        assert self.trainer._manual is not None  # built by fit with the optimizers
        self.trainer._manual.backward(loss)

    def toggle_optimizer(self, optimizer: torch.optim.Optimizer | ManualOptimizer) -> None:
        """Freeze every parameter that ``optimizer`` does not own (``requires_grad=False``) until
        :meth:`untoggle_optimizer`, so a backward computes only that optimizer's gradients."""
        inner = optimizer.optimizer if isinstance(optimizer, ManualOptimizer) else optimizer
        owned = {id(p) for group in inner.param_groups for p in group["params"]}
        self._toggled = {p: p.requires_grad for p in self.parameters()}
        for p in self.parameters():
            if id(p) not in owned:
                p.requires_grad_(False)

    def untoggle_optimizer(self, optimizer: torch.optim.Optimizer | ManualOptimizer) -> None:
        """Restore the ``requires_grad`` flags changed by :meth:`toggle_optimizer`."""
        for p, flag in (self._toggled or {}).items():
            p.requires_grad_(flag)
        self._toggled = None

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: str, *, map_location: Any = "cpu", strict: bool = True, **overrides: Any
    ) -> TaskModule:
        """Build the task from a keel checkpoint for inference.

        The constructor receives the checkpoint's saved hyperparameters (``save_hyperparameters``)
        updated with ``overrides``; then the weights are loaded (``weights_only=True``: nothing in the
        file can run code). The task is returned in eval mode.
        """
        from trainer.checkpoint.files import K_HPARAMS, K_STATE_DICT
        from trainer.checkpoint.reader import load_weights

        state = load_weights(checkpoint_path)  # verified; any strategy and world size, or a plain file
        kwargs = dict(state.get(K_HPARAMS, {}))
        kwargs.update(overrides)
        task = cls(**kwargs)
        task.load_state_dict(state[K_STATE_DICT], strict=strict)
        if map_location is not None:
            task.to(map_location)
        task.on_load_checkpoint(state)
        return task.eval()

    # ------------------------------------------------------------------ logging
    def log(
        self,
        name: str,
        value: Any,
        *,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        prog_bar: bool = False,
        logger: bool = True,
        batch_size: int | None = None,
        reduce_fx: str | Callable = "mean",
        sync_dist: bool = False,
        rank_zero_only: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        enable_graph: bool = False,
        metric_attribute: str | None = None,
    ) -> None:
        """Record a scalar metric, or a metric object (a torchmetrics ``Metric`` or anything with ``compute()``
        and ``reset()``: keel calls ``compute()`` at logging steps / the epoch end and ``reset()`` after the
        epoch, and never reduces its result again; see trainer/metrics.py).

        Lightning's defaults: inside ``training_step`` a value is logged per step; inside validation and
        test it is aggregated per epoch as a mean weighted by ``batch_size`` (inferred from the batch when
        not given). Values stay on their device: nothing is read back to the host except on logging
        steps and at epoch ends, where metrics are reduced across ranks with ``reduce_fx`` ("mean", "sum",
        "max", "min"), so ``sync_dist`` is accepted for Lightning compatibility and always on.
        ``rank_zero_only=True`` uses rank 0's value as is, on every rank. Lightning's ``sync_dist_group``
        (keel reduces over the default group), ``add_dataloader_idx`` (always added with several loaders),
        ``enable_graph`` (values are always detached) and ``metric_attribute`` are accepted and have no effect.

        Raises:
            ValueError: for a non-scalar tensor or a non-numeric value, naming the metric.
        """
        if self._trainer is None:
            warnings.warn(f"self.log({name!r}) called outside a Trainer loop; the value is dropped.", stacklevel=2)
            return
        self._trainer._metrics.log(
            name,
            value,
            on_step=on_step,
            on_epoch=on_epoch,
            prog_bar=prog_bar,
            logger=logger,
            batch_size=batch_size,
            reduce_fx=reduce_fx,
            rank_zero_only=rank_zero_only,
        )

    def log_dict(self, metrics: Mapping[str, Any], **kwargs: Any) -> None:
        """``self.log`` for every item of ``metrics`` with the same keyword arguments."""
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    # ------------------------------------------------------------------ steps (users implement)
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | Mapping[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch, batch_idx) to fit.")

    @keel_default  # fit() skips validation (with a warning) when a task keeps this default
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} got validation data but does not implement validation_step(batch, batch_idx)."
        )

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} got test data but does not implement test_step(batch, batch_idx)."
        )

    @keel_default  # with several loaders the loop calls it without dataloader_idx
    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """Default: ``self(batch)``."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        """Return an optimizer, ``(optimizers, schedulers)`` lists, or Lightning's dict form.

        ``{"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step" | "epoch", "frequency": n}}``
        """
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers() to fit.")

    # ------------------------------------------------------------------ optional module hooks (no-ops)
    def setup(self, stage: str) -> None:
        """Called on every rank at the start of fit/validate/test/predict, before optimizers exist."""

    def configure_model(self) -> None:
        """Build large layers here instead of in ``__init__`` (Lightning's hook). Called on every rank in
        every stage, after ``setup`` and before the task is moved to its device and wrapped or sharded
        (``strategy="fsdp"`` shards what exists after it). It may run more than once per task (fit, then
        test): build only what is missing. It runs with rank 0's random state on every rank, and weights built
        eagerly in ``__init__`` are rank 0's, so the initial weights are the same at every world size.

        A model too large for one device is built on the meta device (``with torch.device("meta"):`` here or in
        ``__init__``, or ``with self.trainer.init_module(empty_init=True):``): nothing is allocated until the strategy
        has sharded it, then each rank materialises its own part and :meth:`init_weights` initialises it."""

    def init_weights(self, module: torch.nn.Module) -> None:
        """Initialise the parameters and buffers of ``module`` itself (not its submodules'), which keel has just
        allocated, uninitialised, at their full size: called once per module that was built on the meta device, in
        ``self.modules()`` order, on every rank with the same random state (so the weights do not depend on the
        world size; under FSDP each rank then keeps its shard). Default: ``module.reset_parameters()``, which
        every torch layer has and which is what its constructor ran.

        Override it for your own initialisation (call ``super().init_weights(module)`` for the modules you leave
        alone), and for a module of your own that holds parameters or buffers without a ``reset_parameters``.

        Raises:
            TypeError: ``module`` holds tensors of its own and has no ``reset_parameters()``, naming it.
        """
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            own = [n for n, _ in module.named_parameters(recurse=False)] + [
                n for n, _ in module.named_buffers(recurse=False)
            ]
            where = "the task itself" if module is self else f"a {type(module).__name__}"
            raise TypeError(
                f"{type(self).__name__} was built on the meta device, and {where} holds tensors of its own ({own}) "
                f"but has no reset_parameters() to initialise them: override {type(self).__name__}.init_weights("
                "module) to fill them in place for that module (and call super().init_weights(module) for the rest)."
            )
        reset()

    def teardown(self, stage: str) -> None:
        """Called on every rank at the end of a stage, also after an exception."""

    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    def on_validation_model_eval(self) -> None:
        """Called when a validation run starts: put the task in eval mode (override to keep parts training)."""
        self.eval()

    @keel_default
    def on_validation_model_train(self) -> None:
        """Called when a validation run ends. Unless overridden, the loop gives every submodule back the
        training mode it had before the run (so a frozen backbone in eval mode stays in eval mode)."""
        self.train()

    def on_test_model_eval(self) -> None:
        self.eval()

    @keel_default
    def on_test_model_train(self) -> None:
        """As :meth:`on_validation_model_train`, for test runs."""
        self.train()

    def on_predict_model_eval(self) -> None:
        self.eval()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...


class DataModule(DataHooks, HyperparametersMixin):
    """Bundles the data of a task: ``setup(stage)`` then the ``*_dataloader()`` methods.

    The Trainer calls ``setup(stage)`` on every rank before asking for loaders; return plain
    ``torch.utils.data.DataLoader`` objects and the Trainer adds its distributed, resumable sampler.
    """

    def __init__(self) -> None:
        self._trainer: Trainer | None = None

    @property
    def trainer(self) -> Trainer | None:
        return self._trainer

    def setup(self, stage: str) -> None:
        """Build datasets for ``stage`` ("fit", "validate", "test" or "predict") on every rank."""

    def teardown(self, stage: str) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def check_stage_inputs(
    stage: str, task: TaskModule | None, datamodule: DataModule | None, loaders: tuple[Any, ...]
) -> tuple[TaskModule, DataModule | None, tuple[Any, ...], Any | None]:
    """The arguments of ``Trainer.fit/validate/test/predict``, checked before anything runs, in Lightning's
    forms: a DataModule passed where the dataloaders go (``trainer.fit(model, dm)``) is the datamodule, and
    ``torch.compile(task)`` is the task plus its compile settings.

    Returns:
        ``(task, datamodule, loaders, dynamo context or None)``.

    Raises:
        ValueError: no task, or both dataloaders and a datamodule.
        TypeError: ``task`` is not a TaskModule, or ``datamodule`` not a DataModule.
    """
    task, dynamo_ctx = unwrap_compiled(task)
    if loaders and isinstance(loaders[0], DataModule) and datamodule is None:
        datamodule, loaders = loaders[0], (None, *loaders[1:])
    if task is None:
        raise ValueError(f"Trainer.{stage}() needs a task: pass the TaskModule as the first argument.")
    if not isinstance(task, TaskModule):
        hint = (
            (
                " A LightningModule ports by subclassing trainer.TaskModule (or `import callbacks.lightning as L`; "
                'docs/porting.md, "Porting from Lightning").'
            )
            if "lightning" in type(task).__module__
            else ""
        )
        raise TypeError(
            f"Trainer.{stage}() expects a TaskModule (or torch.compile(task)), got {type(task).__name__}.{hint}"
        )
    if datamodule is not None:
        if not isinstance(datamodule, DataModule):
            raise TypeError(f"datamodule must be a trainer.DataModule, got {type(datamodule).__name__}.")
        if any(loader is not None for loader in loaders):
            raise ValueError(f"Trainer.{stage}(): pass either dataloaders or a datamodule, not both.")
    return task, datamodule, loaders, dynamo_ctx
