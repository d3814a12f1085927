"""The validation, test and predict loops (the fit loop and the optimizer step are in trainer.py).

An :class:`EvaluationLoop` is built once by the Trainer with what every evaluation needs (device,
precision, the metric collector, the watchdog's beat) and is handed the rest per call: the trainer
object that callbacks receive as their first argument, the task, the callbacks, the adapted loaders
and their batch limits, and where reduced metrics go. It never reads the Trainer's private state.

Ranks: evaluation shards hold different numbers of batches, so nothing the task computes inside the batch loop
may communicate; the strategy hands out the batches (``Strategy.eval_batches``: under FSDP every rank takes part in
every forward's all-gathers, running the forwards of ranks with more batches without a batch of its own). The
epoch-end reduction (one per loader) and predict's gather are collectives every rank reaches once per loader
(docs/design.md sections 6 and 7).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch

from trainer.callback import Callback
from trainer.compat import is_keel_default, takes_batch_idx
from trainer.data.loaders import AdaptedLoader
from trainer.data.transfer import move_to_device
from trainer.distributed import comm
from trainer.distributed import watchdog as wd
from trainer.distributed.strategy import Strategy
from trainer.hooks import BatchTransfer, check_callback_dataloader_idx, check_task_dataloader_idx, overrides
from trainer.metrics import MetricCollector
from trainer.module import TaskModule
from trainer.step.precision import Precision

if TYPE_CHECKING:  # pragma: no cover
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

# publish(values, to_logger, to_bar): where the reduced epoch metrics of one loader go.
# The Trainer is imported for types only (no import circle at run time).
Publish = Callable[[dict[str, float], dict[str, float], dict[str, float]], None]


def log_results(stage: str, results: list[dict[str, float]], *, verbose: bool) -> list[dict[str, float]]:
    """``validate(verbose=True)`` / ``test(verbose=True)``: log each loader's metrics at INFO (the caller
    passes ``verbose`` False off rank 0), Lightning's results table as log lines; returns ``results``."""
    if verbose:
        for idx, metrics in enumerate(results):
            shown = ", ".join(f"{name}={value:.4g}" for name, value in sorted(metrics.items())) or "(nothing logged)"
            log.info("%s results%s: %s", stage.capitalize(), f" (dataloader {idx})" if len(results) > 1 else "", shown)
    return results


class BatchHooks:
    """The ``on_<stage>_batch_start`` / ``_end`` hooks of one evaluation or predict run that something overrides
    (the task's, then each callback's with ``(trainer, task)`` bound), resolved once per run, never per batch.

    Lightning's call: ``(batch, batch_idx)`` with one loader, ``(batch, batch_idx, dataloader_idx)`` with several
    (``on_*_batch_end`` takes ``outputs`` first); the loop builds that argument tuple once per batch. Checked here,
    before any hook runs, with Lightning's messages: the task's ``<stage>_step`` and batch hooks (Lightning's own
    check), and every callback's batch hooks against the call they will get (Lightning fails with a TypeError).
    """

    __slots__ = ("start", "end")

    def __init__(
        self, trainer: Trainer, task: TaskModule, callbacks: Sequence[Callback], stage: str, *, many: bool
    ) -> None:
        names = (f"on_{stage}_batch_start", f"on_{stage}_batch_end")
        step = "validation_step" if stage == "validation" else f"{stage}_step"
        check_task_dataloader_idx(task, stage, [n for n in (step, *names) if overrides(task, TaskModule, n)], many=many)
        resolved: list[tuple[Callable[..., Any], ...]] = []
        for name, leading in zip(names, (4, 5)):  # (trainer, task, [outputs,] batch, batch_idx)
            calls: list[Callable[..., Any]] = [getattr(task, name)] if overrides(task, TaskModule, name) else []
            for cb in callbacks:
                if overrides(cb, Callback, name):
                    check_callback_dataloader_idx(cb, name, stage, leading=leading, many=many)
                    calls.append(partial(getattr(cb, name), trainer, task))
            resolved.append(tuple(calls))
        self.start, self.end = resolved


