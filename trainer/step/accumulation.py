"""Gradient accumulation: how micro-batches group into optimizer steps, and the loss normalisation.

Loss normalisation is the only maths the loop owns (docs/design.md section 5) and it lives in
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
  whatever the split of (micro-batch size, accumulation, world size). The factor stays on the device:
  no host read on an ordinary step.
* A step with zero items on every rank has nothing to learn from. When every count of this rank was a Python
  int and they added up to more than zero, no rank can be at zero and nothing is read. When this rank counted
  zero, the global count is read (that rare step only) and the optimizer step is skipped if it is zero. When
  the counts are tensors (never read, on any device) the decision stays on the device: a zero-item
  step's gradients are multiplied by 0 instead of ``world_size / N`` (the optimizer still steps: weight decay
  and momentum act, plain SGD changes nothing), and :meth:`StepNormaliser.report_zero_steps` warns once per
  epoch with how many there were.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainer.distributed import comm

log = logging.getLogger(__name__)


@dataclass(slots=True)
class MicroBatch:
    batch_idx: int  # index of the batch in the epoch
    batch: Any
    accumulate: int  # planned micro-batches of this step (k)
    window_len: int | None  # real length of this step's window when known, else None
    is_step_end: bool  # the optimizer steps after this micro-batch
    is_epoch_end: bool


HALF_DTYPES = frozenset((torch.float16, torch.bfloat16))


def micro_batches(
    batches: Iterable[Any],
    *,
    start_idx: int,
    num_batches: int | None,
    accumulate: Callable[[], int],
    drop_incomplete: bool,
    agree: Callable[[bool], bool] | None = None,
) -> Iterator[MicroBatch]:
    """Group an epoch's batches into optimizer-step windows.

    ``accumulate()`` is asked for ``k`` at the start of each window (the generator is lazy, so it runs
    after the previous step and its hooks): a schedule change lands on an optimizer-step boundary.
    ``num_batches`` is the epoch length when known (after ``limit_train_batches``); then no batch is
    fetched beyond it and each window knows its real length. Without it, one batch of look-ahead
    tells which batch is the last. With ``drop_incomplete`` a short final window is not run at all
    (known length); with an unknown length its gradients are discarded by the caller.
    ``agree(has_data)`` (DDP with an unknown length) is asked at each window start whether every rank
    still has data, so ranks with different amounts of data stop at the same step instead of hanging.
    """
    iterator = iter(batches)
    sentinel = object()
    idx = start_idx
    pending = next(iterator, sentinel) if num_batches is None else None
    while True:
        k = accumulate()
        if k == 1 and num_batches is not None:  # the usual window: one micro-batch, the step ends with it
            if idx >= num_batches:
                return
            batch = next(iterator, sentinel)
            if batch is sentinel:
                return
            yield MicroBatch(idx, batch, 1, 1, True, idx == num_batches - 1)
            idx += 1
            continue
        if num_batches is not None:
            window_len = min(k, num_batches - idx)
            if window_len <= 0 or (drop_incomplete and window_len < k):
                return
            for pos in range(window_len):
                batch = next(iterator, sentinel)
                if batch is sentinel:
                    return
                yield MicroBatch(idx, batch, k, window_len, pos == window_len - 1, idx == num_batches - 1)
                idx += 1
            continue
        has_data = pending is not sentinel
        if agree is not None:
            has_data = agree(has_data)  # every rank leaves at the same window start
        if not has_data:
            return
        for pos in range(k):
            if pending is sentinel:
                break
            batch, pending = pending, next(iterator, sentinel)
            is_last = pending is sentinel
            yield MicroBatch(idx, batch, k, None, pos == k - 1 or is_last, is_last)
            idx += 1


def parse_schedule(schedule: Any, *, name: str = "accumulate_grad_batches") -> tuple[str, list[tuple[int, int]]]:
    """Validate an accumulation schedule: ``{epoch: k}`` or ``{"step": {global_step: k}}``.

    Returns ``(clock, [(start, k), ...])`` with ``clock`` "epoch" or "step". Before the first key, k is 1.

    Raises:
        ValueError: naming the offending key or value.
    """
    clock = "epoch"
    if isinstance(schedule, dict) and set(schedule) == {"step"}:
        clock, schedule = "step", schedule["step"]
    if not isinstance(schedule, dict) or not schedule:
        raise ValueError(
            f"{name}={schedule!r}: expected an int >= 1, a non-empty {{epoch: k}} dict, or "
            f"{{'step': {{global_step: k}}}}."
        )
    items = list(schedule.items())
    for key, k in items:
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"{name}: schedule key {key!r} is not a non-negative int {clock}.")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{name}: schedule value {k!r} at {clock} {key} is not an int >= 1.")
    keys = [key for key, _ in items]
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise ValueError(f"{name}: schedule keys {keys} must be strictly increasing.")
    return clock, items


class AccumulationSchedule:
    """``k`` as a function of the step clock: constant, per epoch, or per global step."""

    def __init__(self, schedule: int | dict) -> None:
        if isinstance(schedule, int) and not isinstance(schedule, bool):
            if schedule < 1:
                raise ValueError(f"accumulate_grad_batches={schedule!r}: expected an int >= 1.")
            self.clock, self.items = "epoch", [(0, schedule)]
        else:
            self.clock, self.items = parse_schedule(schedule)
        self.constant: int | None = self.items[0][1] if len(self.items) == 1 and self.items[0][0] == 0 else None

    def k(self, *, epoch: int, global_step: int) -> int:
        if self.constant is not None:  # asked at every window start: the usual case costs one check
            return self.constant
        now = epoch if self.clock == "epoch" else global_step
        value = 1
        for start, k in self.items:
            if now >= start:
                value = k
        return value

    def __repr__(self) -> str:
        return f"AccumulationSchedule({self.clock}: {dict(self.items)})"


class StepNormaliser:
    """Normalises the losses of one optimizer step and corrects its gradients (see module docstring)."""

    def __init__(self, *, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self.zero_steps: torch.Tensor | None = None  # device-decided zero-item steps (see report_zero_steps)
        self.reset()

    def reset(self) -> None:
        self.ran = 0  # micro-batches of this step run so far
        self.mode: str | None = None  # "mean" or "items"
        self.loss_sum: torch.Tensor | None = None  # detached; summed over micro-batches (on device)
        self.items: torch.Tensor | None = None  # items mode: the sum of the tensor counts (on device)
        self.host_items = 0  # items mode: the sum of the int counts
        self.counted_on_device = False  # items mode: some count was a tensor (never read)
        self.planned: int | None = None  # mean mode without a known window length: losses were divided by k

    def take(self, output: Any, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(tensor to backward, detached outputs for callbacks)`` for what ``training_step`` returned
        (checked by :func:`split_step_output`). A 0-dim loss in mean mode on a window's first micro-batch,
        the usual case, takes the short way."""
        if isinstance(output, torch.Tensor) and not output.ndim and output.requires_grad and self.mode is None:
            detached = output.detach()
            self.mode, self.ran = "mean", 1
            self.loss_sum = detached.float() if detached.dtype in HALF_DTYPES else detached
            return (output if micro.window_len == 1 else self._divide(output, micro)), {"loss": detached}
        loss, outputs, num_items = split_step_output(output)
        return self.scale(loss, num_items, micro, detached=outputs["loss"]), outputs

    def scale(
        self, loss: torch.Tensor, num_items: Any, micro: MicroBatch, detached: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tensor to backward for one micro-batch's (scalar) loss; ``detached``: ``loss.detach()`` if
        the caller has it already."""
        mode = "mean" if num_items is None else "items"
        if self.mode != mode:
            if self.mode is not None:
                raise ValueError(
                    "training_step returned 'num_items' for some micro-batches of an optimizer step but not "
                    "for others; return it on every step or never."
                )
            self.mode = mode
        self.ran += 1
        if detached is None:
            detached = loss.detach()
        elif detached.ndim:
            detached = detached.reshape(())
        if detached.dtype in HALF_DTYPES:
            detached = detached.float()
        self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached
        if num_items is not None:
            count = _check_num_items(num_items, self.device)
            if isinstance(count, int):
                self.host_items += count
            else:
                self.items = count if self.items is None else self.items + count
                self.counted_on_device = True
            return loss  # items mode: a sum, normalised by the global count at the end of the step
        return self._divide(loss, micro)

    def _divide(self, loss: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
        """Mean mode: by the real window length when known, else by the planned ``k`` (corrected in finish)."""
        divisor = micro.window_len
        if divisor is None:
            divisor = self.planned = micro.accumulate
        return loss if divisor == 1 else loss / divisor

    def finish(self) -> tuple[float | torch.Tensor | None, torch.Tensor | None, bool]:
        """End of the window: ``(grad_factor, step_loss, skip)``, and :meth:`reset` for the next one.

        ``grad_factor`` multiplies the synchronised gradients (None: leave them). ``step_loss`` is the
        optimised loss of the step: the local mean over micro-batches (mean mode; reduced across
        ranks when logged), or the global items-weighted mean (items mode). ``skip`` is True when the
        step saw zero items on all ranks and this rank's counts were host values (see the module docstring).
        Items mode does one all-reduce on the device; it reads the host only on a step where this rank counted
        zero items on the host. Mean mode does neither.
        """
        loss_sum, ran, planned = self.loss_sum, self.ran, self.planned
        assert loss_sum is not None, "finish() before any micro-batch"
        if self.mode == "mean":
            self.mode, self.ran, self.loss_sum, self.planned = None, 0, None, None  # reset(); items is None
            if ran == 1 and planned is None:
                return None, loss_sum, False
            factor = (
                planned / ran if planned is not None and ran < planned else None
            )  # an unknown-length window ended early
            return factor, (loss_sum if ran == 1 else loss_sum / ran), False
        items, host_items, on_device = self.items, self.host_items, self.counted_on_device
        self.reset()
        # A fill, not a copy, for the host count: no host-to-device transfer to wait for.
        count = torch.full((), host_items, dtype=torch.float64, device=self.device)
        packed = torch.stack([loss_sum.to(torch.float64), count if items is None else count + items])
        comm.all_reduce(packed, "sum")
        total = packed[1]
        if on_device:  # tensor counts: decided on the device (a zero-item step scales by 0)
            some = total > 0
            zero = (~some).to(torch.int64)
            self.zero_steps = zero if self.zero_steps is None else self.zero_steps + zero
            return torch.where(some, self.world_size / total, 0.0), torch.where(some, packed[0] / total, 0.0), False
        if host_items == 0 and float(total.item()) <= 0:  # this rank saw none: whether any rank did (rare read)
            return None, None, True
        return self.world_size / total, packed[0] / total, False

    def report_zero_steps(self, epoch: int) -> None:
        """At the end of an epoch (where the loop reads the host anyway): warn, on rank 0, how many optimizer
        steps had zero items on every rank and were decided on the device (their gradients were zeroed)."""
        zero, self.zero_steps = self.zero_steps, None
        if zero is None or comm.get_rank() != 0:
            return
        count = int(zero.item())
        if count:
            log.warning(
                "%d optimizer step(s) of epoch %d saw zero items (num_items) on every rank: their gradients were "
                "multiplied by 0 (the optimizer still stepped: weight decay and momentum acted). Check the data "
                "(e.g. windows whose every target is masked), or return num_items as an int to skip such steps.",
                count,
                epoch,
            )


def _check_num_items(num_items: Any, device: torch.device) -> torch.Tensor | int:
    """The count: an int as it is (a host value); a tensor on the run's device, never read (on any device, so
    that a zero-item step is decided the same way on CPU and GPU)."""
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.is_floating_point() or num_items.dtype == torch.bool:
            raise ValueError(
                f"training_step returned num_items={num_items!r}; expected a non-negative integer count "
                "(an int, or an integer scalar tensor)."
            )
        return num_items.detach().reshape(()).to(device, torch.float64, non_blocking=True)
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
        raise ValueError(
            f"training_step returned num_items={num_items!r}; expected a non-negative integer count "
            "(an int, or an integer scalar tensor)."
        )
    return num_items


def split_step_output(output: Any) -> tuple[torch.Tensor, dict[str, Any], Any]:
    """``(loss, detached outputs for callbacks, num_items)`` from what ``training_step`` returned.

    Raises:
        ValueError: naming what was returned and what is expected.
    """
    if isinstance(output, torch.Tensor):
        loss, extras, num_items = output, {}, None
    elif isinstance(output, dict):
        if "loss" not in output:
            raise ValueError(
                f"training_step returned a dict without 'loss' (keys: {sorted(output)}); include the loss tensor."
            )
        loss, num_items = output["loss"], output.get("num_items")
        extras = {
            k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in output.items() if k not in ("loss",)
        }
    else:
        raise ValueError(
            f"training_step returned {type(output).__name__}; return a scalar loss tensor or a dict with 'loss'."
        )
    if not isinstance(loss, torch.Tensor) or (loss.ndim and loss.numel() != 1):
        if isinstance(loss, torch.Tensor):
            raise ValueError(
                f"training_step's loss must be a scalar tensor; got a tensor of shape {tuple(loss.shape)} (one value "
                "per sample, as from reduction='none'). Return its mean (loss.mean()), or its sum with "
                "{'loss': loss.sum(), 'num_items': n} to average over every rank's items."
            )
        raise ValueError(
            f"training_step's loss must be a scalar tensor; got {type(loss).__name__}. Return the loss tensor itself "
            "(not loss.item(), which detaches it from the graph)."
        )
    if not loss.requires_grad:
        raise ValueError(
            "training_step's loss does not require grad: it was computed without the task's parameters "
            "(or under torch.no_grad())."
        )
    extras["loss"] = loss.detach()
    return (loss.reshape(()) if loss.ndim else loss), extras, num_items


def estimate_stepping_batches(
    schedule: AccumulationSchedule,
    *,
    batches: int | None,
    epochs: int | None,
    max_steps: int,
    drop_incomplete: bool,
) -> int | float:
    """Optimizer steps a fit will take: ``batches`` per epoch (None: unknown) for ``epochs`` epochs (None
    or -1: unbounded) under ``schedule``, capped by ``max_steps`` (-1: none). ``inf`` when unbounded."""
    limit = max_steps if max_steps != -1 else float("inf")
    if batches is None or epochs in (None, -1):
        return limit
    total = 0
    for epoch in range(epochs):
        k = schedule.k(epoch=epoch, global_step=total)
        total += batches // k if drop_incomplete else -(-batches // k)
        if total >= limit:
            return max_steps
    return total


def finite_on_all_ranks(step_loss: torch.Tensor | None, world_size: int) -> bool:
    """``on_nonfinite='skip'``: whether the step's loss is finite on every rank (one host read per step,
    and one all-reduce when ``world_size > 1``, so that all ranks agree). None counts as finite."""
    if step_loss is None:
        return True
    flag = torch.isfinite(step_loss).to(torch.float32).reshape(1)
    if world_size > 1:
        comm.all_reduce(flag, "min")
    return bool(flag.item() > 0)
