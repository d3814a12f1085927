"""Turning a task built on the meta device into real tensors, a module at a time, and making ranks start equal.

A large model is built without storage (``torch.device("meta")`` in ``__init__``, in ``configure_model`` or inside
``trainer.init_module(empty_init=True)``), sharded while it is still empty, and only then given memory:
:func:`materialize` allocates each rank's part (its shards under FSDP, the whole model under DDP) and initialises it
module by module. For each module that holds meta tensors of its own, in ``task.modules()`` order, the module's
parameters are made at full size on the device, ``init(module)`` fills them (``TaskModule.init_weights``, by default
the module's ``reset_parameters()``), and each rank keeps its slice. Every rank draws from the same random stream
(:func:`shared_rng`), so the weights do not depend on the world size and equal a one-process run's, while no rank
holds more than one module's full parameters at a time beyond its own shards.

:func:`broadcast_tensors` gives every rank rank 0's values of a task built eagerly (each rank built its own), one
tensor at a time through the device, so no rank holds a second copy of the model.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from trainer.distributed import comm


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (its submodules included) is on the meta device."""
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _own_tensors(module: nn.Module) -> Iterator[tuple[dict[str, Any], str, torch.Tensor]]:
    for table in (module._parameters, module._buffers):
        for name, tensor in table.items():
            if tensor is not None:
                yield table, name, tensor


def _is_dtensor(tensor: Any) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


@contextlib.contextmanager
def shared_rng(device: torch.device) -> Iterator[None]:
    """Inside the block every rank draws what rank 0 draws: rank 0 from its own random state (CPU, and ``device``'s
    generator on CUDA), which advances as in a one-process run; the others from a copy of it, after which their own
    states come back. One broadcast when there are several ranks (a collective)."""
    if comm.get_world_size() == 1:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    states = comm.broadcast_object([torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)], 0)
    if comm.get_rank() == 0:
        yield
        return
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(states[0])
        if devices:
            torch.cuda.set_rng_state(states[1], devices[0])
        yield


@torch.no_grad()
def materialize(task: nn.Module, device: torch.device, init: Callable[[nn.Module], None]) -> int:
    """Give every meta tensor of ``task`` storage on ``device`` and initialise it; returns how many modules were
    initialised (0: nothing was on the meta device). Call it inside :func:`shared_rng` on every rank.

    Works on a plain task and on one sharded by FSDP (DTensor parameters whose local shards are still meta): each
    module's own parameters are swapped for full-size tensors while ``init(module)`` runs, and each rank copies its
    slice (``distribute_tensor`` with every rank's data, no communication) into its shard. Tensors that were
    already real keep their values.

    Raises:
        TypeError: from ``init``, for a module it cannot initialise (the default names the module and the fix).
    """
    modules = [m for m in task.modules() if any(t.is_meta for _, _, t in _own_tensors(m))]
    if not modules:
        return 0
    # to_empty gives every tensor new storage; the real ones (a task built partly eagerly) are put back after it.
    kept = [
        (index, name, _local(t).detach().clone())
        for index, m in enumerate(task.modules())
        for _, name, t in _own_tensors(m)
        if not t.is_meta
    ]
    task.to_empty(device=device)  # FSDP's own _apply re-registers its sharded parameters
    if kept:
        by_index = list(task.modules())
        for index, name, value in kept:
            module = by_index[index]
            tensor = module._parameters.get(name, module._buffers.get(name))
            assert tensor is not None
            _local(tensor).copy_(value)
    for module in modules:
        swapped: dict[tuple[int, str], torch.Tensor] = {}
        for table, name, tensor in _own_tensors(module):
            if _is_dtensor(tensor):
                full = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                swapped[(id(table), name)] = tensor
                table[name] = nn.Parameter(full, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else full
        init(module)
        for table, name, tensor in _own_tensors(module):
            original = swapped.get((id(table), name))
            if original is None:
                continue
            from torch.distributed.tensor import distribute_tensor

            mine = distribute_tensor(tensor.detach(), original.device_mesh, original.placements, src_data_rank=None)  # type: ignore[attr-defined]
            _local(original).copy_(mine.to_local())
            table[name] = original
    return len(modules)


@torch.no_grad()
def broadcast_tensors(module: nn.Module, device: torch.device) -> None:
    """Overwrite every parameter and buffer of ``module`` with rank 0's, one tensor at a time (a collective per
    tensor). A tensor that is not on ``device`` travels through a temporary copy there (NCCL sends device memory
    only), so the device never holds more than one extra tensor."""
    if comm.get_world_size() == 1:
        return
    for tensor in _tensors(module):
        if tensor.is_meta:
            continue
        local = _local(tensor)
        if local.device == device or device.type == "cpu":
            comm.broadcast(local, 0)
        else:
            staged = local.to(device)
            comm.broadcast(staged, 0)
            local.copy_(staged)


# Tasks already compared across ranks, with the points of the setup they were compared at (every rank runs the same
# stages on the same tasks, so every rank skips the same checks): a later stage of the same task adds no collective.
_CHECKED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def check_same_model(task: nn.Module, when: str = "built") -> None:
    """Every rank built the same model: the names, shapes and dtypes of its parameters and buffers, compared in one
    ``all_gather_object`` before the first collective that carries them (a broadcast or all-reduce of tensors that
    differ in shape aborts the process group with no word about the model). Collective with several ranks, once per
    task and ``when`` (the point of the setup: what the constructor built, what ``configure_model`` added).

    Raises:
        ValueError: on every rank, naming the first rank whose model differs from rank 0's and the first entry that
            differs (missing, extra, or another shape or dtype).
    """
    if comm.get_world_size() <= 1 or when in _CHECKED.get(task, ()):
        return
    mine = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in _named_entries(task)]
    every = comm.all_gather_object(mine)
    for rank, entries in enumerate(every[1:], start=1):
        if entries == every[0]:
            continue
        theirs = {name: (shape, dtype) for name, shape, dtype in entries}
        ours = {name: (shape, dtype) for name, shape, dtype in every[0]}
        difference = next(
            (
                f"{name}: {_describe(ours.get(name))} on rank 0, {_describe(theirs.get(name))} on rank {rank}"
                for name in [*ours, *(n for n in theirs if n not in ours)]
                if ours.get(name) != theirs.get(name)
            ),
            "the same entries in another order",
        )
        raise ValueError(
            f"Rank {rank} built a different {type(task).__name__} from rank 0's ({difference}). Every rank must build "
            "the same model: the same constructor arguments and the same configure_model on every rank (read "
            "settings that differ by rank, such as the rank itself, only outside the model's shape)."
        )
    _CHECKED.setdefault(task, set()).add(when)


def _named_entries(task: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from task.named_parameters()
    yield from task.named_buffers()


def _describe(entry: tuple[tuple[int, ...], str] | None) -> str:
    if entry is None:
        return "absent"
    shape, dtype = entry
    return f"shape {list(shape)} {dtype}"