class PredictionRecord:
    """What a predict run keeps for prediction writers, under the names of Lightning's ``trainer.predict_loop``
    (``callbacks.prediction_writer.BasePredictionWriter`` reads them; so may a Lightning program):

    * ``predictions``: this rank's outputs (on the CPU), kept when ``predict`` returns them or a writer writes at
      epoch end; the list of one loader's outputs, or one list per loader;
    * ``current_batch_indices``: the dataset indices of the batch being predicted (a writer writing per batch);
    * ``epoch_batch_indices``: per loader, per batch, the dataset indices (a writer writing at epoch end).

    keel knows a batch's dataset indices for the plain DataLoaders it shards (each rank's contiguous shard, in
    order); for a loader used as it is they stay empty, with a warning, as Lightning leaves them for a loader it
    cannot wrap.
    """

    def __init__(self) -> None:
        self.outputs: list[list[Any]] = []  # per loader
        self.current_batch_indices: list[int] = []
        self.epoch_batch_indices: list[list[list[int]]] = []
        self.indices: list[list[list[int]] | None] | None = None  # per loader, per batch; None: no writer
        self.on_batch = self.on_epoch = False

    @property
    def predictions(self) -> list[Any]:
        if len(self.outputs) == 1:
            return self.outputs[0]
        return self.outputs

    def start(self, loaders: Sequence[AdaptedLoader], callbacks: Sequence[Callback]) -> None:
        """A predict run over ``loaders`` begins: which of ``callbacks`` are writers, and every batch's indices."""
        # Writers live in callbacks/, which trainer/ never imports: known by their flag, their interval read as is.
        writers: list[Any] = [cb for cb in callbacks if getattr(cb, "is_prediction_writer", False)]
        intervals = [writer.interval for writer in writers]
        self.on_batch = any(interval.on_batch for interval in intervals)
        self.on_epoch = any(interval.on_epoch for interval in intervals)
        self.outputs = [[] for _ in loaders]
        self.epoch_batch_indices = [[] for _ in loaders]
        self.current_batch_indices = []
        self.indices = [_batch_indices(a) for a in loaders] if intervals else None

    def see(self, loader_idx: int, batch_idx: int) -> None:
        """Batch ``batch_idx`` of loader ``loader_idx`` is next (called only while a writer is present)."""
        assert self.indices is not None
        known = self.indices[loader_idx]
        if known is None:
            return
        indices = known[batch_idx]
        if self.on_epoch:
            self.epoch_batch_indices[loader_idx].append(indices)
        if self.on_batch:
            self.current_batch_indices = indices

    def finish(self, *, kept: bool) -> None:
        """After ``on_predict_epoch_end``: the outputs stay only when ``predict`` returns them (Lightning's)."""
        if not kept:
            self.outputs = []
        self.epoch_batch_indices, self.indices = [], None


def _batch_indices(adapted: AdaptedLoader) -> list[list[int]] | None:
    """Each batch's dataset indices in a loader keel shards (its batch sampler over this rank's contiguous shard);
    None, with a warning, for a loader used as it is."""
    batch_sampler = getattr(adapted.loader, "batch_sampler", None)
    if adapted.sampler is not None and batch_sampler is not None:
        return [list(indices) for indices in batch_sampler]
    warnings.warn(
        f"Couldn't infer the batch indices fetched from your dataloader: `{type(adapted.loader).__name__}` (keel "
        f"uses it as it is because {adapted.reason}): a prediction writer gets empty batch_indices for it.",
        UserWarning,
        stacklevel=5,
    )
    return None


