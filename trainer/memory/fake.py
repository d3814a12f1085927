"""What a training step holds in memory on one rank, measured on fake tensors before anything is allocated.

:func:`measure_step` builds the task, applies the strategy to it and runs two training steps under torch's
``FakeTensorMode`` (tensors with shapes and dtypes, no storage) and torch's own memory tracker
(``torch.distributed._tools``: ``MemTracker``, or ``FSDPMemTracker`` for FSDP), inside a *fake* process group of
the world size asked for (torch's ``fake`` backend: collectives return at once), so an FSDP run of 64 ranks is
planned in one process, or, at the start of fit, on fake groups over the run's own ranks. The peak over both steps
(the first creates the gradients and the optimizer state) is reported by category, as the tracker saw it at that
moment. :mod:`trainer.memory.plan` turns it into a plan; see docs/memory.md.
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


class FakeWorld:
    """The fake process group an estimate runs in (:func:`fake_process_group`); :meth:`device_mesh` makes meshes
    on it."""

    def __init__(self, *, inside_run: bool) -> None:
        self.inside_run = inside_run
        self.groups: list[Any] = []

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def device_mesh(self, device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
        """A ``DeviceMesh`` of ``shape`` whose collectives return at once. Inside a run, every rank calls this in
        the same order (``new_group`` is collective over the run's ranks)."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if not self.inside_run:
            return init_device_mesh(device_type, shape, mesh_dim_names=names)
        ranks = torch.arange(dist.get_world_size()).reshape(shape)
        mine = []
        for dim, size in enumerate(shape):
            for line in ranks.movedim(dim, -1).reshape(-1, size).tolist():
                self.groups.append(dist.new_group(line, backend="fake"))
                if self.rank in line:
                    mine.append(self.groups[-1])
        return DeviceMesh.from_group(mine, device_type, mesh=ranks, mesh_dim_names=names)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[FakeWorld]:
    """For the duration of the block, a process group of ``world_size`` ranks in which every collective returns at
    once (torch's ``fake`` backend). Outside a run this process is its rank 0 (the default group). Inside a run of
    ``world_size`` ranks (the plan keel logs at the start of fit) each rank keeps its own rank, and meshes made by
    :meth:`FakeWorld.device_mesh` are built of fake groups over the run's ranks, destroyed after the block.

    Raises:
        RuntimeError: this process belongs to a process group of another size.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"trainer.memory estimates {world_size} ranks in a fake process group, and this process is one of "
                f"{dist.get_world_size()} ranks of a process group already: estimate at world_size="
                f"{dist.get_world_size()} here, before the Trainer creates its group, or in its own process "
                "(`python -m trainer.memory ...`)."
            )
        world = FakeWorld(inside_run=True)
        try:
            yield world
        finally:
            for group in world.groups:
                dist.destroy_process_group(group)
        return
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield FakeWorld(inside_run=False)
    finally:
        dist.destroy_process_group()


Built = tuple[nn.Module, list[torch.optim.Optimizer], Callable[[], None], Callable[[], None] | None]


def measure_step(
    build: Callable[[Any], Built],
    *,
    world_size: int,
    sharded: bool,
    prepare: Callable[[FakeWorld], object] | None = None,
    device: torch.device | None = None,
) -> dict[str, int]:
    """Bytes per category at the peak of a training step on rank 0 of ``world_size`` ranks, and the peak of an
    evaluation forward after it.

    Args:
        build: Called inside the fake tensor mode (and the fake process group) with the mode: builds the task
            with its strategy applied and returns ``(module, optimizers, step, evaluate)``, where ``step()`` runs
            one whole training step (forward, backward, optimizer step, zero_grad) and ``evaluate()`` (or None)
            one evaluation forward.
        world_size: Ranks of the fake process group.
        sharded: The module is FSDP-sharded (torch's FSDP tracker then tells gathered from sharded parameters).
        prepare: Called with the :class:`FakeWorld` before the fake tensor mode is entered (a device mesh is
            made of real tensors).
        device: Count this device's memory only (None: every device's).

    Returns:
        ``{"params", "grads", "optimizer", "activations", "other", "peak", "eval_peak"}`` in bytes (``eval_peak``:
        everything alive at the peak of ``evaluate()``, the training state included; 0 without it).
    """
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
    )

    with fake_process_group(world_size) as world, _real_mesh_concatenation():
        if prepare is not None:
            prepare(world)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            module, optimizers, step, evaluate = build(mode)
            try:
                train, evaluated = _track(module, optimizers, step, evaluate, sharded)
                return {**_categories(train, device), "eval_peak": _categories(evaluated, device)["peak"]}
            except (DataDependentOutputException, DynamicOutputShapeException) as exc:
                raise RuntimeError(
                    f"The memory estimate runs the training step on fake tensors (no values), and the step needs a "
                    f"value ({exc}): a training_step that reads a tensor on the host (.item(), .tolist(), a Python "
                    "`if` on a tensor, nonzero or boolean indexing) cannot be estimated: estimate a subclass whose "
                    "training_step leaves such reads out."
                ) from exc


@contextlib.contextmanager
def _real_mesh_concatenation() -> Iterator[None]:
    """FSDP over the data-parallel dimension of a 2-D mesh joins the two meshes into one
    (``DeviceMesh._concatenate``), which looks up rank positions with ``nonzero``: an output of data-dependent
    shape, which fake tensors cannot have. A mesh holds ranks, not model data, so the join runs on real tensors
    for the duration of the estimate (torch versions without the method need nothing)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__.get("_concatenate")
    if not isinstance(original, staticmethod):
        yield
        return
    join = original.__func__

    def concatenate(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return join(*args, **kwargs)

    DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._concatenate = original  # type: ignore[method-assign]


def _track(
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    step: Callable[[], None],
    evaluate: Callable[[], None] | None,
    sharded: bool,
) -> tuple[dict[Any, dict[Any, int]], dict[Any, dict[Any, int]]]:
    """The tracker's peak snapshots of the training steps and of the evaluation forward after them (a tracker of
    its own: its peak starts from what the steps left, the parameters and optimizer state)."""
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
    train = tracker.get_tracker_snapshot("peak")
    if evaluate is None:
        return train, {}
    evaluating = MemTracker()
    evaluating.track_external(module, *optimizers)
    with evaluating:
        evaluate()
    return train, evaluating.get_tracker_snapshot("peak")


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
