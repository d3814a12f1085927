"""Hugging Face safetensors weights in and out of keel, tensor by tensor (docs/checkpoints.md).

:func:`open_weights` reads named tensors from a ``.safetensors`` file, a Hugging Face folder (sharded with
``model.safetensors.index.json``, or one ``model.safetensors``), a ``torch.save``'d state dict or a keel checkpoint
(verified first, then read with DCP a few keys at a time). :func:`write_safetensors` writes one safetensors file from
a stream of tensors whose layout is known up front, so that each tensor is written and dropped before the next is
read. :func:`export_weights` joins the two: a checkpoint becomes one safetensors file, a folder of shards, or one
plain ``torch.save`` file, reading the source at most one output shard at a time.

The ``safetensors`` library (the ``hf`` extra) is needed only to read safetensors files, and is imported then;
writing needs nothing beyond torch. Neither it nor DCP is imported when this module is.
"""

from __future__ import annotations

import ctypes
import io
import json
import logging
import os
import re
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from trainer.checkpoint import reader
from trainer.checkpoint.files import (
    FORMAT_VERSION,
    K_FORMAT,
    K_STATE_DICT,
    CheckpointError,
    CorruptCheckpointError,
    save_file,
    unreadable,
    verify_records,
    write_atomic,
)
from trainer.checkpoint.store import KEEL_FILE, MANIFEST_FILE, METADATA_FILE
from trainer.storage import AnyPath, RemotePath, as_path, location

__all__ = ["WeightSource", "export_weights", "open_weights", "write_safetensors"]

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHARD_FILE = "model-{:05d}-of-{:05d}.safetensors"
_HF_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
INSTALL = "pip install 'keel-trainer[hf]'"
FORMAT_METADATA = {"format": "pt"}  # what transformers expects in a safetensors header's __metadata__

# safetensors' dtype names
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

Index = tuple[slice, ...]
Layout = Sequence[tuple[str, Sequence[int], torch.dtype]]


# ---------------------------------------------------------------------- reading
class WeightSource:
    """Named tensors of a weights file or a checkpoint, read a few at a time (a context manager).

    ``skipped`` names the entries that are not tensors (left out of :meth:`keys`).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.skipped: list[str] = []

    def keys(self) -> list[str]:
        """The tensors' names, in the source's order."""
        raise NotImplementedError

    def meta(self, key: str) -> tuple[torch.Size, torch.dtype]:
        """The shape and dtype of ``key``, without reading it.

        Raises:
            KeyError: no tensor ``key`` (the message names the source).
        """
        raise NotImplementedError

    def read(self, key: str, index: Index = ()) -> torch.Tensor:
        """A new contiguous CPU tensor holding ``full[index]`` of ``key`` (only that slice's bytes are read where
        the format allows).

        Raises:
            KeyError: no tensor ``key`` (the message names the source).
        """
        raise NotImplementedError

    def read_many(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Whole tensors of ``keys`` (in one read where the format allows: one DCP load for a keel checkpoint)."""
        return {key: self.read(key) for key in keys}

    def state_dict(self) -> dict[str, Any]:
        """Every entry at once (the whole model in memory), non-tensor entries included where the source has them."""
        return dict(self.read_many(self.keys()))

    def close(self) -> None:
        """Release the open files."""

    def __enter__(self) -> WeightSource:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _missing(self, key: str) -> KeyError:
        names = self.keys()
        return KeyError(f"{self.path!r} holds no tensor {key!r} ({len(names)} tensors, the first: {names[:3]}).")


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ImportError(f"Reading safetensors files needs the safetensors package: {INSTALL}.") from exc
    return safe_open


def _open_shard(safe_open: Any, path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"Safetensors file {str(path)!r} does not exist.")
    try:
        return safe_open(os.fspath(path), framework="pt")
    except Exception as exc:  # safetensors' SafetensorError: a truncated file, a garbled header
        raise CorruptCheckpointError(
            f"Safetensors file {str(path)!r} is truncated or corrupt ({exc}); write or download it again."
        ) from exc


