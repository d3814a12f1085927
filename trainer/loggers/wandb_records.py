"""Reads the records of a W&B run file (``run-<id>.wandb``, the transaction log W&B writes online and offline).

:class:`~trainer.loggers.wandb.WandbLogger` reads what earlier attempts of a resumed run actually recorded
(the last step per metric key), and the tests read what was logged. wandb 0.31 ships no Python reader for
the file it writes, but it ships the protobuf definitions
(``wandb.proto.wandb_internal_pb2.Record``), and the framing is LevelDB's log format, as wandb documents
in its source: a 7-byte file header (``:W&B``, the magic ``0xBEE1``, version 0), then 32 KiB blocks of
chunks, each ``crc32 (4) | length (2) | type (1) | data`` with types FULL=1, FIRST=2, MIDDLE=3, LAST=4;
a block tail shorter than a chunk header is zero padding. The CRC is checked, so a torn or misread file
fails loudly instead of yielding garbage.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = struct.Struct("<IHB")
FILE_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    if not data.startswith(FILE_HEADER):
        raise ValueError(f"not a W&B run file (header {data[:7]!r})")
    pos, pending = len(FILE_HEADER), b""
    while pos + HEADER.size <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER.size:
            pos += room
            continue
        checksum, length, kind = HEADER.unpack_from(data, pos)
        if length == 0 and kind == 0:  # zero padding at the end of a block
            pos += room
            continue
        chunk = data[pos + HEADER.size : pos + HEADER.size + length]
        if len(chunk) < length:
            break  # a torn final chunk (the writer was killed): everything before it is intact
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != checksum:
            raise ValueError(f"bad checksum at offset {pos}")
        pos += HEADER.size + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        else:
            raise ValueError(f"unknown chunk type {kind} at offset {pos}")


def records(path: str | Path) -> list[Any]:
    """Every ``wandb_internal_pb2.Record`` in the file, in order."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for payload in _payloads(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated per protobuf version
        record.ParseFromString(payload)
        out.append(record)
    return out


def _item_key(item: Any) -> str:
    return item.key if item.key else "/".join(item.nested_key)


def history(path: str | Path) -> list[dict[str, Any]]:
    """The logged rows (``run.log`` calls), each ``{key: value}`` including ``_step``."""
    return [
        {_item_key(item): json.loads(item.value_json) for item in record.history.item}
        for record in records(path)
        if record.WhichOneof("record_type") == "history"
    ]


def last_steps(paths: list[str] | list[Path]) -> dict[str, int]:
    """The last ``_step`` at which each metric key (not W&B's own ``_``-keys) appears, over all ``paths``."""
    steps: dict[str, int] = {}
    for path in paths:
        for row in history(path):
            step = row.get("_step")
            if not isinstance(step, int):
                continue
            for key in row:
                if not key.startswith("_") and step > steps.get(key, -1):
                    steps[key] = step
    return steps


def wait_for_exit(path: str | Path, timeout: float) -> bool:
    """Waits until the file holds W&B's ``exit`` record (written last when a run finishes): ``run.finish()``
    returns before wandb's service has written it. Returns False if it is still missing after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if any(record.WhichOneof("record_type") == "exit" for record in records(path)):
                return True
        except (OSError, ValueError):
            pass  # not there yet, or a chunk being written
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def run_ids(path: str | Path) -> list[str]:
    return [record.run.run_id for record in records(path) if record.WhichOneof("record_type") == "run"]


def config(path: str | Path) -> dict[str, Any]:
    """The run config as the file leaves it: the run record's config, then every config update."""
    out: dict[str, Any] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in items:
            out[_item_key(item)] = json.loads(item.value_json)
    return out
