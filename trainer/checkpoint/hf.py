"""Hugging Face safetensors weights in and out of keel, tensor by tensor (docs/checkpoints.md).

:func:`open_weights` reads named tensors from a ``.safetensors`` file, a Hugging Face folder (sharded with
``model.safetensors.index.json``, or one ``model.safetensors``), a ``torch.save``'d state dict or a keel checkpoint
(verified first, then read with DCP a few keys at a time). :func:`write_safetensors` writes one safetensors file from
a stream of tensors whose layout is known up front, so that each tensor is written and dropped before the next is
read. :func:`export_weights` joins the two: a checkpoint becomes one safetensors file, a folder of shards, or one
plain ``torch.save`` file, reading the source at most one output shard at a time, and whole or refused (a failed
export leaves the previous one, or nothing that loads; never a mix). keel's safetensors record each tensor's CRC32 in
their header (``keel.crc32``), computed as it is written and checked as it is read.

The ``safetensors`` library (the ``hf`` extra) is needed only to read safetensors files, and is imported then;
writing needs nothing beyond torch. Neither it nor DCP is imported when this module is.
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import logging
import os
import re
import shutil
import struct
import sys
import tempfile
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
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
    CheckpointSaveError,
    CorruptCheckpointError,
    fsync_dir,
    human_bytes,
    os_error,
    remove_quietly,
    save_file,
    tensor_bytes,
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
CRC_KEY = "keel.crc32"  # __metadata__ key of keel's safetensors: JSON {tensor name: CRC32 of its bytes, 8 hex digits}
_CHUNK = 16 << 20  # bytes per read when a tensor's bytes are checked from the file, or a staged file is uploaded

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
    """One safetensors file, or the shards of a Hugging Face folder (``weight_map``: name -> shard path).

    A file keel wrote carries each tensor's CRC32 (:data:`CRC_KEY`); a tensor read whole is checked against it from
    the bytes just read, and a tensor read in slices is checked once, the first time, by reading its bytes from the
    file in chunks. A file without the key (written by anything else) is read unchecked.
    """

    def __init__(self, path: str, shards: Sequence[Path], weight_map: dict[str, str] | None = None) -> None:
        super().__init__(path)
        safe_open = _safe_open()
        self._handles: dict[str, Any] = {}
        self._crcs: dict[str, dict[str, int]] = {}  # file -> tensor -> CRC32 it was written with
        self._checked: set[str] = set()  # tensors whose bytes matched their CRC32 (read in slices)
        try:
            for shard in shards:
                handle = self._handles[str(shard)] = _open_shard(safe_open, shard)
                self._crcs[str(shard)] = _recorded_crcs(shard, handle.metadata())
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
        file = self._where[key]
        want = self._crcs[file].get(key)
        if index:
            if want is not None and key not in self._checked:
                _check_crc(file, key, _file_crc(Path(file), key), want)
                self._checked.add(key)
            return handle.get_slice(key)[index].contiguous()
        tensor = handle.get_tensor(key).contiguous()
        if want is not None:  # the bytes just read: checked without reading them again
            _check_crc(file, key, _crc32(tensor), want)
        return tensor

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles = {}


def _recorded_crcs(path: Path, metadata: dict[str, str] | None) -> dict[str, int]:
    """The CRC32s a keel-written file records in its header (:data:`CRC_KEY`); none for a file from elsewhere."""
    text = (metadata or {}).get(CRC_KEY)
    if text is None:
        return {}
    try:
        sums = json.loads(text)
        if not isinstance(sums, dict):
            raise TypeError("not a JSON object")
        return {str(name): int(value, 16) for name, value in sums.items() if len(value) == 8}
    except (ValueError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"Safetensors file {str(path)!r} has a damaged {CRC_KEY} entry in its header ({type(exc).__name__}: "
            f"{exc}); write or download the file again."
        ) from exc


def _check_crc(file: str, key: str, actual: int, want: int) -> None:
    if actual != want:
        raise CorruptCheckpointError(
            f"Safetensors file {file!r} is damaged: the bytes of tensor {key!r} do not match the CRC32 they were "
            f"written with (crc32 {actual:08x}, the header records {want:08x}; a flipped bit or a torn copy), so it is "
            "refused rather than loaded. Export or download the file again."
        )


def _file_crc(path: Path, key: str) -> int:
    """The CRC32 of tensor ``key``'s bytes, read from the file in chunks (its offsets from the header)."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            begin, end = json.loads(handle.read(length))[key]["data_offsets"]
            handle.seek(8 + length + begin)
            crc, left = 0, end - begin
            while left > 0:
                chunk = handle.read(min(left, _CHUNK))
                if not chunk:
                    raise EOFError(f"{left} bytes of {key!r} missing at the end of the file")
                crc, left = zlib.crc32(chunk, crc), left - len(chunk)
    except (OSError, ValueError, KeyError, TypeError, EOFError, struct.error) as exc:
        raise CorruptCheckpointError(
            f"Safetensors file {str(path)!r} is truncated or corrupt ({type(exc).__name__}: {exc}); write or "
            "download it again."
        ) from exc
    return crc


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
    limit = _name_max(folder)
    for name in names:
        if "\0" in name or len(os.fsencode(name)) > limit:
            raise CorruptCheckpointError(
                f"Index {str(index)!r} names the shard {_shorten(name)!r} ({len(name):,} characters) for "
                f"{next(k for k, v in weight_map.items() if v == name)!r}, which cannot be "
                f"a file name (a file name holds at most {limit} bytes and no NUL). The index is damaged or was not "
                f"written for this folder: download the folder again, or correct that entry of its weight_map."
            )
    try:
        missing = [n for n in names if not (folder / n).is_file()]
    except OSError as exc:  # a name this filesystem refuses in some other way
        raise CorruptCheckpointError(
            f"Index {str(index)!r} names a shard that cannot be looked up in {str(folder)!r} ({exc.strerror or exc}, "
            f"{_shorten(exc.filename or '')!r}): download the folder again, or correct its weight_map."
        ) from exc
    if missing:
        raise CheckpointError(
            f"Index {str(index)!r} names shards that are not in {str(folder)!r}: {missing}. The download or copy "
            "is incomplete; fetch the missing files."
        )
    return [folder / n for n in names], {k: str(folder / v) for k, v in weight_map.items()}


