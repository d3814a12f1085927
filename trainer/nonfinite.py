"""``on_nonfinite="error"``: a NaN or inf loss at ANY step stops training, naming the first bad step.

Checking every step's loss on the host would sync every step (DESIGN.md section 11). Instead the loop
hands each optimizer step's loss (a detached device scalar) to :meth:`NonFiniteGuard.record`, which only
keeps the reference; every so many steps the kept losses are folded on the device into (any bad, first bad
index, its loss) (a few kernels, no host read; the step numbers stay on the host). :meth:`NonFiniteGuard.check` reads that scalar once and agrees
on it across ranks; the loop calls it where it syncs anyway: on logging steps, at epoch ends, before
every checkpoint and at the end of ``fit``. All ranks call it at the same points, so all of them raise
together, naming the same step.
"""

from __future__ import annotations

import math

import torch

from trainer import dist

_FOLD_EVERY = 1024  # kept references before a device-side fold (bounds the list, never syncs)
_NONE = float("inf")  # "no bad step" on the device


class NonFiniteGuard:
    """Remembers the first optimizer step whose loss was NaN or inf, on the device, until :meth:`check`.

    Args:
        enabled: ``on_nonfinite == "error"``; when False, :meth:`record` is never needed and
            :meth:`check` only forgets what was recorded.
        world_size: ranks that must agree (one collective per check when > 1).
        device: where the fold runs.
    """

    def __init__(self, *, enabled: bool, world_size: int, device: torch.device) -> None:
        self.enabled = enabled
        self.world_size = world_size
        self.device = device
        self.reset()

    def reset(self) -> None:
        self._steps: list[int] = []
        self._losses: list[torch.Tensor] = []
        # One entry per fold: (any bad, index of the first bad, its loss) on the device, and the fold's steps.
        self._folds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]] = []

    def record(self, step: int, loss: torch.Tensor | None) -> None:
        """The loss of optimizer step ``step`` (after the step). A list append; no kernel, no sync."""
        if loss is None or not self.enabled:
            return
        self._steps.append(step)
        self._losses.append(loss)
        if len(self._losses) >= _FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """Reduce the kept losses to (any bad, first bad index, its loss) on the device: a handful of kernels
        per :data:`_FOLD_EVERY` steps, no host read (the steps stay a host list)."""
        if not self._losses:
            return
        try:
            losses = torch.stack(self._losses).reshape(len(self._losses))
        except RuntimeError:  # mixed dtypes or devices: align them first (rare)
            losses = torch.stack([t.reshape(()).to(self.device, torch.float64) for t in self._losses])
        bad = ~torch.isfinite(losses)
        first = bad.to(torch.int32).argmax()  # the first True (argmax returns the first maximum)
        value = losses.gather(0, first.reshape(1)).reshape(())  # not losses[first]: a 0-dim index reads to the host
        self._folds.append((bad.any(), first, value, self._steps))
        self._steps, self._losses = [], []

    def check(self, where: str) -> None:
        """Raise on every rank if any rank recorded a non-finite loss since the last check (one host read,
        and one collective with several ranks). ``where`` names the check point in the message.

        Raises:
            FloatingPointError: naming the first bad step, its loss, the rank and the usual fixes.
        """
        if not self.enabled:
            self.reset()
            return
        self._fold()
        folds = self._folds
        self.reset()
        local: tuple[float, float] = (_NONE, 0.0)
        if folds:  # one host read for every fold since the last check
            read = torch.stack([torch.stack([a.double(), i.double(), v.double()]) for a, i, v, _ in folds]).tolist()
            for (any_bad, index, value), (*_, steps) in zip(read, folds):
                if any_bad:
                    local = (float(steps[int(index)]), value)
                    break
        found = [local] if self.world_size <= 1 else dist.all_gather_object(local)  # collective
        step, loss = min(found, key=lambda item: item[0])  # type: ignore[index]
        if math.isinf(step):
            return
        rank = [item[0] for item in found].index(step)  # type: ignore[index]
        raise FloatingPointError(
            f"Non-finite training loss ({loss}) at step {int(step)} on rank {rank} (caught {where}; keel checks on "
            "logging steps, at epoch ends, before every checkpoint and at the end of fit): training stops on all "
            "ranks. Lower the learning rate, clip gradients (gradient_clip_val), check the data, or pass "
            "on_nonfinite='skip' to skip such steps."
        )
