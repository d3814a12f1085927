"""keel's pieces of DCP (``torch.distributed.checkpoint``): the safe reader and load planners, the hashing writer and
the CPU stager of async saves (docs/design.md section 8).

The only module of keel that imports DCP when it is imported. Importing DCP takes 0.6 s (it brings in DTensor),
so :mod:`~trainer.checkpoint.reader` and :mod:`~trainer.checkpoint.store` import this module on the first save or
load, not at ``import trainer``: a run that never checkpoints, and every command-line tool, starts without it.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import AsyncStager

from trainer.checkpoint.files import CorruptCheckpointError, HashingWriter, StoreReadError, store_failed
from trainer.data.transfer import tensors_in
from trainer.storage import AnyPath, RemotePath

__all__ = ["dcp", "MetadataUnpickler", "SafeEmptyPlanner", "SafePlanner", "ReusedStaging", "reader", "writer"]


# ---------------------------------------------------------------------- reading
# What a real .metadata pickle refers to (torch 2.4 - 2.13); anything else is refused.
_ALLOWED_GLOBALS: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}


class MetadataUnpickler(pickle.Unpickler):
    def __init__(self, handle: Any, path: str) -> None:
        super().__init__(handle)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise CorruptCheckpointError(
            f"Checkpoint metadata {self.path!r} refers to {module}.{name}, which is not one of DCP's metadata "
            "classes; keel refuses to load it (a crafted .metadata file could run code)."
        )


class _SafeMetadata:
    """DCP's reader, but ``.metadata`` is read through the allow-listed unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as handle:  # type: ignore[attr-defined]
            metadata = MetadataUnpickler(handle, os.fspath(path)).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return metadata


class _SafeReader(_SafeMetadata, FileSystemReader):
    """DCP's file reader with the safe ``.metadata``."""


class _StoreStream:
    """A stream of an object being read: an error the store's client raises from it (a refused connection, a
    timeout, a 5xx answer) is a :class:`StoreReadError`, so that a load that fails because the store does is never
    taken for a damaged save (which ``ckpt_path="last"`` would fall back past). What is made of the bytes read
    (``torch.load``, the unpickler) raises its own errors, outside this stream."""

    def __init__(self, raw: Any, path: str) -> None:
        self._raw, self._path = raw, path

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._raw, name)
        if not callable(attribute):
            return attribute

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return attribute(*args, **kwargs)
            except Exception as exc:
                if store_failed(self._path, exc):
                    raise StoreReadError.reading(self._path, exc) from exc
                raise

        return guarded

    def __enter__(self) -> _StoreStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _store_reading(base: type) -> type:
    """``base`` (DCP's fsspec file system) whose read streams are :class:`_StoreStream`: the store's failure while a
    save's data is read raises :class:`StoreReadError` on the rank that saw it (DCP gathers every rank's)."""

    class _StoreReading(base):  # type: ignore[misc]
        @contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
            if "r" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            url = os.fspath(path)
            with ExitStack() as stack:
                try:
                    raw = stack.enter_context(super().create_stream(path, mode))
                except Exception as exc:
                    if store_failed(url, exc):
                        raise StoreReadError.reading(url, exc) from exc
                    raise
                yield _StoreStream(raw, url)

    return _StoreReading


def reader(root: AnyPath) -> FileSystemReader:
    """The safe DCP reader of the folder (or object storage prefix) that holds a save's data files; on object
    storage its streams raise :class:`StoreReadError` when the store fails."""
    if not isinstance(root, RemotePath):
        return _SafeReader(os.fspath(root))
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class _SafeFsspecReader(_SafeMetadata, FsspecReader):
        pass

    safe = _SafeFsspecReader(str(root), use_listings_cache=False, skip_instance_cache=True)
    fs = _store_reading(FsspecFileSystem)()
    fs.init_path(str(root), use_listings_cache=False, skip_instance_cache=True)
    safe.fs = fs
    return safe


def _load_bytes_safely(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    """DCP's non-tensor items with ``weights_only=True`` (DCP's planner uses ``weights_only=False``)."""
    try:
        obj = torch.load(value, weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"Checkpoint item {read_item.dest_index.fqn!r} holds pickled objects that are not plain values; "
            f"keel refuses to load it so that nothing in it can run ({type(exc).__name__})."
        ) from exc
    if planner.flatten_state_dict:
        from torch.distributed.checkpoint._nested_dict import set_element

        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


class SafePlanner(DefaultLoadPlanner):
    load_bytes = _load_bytes_safely


class SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
    load_bytes = _load_bytes_safely


# ---------------------------------------------------------------------- writing
class _Hashing:
    """Keeps the size and CRC32 of every file a DCP file system writes (by any writer thread)."""

    written: dict[str, list[int]]
    _lock: threading.Lock

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:  # type: ignore[misc]
                yield stream
            return
        with super().create_stream(path, mode) as raw:  # type: ignore[misc]
            handle = HashingWriter(raw)
            yield handle
        with self._lock:
            self.written[os.path.basename(os.fspath(path))] = [handle.size, handle.crc]

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # type: ignore[misc]
        old, new = os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path))
        with self._lock:
            if old in self.written:
                self.written[new] = self.written.pop(old)


class _HashingFileSystem(_Hashing, FileSystem):
    """DCP's local file system, keeping the size and CRC32 of every file written."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self._lock = {}, threading.Lock()


def writer(folder: AnyPath) -> tuple[FileSystemWriter, _Hashing]:
    """DCP's writer for ``folder`` and its hashing file system: the local one, or fsspec's for object storage
    (no fsync there: an upload is durable when it completes)."""
    if not isinstance(folder, RemotePath):
        writer = FileSystemWriter(folder, sync_files=True)
        fs: _Hashing = _HashingFileSystem()
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        class _HashingFsspec(_Hashing, FsspecFileSystem):
            def __init__(self) -> None:
                super().__init__()
                self.written, self._lock = {}, threading.Lock()

        writer = FsspecWriter(str(folder), sync_files=False, use_listings_cache=False, skip_instance_cache=True)
        fs = _HashingFsspec()
        fs.init_path(str(folder), use_listings_cache=False, skip_instance_cache=True)
    writer.fs = fs  # type: ignore[assignment]
    return writer, fs


# ---------------------------------------------------------------------- staging (async saves)
class ReusedStaging(AsyncStager):
    """DCP's staging of this rank's tensors to CPU memory, into the buffers of the previous async save.

    DCP's default stager allocates a fresh CPU copy on every save; allocating and first touching it was
    most of the time an async save blocked the loop (benchmarks/fsdp.py). The buffers are free again when
    the next save stages: the checkpointer waits for the save in flight first. One copy of this rank's
    tensors (pinned on CUDA) stays in memory between saves; a different layout (optimizer state that
    appeared, a resized parameter) allocates anew. Blocking: the copy is done when :meth:`stage` returns.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: Any = None
        self._last: dict[str, Any] = {}

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict, _create_cpu_state_dict

        cuda = any(t.device.type == "cuda" for t in tensors_in(state_dict))
        staged = None
        if self._buffers is not None:
            try:
                staged = _copy_state_dict(state_dict, self._buffers, non_blocking=cuda)
            except (CompanionMismatch, RuntimeError):  # another structure, or a tensor of another shape
                staged = None
        if staged is None:
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=cuda)
            staged = _copy_state_dict(state_dict, self._buffers, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()  # the copies are complete before training changes the weights
        self._last = staged
        return staged

    def staged(self, key: str) -> Any:
        """The staged copy of ``state_dict[key]`` of the last :meth:`stage`."""
        return self._last.get(key, {})

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        self._buffers, self._last = None, {}