def _name_max(folder: Path) -> int:
    """The longest file name (in bytes) the folder's filesystem takes: 255 on every common one."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (AttributeError, OSError, ValueError):  # pragma: no cover - platforms without pathconf
        return 255


def _shorten(text: str, keep: int = 60) -> str:
    """``text`` cut to its first and last characters for a message (an index may name a 5000-character file)."""
    return text if len(text) <= keep else f"{text[: keep - 20]}...{text[-16:]}"


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


class StateDictSource(WeightSource):
    """A state dict in memory (``label`` names it in messages): the weights of a model being exported as it is."""

    def __init__(self, state: dict[str, Any], label: str) -> None:
        super().__init__(label)
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
        return self._full(key)[index].detach().to("cpu").clone(memory_format=torch.contiguous_format)

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def close(self) -> None:
        self._state, self._tensors = {}, {}


class _TorchFile(StateDictSource):
    """A ``torch.save``'d state dict, or a dict whose ``"state_dict"`` is one (Lightning's, a keel weights file)."""

    def __init__(self, path: AnyPath) -> None:
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
        super().__init__(state, str(path))


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
    return locate_weights(path).open(collective=collective)


@dataclass(frozen=True)
class Located:
    """What :func:`locate_weights` found: the source's form (``kind``) and how to open it."""

    kind: str  # "keel", "hf-index", "safetensors" or "torch"
    target: AnyPath
    shards: tuple[Any, ...] = ()  # the index's (files, weight map) of a Hugging Face folder

    def open(self, *, collective: bool = False) -> WeightSource:
        """The source (for a keel checkpoint verified first, by the ranks together when ``collective``)."""
        if self.kind == "keel":
            return KeelSource(self.target, collective=collective)
        if self.kind == "hf-index":
            return _Safetensors(str(self.target), *self.shards)
        if self.kind == "safetensors":
            assert isinstance(self.target, Path)  # safetensors are read from local paths
            single = self.target / SINGLE_FILE if self.target.is_dir() else self.target
            return _Safetensors(str(self.target), [single])
        return _TorchFile(self.target)


