"""Elastic runs: the global batch is a property of the run, not of the world size (docs/design.md section 12).

``Trainer(global_batch_size=G)`` fixes the samples per optimizer step. At every (re)start, for the world
size ``W`` the launcher gave and the training loader's micro-batch size ``b``, keel derives::

    accumulate_grad_batches = G / (W * b)

and refuses, naming the three numbers and the nearest valid sizes, when it does not divide. A schedule
in global-batch terms (``{epoch: G}`` or ``{"step": {global_step: G}}``) becomes an accumulation
schedule on the same clock. Together with the sampler's global cursor (trainer/data/loaders.py) this makes a
run that torchrun restarts on more or fewer nodes the same maths as the uninterrupted run: every step
sees the same ``G`` samples, in the same global order (the strided shards of the sampler put samples
``perm[c : c + G]`` into the step that starts at cursor ``c`` whatever ``W`` and ``b`` are), and the
step's gradient is their mean (mean losses over equal micro-batches; ``num_items`` losses for ragged
ones).

A checkpoint records the run's global batch (:func:`checkpoint_record`); resuming checks it
(:func:`check_resume`): another ``G``, or a resume without the option that would change the samples per
step, is refused with the reason; so is a micro-batch size that does not divide ``G`` at the new world size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from trainer.options import parse_global_batch
from trainer.step.accumulation import AccumulationSchedule

log = logging.getLogger(__name__)

OPTION = "global_batch_size"
# Keys of the checkpoint's record of the global batch (checkpoint key trainer.checkpoint.files.K_GLOBAL_BATCH).
R_SPEC = "global_batch_size"  # the option as given: an int, or the schedule as {"clock", "items"}; None without it
R_SAMPLES = "samples_per_step"  # samples of the next optimizer step at the checkpoint's clock (W x b x k)
R_MICRO = "micro_batch_size"
R_WORLD = "world_size"


def micro_batch_size(loader: Iterable[Any]) -> int:
    """The per-rank micro-batch size of a training loader: its ``batch_size``.

    Raises:
        ValueError: the loader has no ``batch_size`` (an iterable, or ``batch_size=None``).
    """
    size = getattr(loader, "batch_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"Trainer option {OPTION} needs the micro-batch size, but the training loader "
            f"({type(loader).__qualname__}) has no batch_size (got {size!r}). Pass a DataLoader(dataset, "
            "batch_size=...), or use accumulate_grad_batches instead of global_batch_size."
        )
    return size


def accumulation_for(global_batch: int | dict[Any, Any], *, world_size: int, micro_batch: int) -> AccumulationSchedule:
    """The accumulation schedule that keeps ``global_batch`` samples per step at this world size.

    Args:
        global_batch: The ``global_batch_size`` option (int or schedule).
        world_size: Ranks of this (re)start.
        micro_batch: Samples per micro-batch on each rank (the loader's ``batch_size``).

    Raises:
        ValueError: some ``G`` is not a multiple of ``world_size * micro_batch``; the message names the
            three numbers, the nearest valid global batch sizes and the micro-batch sizes that would work.
    """
    clock, items = parse_global_batch(global_batch)
    per_micro = world_size * micro_batch
    derived = []
    for start, size in items:
        if size % per_micro:
            where = "" if len(items) == 1 else f" (the schedule's value from {clock} {start})"
            raise ValueError(_not_divisible(size, world_size, micro_batch, where))
        derived.append((start, size // per_micro))
    if clock == "step":
        return AccumulationSchedule({"step": dict(derived)})
    return AccumulationSchedule(dict(derived) if len(derived) > 1 else derived[0][1])


def _not_divisible(size: int, world_size: int, micro_batch: int, where: str = "") -> str:
    per_micro = world_size * micro_batch
    below, above = (size // per_micro) * per_micro, (size // per_micro + 1) * per_micro
    nearest = f"{below} or {above}" if below else f"{above}"
    if size % world_size == 0:
        per_rank = size // world_size
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        closest = sorted(sorted(divisors, key=lambda d: (abs(d - micro_batch), d))[:6])
        micro_hint = (
            f", or keep {size} with a micro-batch size that divides {size} / {world_size} = "
            f"{per_rank}: {', '.join(map(str, closest))}"
        )
    else:
        micro_hint = f"; no micro-batch size works: {size} is not a multiple of the world size {world_size}"
    return (
        f"Trainer option {OPTION}={size}{where} is not a multiple of world size {world_size} x micro-batch size "
        f"{micro_batch} = {per_micro}, so no whole number of accumulated micro-batches gives {size} samples per "
        f"optimizer step. Nearest valid global batch sizes: {nearest}{micro_hint}. For an elastic run pick a "
        "global batch divisible by micro-batch x every world size the job may run at."
    )


def configure(
    option: int | dict[Any, Any] | None, loader: Iterable[Any], *, replicas: int
) -> AccumulationSchedule | None:
    """The accumulation schedule that ``global_batch_size`` (``option``) gives on ``replicas`` data-parallel ranks
    with the micro-batch of ``loader``, for this (re)start; None without the option.

    The Trainer calls it in ``fit`` once the training loader is known, before ``configure_optimizers`` (so
    ``estimated_stepping_batches`` counts the right steps).
    """
    if option is None:
        return None
    micro = micro_batch_size(loader)
    schedule = accumulation_for(option, world_size=replicas, micro_batch=micro)
    log.info(
        "%s=%r on %d data-parallel rank(s) x micro-batch %d: accumulation %s.",
        OPTION,
        option,
        replicas,
        micro,
        schedule,
    )
    return schedule


def _spec(value: int | dict[Any, Any] | None) -> int | dict[str, Any] | None:
    """The option as a plain, comparable value (checkpoints hold only plain containers)."""
    if value is None:
        return None
    clock, items = parse_global_batch(value)
    if clock == "epoch" and len(items) == 1:
        return items[0][1]
    return {"clock": clock, "items": [[start, size] for start, size in items]}


def micro_batch_of(loader: Any) -> int | None:
    """The training loader's batch size (one micro-batch of one rank), or None when it has none."""
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def checkpoint_record(
    option: int | dict[Any, Any] | None, *, micro: int | None, k: int, replicas: int
) -> dict[str, Any]:
    """What a checkpoint records of the global batch: the option, and the layout of the step to come (``k``
    micro-batches of ``micro`` samples on ``replicas`` data-parallel ranks)."""
    return {
        R_SPEC: _spec(option),
        R_SAMPLES: None if micro is None else replicas * micro * k,
        R_MICRO: micro,
        R_WORLD: replicas,
    }


def check_resume(
    record: dict[str, Any] | None,
    *,
    option: int | dict[Any, Any] | None,
    micro: int | None,
    k: int,
    replicas: int,
    step: int,
    path: str,
) -> None:
    """Refuse a resume that would change the run's samples per optimizer step: ``record`` is the checkpoint's,
    the rest this run's (``global_batch_size``, micro-batch, accumulation at ``step``, data-parallel ranks).

    Call after the step clock is restored (the accumulation in force is read at it). A micro-batch size
    that does not divide the global batch at the new world size was already refused by :func:`configure`.

    Raises:
        ValueError: naming the checkpoint, the recorded and the requested global batch, and the fix.
    """
    if not record:
        saved_spec, saved_samples = None, None
    else:
        saved_spec, saved_samples = record.get(R_SPEC), record.get(R_SAMPLES)
    spec = _spec(option)
    now = None if micro is None else replicas * micro * k
    where = f"Checkpoint {path!r} (step {step})"
    changed = now is not None and saved_samples is not None and now != saved_samples
    if saved_spec is not None and spec is not None and saved_spec != spec:
        raise ValueError(
            f"{where} was written by a run with {OPTION}={_show(saved_spec)}; this run asks for "
            f"{OPTION}={_show(spec)}. Changing the global batch mid-run changes the optimisation (samples and "
            f"learning rate per step), so keel refuses. Pass {OPTION}={_show(saved_spec)} to continue the run, "
            "or start a new run from its weights (TaskModule.load_from_checkpoint)."
        )
    if saved_spec is not None and spec is None and changed:
        raise ValueError(
            f"{where} was written by a run with {OPTION}={_show(saved_spec)} ({saved_samples} samples per step "
            f"at this step); without the option this run would take {now} ({replicas} data-parallel rank(s) x "
            f"micro-batch {micro} x accumulate {k}). Pass "
            f"{OPTION}={_show(saved_spec)} to continue the run with the same global batch."
        )
    if saved_spec is None and spec is not None and changed:
        raise ValueError(
            f"{where} was written with {saved_samples} samples per optimizer step (no {OPTION}); "
            f"{OPTION}={_show(spec)} gives {now} at this step, which would change the run's optimisation "
            f"mid-way. Pass {OPTION}={saved_samples} to keep it, or start a new run from its weights."
        )


def _show(spec: int | dict[str, Any] | None) -> str:
    if isinstance(spec, dict):
        items = {int(start): int(size) for start, size in spec["items"]}
        return repr({"step": items} if spec["clock"] == "step" else items)
    return repr(spec)
