"""``self.log`` storage and cross-rank reduction.

Values stay where they were logged (on the device) until a logging step or an epoch end; then every
rank calls :meth:`MetricCollector.reduce_step` / :meth:`MetricCollector.reduce_epoch` at the same
point of the loop. Each does one host read of the local values (one stacked copy) and one
``all_gather_object`` of a small dict, so a key logged on only some ranks reduces over the ranks that
logged it instead of hanging a collective that other ranks never enter. The step reduction, on every
logging step, takes a shorter road when every rank logged the same names (the usual case, told by a
hash of the names in one small all-reduce): one all-gather of the values, no pickling.

Cross-rank reduction follows Lightning's ``self.log`` arguments:

* ``reduce_fx`` ("mean", "sum", "max", "min"; Lightning's "avg" and ``torch.mean``/``torch.sum``/
  ``torch.max``/``torch.min`` are accepted too) reduces over the batches of an epoch AND over the ranks,
  for epoch and step values alike. An epoch "mean" is weighted by ``batch_size`` (global sums and
  weights, so N ranks give the one-process value); a step "mean" is the plain mean over the ranks.
* ``rank_zero_only=True``: rank 0's value is used as is, on every rank (no cross-rank reduction; other
  ranks' values of that name are ignored).
* ``sync_dist`` is accepted and has no effect: keel always reduces, at logging steps and epoch ends only,
  so every rank sees the same ``callback_metrics`` (docs/design.md section 7) at no per-step cost.

Metric objects (a torchmetrics ``Metric`` or anything with callable ``compute`` and ``reset``; keel never
imports torchmetrics): the collector keeps a reference, never calls ``update`` (the task does, as in
Lightning) and

* at the epoch end (``on_epoch=True``: the default in validation and test) calls ``compute()`` and then
  ``reset()``. ``compute()`` is the metric's own distributed sync, so its result is already global: keel
  uses it as is (rank 0's, if ranks disagree; ``reduce_fx`` does not apply) and never reduces it again.
  ``reset()`` runs at the end of the epoch of every metric object logged in it, ``on_epoch`` or not;
* at a training logging step (``on_step=True``) logs ``compute()`` of the RUNNING state, i.e. the metric
  over everything since its last reset (the start of the epoch), not Lightning's value of the last batch
  alone (Lightning logs ``forward``'s return value). To log the batch value, log the tensor that
  ``metric(preds, target)`` returns instead of the object.

``compute()`` of a torchmetrics metric is a collective under DDP: every rank must log the same metric
objects in the same order (the natural case: the same ``validation_step`` on every rank).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainer.data.transfer import infer_batch_size, read_to_host
from trainer.distributed import comm

log = logging.getLogger(__name__)

REDUCE_FX = ("mean", "sum", "max", "min")
_REDUCE_FX_ALIASES: dict[Any, str] = {
    "avg": "mean",
    torch.mean: "mean",
    torch.sum: "sum",
    torch.max: "max",
    torch.min: "min",
}

# How a value combines over ranks: "reduce" with its reduce_fx; "rank_zero": rank 0's value as is;
# "global": already global (a metric object's compute()), taken from the lowest rank that logged it.
Mode = Literal["reduce", "rank_zero", "global"]


def logged_step(global_step: int, *, in_fit_step: bool) -> int:
    """The ``step`` the loggers receive: Lightning 2.6's axis (its ``fit_loop.epoch_loop._batches_that_stepped``).

    ``in_fit_step``: the values were measured in ``fit`` after the N-th optimizer step and before the next batch
    (its step metrics, a validation it triggers) or are the epoch's aggregates; they are logged at step N - 1,
    the 0-based index of that step. Otherwise (``validate`` / ``test``, the hooks between batches) the step is
    ``global_step``, the number of optimizer steps done. Never negative.
    """
    return global_step - 1 if in_fit_step and global_step > 0 else global_step


def logger_row(metrics: dict[str, float], epoch: int, global_step: int, fitting: bool) -> tuple[dict[str, float], int]:
    """The row and step that ``self.log`` values go to the loggers with, as in Lightning 2.6: at
    :func:`logged_step` (every row ``fit`` logs is ``in_fit_step``), with ``epoch`` added unless the task logged
    one; a logged ``step`` value is the row's step instead (removed from the row, and no ``epoch`` added)."""
    row = dict(metrics)
    if "step" in row:
        return row, int(row.pop("step"))
    row.setdefault("epoch", epoch)
    return row, logged_step(global_step, in_fit_step=fitting)