class _Safetensors(WeightSource):
    """One safetensors file, or the shards of a Hugging Face folder (``weight_map``: name -> shard path)."""

    def __init__(self, path: str, shards: Sequence[Path], weight_map: dict[str, str] | None = None) -> None:
        super().__init__(path)
        safe_open = _safe_open()
        self._handles: dict[str, Any] = {}
        try:
            for shard in shards:
                self._handles[str(shard)] = _open_shard(safe_open, shard)
            if weight_map is None:
                (handle,) = self._handles.values()
                names = getattr(handle, "offset_keys", handle.keys)()  # the file's order (safetensors >= 0.5)
                weight_map = {name: str(shards[0]) for name in names}
            for file, names in _by_shard(weight_map).items():
                missing = set(names) - set(self._handles[file].keys())
                if missing:
                    raise CorruptCheckpointError(
                        f"{path!r}: {INDEX_FILE} places {sorted(missing)[:5]} in {file!r}, which does not hold "
                        "them; the index belongs to other shards. Download the folder again."
                    )
        except BaseException:
            self.close()
            raise
        self._where = weight_map

    def keys(self) -> list[str]:
        return list(self._where)

    def _handle(self, key: str) -> Any:
        if key not in self._where:
            raise self._missing(key)
        return self._handles[self._where[key]]

    def meta(self, key: str) -> tuple[torch.Size, torch.dtype]:
        piece = self._handle(key).get_slice(key)
        name = piece.get_dtype()
        if name not in DTYPES:
            raise CheckpointError(
                f"Tensor {key!r} of {self._where[key]!r} has dtype {name}, which keel does not read (it reads "
                f"{', '.join(DTYPES)})."
            )
        return torch.Size(piece.get_shape()), DTYPES[name]

    def read(self, key: str, index: Index = ()) -> torch.Tensor:
        handle = self._handle(key)
        tensor = handle.get_slice(key)[index] if index else handle.get_tensor(key)
        return tensor.contiguous()

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles = {}


def _by_shard(weight_map: dict[str, str]) -> dict[str, list[str]]:
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    return shards


def _read_index(folder: Path) -> tuple[list[Path], dict[str, str]]:
    """The shards (in the folder) and ``name -> shard path`` of a Hugging Face index."""
    index = folder / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"Index {str(index)!r} is unreadable ({type(exc).__name__}: {exc}).") from exc
    names = sorted(set(weight_map.values()))
    outside = [n for n in names if not n or n.startswith(".") or "/" in n or "\\" in n]
    if outside:
        raise CorruptCheckpointError(f"Index {str(index)!r} names {outside[0]!r}, which is not a file in its folder.")
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(
            f"Index {str(index)!r} names shards that are not in {str(folder)!r}: {missing}. The download or copy "
            "is incomplete; fetch the missing files."
        )
    return [folder / n for n in names], {k: str(folder / v) for k, v in weight_map.items()}


def _load_torch(path: AnyPath) -> Any:
    """A ``torch.save`` file, memory-mapped (a slice reads only its pages), ``weights_only=True``."""
    remote = isinstance(path, RemotePath)
    try:
        source: Any = io.BytesIO(path.read_bytes()) if remote else path
        verify_records(path, source)  # the file's own CRC32s: a flipped bit is named, never loaded
        try:
            return torch.load(source, map_location="cpu", mmap=not remote, weights_only=True)
        except RuntimeError as exc:
            if remote or "mmap" not in str(exc):
                raise
            return torch.load(source, map_location="cpu", weights_only=True)  # the legacy format: no mmap
    except CheckpointError:
        raise
    except Exception as exc:
        raise unreadable(path, exc) from exc