def locate_weights(path: str | os.PathLike[str]) -> Located:
    """Where the weights of ``path`` are and in which form (:func:`open_weights`), from this process's view of the
    filesystem and without a collective: ranks that will open a source together first agree on what each found.

    Raises:
        CheckpointError: as :func:`open_weights`, for a path that does not exist or holds no known layout.
    """
    target = reader.save_folder(location(path, "open_weights(path)"))
    if isinstance(target, RemotePath):
        if not target.is_file():
            return Located("keel", target)
        if target.suffix == ".safetensors":
            raise CheckpointError(f"{str(target)!r}: safetensors files are read from local paths; download it first.")
        return Located("torch", target)
    if target.is_dir():
        if (target / INDEX_FILE).is_file():
            return Located("hf-index", target, tuple(_read_index(target)))
        if (target / SINGLE_FILE).is_file():
            return Located("safetensors", target)
        if any((target / name).exists() for name in (MANIFEST_FILE, KEEL_FILE, METADATA_FILE)):
            return Located("keel", target)
        raise CheckpointError(
            f"{str(target)!r} is neither a Hugging Face weights folder ({INDEX_FILE} with its shards, or "
            f"{SINGLE_FILE}) nor a keel checkpoint ({MANIFEST_FILE}); pass such a folder, or a weights file."
        )
    if not target.is_file():
        raise CheckpointError(f"Checkpoint {str(target)!r} does not exist.")
    if _is_safetensors(target):
        return Located("safetensors", target)
    return Located("torch", target)


# ---------------------------------------------------------------------- writing
def _header(
    layout: Layout, metadata: dict[str, str] | None, target: AnyPath, crcs: dict[str, int] | None = None
) -> tuple[bytes, int]:
    """The header bytes (length, JSON padded to 8 bytes) of ``layout``, and the bytes of its tensors.

    With ``crcs`` the ``__metadata__`` also holds :data:`CRC_KEY`: every tensor's CRC32 as 8 hex digits. Every value
    has the same width, so the header written before the tensors (with zeros) and the one written over it after them
    (with their CRCs) are the same length, and the tensors' offsets hold.
    """
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError(f"{str(target)!r}: safetensors metadata maps str to str; got {metadata!r}.")
        if CRC_KEY in metadata:
            raise ValueError(f"{str(target)!r}: the metadata key {CRC_KEY!r} is keel's own (each tensor's CRC32).")
        header["__metadata__"] = dict(metadata)
    if crcs is not None:
        sums = json.dumps({name: f"{crcs.get(name, 0):08x}" for name, _, _ in layout}, separators=(",", ":"))
        header["__metadata__"] = {**header.get("__metadata__", {}), CRC_KEY: sums}
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


def _crc32(tensor: torch.Tensor, crc: int = 0) -> int:
    """The CRC32 of a CPU tensor's raw bytes (C order), read in place."""
    data = tensor.contiguous()
    size = data.numel() * data.element_size()
    return zlib.crc32(memoryview((ctypes.c_ubyte * size).from_address(data.data_ptr())), crc) if size else crc


def _write_tensor(handle: Any, tensor: torch.Tensor) -> int:
    """The raw bytes of ``tensor`` (C order, this machine's byte order: little-endian, checked by the caller);
    returns their CRC32, computed from the same buffer as it is written (no copy)."""
    data = tensor.detach().to("cpu").contiguous()
    size = data.numel() * data.element_size()
    if not size:
        return 0
    view = memoryview((ctypes.c_ubyte * size).from_address(data.data_ptr())).cast("B")
    handle.write(view)
    return zlib.crc32(view)