def is_metric_object(value: Any) -> bool:
    """True for a torchmetrics ``Metric`` or any object with callable ``compute`` and ``reset``."""
    return (
        not isinstance(value, torch.Tensor)
        and callable(getattr(value, "compute", None))
        and callable(getattr(value, "reset", None))
    )


def normalise_reduce_fx(name: str, reduce_fx: Any) -> str:
    """``reduce_fx`` as one of :data:`REDUCE_FX`, accepting Lightning's spellings."""
    try:
        fx = _REDUCE_FX_ALIASES.get(reduce_fx, reduce_fx)
    except TypeError:  # unhashable
        fx = reduce_fx
    if fx not in REDUCE_FX:
        raise ValueError(
            f"self.log({name!r}, reduce_fx={reduce_fx!r}): expected one of {REDUCE_FX} "
            "(or torch.mean / torch.sum / torch.max / torch.min)."
        )
    return fx


@dataclass
class _Entry:
    """One value metric of the current epoch: a weighted sum (mean) or a running sum/max/min."""

    total: torch.Tensor | float
    weight: float
    reduce_fx: str
    prog_bar: bool
    logger: bool
    out_name: str
    mode: Mode


@dataclass
class _MetricRef:
    """A metric object logged in the current epoch: ``compute()`` at the end if ``publish``, then ``reset()``."""

    metric: Any
    publish: bool
    prog_bar: bool
    logger: bool
    out_name: str
    mode: Mode


@dataclass
class _StepValue:
    """The latest value of a step metric (a scalar, or a metric object read at the logging step)."""

    value: Any
    reduce_fx: str
    prog_bar: bool
    logger: bool
    mode: Mode


def _combine(fx: str, a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor | float:
    """Fold a new value ``b`` (already weighted for "mean") into the running aggregate ``a``."""
    if fx in ("mean", "sum"):
        return a + b
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        return torch.maximum(a, b.to(a.device)) if fx == "max" else torch.minimum(a, b.to(a.device))
    return max(a, b) if fx == "max" else min(a, b)


def _to_scalar(name: str, value: Any) -> torch.Tensor | float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; log a scalar "
                "(e.g. value.mean()) or one metric per element."
            )
        value = value.detach()
        return value if value.dim() == 0 else value.reshape(())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            return float(value)  # numpy scalars and other number-likes
        except (TypeError, ValueError):
            raise ValueError(
                f"self.log({name!r}, ...) got {type(value).__name__}; expected a scalar tensor, a number, or a "
                "metric object (with compute() and reset(), e.g. a torchmetrics Metric)."
            ) from None
    return float(value)


def _compute(name: str, metric: Any) -> torch.Tensor | float:
    """``metric.compute()`` as a scalar (a collective for torchmetrics under DDP)."""
    value = metric.compute()
    if isinstance(value, dict):
        raise ValueError(
            f"self.log({name!r}, {type(metric).__name__}): compute() returned a dict "
            f"({sorted(value)}); log a collection with self.log_dict(collection) instead."
        )
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(
            f"self.log({name!r}, {type(metric).__name__}): compute() returned a tensor of shape "
            f"{tuple(value.shape)}; self.log needs a scalar (e.g. average='macro', or log one value per class)."
        )
    return _to_scalar(name, value)


