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
from typing import Any, TypeVar

import torch
from torch import nn

from trainer.checkpoint.files import CheckpointError
from trainer.distributed import comm
from trainer.options import Rename, rename_function

__all__ = ["Rename", "load_initial_weights", "rename_function"]

log = logging.getLogger(__name__)

_SHOWN = 8  # names listed per kind of problem
T = TypeVar("T")


def load_initial_weights(
    task: nn.Module, path: str | os.PathLike[str], *, rename: Rename | None = None, strict: bool = True
) -> None:
    """Copy the weights of ``path`` into ``task`` (already placed by its strategy), this rank's slices only.

    A collective when a process group is up: every rank calls it, and every rank raises when any rank fails. The
    load runs in steps (find the source, open it, match the names, read), and the ranks agree after each before any
    enters the next step's collectives: a rank that fails early (its node lacks the file) never leaves the others
    paired with the wrong collective.

    Raises:
        CheckpointError: the source cannot be read, or names do not match (missing, unexpected, other shapes;
            naming each), or another rank failed (naming it and its error).
    """
    from trainer.checkpoint import hf

    where = os.fspath(path)
    together = comm.is_initialized() and comm.get_world_size() > 1
    located = _agreed(lambda: hf.locate_weights(path), where, together, kind=lambda found: found.kind)
    source = _agreed(lambda: located.open(collective=together), where, together)
    try:
        targets, aliases = _targets(task)
        pairs = _agreed(
            lambda: _match(source, targets, aliases, rename_function(rename), strict, where), where, together
        )
        with torch.no_grad():
            if isinstance(source, hf.KeelSource):  # DCP's load: a collective that agrees on failures itself
                source.load_into({src: targets[key] for key, src in pairs.items()})
            else:
                _agreed(lambda: _copy_all(source, pairs, targets), where, together)
    finally:
        source.close()
    log.info("Initial weights: %d tensors from %s.", len(pairs), where)


def _agreed(step: Callable[[], T], path: str, together: bool, *, kind: Callable[[T], str] | None = None) -> T:
    """``step()`` on every rank, then (``together``) the ranks agree before going on: when a rank failed every rank
    raises (a failed rank its own error, the others one naming the first failed rank and its error). ``kind``: what
    each rank found must also be the same everywhere (the next step's collectives depend on it)."""
    error: Exception | None = None
    result: T | None = None
    try:
        result = step()
    except Exception as exc:  # raised below, once the ranks agree
        error = exc
    if together:
        found = kind(result) if kind is not None and result is not None else None
        outcomes = comm.all_gather_object((_describe(error), found))
        failures = [(rank, text) for rank, (text, _) in enumerate(outcomes) if text]
        if error is None and failures:
            rank, text = failures[0]
            raise CheckpointError(f"initial_weights={path!r}: rank {rank} failed: {text}")
        kinds = {f for _, f in outcomes}
        if error is None and kind is not None and len(kinds) > 1:
            seen = ", ".join(f"rank {rank}: {f}" for rank, (_, f) in enumerate(outcomes))
            raise CheckpointError(
                f"initial_weights={path!r} is not the same source on every rank ({seen}): give every rank the same "
                "weights (a path on a shared filesystem, or the same copy on each node)."
            )
    if error is not None:
        raise error
    return result  # type: ignore[return-value]  # set when step() returned


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _copy_all(source: Any, pairs: dict[str, str], targets: dict[str, torch.Tensor]) -> None:
    for key, src in pairs.items():
        _copy_slice(source, src, targets[key])


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