def _write_tensors(
    handle: Any, layout: Layout, tensors: Iterable[tuple[str, torch.Tensor]], target: AnyPath, crcs: dict[str, int]
) -> None:
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
        crcs[name] = _write_tensor(handle, tensor)
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

    The header's ``__metadata__`` also holds ``keel.crc32``: a JSON object of every tensor's name and the CRC32 of
    its bytes (8 hex digits), which keel's reader checks. Each CRC is computed from the buffer being written, and
    the header is written again over its first copy once the tensors are in the file (same length: the values are
    fixed-width), so nothing is held beyond the tensor being written. On object storage, which cannot rewrite the
    start of an object, the file is assembled in a local temporary file (one file's bytes of local disk) and then
    uploaded: the object appears whole or not at all.

    Args:
        path: The file to write.
        layout: ``(name, shape, dtype)`` of every tensor, in the order ``tensors`` yields them (the header is
            written first).
        tensors: ``(name, tensor)`` pairs in the layout's order.
        metadata: The header's ``__metadata__`` (str to str), e.g. ``{"format": "pt"}``; ``keel.crc32`` is keel's.

    Raises:
        ValueError: a tensor that is not the layout's next entry (name, shape or dtype), too many or too few
            tensors, a dtype safetensors cannot hold, a name twice, the metadata key ``keel.crc32``.
        CheckpointSaveError: the file could not be written (disk full, no permission, ...).
    """
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
        raise ValueError("write_safetensors writes little-endian bytes and runs on little-endian machines only.")
    target = as_path(location(path, "write_safetensors(path)"))
    crcs: dict[str, int] = {}
    header, size = _header(layout, metadata, target, crcs)

    def write(handle: Any) -> None:
        handle.write(header)
        _write_tensors(handle, layout, tensors, target, crcs)
        final, _ = _header(layout, metadata, target, crcs)
        if len(final) != len(header):  # pragma: no cover - the CRCs are fixed-width
            raise AssertionError(f"{str(target)!r}: the header changed length ({len(header)} -> {len(final)}).")
        handle.seek(0)
        handle.write(final)
        handle.seek(0, os.SEEK_END)

    if not isinstance(target, RemotePath):
        write_atomic(target, write, state=len(header) + size)
        return
    try:
        staging = tempfile.TemporaryFile(prefix="keel-export-", suffix=".safetensors")
    except OSError as exc:
        raise CheckpointSaveError.for_file(target, len(header) + size, exc) from exc
    with staging:
        try:
            write(staging)
            staging.flush()
            staging.seek(0)
        except OSError as exc:
            raise CheckpointSaveError.for_file(target, len(header) + size, exc) from exc
        write_atomic(target, lambda handle: shutil.copyfileobj(staging, handle, _CHUNK), state=len(header) + size)


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


def _shard_writer(source: WeightSource, shard: list[_Entry]) -> Callable[[AnyPath], None]:
    def write(path: AnyPath) -> None:
        write_safetensors(path, _layout(shard), _stream(source, [shard]), metadata=FORMAT_METADATA)

    return write


def _bytes_writer(body: bytes) -> Callable[[AnyPath], None]:
    def write(path: AnyPath) -> None:
        write_atomic(path, lambda handle: handle.write(body), state=len(body))

    return write


@dataclass
class _Commit:
    """How far a folder export got: what its error says the folder holds now comes from here."""

    before: set[str]  # the files the folder loaded from before this export (the previous export's)
    retired: bool = False  # the previous export's index was removed before its shards were replaced
    switched: bool = False  # the folder loads the new export
    installed: list[str] = field(default_factory=list)  # the new files in place under their own names


def _live_files(folder: AnyPath) -> set[str]:
    """The files ``folder`` loads from now: the index and the shards it names (it wins), or ``model.safetensors``."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError):
            weight_map = None  # an unreadable index loads nothing; writing over its shards harms nothing
        names = weight_map.values() if isinstance(weight_map, dict) else ()
        return {INDEX_FILE, *(name for name in names if isinstance(name, str))}
    return {SINGLE_FILE} if (folder / SINGLE_FILE).is_file() else set()


def _overwrites(files: list[tuple[str, Callable[[AnyPath], None]]], commit: _Commit) -> bool:
    """Whether a new file takes the name of a file the previous export loads from, other than its entry point (the
    index, or a lone ``model.safetensors``), which one rename (one upload) replaces whole: the same shard names."""
    entry = INDEX_FILE if INDEX_FILE in commit.before else SINGLE_FILE
    return any(name in commit.before and name != entry for name, _ in files)


def _retire(folder: AnyPath, commit: _Commit) -> None:
    """Remove the previous export's entry points (its index, and a ``model.safetensors`` the folder would load once
    the index is gone) before a new shard replaces one of its shards: until the new index is in place the folder
    then loads nothing, never a mix of the two exports."""
    for name in (INDEX_FILE, SINGLE_FILE):
        if (folder / name).is_file():
            (folder / name).unlink()
            commit.retired = True
    if isinstance(folder, Path):
        fsync_dir(folder)


def _stage_and_swap(folder: Path, files: list[tuple[str, Callable[[AnyPath], None]]], commit: _Commit) -> None:
    """Write every file under a hidden temporary name in ``folder`` (same filesystem, so a rename moves it), then
    rename them into place, the index (or ``model.safetensors``) last. A failure while writing (the long part: disk
    full, no permission) leaves what the folder loads untouched."""
    token = uuid.uuid4().hex[:8]
    staged: dict[str, Path] = {}
    try:
        for name, write in files:
            staged[name] = folder / f".{name}.{token}.export"
            write(staged[name])
            log.info("export_weights: wrote %s (to be renamed %s)", staged[name], name)
        if _overwrites(files, commit):
            _retire(folder, commit)
        for name, _ in files:
            os.replace(staged[name], folder / name)
            del staged[name]
            commit.installed.append(name)
        fsync_dir(folder)
        if files[-1][0] == SINGLE_FILE and (folder / INDEX_FILE).is_file():  # the index wins over model.safetensors
            (folder / INDEX_FILE).unlink()
            fsync_dir(folder)
        commit.switched = True
    finally:
        for path in staged.values():
            remove_quietly(path)


def _write_objects(folder: RemotePath, files: list[tuple[str, Callable[[AnyPath], None]]], commit: _Commit) -> None:
    """Object storage has no rename: each object is uploaded under its own name (it appears whole or not at all),
    the index (or ``model.safetensors``) last. Shards whose names the previous export's index holds are written only
    after that index was removed, so a failure part-way leaves either the previous export or nothing that loads."""
    if _overwrites(files, commit):
        _retire(folder, commit)
    assert commit.installed is not None
    for name, write in files:
        write(folder / name)
        commit.installed.append(name)
        log.info("export_weights: wrote %s", folder / name)
    if files[-1][0] == SINGLE_FILE and (folder / INDEX_FILE).is_file():
        (folder / INDEX_FILE).unlink()
    commit.switched = True


def _undo(folder: AnyPath, commit: _Commit) -> str:
    """Remove the new files already in place (the export failed before the folder loaded it) and say what the
    folder holds now."""
    for name in reversed(commit.installed):
        try:
            (folder / name).unlink()
        except Exception as exc:  # the store's client raises its own classes
            log.warning("export_weights: could not remove %s after the failed export: %s", folder / name, exc)
    if commit.retired:
        return (
            f"the previous export's {INDEX_FILE} had been removed before its shards were replaced (the new export "
            f"reuses their names), so {str(folder)!r} now holds no complete export: open_weights and initial_weights "
            "refuse the folder instead of loading a mix of the two. Export again"
        )
    temporary = "" if isinstance(folder, RemotePath) else "; the new export's temporary files were removed"
    if commit.before:
        return f"the previous export in {str(folder)!r} is intact and unchanged (it loads as before){temporary}"
    return f"{str(folder)!r} held no export before and holds none now{temporary}"


def _export_error(target: AnyPath, cause: BaseException, needed: int, kept: str) -> CheckpointSaveError:
    """The error of a failed export: the cause, the size, the free space, and what ``target`` holds now."""
    number = getattr(cause, "errno", None)
    code = errno.errorcode.get(number or 0, "")
    reason = f"{getattr(cause, 'strerror', None) or cause}" + (f" ({code})" if code else "")
    free = ""
    if not isinstance(target, RemotePath):
        folder = target
        while not folder.is_dir() and folder != folder.parent:
            folder = folder.parent
        try:
            free = f"; {human_bytes(shutil.disk_usage(folder).free)} free in {str(folder)!r}"
        except OSError:
            pass
    if number in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) and isinstance(target, RemotePath):
        hint = f" Free space in {tempfile.gettempdir()!r} (each file is assembled there before its upload)."
    elif number in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        hint = (
            " Free space (the new files are written beside the previous ones before they replace them), or export "
            "to a larger disk."
        )
    elif number in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = " Make the folder writable by this user, or export elsewhere."
    else:
        hint = ""
    error = CheckpointSaveError(
        f"Could not export weights to {str(target)!r}: {reason}. The export holds about {human_bytes(needed)} "
        f"({needed:,} bytes) of tensors{free}. {kept[:1].upper()}{kept[1:]}.{hint}"
    )
    error.errno, error.strerror, error.filename = number, getattr(cause, "strerror", None) or str(cause), str(target)
    return error


