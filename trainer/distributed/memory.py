"""What a training step holds in memory on one rank, measured on fake tensors before anything is allocated.

:func:`measure_step` builds the task, applies the strategy to it and runs two training steps under torch's
``FakeTensorMode`` (tensors with shapes and dtypes, no storage) and torch's own memory tracker
(``torch.distributed._tools``: ``MemTracker``, or ``FSDPMemTracker`` for FSDP), inside a *fake* process group of
the world size asked for (torch's ``fake`` backend: collectives return at once), so an FSDP run of 64 ranks is
planned in one process. The peak of the second step is reported by category. :mod:`trainer.memory` turns it into
a plan; see docs/memory.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch's tracker categories -> keel's. Everything else (temporaries, all-gather and reduce-scatter buffers,
# gathered parameters, inputs, buffers) is "other".
_PARAMS = ("PARAM", "SHARDED_PARAM")
_GRADS = ("GRAD", "SHARDED_GRAD", "UNSHARDED_GRAD")
_OPTIMIZER = ("OPT",)
_ACTIVATIONS = ("ACT",)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks in which this process is rank 0 and every collective returns at
    once (torch's ``fake`` backend), for the duration of the block.

    Raises:
        RuntimeError: a process group already exists (plan before any is created, or in its own process:
            ``python -m trainer.memory``).
    """
    if dist.is_initialized():
        raise RuntimeError(
            "trainer.memory estimates in a fake process group of its own, and this process already has a "
            "process group: estimate before the Trainer creates one, or run `python -m trainer.memory ...`."
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure_step(
    build: Callable[[Any], tuple[nn.Module, list[torch.optim.Optimizer], Callable[[], None]]],
    *,
    world_size: int,
    sharded: bool,
    prepare: Callable[[], object] | None = None,
    device: torch.device | None = None,
) -> dict[str, int]:
    """Bytes per category at the peak of a training step on rank 0 of ``world_size`` ranks.

    Args:
        build: Called inside the fake tensor mode (and the fake process group) with the mode: builds the task
            with its strategy applied and returns ``(module, optimizers, step)``, where ``step()`` runs one whole
            training step (forward, backward, optimizer step, zero_grad).
        world_size: Ranks of the fake process group.
        sharded: The module is FSDP-sharded (torch's FSDP tracker then tells gathered from sharded parameters).
        prepare: Called in the fake process group before the fake tensor mode is entered (a device mesh is
            made of real tensors).
        device: Count this device's memory only (None: every device's).

    Returns:
        ``{"params", "grads", "optimizer", "activations", "other", "peak"}`` in bytes.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_process_group(world_size):
        if prepare is not None:
            prepare()
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            module, optimizers, step = build(mode)
            return _categories(_track(module, optimizers, step, sharded), device)


def _track(
    module: nn.Module, optimizers: list[torch.optim.Optimizer], step: Callable[[], None], sharded: bool
) -> dict[Any, dict[Any, int]]:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if sharded:
        tracker: MemTracker = FSDPMemTracker(mod=module, optm=optimizers[0] if len(optimizers) == 1 else None)
    else:
        tracker = MemTracker()
        tracker.track_external(module, *optimizers)
    with tracker:
        step()  # the first step creates the optimizer state and the gradients
        tracker.reset_mod_stats()
        step()
    return tracker.get_tracker_snapshot("peak")


def _categories(snapshot: dict[Any, dict[Any, int]], device: torch.device | None) -> dict[str, int]:
    out = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0, "other": 0, "peak": 0}
    for where, per_device in snapshot.items():
        if device is not None and torch.device(where).type != device.type:
            continue
        for kind, nbytes in per_device.items():
            name = str(kind).rsplit(".", 1)[-1]
            if name == "Total":
                out["peak"] += nbytes
            elif name in _PARAMS:
                out["params"] += nbytes
            elif name in _GRADS:
                out["grads"] += nbytes
            elif name in _OPTIMIZER:
                out["optimizer"] += nbytes
            elif name in _ACTIVATIONS:
                out["activations"] += nbytes
            else:
                out["other"] += nbytes
    return out
