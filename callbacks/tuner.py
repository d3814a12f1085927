"""Lightning's ``Tuner``: the learning-rate range test (:meth:`Tuner.lr_find`) and the batch-size search
(:meth:`Tuner.scale_batch_size`), built on the Trainer's public behaviour.

A search is one or more ordinary stages of the Trainer (``fit``, or ``validate`` / ``test`` / ``predict`` for a
batch size) run with the Trainer set up for the search: its callbacks replaced by the search's own, no loggers, no
profiler, a few options changed (``max_steps`` to the search's length, no sanity check, ...). A callback does the
search's work on the public hooks: :class:`_LRSearch` sets the learning rate before each step, records the
smoothed loss after it and sets ``should_stop`` when the loss diverges; :class:`_Snapshot` copies the task's
weights and its optimizers' and schedulers' states (to host memory) when the first stage starts. Afterwards
everything is put back (:func:`_searching`): the Trainer's callbacks, loggers, profiler, options and step clock,
the global random generators, and the task's weights and its optimizers' and schedulers' states (Lightning saves a
checkpoint file and restores it). What the search found is then applied (``update_attr``) on top.

The algorithms are Lightning 2.6.6's, step for step, so a ported program finds the same learning rate and the same
batch size (tests/unit/test_tuner.py compares with Lightning's measured results); the differences are listed in
docs/porting.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import random
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from trainer.callback import Callback
from trainer.data.loaders import resolve_loaders
from trainer.distributed import comm
from trainer.module import DataModule, TaskModule
from trainer.observability.profiler import PassThroughProfiler
from trainer.observability.rank_zero import rank_zero_warn

if TYPE_CHECKING:  # pragma: no cover
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

_METHODS = ("fit", "validate", "test", "predict")
_LR_MODES = ("linear", "exponential")
_BATCH_SIZE_MODES = ("power", "binsearch")
_NO_LOGGING_STEP = 2**62  # log_every_n_steps during a search: nothing is logged, so no step reads metrics


# ---------------------------------------------------------------------- the learning-rate range test
class LRFinder:
    """What :meth:`Tuner.lr_find` found (Lightning's ``_LRFinder``): ``results["lr"]`` and ``results["loss"]``,
    the learning rate of each search step and the smoothed loss after it, :meth:`suggestion` and :meth:`plot`.

    Args:
        mode: ``"exponential"`` or ``"linear"``: how the learning rate grows from step to step.
        lr_min: The learning rate of the first step.
        lr_max: The learning rate of the last step.
        num_training: The steps of the search (fewer when the loss diverged).
    """

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int) -> None:
        if mode not in _LR_MODES:
            raise ValueError(f"lr_find(mode={mode!r}): mode should be either of {_LR_MODES}.")
        if num_training < 1:
            raise ValueError(f"lr_find(num_training={num_training!r}): the search needs at least one step.")
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results: dict[str, list[float]] = {}
        self._optimal_idx: int | None = None

    def lr_at(self, step: int) -> float:
        """The learning rate of search step ``step`` (0 is the first), as Lightning's schedule gives it: ``lr_min``,
        then ``lr_min * (lr_max / lr_min) ** r`` (exponential) or ``lr_min + r * (lr_max - lr_min)`` (linear) with
        ``r = (step + 1) / num_training``, which reaches ``lr_max`` at the last step (its second step is already at
        ``r = 2 / num_training``)."""
        if step == 0:
            return self.lr_min
        r = (step + 1) / self.num_training
        if self.mode == "exponential":
            return self.lr_min * (self.lr_max / self.lr_min) ** r
        return self.lr_min + r * (self.lr_max - self.lr_min)

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The learning rate where the smoothed loss falls fastest: the steepest negative gradient of the loss
        over the learning rate (``torch.gradient``), among the finite losses after the first ``skip_begin`` and
        before the last ``skip_end`` steps. None (logged as an error) with fewer than two such points.

        ``skip_end=0`` skips nothing at the end (Lightning 2.6.6 slices ``[skip_begin:-0]``, which is empty, and so
        returns None)."""
        losses_all, lrs_all = self.results["loss"], self.results["lr"]
        end = max(0, len(losses_all) - skip_end)
        losses = torch.tensor(losses_all[skip_begin:end])
        lrs = torch.tensor(lrs_all[skip_begin:end])
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        if len(losses) < 2:
            log.error(
                "Failed to compute suggestion for learning rate because there are not enough points. Increase the "
                "loop iteration limits or the size of your dataset/dataloader."
            )
            self._optimal_idx = None
            return None
        gradients = torch.gradient(losses, spacing=[lrs])[0]
        steepest = int(torch.argmin(gradients).item())
        kept = torch.arange(len(losses_all))[skip_begin:end][finite]
        self._optimal_idx = int(kept[steepest].item())
        return self.results["lr"][self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """The loss over the learning rate (a log axis for ``"exponential"``), with the suggestion marked red when
        ``suggest``; ``show`` calls ``plt.show()``. Draws on ``ax`` (a matplotlib ``Axes``) when given, else on a
        new figure; returns the figure.

        Raises:
            ModuleNotFoundError: matplotlib is not installed (keel does not depend on it).
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ModuleNotFoundError(
                "LRFinder.plot draws with matplotlib, which keel does not install: `pip install matplotlib`."
            ) from exc
        lrs, losses = self.results["lr"], self.results["loss"]
        if ax is None:
            fig, ax = plt.subplots()
        else:
            fig = ax.figure
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest:
            self.suggestion()
            if self._optimal_idx:
                idx = self._optimal_idx
                ax.plot(lrs[idx], losses[idx], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return fig


class _LRSearch(Callback):
    """Runs Lightning's range test in a ``fit``: before each optimizer step the learning rate of every parameter
    group is :meth:`LRFinder.lr_at` the steps done; after it the loss (divided by ``accumulate_grad_batches``, as
    Lightning's step outputs hold it; averaged over the ranks under DDP) is smoothed and recorded, and the search
    stops once the smoothed loss exceeds ``early_stop_threshold`` times the best one.

    Smoothing is Lightning's: ``avg = beta * avg + (1 - beta) * loss`` and ``smoothed = avg / (1 - beta **
    (global_step + 1))`` with ``global_step`` counted after the step (1 for the first: its bias correction is one
    step ahead). The task's schedulers do not step during the search.
    """

    def __init__(self, finder: LRFinder, early_stop_threshold: float | None, beta: float = 0.98) -> None:
        self.finder, self.early_stop_threshold, self.beta = finder, early_stop_threshold, beta
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.avg_loss = self.best_loss = 0.0
        self.start = 0
        self.steps = 0  # optimizer steps the search took
        self.nonfinite_at: int | None = None  # the first step whose loss was NaN or inf (fit then stops with an error)
        self._optimizer: torch.optim.Optimizer | None = None
        self._lr = 0.0

    def on_train_start(self, trainer: Trainer, task: TaskModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"`model.configure_optimizers()` returned {len(trainer.optimizers)} optimizers, but the learning rate "
                "finder only works with a single optimizer: return the one whose learning rate you search."
            )
        self._optimizer = trainer.optimizers[0]
        self.start = trainer.global_step
        trainer.lr_scheduler_configs = []  # the search's schedule replaces the task's (put back afterwards)

    def _window_end(self, trainer: Trainer, batch_idx: int) -> bool:
        """Lightning records at the micro-batch ``batch_idx`` with ``(batch_idx + 1) % accumulate == 0``."""
        return (batch_idx + 1) % trainer.accumulate_grad_batches == 0

    def on_train_batch_start(self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int) -> None:
        assert self._optimizer is not None
        self._lr = self.finder.lr_at(trainer.global_step - self.start)
        for group in self._optimizer.param_groups:
            group["lr"] = self._lr
        if self._window_end(trainer, batch_idx):
            self.lrs.append(self._lr)

    def on_train_batch_end(self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps = trainer.global_step - self.start
        if not self._window_end(trainer, batch_idx):
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, torch.Tensor):  # nothing to record; NaN keeps lrs and losses aligned
            self.losses.append(float("nan"))
            return
        loss = loss.detach() / trainer.accumulate_grad_batches
        if trainer.world_size > 1:  # every rank records (and decides on) the same mean
            loss = comm.all_reduce(loss.clone(), "sum") / trainer.world_size
        current, step = loss.item(), trainer.global_step
        self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * current
        smoothed = self.avg_loss / (1 - self.beta ** (step + 1))
        threshold = self.early_stop_threshold
        if threshold is not None and step > 1 and smoothed > threshold * self.best_loss:
            trainer.should_stop = True
        if smoothed < self.best_loss or step == 1:
            self.best_loss = smoothed
        self.losses.append(smoothed)
        if self.nonfinite_at is None and not math.isfinite(current):
            self.nonfinite_at = step - self.start


# ---------------------------------------------------------------------- the batch-size search
def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a device (or the host) ran out of memory: ``torch.cuda.OutOfMemoryError``, or a
    ``RuntimeError`` with one message that says "out of memory" (CUDA, MPS, ...), cuDNN's
    ``CUDNN_STATUS_NOT_SUPPORTED`` (what cuDNN raises for a too-large batch) or the CPU allocator's failure."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError) or len(exc.args) != 1 or not isinstance(exc.args[0], str):
        return False
    message = exc.args[0]
    return (
        "out of memory" in message
        or "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED." in message
        or "DefaultCPUAllocator: can't allocate memory" in message
    )


def _free_device_memory() -> None:
    """Between trials: collect garbage and return cached CUDA blocks (an OOM there is ignored, as Lightning does)."""
    gc.collect()
    if torch.cuda.is_initialized():
        try:
            torch.cuda.empty_cache()
        except RuntimeError as exc:
            if not is_oom_error(exc):
                raise


class _BatchSizeSearch:
    """Lightning's batch-size search over the stage ``method``: each trial runs the stage for ``steps_per_trial``
    batches with the batch size in ``batch_arg_name`` (on the task, its ``hparams``, the datamodule or its
    ``hparams``), and an out-of-memory error during a trial (:func:`is_oom_error`) is a failed trial."""

    def __init__(
        self,
        trainer: Trainer,
        task: TaskModule,
        datamodule: DataModule | None,
        *,
        method: str,
        batch_arg_name: str,
        steps_per_trial: int,
        max_val: int,
    ) -> None:
        self.trainer, self.task, self.datamodule, self.method = trainer, task, datamodule, method
        self.name, self.steps_per_trial, self.max_val = batch_arg_name, steps_per_trial, max_val

    def options(self) -> dict[str, Any]:
        """The Trainer options of a trial (Lightning's: the whole training set, the evaluation stage's batches
        limited to the trial's)."""
        steps = self.steps_per_trial
        if self.method == "fit":
            return {"max_steps": steps, "limit_train_batches": 1.0, "limit_val_batches": steps}
        limit = {"validate": "limit_val_batches", "test": "limit_test_batches", "predict": "limit_predict_batches"}
        return {limit[self.method]: steps}

    def check_attribute(self) -> None:
        """Lightning's checks before the search: the attribute exists; the task's own and its ``hparams``' both
        holding it is warned about (the task's is the one that is read)."""
        if not _holders(self.task, self.datamodule, self.name):
            raise AttributeError(
                f"Field {self.name} not found in `model`, `datamodule`, nor their `hparams` attributes: the batch "
                f"size finder reads and sets the batch size there (`batch_arg_name={self.name!r}`), so build your "
                "DataLoader in `train_dataloader()` from it."
            )
        if hasattr(self.task, self.name) and self.name in self.task.hparams:
            rank_zero_warn(
                f"Field `model.{self.name}` and `model.hparams.{self.name}` are mutually exclusive! "
                f"`model.{self.name}` will be used as the initial batch size for scaling. If this is not the "
                "intended behavior, please remove either one."
            )

    def trial(self) -> None:
        """One trial: the stage, on the loaders the task or datamodule builds now (with the current batch size)."""
        trainer, task, dm = self.trainer, self.task, self.datamodule
        if self.method == "fit":
            trainer.fit(task, datamodule=dm)
        elif self.method == "validate":
            trainer.validate(task, datamodule=dm, verbose=False)
        elif self.method == "test":
            trainer.test(task, datamodule=dm, verbose=False)
        else:
            trainer.predict(task, datamodule=dm, return_predictions=False)

    def dataset_length(self) -> int | None:
        """The stage's data in samples, as Lightning measures it (the longest training set; the evaluation sets
        together), or None when no dataset has a length."""
        source = self.datamodule if self.datamodule is not None else self.task
        stage = "train" if self.method == "fit" else self.method
        lengths = []
        for loader in resolve_loaders(source, stage, None):
            try:
                lengths.append(len(loader.dataset))
            except (AttributeError, TypeError, NotImplementedError):  # no dataset, or an iterable one
                continue
        if not lengths:
            return None
        return max(lengths) if self.method == "fit" else sum(lengths)

    def adjust(self, *, factor: float = 1.0, value: int | None = None, desc: str | None = None) -> tuple[int, bool]:
        """Set the batch size to ``value`` (or the current one times ``factor``), at most ``max_val``; returns it
        and whether it changed. A batch size already at least the dataset's length is left as it is."""
        size = _get(self.task, self.datamodule, self.name)
        length = self.dataset_length()
        if length is not None and size >= length:
            log.info("The batch size %d is greater or equal than the length of your dataset: %d.", size, length)
            return size, False
        new_size = value if value is not None else int(size * factor)
        if new_size > self.max_val:
            if desc:
                log.info("Batch size %d exceeds max_val limit %d, capping at %d", new_size, self.max_val, self.max_val)
            new_size = self.max_val
        if desc:
            log.info("Batch size %d %s, trying batch size %d", size, desc, new_size)
        _set(self.task, self.datamodule, self.name, new_size)
        return new_size, new_size != size

    def _run_trial(self) -> bool:
        """One trial; False when it ran out of memory (any other error is raised)."""
        try:
            self.trial()
        except RuntimeError as exc:
            if not is_oom_error(exc):
                raise
            _free_device_memory()
            return False
        return True

    def power(self, size: int, max_trials: int) -> int:
        """Double the batch size after every trial that fits; after one that does not, halve it and stop (keep
        halving while none has fitted yet)."""
        any_success = False
        for trial in range(max_trials):
            _free_device_memory()
            if size >= self.max_val:
                log.info("Reached the maximum batch size limit of %d. Stopping search.", self.max_val)
                break
            if not self._run_trial():
                size, _ = self.adjust(factor=0.5, desc="failed")
                if any_success:
                    break
                continue
            if trial + 1 >= max_trials:
                break
            size, changed = self.adjust(factor=2.0, desc="succeeded")
            if not changed:
                break
            any_success = True
        return size

    def binsearch(self, size: int, max_trials: int, margin: float) -> int:
        """Double the batch size until a trial does not fit, then bisect between the largest that fitted and the
        smallest that did not; the result is reduced by ``margin`` (a fraction) for safety."""
        low, high, count = 1, None, 0
        while True:
            _free_device_memory()
            if size >= self.max_val:
                log.info("Reached the maximum batch size limit of %d. Stopping search.", self.max_val)
                break
            if self._run_trial():
                count += 1
                if count >= max_trials:
                    break
                low = size
                if high is not None:
                    if high - low <= 1:
                        break
                    size, changed = self.adjust(value=(high + low) // 2, desc="succeeded")
                else:
                    size, changed = self.adjust(factor=2.0, desc="succeeded")
                if not changed:
                    break
            else:
                high = size
                size, _ = self.adjust(value=(high + low) // 2, desc="failed")
                if high - low <= 1:
                    break
        if margin > 0:
            reduced = max(1, int(size * (1 - margin)))
            if reduced != size:
                log.info("Applying margin of %.1f%%, reducing batch size from %d to %d", 100 * margin, size, reduced)
                size = reduced
                _set(self.task, self.datamodule, self.name, size)
        return size


# ---------------------------------------------------------------------- the task's attributes (Lightning's rules)
def _holders(task: TaskModule, datamodule: DataModule | None, name: str) -> list[Any]:
    """Where ``name`` lives, in Lightning's order: the task, its ``hparams``, the datamodule, its ``hparams``."""
    holders: list[Any] = []
    for owner in (task, datamodule):
        if owner is None:
            continue
        if hasattr(owner, name):
            holders.append(owner)
        hparams = getattr(owner, "hparams", None)
        if hparams is not None and name in hparams:
            holders.append(hparams)
    return holders


def _get(task: TaskModule, datamodule: DataModule | None, name: str) -> Any:
    """``name`` as Lightning reads it: from the last of its holders."""
    holder = _holders(task, datamodule, name)[-1]
    return holder[name] if isinstance(holder, dict) else getattr(holder, name)


def _set(task: TaskModule, datamodule: DataModule | None, name: str, value: Any) -> None:
    """``name`` set on every holder, as Lightning sets it."""
    for holder in _holders(task, datamodule, name):
        if isinstance(holder, dict):
            holder[name] = value
        else:
            setattr(holder, name, value)


def _lr_attr_name(task: TaskModule, datamodule: DataModule | None, attr_name: str) -> str:
    if attr_name:
        if not _holders(task, datamodule, attr_name):
            raise AttributeError(
                f"The attribute name for the learning rate was set to {attr_name}, but could not find this as a field "
                "in `model` or `model.hparams`."
            )
        return attr_name
    for name in ("lr", "learning_rate"):
        if _holders(task, datamodule, name):
            return name
    raise AttributeError(
        "When using the learning rate finder, either `model` or `model.hparams` should have one of these fields: "
        "('lr', 'learning_rate'). If your model has a different name for the learning rate, set it with "
        "`.lr_find(attr_name=...)`; or pass `update_attr=False` and read `lr_finder.suggestion()`."
    )


# ---------------------------------------------------------------------- before and after a search
def _to_host(obj: Any) -> Any:
    """A copy of ``obj`` (a state dict) with every tensor copied to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):  # a state dict keeps its type and its _metadata (load_state_dict reads versions there)
        copy = type(obj)((k, _to_host(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            copy._metadata = _to_host(obj._metadata)  # type: ignore[attr-defined]
        return copy
    if isinstance(obj, list):
        return [_to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_host(v) for v in obj)
    return obj


class _Snapshot(Callback):
    """The task's weights and its optimizers' and schedulers' states, copied to host memory when the search's
    first stage starts (its layers built, its optimizers made) and put back by :meth:`restore` afterwards: what
    Lightning's tuner keeps in a checkpoint file. The optimizers keep their identity: an optimizer the task keeps
    and returns again is the one restored."""

    def __init__(self) -> None:
        self.weights: dict[str, Any] | None = None
        self.optimizers: list[tuple[torch.optim.Optimizer, dict[str, Any]]] = []
        self.schedulers: list[tuple[Any, dict[str, Any]]] = []

    def _take(self, trainer: Trainer, task: TaskModule) -> None:
        if self.weights is not None:
            return
        self.weights = _to_host(task.state_dict())
        self.optimizers = [(o, _to_host(o.state_dict())) for o in trainer.optimizers]
        self.schedulers = [(c.scheduler, _to_host(c.scheduler.state_dict())) for c in trainer.lr_scheduler_configs]

    def on_fit_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._take(trainer, task)

    def on_validation_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._take(trainer, task)

    def on_test_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._take(trainer, task)

    def on_predict_start(self, trainer: Trainer, task: TaskModule) -> None:
        self._take(trainer, task)

    def restore(self, task: TaskModule) -> None:
        if self.weights is None:  # the search failed before its first stage started: nothing changed
            return
        task.load_state_dict(self.weights)
        for optimizer, state in self.optimizers:
            optimizer.load_state_dict(state)
        for scheduler, state in self.schedulers:
            scheduler.load_state_dict(state)


@contextlib.contextmanager
def _isolated_rng() -> Iterator[None]:
    """Python's, NumPy's (when imported) and torch's global generators (CPU, and CUDA when in use) as they were."""
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            if numpy is not None:
                numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def _searching(trainer: Trainer, callbacks: list[Callback], **options: Any) -> Iterator[None]:
    """``trainer`` set up for a search: ``callbacks`` instead of its own, no loggers (nothing is written), no
    profiler, no sanity check, no model summary, no logging step, and ``options``; put back as it was afterwards,
    also when the search raises: its callbacks, loggers, profiler, options, step clock (``global_step``, the
    epoch, the data cursor), ``should_stop``, optimizers and scheduler configs, and the global random generators."""
    options = {
        "num_sanity_val_steps": 0,
        "enable_model_summary": False,
        "log_every_n_steps": _NO_LOGGING_STEP,
    } | options
    saved_callbacks, saved_loggers, saved_profiler = list(trainer.callbacks), trainer.loggers, trainer.profiler
    saved_options = {name: getattr(trainer.options, name) for name in options}
    saved_state = dataclasses.replace(trainer.state)
    saved_optimizers, saved_configs = trainer.optimizers, trainer.lr_scheduler_configs
    trainer.callbacks[:] = callbacks  # in place: the Trainer's parts hold this list
    trainer.loggers, trainer.profiler = [], PassThroughProfiler()
    for name, value in options.items():
        setattr(trainer.options, name, value)
    try:
        with _isolated_rng():
            yield
    finally:
        trainer.callbacks[:] = saved_callbacks
        trainer.loggers, trainer.profiler = saved_loggers, saved_profiler
        for name, value in saved_options.items():
            setattr(trainer.options, name, value)
        for field in dataclasses.fields(saved_state):
            setattr(trainer.state, field.name, getattr(saved_state, field.name))
        trainer.optimizers, trainer.lr_scheduler_configs = saved_optimizers, saved_configs
        trainer.should_stop = False


def _check_tuner_configuration(train_dataloaders: Any, val_dataloaders: Any, dataloaders: Any, method: str) -> None:
    """Lightning's checks of the loader arguments for ``method``."""
    if method not in _METHODS:
        raise ValueError(f"method {method!r} is invalid. Should be one of {_METHODS}.")
    if method == "fit":
        if dataloaders is not None:
            raise ValueError(
                f"In tuner with method={method!r}, `dataloaders` argument should be None, please consider setting "
                "`train_dataloaders` and `val_dataloaders` instead."
            )
    elif train_dataloaders is not None or val_dataloaders is not None:
        raise ValueError(
            f"In tuner with `method`={method!r}, `train_dataloaders` and `val_dataloaders` arguments should be None, "
            "please consider setting `dataloaders` instead."
        )


class Tuner:
    """Lightning's ``Tuner(trainer)``: :meth:`lr_find` and :meth:`scale_batch_size` run searches on ``trainer``
    before the real ``fit``, and leave the task, its optimizers and the Trainer as they found them (with the
    learning rate or batch size found set on the task, its ``hparams`` or the datamodule)::

        tuner = Tuner(trainer)
        lr_finder = tuner.lr_find(model, datamodule=dm)     # sets model.lr / model.hparams.lr to the suggestion
        fig = lr_finder.plot(suggest=True)                  # needs matplotlib
        tuner.scale_batch_size(model, datamodule=dm, mode="power")
        trainer.fit(model, datamodule=dm)

    Each search runs the Trainer's own stages (``fit``, or ``validate`` / ``test`` / ``predict``), so the task's
    hooks (``setup``, ``on_fit_start``, ``on_train_start``, ...) run for the search too, while the Trainer's callbacks
    and loggers sit it out. The learning-rate search runs on one device or under DDP (where every rank records the
    loss averaged over the ranks); the batch-size search on one process only.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def lr_find(
        self,
        model: TaskModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        method: Literal["fit", "validate", "test", "predict"] = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> LRFinder | None:
        """The learning-rate range test: ``num_training`` optimizer steps of ``fit`` with the learning rate rising
        from ``min_lr`` to ``max_lr`` (``mode``: ``"exponential"`` or ``"linear"``), recording the smoothed loss
        after each step; the search stops early once that loss exceeds ``early_stop_threshold`` times the best
        one (None: never). Then the weights, the optimizers and the Trainer are put back as they were and, with
        ``update_attr``, the suggestion (:meth:`LRFinder.suggestion`) is set as ``attr_name`` (by default ``lr``
        or ``learning_rate``) on the task, its ``hparams`` or the datamodule, and as the learning rate of the
        optimizers the search used.

        A loss that becomes NaN or inf ends the search at the end of that epoch at the latest (where keel's ``fit``
        checks for one; Lightning goes on to ``num_training``): the suggestion skips non-finite points in both.

        Returns:
            The :class:`LRFinder` (``results``, ``suggestion()``, ``plot()``); None under ``fast_dev_run``.

        Raises:
            ValueError: ``method`` is not ``"fit"``, a misplaced loader argument, ``mode`` unknown, the task has
                several optimizers, or a strategy other than one device or DDP.
            AttributeError: ``update_attr`` and no learning-rate attribute found.
        """
        if method != "fit":
            raise ValueError("method='fit' is the only valid configuration to run lr finder.")
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        if isinstance(train_dataloaders, DataModule):  # fit(model, dm), as Lightning allows
            datamodule, train_dataloaders = train_dataloaders, None
        trainer = self._trainer
        if trainer.strategy.name not in ("single", "ddp"):
            raise ValueError(
                f"Tuner.lr_find runs on one device or under DDP, not with strategy {trainer.strategy.name!r}: find "
                "the learning rate with a smaller model or on one device, then set it for the sharded run."
            )
        if trainer.fast_dev_run:
            rank_zero_warn("Skipping learning rate finder since `fast_dev_run` is enabled.")
            return None
        finder = LRFinder(mode.lower(), min_lr, max_lr, num_training)
        if update_attr:
            attr_name = _lr_attr_name(model, datamodule, attr_name)
        search, snapshot = _LRSearch(finder, early_stop_threshold), _Snapshot()
        with _searching(trainer, [snapshot, search], max_steps=num_training, limit_val_batches=num_training):
            try:
                trainer.fit(model, train_dataloaders, val_dataloaders, datamodule)
            except FloatingPointError:  # keel's fit stops after a NaN / inf loss: there the search ends
                if search.nonfinite_at is None:
                    raise
                log.info(
                    "LR finder: the loss became NaN or inf at step %d; the search stopped after %d steps.",
                    search.nonfinite_at,
                    search.steps,
                )
            finally:
                snapshot.restore(model)
        if search.steps != num_training and search.nonfinite_at is None:
            log.info("LR finder stopped early after %d steps due to diverging loss.", search.steps)
        size = min(len(search.lrs), len(search.losses))
        finder.results = {"lr": search.lrs[:size], "loss": search.losses[:size]}
        if update_attr:
            lr = finder.suggestion()
            if lr is not None:
                _set(model, datamodule, attr_name, lr)
                for optimizer, _ in snapshot.optimizers:
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                log.info("Learning rate set to %s", lr)
        return finder

    def scale_batch_size(
        self,
        model: TaskModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        method: Literal["fit", "validate", "test", "predict"] = "fit",
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> int | None:
        """The largest batch size that does not run out of memory: trials of ``steps_per_trial`` batches of
        ``method`` (``fit``, ``validate``, ``test`` or ``predict``), starting at ``init_val``. ``mode="power"``
        doubles the size after each trial that fits and halves it after the first that does not;
        ``"binsearch"`` then bisects between the two and takes ``margin`` (a fraction) off the result. At most
        ``max_trials`` trials, never beyond ``max_val``, never beyond the dataset's length. The batch size is
        ``batch_arg_name`` on the task, its ``hparams`` or the datamodule (the loaders must be built from it in
        the ``*_dataloader()`` hooks); it is left at the size found. Weights, optimizers and the Trainer are put
        back as they were.

        Returns:
            The batch size found; None under ``fast_dev_run``.

        Raises:
            ValueError: a bad argument, loaders passed directly, or a distributed run (find the per-device batch
                size on one process: it is the same under DDP).
            AttributeError: no ``batch_arg_name`` attribute found.
        """
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        if isinstance(train_dataloaders, DataModule):
            datamodule, train_dataloaders = train_dataloaders, None
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"`margin` should be between 0 and 1. Found {margin=}")
        mode = mode.lower()
        if mode not in _BATCH_SIZE_MODES:
            raise ValueError(f"`mode` should be either of {_BATCH_SIZE_MODES}")
        trainer = self._trainer
        if trainer.world_size > 1:
            raise ValueError(
                "Tuning the batch size is not supported with distributed strategies (as in Lightning): find the "
                "per-device batch size in one process (it is the same under DDP), then launch the job with it."
            )
        if any(loader is not None for loader in (train_dataloaders, val_dataloaders, dataloaders)):
            raise ValueError(
                "The batch size finder cannot be used with dataloaders passed directly to the Tuner: build them in "
                f"your LightningModule's or LightningDataModule's `*_dataloader()` hooks from `{batch_arg_name}`."
            )
        if trainer.fast_dev_run:
            rank_zero_warn("Skipping batch size scaler since `fast_dev_run` is enabled.")
            return None
        search = _BatchSizeSearch(
            trainer,
            model,
            datamodule,
            method=method,
            batch_arg_name=batch_arg_name,
            steps_per_trial=steps_per_trial,
            max_val=max_val,
        )
        search.check_attribute()
        snapshot = _Snapshot()
        with _searching(trainer, [snapshot], **search.options()):
            try:
                size, _ = search.adjust(value=init_val)
                if mode == "power":
                    size = search.power(size, max_trials)
                else:
                    size = search.binsearch(size, max_trials, margin)
                _free_device_memory()
                log.info("Finished batch size finder, will continue with full run using batch size %d", size)
            finally:
                snapshot.restore(model)
        return size