class _TorchFile(WeightSource):
    """A ``torch.save``'d state dict, or a dict whose ``"state_dict"`` is one (Lightning's, a keel weights file)."""

    def __init__(self, path: AnyPath) -> None:
        super().__init__(str(path))
        state = _load_torch(path)
        if isinstance(state, dict) and int(state.get(K_FORMAT, 0) or 0) > FORMAT_VERSION:
            raise CheckpointError(
                f"Checkpoint {str(path)!r} has format version {state[K_FORMAT]}, newer than this keel "
                f"({FORMAT_VERSION}); upgrade keel to load it."
            )
        if isinstance(state, dict) and isinstance(state.get(K_STATE_DICT), dict):
            state = state[K_STATE_DICT]
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{str(path)!r} holds a {type(state).__name__}, not a state dict (a dict of tensors, or a dict "
                "whose 'state_dict' is one)."
            )
        self._state = state
        self._tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
        self.skipped = [str(k) for k in state if k not in self._tensors]

    def keys(self) -> list[str]:
        return list(self._tensors)

    def _full(self, key: str) -> torch.Tensor:
        if key not in self._tensors:
            raise self._missing(key)
        return self._tensors[key]

    def meta(self, key: str) -> tuple[torch.Size, torch.dtype]:
        tensor = self._full(key)
        return tensor.shape, tensor.dtype

    def read(self, key: str, index: Index = ()) -> torch.Tensor:
        return self._full(key)[index].clone(memory_format=torch.contiguous_format)

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def close(self) -> None:
        self._state, self._tensors = {}, {}