def _failed_write(exc: BaseException) -> BaseException | None:
    """The cause to report for a failed write, None for an error that is not one (a damaged source, a bug)."""
    return os_error(exc) or (exc if isinstance(exc, CheckpointSaveError) else None)


def _export_folder(source: WeightSource, folder: AnyPath, entries: list[_Entry], max_shard_size: int) -> None:
    """Hugging Face's layout in ``folder``, whole or refused: a failure leaves the previous export loadable and
    unchanged, or (only when the swap itself fails after the previous index was removed) nothing that loads; the
    error says which."""
    shards = _batches(entries, max_shard_size)
    count = len(shards)
    names = [SINGLE_FILE] if count == 1 else [SHARD_FILE.format(i + 1, count) for i in range(count)]
    files = [(name, _shard_writer(source, shard)) for name, shard in zip(names, shards)]
    needed = sum(e.nbytes for e in entries)
    if count > 1:
        index = {
            "metadata": {"total_size": needed},
            "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard},
        }
        files.append((INDEX_FILE, _bytes_writer(json.dumps(index, indent=2).encode())))
        names.append(INDEX_FILE)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        commit = _Commit(_live_files(folder))
    except OSError as exc:
        raise _export_error(folder, exc, needed, f"nothing was written in {str(folder)!r}") from exc
    try:
        if isinstance(folder, RemotePath):
            _write_objects(folder, files, commit)
        else:
            _stage_and_swap(folder, files, commit)
    except BaseException as exc:
        kept = _undo(folder, commit)
        cause = _failed_write(exc)
        if cause is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            if commit.retired:
                log.error("export_weights: %s failed: %s.", folder, kept)
            raise
        raise _export_error(folder, cause, needed, kept) from exc
    for stale in [p for p in folder.iterdir() if _HF_FILE.fullmatch(p.name) and p.name not in names]:
        log.info("export_weights: removing %s, left by an earlier export to %s", stale, folder)
        try:
            stale.unlink()
        except Exception as exc:  # the export is in place and loads; a leftover the index does not name is harmless
            log.warning("export_weights: could not remove %s, left by an earlier export: %s", stale, exc)


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
    try:
        save_file(state, target)
    except CheckpointSaveError as exc:
        raise _file_refused(target, exc, tensor_bytes(state)) from exc


