"""Gradient accumulation: how micro-batches group into optimizer steps, and the loss normalisation.

Loss normalisation is the only maths the loop owns (DESIGN.md section 5) and it lives in
:class:`StepNormaliser`:

* A plain loss tensor is a mean over its micro-batch. The step's gradient is the mean over the
  micro-batches actually run: when the window length is known up front (a loader with ``len``), each
  loss is divided by the real window length, so a short last window of an epoch divides by its own
  length; when it is not known (an iterable without ``len``), losses are divided by the planned
  ``k`` and, if the window ends early after ``n`` micro-batches, the gradients are multiplied by
  ``k / n`` before the optimizer step.
* A loss returned with ``num_items`` is a SUM over ``num_items`` contributing items. Its gradient is
  accumulated unscaled; at the end of the step one all-reduce (on device) gives the global item count
  ``N`` and the loss sum over all micro-batches and ranks, and the gradients are multiplied by
  ``world_size / N``: DDP's all-reduce averages over ranks, so the result is ``sum(grad) / N``
  whatever the split of (micro-batch size, accumulation, world size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from trainer import dist


@dataclass
class MicroBatch:
    batch_idx: int  # index of the batch in the epoch
    batch: Any
    window_len: int | None  # real length of this step's window when known, else None
    is_step_end: bool  # the optimizer steps after this micro-batch
    is_epoch_end: bool


def micro_batches(
    batches: Iterable[Any],
    *,
    start_idx: int,
    num_batches: int | None,
    accumulate: int,
    drop_incomplete: bool,
) -> Iterator[MicroBatch]:
    """Group an epoch's batches into optimizer-step windows of ``accumulate`` micro-batches.

    Windows are aligned to the start of the epoch (batch ``i`` belongs to window ``i // accumulate``).
    ``num_batches`` is the epoch length when known (after ``limit_train_batches``); then no batch is
    fetched beyond it. Without it, one batch of look-ahead tells which batch is the last.
    With ``drop_incomplete`` a short final window is not run at all (known length) or its gradients
    are discarded (unknown length: see :meth:`StepNormaliser.discard`).
    """
    iterator = iter(batches)
    idx = start_idx
    if num_batches is not None:
        last_full = (num_batches // accumulate) * accumulate
        end = last_full if drop_incomplete else num_batches
        while idx < end:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            window_start = idx - idx % accumulate
            window_len = min(accumulate, num_batches - window_start)
            is_step_end = idx - window_start == window_len - 1
            yield MicroBatch(idx, batch, window_len, is_step_end, idx == end - 1)
            idx += 1
        return
    sentinel = object()
    batch = next(iterator, sentinel)
    while batch is not sentinel:
        following = next(iterator, sentinel)
        is_last = following is sentinel
        is_step_end = (idx + 1) % accumulate == 0 or is_last
        yield MicroBatch(idx, batch, None, is_step_end, is_last)
        batch = following
        idx += 1


class StepNormaliser:
    """Normalises the losses of one optimizer step and corrects its gradients (see module docstring)."""

    def __init__(self, *, accumulate: int, world_size: int, device: torch.device) -> None:
        self.accumulate = accumulate
        self.world_size = world_size
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.ran = 0  # micro-batches of this step run so far
        self.mode: str | None = None  # "mean" or "items"
        self.loss_sum: torch.Tensor | None = None  # detached; summed over micro-batches (on device)
        self.items: torch.Tensor | None = None  # items-mode count (on device)
        self.divided_by_planned = False  # mean mode without a known window length: losses / k

    def scale(self, loss: torch.Tensor, num_items: Any, window_len: int | None) -> torch.Tensor:
        """The tensor to backward for one micro-batch's loss."""
        mode = "mean" if num_items is None else "items"
        if self.mode is None:
            self.mode = mode
        elif self.mode != mode:
            raise ValueError(
                "training_step returned 'num_items' for some micro-batches of an optimizer step but not "
                "for others; return it on every step or never."
            )
        self.ran += 1
        detached = loss.detach().to(torch.float32 if loss.dtype in (torch.float16, torch.bfloat16) else loss.dtype)
        self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached
        if mode == "items":
            count = _check_num_items(num_items, self.device)
            self.items = count if self.items is None else self.items + count
            return loss
        self.divided_by_planned = window_len is None
        divisor = window_len if window_len is not None else self.accumulate
        return loss if divisor == 1 else loss / divisor

    def finish(self) -> tuple[float | torch.Tensor | None, torch.Tensor | None, bool]:
        """End of the window: ``(grad_factor, step_loss, skip)``.

        ``grad_factor`` multiplies the synchronised gradients (None: leave them). ``step_loss`` is the
        optimised loss of the step: the local mean over micro-batches (mean mode; reduced across
        ranks when logged), or the global items-weighted mean (items mode). ``skip`` is True when the
        step saw zero items on all ranks. Items mode does one all-reduce and reads the count on the
        host (to decide ``skip``); mean mode does neither.
        """
        assert self.loss_sum is not None, "finish() before any micro-batch"
        if self.mode == "mean":
            step_loss = self.loss_sum / self.ran
            if self.divided_by_planned and self.ran < self.accumulate:
                return self.accumulate / self.ran, step_loss, False
            return None, step_loss, False
        assert self.items is not None
        packed = torch.stack([self.loss_sum.to(torch.float64), self.items.to(torch.float64)])
        dist.all_reduce(packed, "sum")
        total = float(packed[1].item())  # host read: the skip decision needs it
        if total <= 0:
            return None, None, True
        return self.world_size / total, packed[0] / total, False


def _check_num_items(num_items: Any, device: torch.device) -> torch.Tensor:
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.is_floating_point() or num_items.dtype == torch.bool:
            raise ValueError(
                f"training_step returned num_items={num_items!r}; expected a non-negative integer count "
                "(an int, or an integer scalar tensor)."
            )
        return num_items.detach().reshape(()).to(device)
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
        raise ValueError(
            f"training_step returned num_items={num_items!r}; expected a non-negative integer count "
            "(an int, or an integer scalar tensor)."
        )
    return torch.tensor(num_items, device=device)
