"""Save names, weights and bit flips in a save's tensors, shared by the checkpoint integrity tests
(tests/unit/test_checkpoint_safety.py) and the two-rank program of tests/integration/test_checkpoint_integrity.py,
which imports them; and a bit flip in an exported safetensors file (tests/unit/test_hf_weights.py,
tests/unit/test_initial_weights.py)."""

from __future__ import annotations

import io
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from trainer.checkpoint.store import METADATA_FILE, quiet_dcp

STEPS_PER_EPOCH = 4  # regression_data() (64 samples) in batches of 16


def save_name(step: int) -> str:
    """ModelCheckpoint's default name of the step-triggered save at ``step``."""
    return f"epoch={(step - 1) // STEPS_PER_EPOCH}-step={step}.ckpt"


def weights(task: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in task.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def flip_bit(path: Path, offset: int, bit: int = 3) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit
    path.write_bytes(bytes(raw))


def tensor_span(folder: Path, fqn: str) -> tuple[str, int, int]:
    """(data file, offset, length) of the raw bytes of the stored tensor ``fqn`` (read from DCP's own,
    trusted, .metadata of a save this test wrote)."""
    with open(folder / METADATA_FILE, "rb") as handle:
        metadata = pickle.load(handle)
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == fqn]
    with open(folder / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        blob = handle.read(info.length)
    try:  # DCP writes each tensor as a small torch.save archive: find its storage bytes inside it
        value = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception:  # a DCP that writes the raw bytes
        return info.relative_path, info.offset, info.length
    raw = value.contiguous().view(torch.uint8).numpy().tobytes()
    start = blob.find(raw)
    assert start >= 0 and blob.find(raw, start + 1) < 0, f"the bytes of {fqn} are not found once in its item"
    return info.relative_path, info.offset + start, len(raw)


def stored_tensor(folder: Path, fqn: str) -> torch.Tensor:
    """The model tensor ``fqn`` (``model.<name>``) as DCP reads it, with no verification at all."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict[str, Any] = {}
    with quiet_dcp():
        _load_state_dict(
            out,
            storage_reader=FileSystemReader(folder),
            planner=_EmptyStateDictLoadPlanner(keys={"model"}),
            no_dist=True,
        )
    return out["model"][fqn.removeprefix("model.")]


def flip_tensor_bit(folder: Path, fqn: str) -> str:
    """Flip one bit in the middle of the stored tensor ``fqn``; prove that an unverified read now sees
    exactly one element changed (the flip is inside the tensor's data). Returns the data file's name."""
    before = stored_tensor(folder, fqn)
    name, offset, length = tensor_span(folder, fqn)
    flip_bit(folder / name, offset + length // 2)
    after = stored_tensor(folder, fqn)
    assert int((before != after).sum()) == 1, "the flipped bit is not inside the tensor's data"
    return name


def flip_a_byte(path: Path, tensor: str) -> None:
    """Flip one bit in the middle of ``tensor``'s bytes in a safetensors file."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8 : 8 + length])[tensor]["data_offsets"]
    data[8 + length + (begin + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))