def _file_refused(target: AnyPath, exc: CheckpointSaveError, needed: int) -> CheckpointSaveError:
    """The error of a one-file export that failed: the file is written under a temporary name and renamed (an
    object is uploaded whole), so whatever ``target`` held before it still holds."""
    if isinstance(target, RemotePath):
        kept = f"an object appears whole or not at all: {str(target)!r} is as it was"
    else:
        was = f"the existing {str(target)!r} is unchanged" if target.exists() else f"{str(target)!r} was not created"
        kept = f"{was}; the temporary file was removed"
    return _export_error(target, _failed_write(exc) or exc, needed, kept)


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
    Each safetensors file records every tensor's CRC32 in its header (``keel.crc32``), which keel's reader checks.

    An export is whole or refused. A folder's files are written under hidden temporary names in the folder (room
    for the new export beside the previous one is needed), then renamed into place, the index last: a failure
    while writing leaves the previous export loadable and unchanged. When the new shards reuse the previous ones'
    names, the previous index is removed just before the renames, so a failure during them leaves a folder that
    loads nothing (refused), never a mix of two exports. On object storage, which has no rename, each object is
    uploaded under its own name (whole or not at all) with the same order and the same two outcomes. The one-file
    forms are written to a temporary name and renamed (uploaded whole).

    Args:
        ckpt_path: The checkpoint or weights to export (local, or a keel checkpoint on object storage).
        out_path: The file or folder to write (a ``.pt`` file may be on object storage).
        rename: Maps keel's key to the exported name (``lambda k: "model." + k``); None drops the key.
        max_shard_size: The most bytes of tensors per shard (and per read of the source).
        dtype: Cast floating-point tensors to this dtype (``torch.bfloat16``); others are kept.

    Raises:
        CheckpointError: the checkpoint is missing, damaged or unsafe (naming the file).
        ValueError: ``rename`` gives a name twice or a non-string, or an argument is out of range.
        CheckpointSaveError: the output could not be written (naming the cause, the size and the free space). The
            message says what ``out_path`` holds now: the previous file or export, intact and unchanged (the
            temporary files removed); or, for a folder whose swap failed after its previous index was removed, no
            export that loads.
    """
    source_path = location(ckpt_path, "export_weights(ckpt_path)")
    target = as_path(location(out_path, "export_weights(out_path)"))
    _check_export_args(max_shard_size, dtype)
    with open_weights(source_path) as source:
        export_source(source, target, rename=rename, max_shard_size=max_shard_size, dtype=dtype)


def _check_export_args(max_shard_size: Any, dtype: Any) -> None:
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ValueError(f"export_weights(max_shard_size={max_shard_size!r}): give a positive number of bytes.")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"export_weights(dtype={dtype!r}): give a floating-point torch dtype, e.g. torch.bfloat16.")


def export_source(
    source: WeightSource,
    out_path: str | os.PathLike[str] | AnyPath,
    *,
    rename: Callable[[str], str | None] | None = None,
    max_shard_size: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
) -> None:
    """:func:`export_weights` from an open :class:`WeightSource` (a checkpoint, a file, or a state dict in memory:
    :class:`StateDictSource`); the same forms, checks and guarantees."""
    _check_export_args(max_shard_size, dtype)
    target = out_path if isinstance(out_path, (Path, RemotePath)) else as_path(location(out_path, "export(out_path)"))
    if target.is_dir() or not target.suffix:
        _export_folder(source, target, _plan(source, rename, dtype), max_shard_size)
    elif target.suffix == ".safetensors":
        entries = _plan(source, rename, dtype)
        batches = _batches(entries, max_shard_size)
        try:
            write_safetensors(target, _layout(entries), _stream(source, batches), metadata=FORMAT_METADATA)
        except CheckpointSaveError as exc:
            raise _file_refused(target, exc, sum(e.nbytes for e in entries)) from exc
    else:
        _export_plain(source, target, rename, dtype)
    log.info("export_weights: wrote %s from %s", target, source.path)
