"""ModelSummary: a table of the task's layers and its parameter counts, logged on rank 0 at fit start."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from trainer.callback import Callback

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerSummary:
    """One row of the table: a submodule's qualified name, class name and parameter count (its own and
    its children's)."""

    name: str
    type: str
    params: int


@dataclass(frozen=True)
class Summary:
    """What :class:`ModelSummary` logs. Shared parameters are counted once."""

    layers: list[LayerSummary]
    total_params: int
    trainable_params: int
    size_mb: float  # bytes of all parameters / 2**20

    @property
    def non_trainable_params(self) -> int:
        return self.total_params - self.trainable_params


def summarize(module: nn.Module, max_depth: int = 1) -> Summary:
    """Layers of ``module`` down to ``max_depth`` levels of nesting (-1: all; 0: none) and its totals."""
    layers = []
    if max_depth != 0:
        for name, sub in module.named_modules():
            depth = name.count(".") + 1
            if not name or (max_depth != -1 and depth > max_depth):
                continue
            layers.append(LayerSummary(name, type(sub).__name__, sum(p.numel() for p in sub.parameters())))
    params = list(module.parameters())  # unique parameters
    return Summary(
        layers=layers,
        total_params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        size_mb=sum(p.numel() * p.element_size() for p in params) / 2**20,
    )


def format_summary(summary: Summary) -> str:
    """The table as text: ``| idx | Name | Type | Params |`` rows, then the totals."""
    header = ("", "Name", "Type", "Params")
    rows = [(str(i), layer.name, layer.type, f"{layer.params:,}") for i, layer in enumerate(summary.layers)]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    lines = []
    if rows:
        fmt = "  ".join(f"{{:<{w}}}" if c < 3 else f"{{:>{w}}}" for c, w in enumerate(widths))
        lines.append(fmt.format(*header))
        lines.append("-" * len(lines[0]))
        lines += [fmt.format(*row) for row in rows]
        lines.append("-" * len(lines[0]))
    lines += [
        f"{summary.trainable_params:,} trainable params",
        f"{summary.non_trainable_params:,} non-trainable params",
        f"{summary.total_params:,} total params",
        f"{summary.size_mb:.3f} total estimated model params size (MB)",
    ]
    return "\n".join(lines)


class ModelSummary(Callback):
    """Logs a table of the task's submodules (name, type, parameters) and its parameter totals.

    It runs in ``on_fit_start``, on global rank 0 only (a side effect; nothing is communicated), at INFO.

    Args:
        max_depth: Nesting depth of the listed submodules: 1 lists the task's direct children, -1 every
            submodule, 0 only the totals.

    Raises:
        ValueError: ``max_depth`` is not an integer >= -1.
    """

    is_model_summary = True  # lets the Trainer skip its own one-line summary (see the callbacks report)

    def __init__(self, max_depth: int = 1) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(f"ModelSummary(max_depth={max_depth!r}): expected an integer >= -1.")
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Trainer, task: TaskModule) -> None:
        if not trainer.is_global_zero:
            return
        summary = summarize(task, self.max_depth)
        log.info("%s summary:\n%s", type(task).__name__, format_summary(summary))
