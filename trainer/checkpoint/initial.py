"""``Trainer(initial_weights=PATH)``: a task's starting weights from published or earlier weights, each rank reading
only the part of each tensor it holds (docs/checkpoints.md, "Starting from pretrained weights").

The source is anything :func:`trainer.checkpoint.hf.open_weights` reads: a ``.safetensors`` file, a Hugging Face
folder (an index with its shards), a ``torch.save``'d state dict, or a keel checkpoint. The task is already placed
by its strategy (sharded under FSDP): for every entry of its state dict this rank works out which slice of the full
tensor it holds (a DTensor's local shape and offset; a plain tensor is whole) and reads that slice alone. A keel
checkpoint is read with DCP, which does the same from the saved shards (any world size, any strategy).

Before a byte is read, every name is matched: the source's names (after ``rename``) against the task's, and every
shape. Missing, unexpected or mismatched entries are named together in one error; with ``strict=False`` the first
two are logged and skipped (a new head keeps its initialisation). Every rank agrees on the outcome, so one rank's
failure (a file missing on one node) raises on all of them instead of leaving the others waiting.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.checkpoint.files import CheckpointError
from trainer.distributed import comm
from trainer.options import Rename, rename_function

__all__ = ["Rename", "load_initial_weights", "rename_function"]

log = logging.getLogger(__name__)

_SHOWN = 8  # names listed per kind of problem


def load_initial_weights(
    task: nn.Module, path: str | os.PathLike[str], *, rename: Rename | None = None, strict: bool = True
) -> None:
    """Copy the weights of ``path`` into ``task`` (already placed by its strategy), this rank's slices only.

    A collective when a process group is up: every rank calls it, and every rank raises when any rank fails.

    Raises:
        CheckpointError: the source cannot be read, or names do not match (missing, unexpected, other shapes;
            naming each), or another rank failed.
    """
    error: BaseException | None = None
    try:
        _load(task, path, rename_function(rename), strict)
    except Exception as exc:  # raised below, once the ranks agree
        error = exc
    if comm.is_initialized() and comm.get_world_size() > 1:
        failures = [(rank, text) for rank, text in enumerate(comm.all_gather_object(_describe(error))) if text]
        if error is None and failures:
            rank, text = failures[0]
            raise CheckpointError(f"initial_weights={os.fspath(path)!r}: rank {rank} failed: {text}")
    if error is not None:
        raise error


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _load(task: nn.Module, path: str | os.PathLike[str], rename: Callable[[str], str | None], strict: bool) -> None:
    from trainer.checkpoint import hf

    with hf.open_weights(path, collective=True) as source:
        targets, aliases = _targets(task)
        pairs = _match(source, targets, aliases, rename, strict, os.fspath(path))
        with torch.no_grad():
            if isinstance(source, hf.KeelSource):
                source.load_into({src: targets[key] for key, src in pairs.items()})
            else:
                for key, src in pairs.items():
                    _copy_slice(source, src, targets[key])
    log.info("Initial weights: %d tensors from %s.", len(pairs), os.fspath(path))


def _targets(task: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The task's state dict entries as detached views of what it holds, a parameter shared under several names
    (tied weights) once; and every name -> the name it is kept under (the source may hold either)."""
    first: dict[int, str] = {}
    targets, aliases = {}, {}
    for key, tensor in task.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        aliases[key] = first.setdefault(id(tensor), key)
        if aliases[key] == key:
            targets[key] = tensor.detach()
    return targets, aliases


def _match(
    source: Any,
    targets: dict[str, torch.Tensor],
    aliases: dict[str, str],
    rename: Callable[[str], str | None],
    strict: bool,
    path: str,
) -> dict[str, str]:
    """task key -> source key, after every name and shape was checked (one error naming every problem)."""
    pairs: dict[str, str] = {}
    named: dict[str, str] = {}  # task name -> the source name renamed to it
    unexpected, twice, shapes = [], [], []
    for src in source.keys():
        name = rename(src)
        if name is None:
            continue
        if not isinstance(name, str):
            raise ValueError(
                f"initial_weights_rename returned {name!r} for {src!r}: return a name, or None to drop it."
            )
        key = aliases.get(name)
        if key is None:
            unexpected.append(src if name == src else f"{src} (as {name})")
        elif name in named:
            twice.append(f"{named[name]} and {src} (both as {name})")
        else:
            named[name] = src
            if key in pairs:  # a tied weight the file holds under both of its names: read once
                continue
            shape = tuple(source.meta(src)[0])
            if shape != tuple(targets[key].shape):
                shapes.append(f"{src}: {shape} in the file, {tuple(targets[key].shape)} in the task")
            pairs[key] = src
    missing = [key for key in targets if key not in pairs]
    problems = [f"{len(shapes)} with another shape: {_names(shapes)}"] if shapes else []
    if twice:
        problems.append(f"{len(twice)} task names given twice: {_names(twice)}")
    loose = []
    if missing:
        loose.append(f"{len(missing)} task entries the file does not have: {_names(missing)}")
    if unexpected:
        loose.append(f"{len(unexpected)} file entries the task does not have: {_names(unexpected)}")
    if loose and not strict:
        log.warning("initial_weights=%r (strict=False): %s; those keep their initialisation.", path, "; ".join(loose))
    elif loose:
        problems += loose
    if problems:
        raise CheckpointError(
            f"initial_weights={path!r} does not match the task: {'; '.join(problems)}. Map the file's names with "
            "initial_weights_rename (a function, or {source_prefix: task_prefix}; a function returning None drops an "
            "entry), or pass initial_weights_strict=False to keep the initialisation of what the file lacks. Nothing "
            "was loaded."
        )
    return pairs


def _names(items: list[str]) -> str:
    more = f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank holds of ``tensor`` and where it sits in the full tensor (a DTensor's local shard and
    its index; a plain tensor whole)."""
    if not hasattr(tensor, "device_mesh"):
        return tensor, ()
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert isinstance(tensor, DTensor)

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):  # pragma: no cover - a placement this computation does not describe
        raise CheckpointError(
            f"initial_weights: a tensor of placements {tensor.placements} holds {tuple(local.shape)} on this rank, "
            f"not {tuple(shape)}; load a keel checkpoint instead (DCP reshards any layout)."
        )
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _copy_slice(source: Any, key: str, target: torch.Tensor) -> None:
    local, index = local_part(target)
    if local.numel():
        local.copy_(source.read(key, index))
