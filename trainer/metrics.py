"""``self.log`` storage and cross-rank reduction.

Values stay where they were logged (on the device) until a logging step or an epoch end; then every
rank calls :meth:`MetricCollector.reduce_step` / :meth:`MetricCollector.reduce_epoch` at the same
point of the loop. Each does one host read of the local values (one stacked copy) and one
``all_gather_object`` of a small dict, so a key logged on only some ranks reduces over the ranks that
logged it instead of hanging a collective that other ranks never enter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from trainer import dist

REDUCE_FX = ("mean", "sum", "max", "min")


@dataclass
class _Entry:
    """One metric of the current epoch: a weighted sum (mean) or a running sum/max/min."""

    total: torch.Tensor | float
    weight: float
    reduce_fx: str
    prog_bar: bool
    logger: bool
    out_name: str


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
        return value.detach().reshape(())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            return float(value)  # numpy scalars and other number-likes
        except (TypeError, ValueError):
            raise ValueError(
                f"self.log({name!r}, ...) got {type(value).__name__}; expected a scalar tensor or a number."
            ) from None
    return float(value)


def _read(values: list[torch.Tensor | float]) -> list[float]:
    """Host copies of ``values`` with ONE device-to-host transfer for all tensors (a sync point)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.to(torch.float64) for t in tensors]).tolist()) if tensors else iter(())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


class MetricCollector:
    """Collects ``self.log`` calls for the loop that is running (``stage``)."""

    def __init__(self) -> None:
        self.stage: str = "train"
        self.batch_size: int | None = None  # set by the loop from the current batch (shape read, no sync)
        self._step: dict[str, tuple[torch.Tensor | float, bool, bool]] = {}
        self._epoch: dict[str, _Entry] = {}

    # ------------------------------------------------------------------ recording
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
        reduce_fx: str,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"self.log: metric name must be a non-empty str, got {name!r}.")
        if reduce_fx not in REDUCE_FX:
            raise ValueError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): expected one of {REDUCE_FX}.")
        training = self.stage == "train"
        on_step = training if on_step is None else on_step
        on_epoch = (not training) if on_epoch is None else on_epoch
        if not training:
            on_step = False  # evaluation metrics are epoch aggregates (per-batch values: use a callback)
            on_epoch = True
        scalar = _to_scalar(name, value)
        if on_step:
            self._step[f"{name}_step" if on_epoch else name] = (scalar, prog_bar, logger)
        if on_epoch:
            weight = float(batch_size if batch_size is not None else (self.batch_size or 1))
            if isinstance(scalar, torch.Tensor):
                scalar = scalar.to(torch.float64)  # accumulate in float64 on the device
            entry = self._epoch.get(name)
            if entry is None:
                total = scalar * weight if reduce_fx == "mean" else scalar
                out_name = f"{name}_epoch" if on_step else name
                self._epoch[name] = _Entry(total, weight, reduce_fx, prog_bar, logger, out_name)
            else:
                if entry.reduce_fx != reduce_fx:
                    raise ValueError(f"self.log({name!r}): reduce_fx changed from {entry.reduce_fx!r} to {reduce_fx!r}.")
                entry.total = _combine(reduce_fx, entry.total, scalar * weight if reduce_fx == "mean" else scalar)
                entry.weight += weight

    def has_step_metrics(self) -> bool:
        return bool(self._step)

    # ------------------------------------------------------------------ reduction (collective: all ranks)
    def reduce_step(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """Reduce the latest per-step values across ranks (mean over ranks that logged each key).

        Returns ``(all, for_logger, for_progress_bar)`` and clears the step values. All ranks must call
        it at the same step (it does one ``all_gather_object``).
        """
        names = list(self._step)
        local = dict(zip(names, _read([self._step[n][0] for n in names])))
        flags = {n: self._step[n][1:] for n in names}
        self._step.clear()
        merged: dict[str, list[float]] = {}
        all_flags: dict[str, tuple[bool, bool]] = {}
        for values, rank_flags in dist.all_gather_object((local, flags)):
            for name, v in values.items():
                merged.setdefault(name, []).append(v)
            all_flags.update(rank_flags)
        reduced = {name: math.fsum(vs) / len(vs) for name, vs in merged.items()}
        return (
            reduced,
            {n: v for n, v in reduced.items() if all_flags[n][1]},
            {n: v for n, v in reduced.items() if all_flags[n][0]},
        )

    def reduce_epoch(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """Reduce the epoch aggregates across ranks exactly (weighted means use global sums and weights).

        Returns ``(all, for_logger, for_progress_bar)`` and clears the epoch state. Collective.
        """
        names = list(self._epoch)
        entries = [self._epoch[n] for n in names]
        totals = _read([e.total for e in entries])
        local = {e.out_name: (t, e.weight, e.reduce_fx, e.prog_bar, e.logger) for t, e in zip(totals, entries)}
        self._epoch.clear()
        gathered: dict[str, list[tuple[float, float, str, bool, bool]]] = {}
        for rank_values in dist.all_gather_object(local):
            for name, item in rank_values.items():
                gathered.setdefault(name, []).append(item)
        reduced: dict[str, float] = {}
        logger: dict[str, float] = {}
        bar: dict[str, float] = {}
        for name, items in gathered.items():
            fx = items[0][2]
            if fx == "mean":
                weight = math.fsum(i[1] for i in items)
                value = math.fsum(i[0] for i in items) / weight if weight > 0 else float("nan")
            elif fx == "sum":
                value = math.fsum(i[0] for i in items)
            elif fx == "max":
                value = max(i[0] for i in items)
            else:
                value = min(i[0] for i in items)
            reduced[name] = value
            if items[0][4]:
                logger[name] = value
            if items[0][3]:
                bar[name] = value
        return reduced, logger, bar

    def reset(self) -> None:
        self._step.clear()
        self._epoch.clear()
