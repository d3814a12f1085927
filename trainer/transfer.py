"""Moving batches to the device and reading their size, without host-device syncs."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch


def move_to_device(batch: Any, device: torch.device, *, float_dtype: torch.dtype | None = None) -> Any:
    """Copy every tensor in a nested batch (tensors, lists, tuples, named tuples, dicts, dataclasses).

    CUDA copies are ``non_blocking``: asynchronous from pinned memory (``pin_memory=True`` loaders), a
    plain synchronous copy otherwise. ``float_dtype`` converts floating-point tensors (precision "64").
    """
    if device.type == "cpu" and float_dtype is None:
        return batch  # loader output already lives on the CPU: skip the traversal (hot path)
    non_blocking = device.type == "cuda"

    def move(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if float_dtype is not None and obj.is_floating_point():
                return obj.to(device=device, dtype=float_dtype, non_blocking=non_blocking)
            return obj.to(device, non_blocking=non_blocking)
        if isinstance(obj, Mapping):
            return type(obj)({k: move(v) for k, v in obj.items()}) if type(obj) is not dict else {k: move(v) for k, v in obj.items()}
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
            return type(obj)(*(move(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(move(v) for v in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: move(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init})
        return obj

    return move(batch)


def infer_batch_size(batch: Any) -> int | None:
    """Size of the first dimension of the first tensor found (shape only: no sync). None if none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        items = batch.values()
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
