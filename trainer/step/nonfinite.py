"""``on_nonfinite="error"``: a NaN or inf loss at ANY step stops training, naming the first bad step.

Checking every step's loss on the host would sync every step (docs/design.md section 11). Instead the loop
hands each optimizer step's loss (a detached device scalar) to :meth:`NonFiniteGuard.record`, which only
keeps the reference; every so many steps the kept losses are stacked into one device tensor (one kernel,
no host read; the step numbers stay on the host). The loop reads them where it syncs anyway, in the same
transfer as what it reads there: on logging steps with the step metrics (:meth:`NonFiniteGuard.pending`
and :meth:`NonFiniteGuard.judge`), and at epoch ends, before every checkpoint and at the end of ``fit``
(:meth:`NonFiniteGuard.check`, which also agrees on the verdict across ranks). All ranks check at the same
points, so all of them raise together, naming the same step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trainer.data.transfer import read_to_host
from trainer.distributed import comm

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
        # One entry per fold: the fold's losses stacked into one device tensor, and their steps.
        self._folds: list[tuple[torch.Tensor, list[int]]] = []

    def record(self, step: int, loss: torch.Tensor | None) -> None:
        """The loss of optimizer step ``step`` (after the step). A list append; no kernel, no sync."""
        if loss is not None and self.enabled:
            losses = self._losses
            losses.append(loss)
            self._steps.append(step)
            if len(losses) >= _FOLD_EVERY:
                self._fold()

    def _fold(self) -> None:
        """Stack the kept losses into one device tensor: one kernel per :data:`_FOLD_EVERY` steps (bounds the
        list of references), no host read (the steps stay a host list)."""
        if not self._losses:
            return
        try:
            losses = torch.stack(self._losses).reshape(len(self._losses))
        except RuntimeError:  # mixed dtypes or devices: align them first (rare)
            losses = torch.stack([t.reshape(()).to(self.device, torch.float64) for t in self._losses])
        self._folds.append((losses, self._steps))
        self._steps, self._losses = [], []

    def pending(self) -> list[torch.Tensor]:
        """The losses kept since the last check, in step order (each fold's 1-D tensor, then the scalars
        recorded since): empty when none, or disabled. No kernel, no host read: the caller reads them on
        the host together with whatever else it reads there (a logging step: with the step metrics, in
        one stack and one transfer of a few hundred bytes) and passes the numbers to :meth:`judge`."""
        if not self.enabled:
            self.reset()
            return []
        return [losses for losses, _ in self._folds] + self._losses

    def judge(self, losses: Sequence[float]) -> tuple[float, float]:
        """``(step, loss)`` of the first non-finite loss since the last check, ``(inf, 0)`` if none, given
        ``losses``: the host values of :meth:`pending`, in order. Forgets the kept losses."""
        steps = self._steps
        folds = self._folds
        self.reset()
        if math.isfinite(sum(losses)):  # a NaN or inf makes the sum non-finite; so can an overflow (searched)
            return _NONE, 0.0
        for index, loss in enumerate(losses):
            if not math.isfinite(loss):
                return float(([s for _, fold_steps in folds for s in fold_steps] + steps)[index]), float(loss)
        return _NONE, 0.0

    def verdict(self) -> tuple[float, float]:
        """This rank's ``(step, loss)`` of the first non-finite loss since the last check (``(inf, 0)``:
        none, or disabled), and forget the kept losses. One host read; no collective (see :meth:`check`)."""
        return self.judge(read_to_host(self.pending()))

    def check(self, where: str) -> None:
        """Raise on every rank if any rank recorded a non-finite loss since the last check (one host read,
        and with several ranks one small all-reduce; the bad step's details are gathered only when one is
        found). ``where`` names the check point in the message.

        Raises:
            FloatingPointError: naming the first bad step, its loss, the rank and the usual fixes.
        """
        if not self.enabled:
            self.reset()
            return
        local = self.verdict()
        if self.world_size > 1:
            flag = torch.tensor([0.0 if math.isinf(local[0]) else 1.0], device=self.device)
            comm.all_reduce(flag, "max")  # collective: every rank learns whether any rank saw one
            if flag.item() == 0:
                return
        self.fail(local, where)

    def fail(self, local: tuple[float, float], where: str) -> None:
        """Raise on every rank for the first bad step over all ranks (collective with several ranks: every
        rank calls it once they agreed that some rank saw one); returns if none did."""
        found = [local] if self.world_size <= 1 else comm.all_gather_object(local)
        step, loss = min(found, key=lambda item: item[0])
        if math.isinf(step):
            return
        rank = [item[0] for item in found].index(step)
        raise FloatingPointError(
            f"Non-finite training loss ({loss}) at step {int(step)} on rank {rank} (caught {where}; keel checks on "
            "logging steps, at epoch ends, before every checkpoint and at the end of fit): training stops on all "
            "ranks. Lower the learning rate, clip gradients (gradient_clip_val), check the data, or pass "
            "on_nonfinite='skip' to skip such steps."
        )