class EvaluationLoop:
    """Runs ``validation_step`` / ``test_step`` / ``predict_step`` over sharded loaders under
    ``torch.no_grad()``, with the task in eval mode (restored to train mode afterwards if it was)."""

    def __init__(
        self,
        *,
        device: torch.device,
        precision: Precision,
        metrics: MetricCollector,
        beat: Callable[[str], None],
        strategy: Strategy,
    ) -> None:
        self.device = device
        self.strategy = strategy  # eval_context and eval_batches: under FSDP, every rank in every forward
        self.precision = precision
        self.metrics = metrics
        self.beat = beat
        self.prediction = PredictionRecord()  # the trainer's predict_loop: what prediction writers read

    def run(
        self,
        trainer: Trainer,
        task: TaskModule,
        callbacks: Sequence[Callback],
        stage: Literal["validate", "test"],
        loaders: list[AdaptedLoader],
        limits: list[int | None],
        *,
        publish: Publish | None,
        sanity: bool = False,
    ) -> list[dict[str, float]]:
        """One validation or test epoch over ``loaders`` (``limits[i]`` batches of loader i, None: all).

        Returns one dict of reduced epoch metrics per loader (the same on every rank). ``publish``
        receives them as they are reduced; None (the sanity check) discards them. ``sanity``: this is
        fit's sanity check (the callbacks' ``on_sanity_check_start`` / ``_end`` around it).

        Hooks, in order (the task's, then the callbacks'): ``on_{validation,test}_model_eval`` (task only;
        default ``task.eval()``), ``on_*_start``, ``on_*_epoch_start``, per batch ``on_*_batch_start``, the
        step, ``on_*_batch_end``; then ``on_*_epoch_end``, ``on_*_end`` and ``on_*_model_train`` (task only;
        unless overridden, every submodule gets back the training mode it had before). The step and the batch
        hooks get ``dataloader_idx`` only with several loaders, as in Lightning (:class:`BatchHooks`).
        """
        validating = stage == "validate"
        if sanity:
            for cb in callbacks:
                cb.on_sanity_check_start(trainer, task)
        # Resolved (and checked against Lightning's dataloader_idx rules) before any hook of the run.
        hooks = BatchHooks(trainer, task, callbacks, "validation" if validating else "test", many=len(loaders) > 1)
        was_training = task.training
        modes = [(m, m.training) for m in task.modules()]
        self._start(trainer, task, callbacks, validating=validating)
        self.metrics.stage = stage
        transfer = self._batch_transfer(trainer, task)
        results = self._run_loaders(task, hooks, transfer, loaders, limits, validating=validating, publish=publish)
        results.append(self._end(trainer, task, callbacks, len(loaders), validating=validating, publish=publish))
        if is_keel_default(task.on_validation_model_train if validating else task.on_test_model_train):
            for module, mode in modes:  # each submodule as it was (a frozen, eval-mode backbone stays so)
                module.train(mode)
        elif validating:
            task.on_validation_model_train()
        else:
            task.on_test_model_train()
        self.metrics.batch = None  # none in flight: self.log's defaults (trainer/metrics.py)
        if was_training:
            self.metrics.stage = "train"
        if sanity:
            for cb in callbacks:
                cb.on_sanity_check_end(trainer, task)
        return results

    def _start(self, trainer: Trainer, task: TaskModule, callbacks: Sequence[Callback], *, validating: bool) -> None:
        if validating:
            task.on_validation_model_eval()
            task.on_validation_start()
            for cb in callbacks:
                cb.on_validation_start(trainer, task)
            task.on_validation_epoch_start()
            for cb in callbacks:
                cb.on_validation_epoch_start(trainer, task)
        else:
            task.on_test_model_eval()
            task.on_test_start()
            for cb in callbacks:
                cb.on_test_start(trainer, task)
            task.on_test_epoch_start()
            for cb in callbacks:
                cb.on_test_epoch_start(trainer, task)

    def _run_loaders(
        self,
        task: TaskModule,
        hooks: BatchHooks,
        transfer: BatchTransfer | None,
        loaders: list[AdaptedLoader],
        limits: list[int | None],
        *,
        validating: bool,
        publish: Publish | None,
    ) -> list[dict[str, float]]:
        """The batches of every loader; the epoch metrics of each loader but the last, reduced (a collective)."""
        results: list[dict[str, float]] = []
        # The user's step: it takes dataloader_idx with several loaders, and may take no batch_idx (Lightning's).
        step: Callable[..., Any] = task.validation_step if validating else task.test_step
        with_idx = takes_batch_idx(step)  # Lightning calls validation_step(batch) when it takes no batch_idx
        phase = wd.PHASE_VALIDATION_STEP if validating else wd.PHASE_TEST_STEP
        many, starts, ends = len(loaders) > 1, hooks.start, hooks.end
        with torch.no_grad(), self.strategy.eval_context(task):
            for loader_idx, (adapted, limit) in enumerate(zip(loaders, limits)):
                for batch_idx, batch in self.strategy.eval_batches(adapted.loader, limit):
                    self.beat(phase)
                    if transfer is None:
                        batch = move_to_device(batch, self.device, float_dtype=self.precision.param_dtype)
                    else:
                        batch = transfer(batch, loader_idx)
                    self.metrics.batch = batch
                    args = (batch, batch_idx, loader_idx) if many else (batch, batch_idx)  # Lightning's call
                    for hook in starts:
                        hook(*args)
                    with self.precision.autocast():
                        outputs = step(*args) if many or with_idx else step(batch)
                    for hook in ends:
                        hook(outputs, *args)
                if loader_idx < len(loaders) - 1:
                    results.append(self._reduce(loader_idx, len(loaders), publish))
        return results

    def _batch_transfer(self, trainer: Trainer, task: TaskModule) -> BatchTransfer | None:
        """The run's batch-transfer hooks (trainer/hooks.py), or None when neither the task nor the datamodule
        overrides one: then each batch moves with :func:`move_to_device`, as always."""
        dtype = self.precision.param_dtype
        move = partial(move_to_device, device=self.device, float_dtype=dtype)
        return BatchTransfer.resolve(task, trainer.datamodule, device=self.device, float_dtype=dtype, move=move)

    def _end(
        self,
        trainer: Trainer,
        task: TaskModule,
        callbacks: Sequence[Callback],
        num_loaders: int,
        *,
        validating: bool,
        publish: Publish | None,
    ) -> dict[str, float]:
        """The epoch-end and end hooks; returns the last loader's reduced epoch metrics. The task's epoch-end
        hook may still log; callbacks then see the reduced epoch metrics."""
        if validating:
            task.on_validation_epoch_end()
            last = self._reduce(num_loaders - 1, num_loaders, publish)
            for cb in callbacks:
                cb.on_validation_epoch_end(trainer, task)
            task.on_validation_end()
            for cb in callbacks:
                cb.on_validation_end(trainer, task)
        else:
            task.on_test_epoch_end()
            last = self._reduce(num_loaders - 1, num_loaders, publish)
            for cb in callbacks:
                cb.on_test_epoch_end(trainer, task)
            task.on_test_end()
            for cb in callbacks:
                cb.on_test_end(trainer, task)
        return last

    def _reduce(self, loader_idx: int, num_loaders: int, publish: Publish | None) -> dict[str, float]:
        """Epoch metrics of one loader, reduced over ranks (a collective)."""
        values, to_logger, to_bar = self.metrics.reduce_epoch()
        if num_loaders > 1:
            suffix = f"/dataloader_idx_{loader_idx}"
            values, to_logger, to_bar = ({k + suffix: v for k, v in d.items()} for d in (values, to_logger, to_bar))
        if publish is not None:
            publish(values, to_logger, to_bar)
        return values

    def predict(
        self,
        trainer: Trainer,
        task: TaskModule,
        callbacks: Sequence[Callback],
        loaders: list[AdaptedLoader],
        limits: list[int | None],
        *,
        gather: str | None,
    ) -> list[Any] | None:
        """``predict_step`` over every loader; outputs moved to CPU and gathered in rank order, so each
        list is in dataset order (contiguous shards). ``gather``: ``"all_ranks"`` (every rank gets them),
        ``"rank_zero"`` (only rank 0 does: the others send theirs and return None) or None (nothing is kept or sent;
        callbacks still see each output in ``on_predict_batch_end``; every rank returns None). With several loaders
        the result is a list of such lists.

        For prediction writers (``callbacks.prediction_writer.BasePredictionWriter``), :attr:`prediction` (the
        trainer's ``predict_loop``) holds, as Lightning's does, this rank's own outputs and the dataset indices of
        each of its batches: never gathered, and kept for a writer that writes at epoch end also when ``gather`` is
        None.

        Hooks, in order (the task's, then the callbacks'): ``on_predict_model_eval`` (task only; default
        ``task.eval()``), ``on_predict_start``, ``on_predict_epoch_start``, per batch
        ``on_predict_batch_start``, ``predict_step``, ``on_predict_batch_end``; then ``on_predict_epoch_end``
        and ``on_predict_end``. The task stays in eval mode afterwards, as in Lightning. ``predict_step`` and the
        batch hooks get ``dataloader_idx`` only with several loaders (:class:`BatchHooks`)."""
        many = len(loaders) > 1
        hooks = BatchHooks(trainer, task, callbacks, "predict", many=many)  # checked before any hook runs
        starts, ends, transfer = hooks.start, hooks.end, self._batch_transfer(trainer, task)
        record = self.prediction
        record.start(loaders, callbacks)
        keep = gather is not None or record.on_epoch  # this rank's outputs, for the return value or a writer
        task.on_predict_model_eval()
        task.on_predict_start()
        for cb in callbacks:
            cb.on_predict_start(trainer, task)
        task.on_predict_epoch_start()
        for cb in callbacks:
            cb.on_predict_epoch_start(trainer, task)
        self.metrics.stage = "predict"
        results: list[list[Any] | None] = []
        # The user's predict_step takes dataloader_idx with several loaders, and may take no batch_idx (Lightning's
        # calls); keel's default, self(batch), takes neither.
        step: Callable[..., Any] = task.predict_step
        step_idx = many and not is_keel_default(step)
        with_idx = takes_batch_idx(step)
        with torch.no_grad(), self.strategy.eval_context(task):
            for loader_idx, (adapted, limit) in enumerate(zip(loaders, limits)):
                local = record.outputs[loader_idx]
                for batch_idx, batch in self.strategy.eval_batches(adapted.loader, limit):
                    if record.indices is not None:
                        record.see(loader_idx, batch_idx)
                    if transfer is None:
                        batch = move_to_device(batch, self.device, float_dtype=self.precision.param_dtype)
                    else:
                        batch = transfer(batch, loader_idx)
                    args = (batch, batch_idx, loader_idx) if many else (batch, batch_idx)  # Lightning's call
                    for hook in starts:
                        hook(*args)
                    with self.precision.autocast():
                        out = step(*args) if step_idx else step(batch, batch_idx) if with_idx else step(batch)
                    for hook in ends:
                        hook(out, *args)
                    if keep:
                        local.append(move_to_device(out, torch.device("cpu"), from_any_device=True))
                results.append(self._gathered(local, gather))
        task.on_predict_epoch_end()
        for cb in callbacks:
            cb.on_predict_epoch_end(trainer, task)  # a prediction writer writing at epoch end reads `record`
        record.finish(kept=gather is not None)
        task.on_predict_end()
        for cb in callbacks:
            cb.on_predict_end(trainer, task)
        if gather is None:
            return None
        return results[0] if len(results) == 1 else results

    def _gathered(self, local: list[Any], gather: str | None) -> list[Any] | None:
        """Every rank's outputs in rank order where ``gather`` says (a collective, but for None: nothing)."""
        if gather is None:
            return None
        if comm.get_world_size() == 1:
            return local
        gathered = comm.all_gather_object(local) if gather == "all_ranks" else comm.gather_object(local)
        if gathered is None:
            return None
        gathered = gathered[:: self.strategy.tensor_parallel_size]  # a tensor-parallel group predicts once
        return [item for rank_items in gathered for item in rank_items]