def _read(values: list[torch.Tensor | float], also: Sequence[torch.Tensor] = ()) -> tuple[list[float], list[float]]:
    """Host copies of ``values`` (scalars) and of the tensors ``also`` (flattened, in order) with ONE
    device-to-host transfer for all of them (a sync point)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    flat = read_to_host(tensors + list(also))
    read = iter(flat[: len(tensors)])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values], flat[len(tensors) :]


def _exchange(
    local: dict[str, tuple[Any, ...]], flags: list[float], device: torch.device | None, row: Sequence[float] = ()
) -> tuple[list[dict[str, tuple[Any, ...]]], list[float], list[list[float]]]:
    """Every rank's ``local`` (name -> (value, options...)), the max over ranks of ``flags``, and every rank's
    ``row`` (numbers >= 0, the same count on every rank).

    The layout (names and options, not values) is hashed into 48 bits, exact in float64; one all-reduce
    (max) of ``[hash, -hash, *flags, *slots]`` tells whether every rank has the same layout (max == min), where
    ``slots`` holds one ``row`` a rank, this rank's in its own place and zeros elsewhere, so the maximum is every
    rank's row. Then one all-gather of the values rebuilds each rank's dict; otherwise the dicts travel pickled."""
    world = comm.get_world_size() if comm.is_initialized() else 1
    if world == 1:
        return [local], flags, [list(row)]
    width, at = len(row), 2 + len(flags)
    slots = [0.0] * (world * width)
    if width:
        rank = comm.get_rank()
        slots[rank * width : (rank + 1) * width] = row
    layout = repr([(name, *rest[1:]) for name, rest in local.items()]).encode()
    digest = float(int.from_bytes(hashlib.blake2b(layout, digest_size=6).digest(), "big"))
    head = comm.all_reduce(
        torch.tensor([digest, -digest, *flags, *slots], dtype=torch.float64, device=device), "max"
    ).tolist()
    rows = [head[at + r * width : at + (r + 1) * width] for r in range(world)]
    if head[0] != -head[1]:  # ranks logged different names or options
        return comm.all_gather_object(local), head[2:at], rows
    names = list(local)
    if not names:
        return [{} for _ in range(world)], head[2:at], rows
    values = torch.tensor([local[n][0] for n in names], dtype=torch.float64, device=device)
    gathered = torch.stack(comm.all_gather_tensor(values)).tolist()
    return [{n: (g[i], *local[n][1:]) for i, n in enumerate(names)} for g in gathered], head[2:at], rows


class MetricCollector:
    """Collects ``self.log`` calls for the loop that is running (``stage``).

    Training and evaluation keep separate epoch states: a validation run inside a training epoch reduces
    only what the validation loop logged, and the training epoch's aggregates stay until its own end.
    """

    rows: list[list[float]] = []  # every rank's ``row`` of the last exchange_step

    def __init__(self, *, replica_ranks: int = 1) -> None:
        """
        Args:
            replica_ranks: Consecutive ranks that compute one replica's values together (tensor parallelism):
                their values are the same, so ranks reduce over one rank per replica (a sum is not counted twice).
        """
        self.replica_ranks = replica_ranks
        self.stage: str = "train"
        # The loop stores the current batch (None between batches); its size (a shape read, no sync) is inferred
        # only when a self.log call needs it, so steps that log nothing never walk the batch.
        self.batch: Any = None
        self._batch_size: tuple[Any, int | None] | None = None  # (batch, its size) of the last inference
        self._step: dict[str, _StepValue] = {}
        self._epochs: dict[str, dict[str, _Entry | _MetricRef]] = {"train": {}, "eval": {}}
        self._warned: set[str] = set()
        # The Trainer's callback_metrics: training values logged with on_step=True land here as logged
        # (device tensors, this rank's value: no sync, as in Lightning); logging steps and epoch ends
        # then overwrite them with the values reduced over ranks.
        self.live: dict[str, torch.Tensor] = {}
        self._in_stage = False  # reset() ran: a Trainer stage drives this collector (see log's defaults)
        # A training value logged with on_step=True and on_epoch=True is "<name>_step" / "<name>_epoch" for the
        # loggers and the progress bar; callback_metrics (live) also holds "<name>" (Lightning's): the latest step
        # value during the epoch, the epoch value after it (reduced over ranks like the others). Forked -> name.
        self._forks: dict[str, str] = {}
        # Every name self.log was given in this stage, with the names it forks into: what a ModelCheckpoint
        # monitor can refer to once the sanity check and the first step have run.
        self.seen: set[str] = set()

    @property
    def batch_size(self) -> int | None:
        """Size of the first dimension of the first tensor of the current batch (None: no tensor)."""
        cached = self._batch_size
        if cached is None or cached[0] is not self.batch:
            cached = self._batch_size = (self.batch, infer_batch_size(self.batch))
        return cached[1]

    @property
    def _epoch(self) -> dict[str, _Entry | _MetricRef]:
        """The epoch state of the running loop ("train", or "eval" for validation / test / sanity)."""
        return self._epochs["train" if self.stage == "train" else "eval"]

    # ------------------------------------------------------------------ recording
    def log_loss(self, loss: torch.Tensor) -> None:
        """The step's optimised loss as ``loss`` in the progress bar (not sent to the loggers) when the task shows
        nothing of its own there; Lightning 2 shows nothing then, and a task that shows its loss under its own
        name does not get it twice."""
        if any(value.prog_bar for value in self._step.values()) or any(
            entry.prog_bar for entry in self._epochs["train"].values()
        ):
            return
        self.log(
            "loss", loss, on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=None, reduce_fx="mean"
        )

    def log(
        self,
        name: str,
        value: Any,
        *,
        on_step: bool | None,
        on_epoch: bool | None,
        prog_bar: bool,
        logger: bool,
        batch_size: int | None,
        reduce_fx: Any,
        rank_zero_only: bool = False,
    ) -> None:
        """Record one ``self.log`` call (see the module docstring for the reduction rules).

        Raises:
            ValueError: for an empty name, an unknown ``reduce_fx``, a non-scalar or non-numeric value,
                or a name whose kind (value or metric object) or ``reduce_fx`` changed within an epoch.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"self.log: metric name must be a non-empty str, got {name!r}.")
        reduce_fx = normalise_reduce_fx(name, reduce_fx)
        training = self.stage == "train"
        # Lightning's defaults: step values in the training step and the batch hooks; epoch values in evaluation
        # and in the training hooks between batches (on_train_start, on_train_epoch_start / _end: no batch).
        in_batch = training and not (self.batch is None and self._in_stage)
        on_step = in_batch if on_step is None else on_step
        on_epoch = (not in_batch) if on_epoch is None else on_epoch
        if not training:
            on_step = False  # evaluation metrics are epoch aggregates (per-batch values: use a callback)
            on_epoch = True
        epoch = self._epoch
        step_name = f"{name}_step" if on_epoch else name
        if on_step and on_epoch and step_name not in self._forks:
            self._forks[step_name] = self._forks[f"{name}_epoch"] = name
            self.seen.update((step_name, f"{name}_epoch"))
        self.seen.add(name)
        if is_metric_object(value):
            mode: Mode = "rank_zero" if rank_zero_only else "global"
            ref = epoch.get(name)
            if ref is None:
                out_name = f"{name}_epoch" if on_step else name
                epoch[name] = _MetricRef(value, on_epoch, prog_bar, logger, out_name, mode)
            elif not isinstance(ref, _MetricRef) or ref.metric is not value:
                raise ValueError(
                    f"self.log({name!r}, ...): this epoch already logged "
                    f"{'a value' if isinstance(ref, _Entry) else 'another metric object'} under this name; log "
                    "one metric object per name (create it in __init__, not in the step)."
                )
            if on_step:
                self._step[step_name] = _StepValue(value, reduce_fx, prog_bar, logger, mode)
            return
        mode = "rank_zero" if rank_zero_only else "reduce"
        scalar = _to_scalar(name, value)
        if on_step:
            self._step[step_name] = _StepValue(scalar, reduce_fx, prog_bar, logger, mode)
            live = scalar if isinstance(scalar, torch.Tensor) else torch.tensor(scalar, dtype=torch.float64)
            self.live[step_name] = live
            if on_epoch:
                self.live[name] = live
        if on_epoch:
            weight = float(batch_size if batch_size is not None else (self.batch_size or 1))
            if isinstance(scalar, torch.Tensor):
                scalar = scalar.to(torch.float64)  # accumulate in float64 on the device
            entry = epoch.get(name)
            if entry is None:
                total = scalar * weight if reduce_fx == "mean" else scalar
                out_name = f"{name}_epoch" if on_step else name
                epoch[name] = _Entry(total, weight, reduce_fx, prog_bar, logger, out_name, mode)
            elif isinstance(entry, _MetricRef):
                raise ValueError(
                    f"self.log({name!r}, ...): this epoch logged a metric object under this name; "
                    "log either the object or values, not both."
                )
            else:
                if entry.reduce_fx != reduce_fx:
                    raise ValueError(
                        f"self.log({name!r}): reduce_fx changed from {entry.reduce_fx!r} to {reduce_fx!r}."
                    )
                entry.total = _combine(reduce_fx, entry.total, scalar * weight if reduce_fx == "mean" else scalar)
                entry.weight += weight

    # ------------------------------------------------------------------ reduction (collective: all ranks)
    def reduce_step(
        self,
        *,
        device: torch.device | None = None,
        flags: Sequence[float] = (),
    ) -> tuple[dict[str, float], dict[str, float], dict[str, float], list[float]]:
        """Reduce the latest per-step values across ranks with each one's ``reduce_fx`` (see module doc).

        :meth:`read_step` then :meth:`exchange_step`. Returns ``(all, for_logger, for_progress_bar, max
        of flags)`` and clears the step values. Collective: all ranks call it at the same step.
        """
        return self.exchange_step(self.read_step()[0], device=device, flags=flags)

    def read_step(self, also: Sequence[torch.Tensor] = ()) -> tuple[dict[str, tuple[Any, ...]], list[float]]:
        """This rank's step values on the host, and the host values of the tensors ``also`` (flattened, in
        order), in ONE device-to-host transfer (a logging step's only sync in one process); clears the
        step values.

        Metric objects are read with ``compute()`` here (their own collective)."""
        names = list(self._step)
        items = [self._step[n] for n in names]
        values = [_compute(n, s.value) if is_metric_object(s.value) else s.value for n, s in zip(names, items)]
        read, extra = _read(values, also)
        self._step.clear()
        local = {n: (v, s.reduce_fx, s.mode, s.prog_bar, s.logger) for n, v, s in zip(names, read, items)}
        return local, extra

    def exchange_step(
        self,
        local: dict[str, tuple[Any, ...]],
        *,
        device: torch.device | None = None,
        flags: Sequence[float] = (),
        row: Sequence[float] = (),
    ) -> tuple[dict[str, float], dict[str, float], dict[str, float], list[float]]:
        """Reduce what :meth:`read_step` returned across ranks. ``flags``: numbers of this rank (the loop's
        "non-finite loss seen") whose maximum over ranks rides on the same collectives. With several
        ranks: one small all-reduce and one all-gather of the values when every rank logged the same
        names (the usual case; else one ``all_gather_object``). ``device``: where the collectives'
        tensors live (nccl: CUDA). ``row``: numbers of this rank (its phase times) that every rank receives on
        the same all-reduce, in :attr:`rows` (one list a rank). Returns ``(all, for_logger, for_progress_bar,
        max of flags)``."""
        per_rank, reduced_flags, self.rows = _exchange(local, list(flags), device, row)
        gathered: dict[str, list[tuple[int, float, float]]] = {}
        options: dict[str, tuple[str, Mode, bool, bool]] = {}
        for rank, rank_values in enumerate(per_rank):
            for name, (value, fx, mode, bar, logger) in rank_values.items():
                gathered.setdefault(name, []).append((rank, value, 1.0))
                options.setdefault(name, (fx, mode, bar, logger))
        return (*self._finish(gathered, options, step=True), reduced_flags)

    def reduce_epoch(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """Reduce the epoch aggregates across ranks exactly (weighted means use global sums and weights);
        ``compute()`` then ``reset()`` the metric objects logged in this epoch.

        Returns ``(all, for_logger, for_progress_bar)`` and clears the epoch state. Collective.
        """
        key = "train" if self.stage == "train" else "eval"
        epoch, self._epochs[key] = self._epochs[key], {}
        names = [n for n, e in epoch.items() if isinstance(e, _Entry) or e.publish]
        entries = [epoch[n] for n in names]
        values: list[torch.Tensor | float] = []
        for name, entry in zip(names, entries):
            values.append(entry.total if isinstance(entry, _Entry) else _compute(name, entry.metric))
        for entry in epoch.values():
            if isinstance(entry, _MetricRef):
                entry.metric.reset()  # after compute(): the next epoch starts from an empty state
        local = {}
        for value, entry in zip(_read(values)[0], entries):
            weight, fx = (entry.weight, entry.reduce_fx) if isinstance(entry, _Entry) else (1.0, "mean")
            local[entry.out_name] = (value, weight, fx, entry.mode, entry.prog_bar, entry.logger)
        gathered: dict[str, list[tuple[int, float, float]]] = {}
        flags: dict[str, tuple[str, Mode, bool, bool]] = {}
        for rank, rank_values in enumerate(comm.all_gather_object(local)):
            for name, (value, weight, fx, mode, bar, logger) in rank_values.items():
                gathered.setdefault(name, []).append((rank, value, weight))
                flags.setdefault(name, (fx, mode, bar, logger))
        return self._finish(gathered, flags, step=False)

    def _finish(
        self,
        gathered: dict[str, list[tuple[int, float, float]]],
        flags: dict[str, tuple[str, Mode, bool, bool]],
        *,
        step: bool,
    ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """Combine the per-rank ``(rank, value, weight)`` of each name: host maths on gathered floats."""
        reduced: dict[str, float] = {}
        logger: dict[str, float] = {}
        bar: dict[str, float] = {}
        for name, items in gathered.items():
            fx, mode, to_bar, to_logger = flags[name]
            if self.replica_ranks > 1:  # the first rank of each tensor-parallel group speaks for it
                items = [i for i in items if i[0] % self.replica_ranks == 0]
            if mode == "rank_zero":
                items = [i for i in items if i[0] == 0]
                if not items:
                    self._warn_once(
                        name, f"self.log({name!r}, rank_zero_only=True) was not logged on rank 0; the value is dropped."
                    )
                    continue
            elif mode == "global":
                first = items[0][1]
                if any(not math.isclose(i[1], first, rel_tol=1e-6, abs_tol=1e-12) for i in items[1:]):
                    self._warn_once(
                        name,
                        f"metric object {name!r}: compute() gave different values on different "
                        "ranks (it does not sync across processes); keel uses rank "
                        f"{items[0][0]}'s value.",
                    )
                items = items[:1]
            value = items[0][1] if mode == "global" else _reduce_items(fx, items, step=step)
            reduced[name] = value
            if to_logger:
                logger[name] = value
            if to_bar:
                bar[name] = value
        for forked, name in self._forks.items():  # Lightning's un-suffixed name: callback_metrics (live) only
            if forked in reduced:
                self.live[name] = torch.scalar_tensor(reduced[forked], dtype=torch.float64)
        return reduced, logger, bar

    def _warn_once(self, name: str, message: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            if comm.is_rank_zero():
                log.warning(message)

    def reset(self) -> None:
        """Forget every value and metric-object reference (the objects themselves are not reset). The Trainer
        calls it at the start of every stage: from then on ``batch`` None means no batch in flight."""
        self._in_stage = True
        self._step.clear()
        self._forks.clear()
        self.seen.clear()
        for state in self._epochs.values():
            state.clear()


def _reduce_items(fx: str, items: list[tuple[int, float, float]], *, step: bool) -> float:
    """One metric's ``(rank, value, weight)`` items reduced with its ``reduce_fx``: a step value's mean is the plain
    mean of each rank's latest value; an epoch's is the weighted sum over batches and ranks over the total weight."""
    values = [i[1] for i in items]
    if fx == "mean":
        if step:
            return math.fsum(values) / len(values)
        weight = math.fsum(i[2] for i in items)
        return math.fsum(values) / weight if weight > 0 else float("nan")
    if fx == "sum":
        return math.fsum(values)
    return max(values) if fx == "max" else min(values)
