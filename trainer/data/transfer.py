"""Moving batches to the device and reading their size without host-device syncs, and reading many small
tensors back to the host in one transfer."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch


def move_to_device(
    batch: Any, device: torch.device, *, float_dtype: torch.dtype | None = None, from_any_device: bool = False
) -> Any:
    """Copy every tensor in a nested batch (tensors, lists, tuples, named tuples, dicts, dataclasses).

    CUDA copies are ``non_blocking``: asynchronous from pinned memory (``pin_memory=True`` loaders), a
    plain synchronous copy otherwise. ``float_dtype`` converts floating-point tensors (precision "64").
    To the CPU, the batch is returned as it is (a loader's output already lives there), unless
    ``from_any_device``: then every tensor is brought to the CPU (predictions made on a GPU).
    """
    if device.type == "cpu" and float_dtype is None and not from_any_device:
        return batch  # loader output already lives on the CPU: skip the traversal (hot path)
    non_blocking = device.type == "cuda"

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if float_dtype is not None and tensor.is_floating_point():
            return tensor.to(device=device, dtype=float_dtype, non_blocking=non_blocking)
        return tensor.to(device, non_blocking=non_blocking)

    return map_tensors(batch, move)


def convert_floats(batch: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor of a nested batch in ``dtype``, each on the device it is on: precision "64" as
    the batch-transfer hooks see the batch (Lightning's precision plugin converts it before them)."""
    return map_tensors(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` rebuilt with ``fn(tensor)`` for every tensor in it (tensors, lists, tuples, named tuples, dicts and
    other mappings, dataclasses); anything else is kept as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        # The batch's own Mapping class, built from a dict (mypy's Mapping takes no arguments).
        return (
            type(obj)({k: map_tensors(v, fn) for k, v in obj.items()})  # type: ignore[call-arg]
            if type(obj) is not dict
            else {k: map_tensors(v, fn) for k, v in obj.items()}
        )
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


_KIND = operator.attrgetter("dtype", "device", "ndim")


def read_to_host(tensors: Sequence[torch.Tensor]) -> list[float]:
    """The values of ``tensors`` (any shapes, flattened in order) as Python floats, with ONE device-to-host
    transfer (one sync on CUDA), usually after a single stack. Mixed dtypes or devices go through float64
    on the first tensor's device, which keeps ints and every float dtype exact."""
    if not tensors:
        return []
    kinds = set(map(_KIND, tensors))  # one pass in C: a logging step reads ~50 scalars
    dtype, _, ndim = next(iter(kinds))
    if len(kinds) == 1 and ndim == 0 and dtype.is_floating_point:  # the usual case: float scalars, one device
        return torch.stack(list(tensors)).tolist()
    device = tensors[0].device
    return torch.cat([t.reshape(-1).to(device, torch.float64) for t in tensors]).tolist()


def infer_batch_size(batch: Any) -> int | None:
    """Size of the first dimension of the first tensor found (shape only: no sync). None if none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        items: Iterable[Any] = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    else:
        return None
    for item in items:
        size = infer_batch_size(item)
        if size is not None:
            return size
    return None


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure (tensors, lists, tuples, mappings, dataclasses), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    return []


class BatchCopier:
    """Moves training batches to the device; on CUDA from a pinned loader, on a copy stream of its own.

    A ``non_blocking`` copy on the compute stream waits behind the kernels of the step before it. With
    pinned batches (``DataLoader(pin_memory=True)``) the copy is issued on a side stream instead, so it
    runs while the previous step's kernels still execute (the host queues them and moves on to fetch the
    next batch); the compute stream then waits for the copy on the device (``wait_stream``, no host sync),
    and each copied tensor is marked used by the compute stream (``record_stream``) so the caching
    allocator keeps its memory until that stream is done with it. Unpinned batches (a pageable copy
    blocks the host anyway), a CPU device, or ``overlap=False`` use :func:`move_to_device` as is.

    Args:
        device: The training device.
        float_dtype: Floating-point tensors are converted to it during the copy (precision "64").
        overlap: Whether the loader pins its batches (``pin_memory``); the side stream is only used then.
    """

    def __init__(self, device: torch.device, *, float_dtype: torch.dtype | None, overlap: bool) -> None:
        self.device = device
        self.float_dtype = float_dtype
        self.stream = torch.cuda.Stream(device) if overlap and device.type == "cuda" else None

    def __call__(self, batch: Any) -> Any:
        stream = self.stream
        if stream is None or not all(t.is_pinned() for t in tensors_in(batch) if t.device.type == "cpu"):
            return move_to_device(batch, self.device, float_dtype=self.float_dtype)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            moved = move_to_device(batch, self.device, float_dtype=self.float_dtype)
        compute.wait_stream(stream)
        for tensor in tensors_in(moved):
            if tensor.device.type == "cuda":
                tensor.record_stream(compute)
        return moved