class KeelSource(WeightSource):
    """A keel checkpoint folder (any strategy and world size): verified, then read with DCP, a batch per load."""

    def __init__(self, folder: AnyPath, *, collective: bool = False) -> None:
        super().__init__(str(folder))
        self.folder = folder
        self.manifest, _ = reader._verified(folder, collective=collective)
        self._meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._fqn: dict[str, str] = {}
        for fqn, name, item in _model_items(folder, self.manifest):
            if hasattr(item, "properties"):  # a TensorStorageMetadata; bytes items are not tensors
                self._meta[name], self._fqn[name] = (torch.Size(item.size), item.properties.dtype), fqn
            else:
                self.skipped.append(name)

    def keys(self) -> list[str]:
        return list(self._meta)

    def meta(self, key: str) -> tuple[torch.Size, torch.dtype]:
        if key not in self._meta:
            raise self._missing(key)
        return self._meta[key]

    def read_many(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        keys = list(keys)
        for key in keys:
            self.meta(key)
        if not keys:
            return {}
        tensors = reader.read_model(self.folder, self.manifest, {self._fqn[k] for k in keys})
        return {key: tensors[key] for key in keys}

    def read(self, key: str, index: Index = ()) -> torch.Tensor:
        tensor = self.read_many([key])[key]
        return tensor[index].clone(memory_format=torch.contiguous_format) if index else tensor

    def state_dict(self) -> dict[str, Any]:
        return reader.read_model(self.folder, self.manifest)

    def load_into(self, targets: dict[str, torch.Tensor]) -> None:
        """Read the entries ``targets`` names (model keys) into its tensors in place, DTensors included: each rank
        reads the saved pieces that overlap what it holds (a collective under a process group)."""
        reader.load_model_into(self.folder, self.manifest, targets)


def _model_items(folder: AnyPath, manifest: dict[str, Any] | None) -> list[tuple[str, str, Any]]:
    """(DCP key, model key, DCP's metadata) of every model entry of a verified save, from its ``.metadata``."""
    from trainer.checkpoint import dcp_io

    try:
        metadata = dcp_io.reader(reader.data_root(folder, manifest)).read_metadata()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        raise reader._load_error(folder, exc, "has an unreadable .metadata") from exc
    items = []
    for fqn, item in metadata.state_dict_metadata.items():
        where = (metadata.planner_data or {}).get(fqn) or tuple(fqn.split(".", 1))
        if len(where) == 2 and where[0] == "model":
            items.append((fqn, str(where[1]), item))
    return items


def _is_safetensors(path: Path) -> bool:
    if path.suffix == ".safetensors":
        return True
    with path.open("rb") as handle:
        head = handle.read(9)
    return len(head) == 9 and head[8:] == b"{" and struct.unpack("<Q", head[:8])[0] < path.stat().st_size


def open_weights(path: str | os.PathLike[str], *, collective: bool = False) -> WeightSource:
    """The named tensors of a weights file or a checkpoint, read a few at a time (use it with ``with``).

    Args:
        path: A ``.safetensors`` file; a Hugging Face folder (``model.safetensors.index.json`` and its shards, or
            one ``model.safetensors``); a ``torch.save``'d state dict (or a dict whose ``"state_dict"`` is one:
            Lightning's, a keel weights file), memory-mapped so that a slice reads only its pages; or a keel
            checkpoint (a save folder, its ``lightning.pt``, ``last.ckpt``), verified first and then read with
            DCP a batch of keys per load (:meth:`WeightSource.read_many`). A keel checkpoint or a ``torch.save`` file
            may be on object storage (``s3://...``; the file is read into memory); safetensors are read locally.
        collective: Every rank of the process group opens the same source: a keel checkpoint's files are verified
            by the ranks together, each checking its share.

    Returns:
        A :class:`WeightSource`: ``keys()``, ``meta(key)``, ``read(key, index)``, ``read_many(keys)``, ``close()``.

    Raises:
        CheckpointError: the path does not exist, a folder holds neither layout, a shard the index names is missing,
            or a keel checkpoint fails its verification (naming the file).
        CorruptCheckpointError: a truncated or garbled file (naming it).
        ImportError: a safetensors file, and the safetensors package is not installed.
    """
    target = reader.save_folder(location(path, "open_weights(path)"))
    if isinstance(target, RemotePath):
        if not target.is_file():
            return KeelSource(target, collective=collective)
        if target.suffix == ".safetensors":
            raise CheckpointError(f"{str(target)!r}: safetensors files are read from local paths; download it first.")
        return _TorchFile(target)
    if target.is_dir():
        if (target / INDEX_FILE).is_file():
            return _Safetensors(str(target), *_read_index(target))
        if (target / SINGLE_FILE).is_file():
            return _Safetensors(str(target), [target / SINGLE_FILE])
        if any((target / name).exists() for name in (MANIFEST_FILE, KEEL_FILE, METADATA_FILE)):
            return KeelSource(target, collective=collective)
        raise CheckpointError(
            f"{str(target)!r} is neither a Hugging Face weights folder ({INDEX_FILE} with its shards, or "
            f"{SINGLE_FILE}) nor a keel checkpoint ({MANIFEST_FILE}); pass such a folder, or a weights file."
        )
    if not target.is_file():
        raise CheckpointError(f"Checkpoint {str(target)!r} does not exist.")
    if _is_safetensors(target):
        return _Safetensors(str(target), [target])
    return _TorchFile(target)


# ---------------------------------------------------------------------- writing
def _header(layout: Layout, metadata: dict[str, str] | None, target: AnyPath) -> tuple[bytes, int]:
    """The header bytes (length, JSON padded to 8 bytes) of ``layout``, and the bytes of its tensors."""
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError(f"{str(target)!r}: safetensors metadata maps str to str; got {metadata!r}.")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, shape, dtype in layout:
        if name in header:
            what = "is reserved for the metadata" if name == "__metadata__" else "appears twice in the layout"
            raise ValueError(f"{str(target)!r}: the tensor name {name!r} {what}.")
        if dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"{str(target)!r}: tensor {name!r} is {dtype}, which safetensors cannot hold; cast it (dtype=...)."
            )
        end = offset + torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": [int(n) for n in shape], "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offset


def _write_tensor(handle: Any, tensor: torch.Tensor) -> None:
    """The raw bytes of ``tensor`` (C order, this machine's byte order: little-endian, checked by the caller)."""
    data = tensor.detach().to("cpu").contiguous()
    size = data.numel() * data.element_size()
    if size:
        handle.write(memoryview((ctypes.c_ubyte * size).from_address(data.data_ptr())).cast("B"))


def _write_tensors(handle: Any, layout: Layout, tensors: Iterable[tuple[str, torch.Tensor]], target: AnyPath) -> None:
    expected = iter(layout)
    for name, tensor in tensors:
        entry = next(expected, None)
        if entry is None:
            raise ValueError(f"{str(target)!r}: got tensor {name!r} after the last entry of the layout.")
        want, shape, dtype = entry
        if name != want or tensor.shape != torch.Size(shape) or tensor.dtype != dtype:
            raise ValueError(
                f"{str(target)!r}: got tensor {name!r} {tuple(tensor.shape)} {tensor.dtype} where the layout has "
                f"{want!r} {tuple(shape)} {dtype}; yield the tensors in the layout's order, as it describes them."
            )
        _write_tensor(handle, tensor)
        del tensor
    left = [name for name, _, _ in expected]
    if left:
        raise ValueError(f"{str(target)!r}: the tensors ended before {left[0]!r} ({len(left)} of the layout left).")


def write_safetensors(
    path: str | os.PathLike[str],
    layout: Layout,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write one safetensors file from a stream: each tensor is written and dropped before the next is taken.

    Written to a temporary file beside ``path``, fsynced and renamed over it: a failure leaves ``path`` as it was.
    Needs no safetensors package.

    Args:
        path: The file to write.
        layout: ``(name, shape, dtype)`` of every tensor, in the order ``tensors`` yields them (the header is
            written first).
        tensors: ``(name, tensor)`` pairs in the layout's order.
        metadata: The header's ``__metadata__`` (str to str), e.g. ``{"format": "pt"}``.

    Raises:
        ValueError: a tensor that is not the layout's next entry (name, shape or dtype), too many or too few
            tensors, a dtype safetensors cannot hold, a name twice.
        CheckpointSaveError: the file could not be written (disk full, no permission, ...).
    """
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
        raise ValueError("write_safetensors writes little-endian bytes and runs on little-endian machines only.")
    target = as_path(location(path, "write_safetensors(path)"))
    header, size = _header(layout, metadata, target)

    def write(handle: Any) -> None:
        handle.write(header)
        _write_tensors(handle, layout, tensors, target)

    write_atomic(target, write, state=len(header) + size)


# ---------------------------------------------------------------------- export
@dataclass(frozen=True)
class _Entry:
    key: str  # in the source
    name: str  # exported
    shape: torch.Size
    dtype: torch.dtype  # exported

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def _exported_name(rename: Callable[[str], str | None] | None, key: str, seen: dict[str, str]) -> str | None:
    name = rename(key) if rename is not None else key
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"export_weights(rename=...) returned {name!r} for {key!r}: return a name, or None to drop it."
        )
    if name in seen:
        raise ValueError(f"export_weights(rename=...) maps both {seen[name]!r} and {key!r} to {name!r}.")
    seen[name] = key
    return name


def _plan(source: WeightSource, rename: Callable[[str], str | None] | None, dtype: torch.dtype | None) -> list[_Entry]:
    entries: list[_Entry] = []
    seen: dict[str, str] = {}
    for key in source.keys():
        name = _exported_name(rename, key, seen)
        if name is not None:
            shape, kind = source.meta(key)
            entries.append(_Entry(key, name, shape, dtype if dtype is not None and kind.is_floating_point else kind))
    if source.skipped:
        log.warning(
            "export_weights: %s holds entries that are not tensors, left out of the safetensors export: %s",
            source.path,
            source.skipped,
        )
    return entries


def _batches(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Consecutive entries in groups of at most ``limit`` bytes; an entry larger than the limit alone in its own."""
    batches: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if batches[-1] and size + entry.nbytes > limit:
            batches.append([])
            size = 0
        batches[-1].append(entry)
        size += entry.nbytes
    return batches


def _stream(source: WeightSource, batches: Iterable[list[_Entry]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The exported tensors, reading the source one batch at a time."""
    for batch in batches:
        tensors = source.read_many([e.key for e in batch])
        for entry in batch:
            yield entry.name, tensors.pop(entry.key).to(entry.dtype)


def _layout(entries: list[_Entry]) -> list[tuple[str, Sequence[int], torch.dtype]]:
    return [(e.name, e.shape, e.dtype) for e in entries]


def _export_folder(source: WeightSource, folder: AnyPath, entries: list[_Entry], max_shard_size: int) -> None:
    shards = _batches(entries, max_shard_size)
    count = len(shards)
    names = [SINGLE_FILE] if count == 1 else [SHARD_FILE.format(i + 1, count) for i in range(count)]
    folder.mkdir(parents=True, exist_ok=True)
    for name, shard in zip(names, shards):
        write_safetensors(folder / name, _layout(shard), _stream(source, [shard]), metadata=FORMAT_METADATA)
        log.info("export_weights: wrote %s (%d tensors)", folder / name, len(shard))
    if count > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard},
        }
        body = json.dumps(index, indent=2).encode()
        write_atomic(folder / INDEX_FILE, lambda handle: handle.write(body), state=len(body))
        names.append(INDEX_FILE)
    for stale in [p for p in folder.iterdir() if _HF_FILE.fullmatch(p.name) and p.name not in names]:
        log.info("export_weights: removing %s, left by an earlier export to %s", stale, folder)
        stale.unlink()


def _export_plain(
    source: WeightSource, target: AnyPath, rename: Callable[[str], str | None] | None, dtype: torch.dtype | None
) -> None:
    state: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in source.state_dict().items():
        name = _exported_name(rename, key, seen)
        if name is None:
            continue
        if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.to(dtype)
        state[name] = value
    save_file(state, target)


def export_weights(
    ckpt_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    rename: Callable[[str], str | None] | None = None,
    max_shard_size: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
) -> None:
    """Write the task weights of a keel checkpoint (any strategy, any world size, this release's or the previous
    one's; or any source :func:`open_weights` reads) as safetensors or one plain ``state_dict`` file, without a
    process group.

    The form follows ``out_path``:

    * ``*.safetensors``: one safetensors file.
    * an existing folder, or a path without a suffix: Hugging Face's layout in that folder, shards of at most
      ``max_shard_size`` bytes (``model-00001-of-00003.safetensors``, ...; a tensor larger than the limit alone in its
      own shard) and ``model.safetensors.index.json``, written last; or one ``model.safetensors`` when everything
      fits one shard. Files of an earlier export to the folder that this one did not write are removed.
    * any other suffix (``.pt``, ``.bin``, ``.pth``, ``.ckpt``): one plain ``torch.save`` state dict that loads with
      bare PyTorch, ``model.load_state_dict(torch.load(out_path, weights_only=True))``. This form holds the whole
      model in memory.

    The safetensors forms read the source at most one output shard (``max_shard_size`` bytes) at a time (for a
    keel checkpoint: one DCP load per shard) and write each tensor before the next is read; they hold tensors only
    (other entries are left out, with a warning). Tied or duplicate tensors are written each under its own key.

    Args:
        ckpt_path: The checkpoint or weights to export (local, or a keel checkpoint on object storage).
        out_path: The file or folder to write (a ``.pt`` file may be on object storage).
        rename: Maps keel's key to the exported name (``lambda k: "model." + k``); None drops the key.
        max_shard_size: The most bytes of tensors per shard (and per read of the source).
        dtype: Cast floating-point tensors to this dtype (``torch.bfloat16``); others are kept.

    Raises:
        CheckpointError: the checkpoint is missing, damaged or unsafe (naming the file).
        ValueError: ``rename`` gives a name twice or a non-string, or an argument is out of range.
        CheckpointSaveError: the output could not be written; nothing was replaced.
    """
    source_path = location(ckpt_path, "export_weights(ckpt_path)")
    target = as_path(location(out_path, "export_weights(out_path)"))
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ValueError(f"export_weights(max_shard_size={max_shard_size!r}): give a positive number of bytes.")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"export_weights(dtype={dtype!r}): give a floating-point torch dtype, e.g. torch.bfloat16.")
    with open_weights(source_path) as source:
        if target.is_dir() or not target.suffix:
            _export_folder(source, target, _plan(source, rename, dtype), max_shard_size)
        elif target.suffix == ".safetensors":
            entries = _plan(source, rename, dtype)
            batches = _batches(entries, max_shard_size)
            write_safetensors(target, _layout(entries), _stream(source, batches), metadata=FORMAT_METADATA)
        else:
            _export_plain(source, target, rename, dtype)
    log.info("export_weights: wrote %s from %s", target, source_path)
