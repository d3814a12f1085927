"""Hugging Face safetensors in and out (trainer/checkpoint/hf.py): exports of a real keel save to one file, to a
sharded folder and to a plain file; ``open_weights`` on files written by the safetensors library, by ``torch.save``
and by keel; the errors; and that an export reads a keel save one output shard at a time. In-process only."""

from __future__ import annotations

import errno
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_damage import flip_a_byte
from models import Regression, loader, quiet, regression_data
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import trainer
from trainer import Trainer
from trainer.checkpoint import hf, reader
from trainer.checkpoint.files import CheckpointError, CheckpointSaveError
from trainer.checkpoint.hf import INDEX_FILE, SINGLE_FILE, export_weights, open_weights, write_safetensors

# The tiny task's tensors: net.0.weight 512 bytes, net.0.bias 64, net.2.weight 64, net.2.bias 4 (644 in all).
# 100 bytes a shard: [net.0.weight] (larger than the limit: alone), [net.0.bias], [net.2.weight, net.2.bias].
SMALL_SHARDS = 100
SHARDS = [["net.0.weight"], ["net.0.bias"], ["net.2.weight", "net.2.bias"]]


@pytest.fixture(scope="module")
def save(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A keel save of a task fitted for 2 steps, and the task's state dict."""
    root = tmp_path_factory.mktemp("hf")
    fit = Trainer(**quiet(max_steps=2, default_root_dir=str(root)))
    task = Regression()
    fit.fit(task, loader(regression_data(), 16))
    fit.save_checkpoint(str(root / "save.ckpt"))
    state = {k: v.detach().clone() for k, v in task.state_dict().items()}
    assert not torch.equal(state["net.0.weight"], Regression().state_dict()["net.0.weight"])  # trained
    return root / "save.ckpt", state


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected) or sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_export_to_one_safetensors_file_is_bit_equal(save: tuple[Path, dict], tmp_path: Path) -> None:
    path, state = save
    export_weights(path, tmp_path / "x.safetensors")
    assert_same(load_file(tmp_path / "x.safetensors"), state)
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as handle:
        metadata = handle.metadata()
    # transformers' "format", and each tensor's CRC32 (of its bytes, 8 hex digits), which keel's reader checks
    assert sorted(metadata) == ["format", "keel.crc32"] and metadata["format"] == "pt"
    crcs = {name: f"{zlib.crc32(tensor.numpy().tobytes()):08x}" for name, tensor in state.items()}
    assert json.loads(metadata["keel.crc32"]) == crcs
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary file left


def test_export_to_a_folder_writes_shards_and_the_index(save: tuple[Path, dict], tmp_path: Path) -> None:
    path, state = save
    out = tmp_path / "hf"
    export_weights(path, out, max_shard_size=SMALL_SHARDS)
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, INDEX_FILE])
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values()) == 644
    assert index["weight_map"] == {key: name for name, keys in zip(names, SHARDS) for key in keys}
    union: dict[str, torch.Tensor] = {}
    for name, keys in zip(names, SHARDS):
        shard = load_file(out / name)
        assert sorted(shard) == sorted(keys)
        union.update(shard)
    assert_same(union, state)
    # open_weights reads the folder back through its index, slices included.
    with open_weights(out) as source:
        assert source.keys() == list(state)
        assert torch.equal(source.read("net.0.weight", (slice(1, 3), slice(2, 5))), state["net.0.weight"][1:3, 2:5])
    # Exported again into the same folder in one shard: one model.safetensors, and the old shards and index gone.
    export_weights(path, out)
    assert [p.name for p in out.iterdir()] == [SINGLE_FILE]
    assert_same(load_file(out / SINGLE_FILE), state)


def test_a_folder_without_a_suffix_is_created(save: tuple[Path, dict], tmp_path: Path) -> None:
    export_weights(save[0], tmp_path / "new" / "model")
    assert_same(load_file(tmp_path / "new" / "model" / SINGLE_FILE), save[1])


def test_rename_and_dtype(save: tuple[Path, dict], tmp_path: Path) -> None:
    path, state = save

    def rename(key: str) -> str | None:
        return None if key == "net.2.bias" else "model." + key

    export_weights(path, tmp_path / "x.safetensors", rename=rename, dtype=torch.bfloat16)
    got = load_file(tmp_path / "x.safetensors")
    expected = {"model." + k: v.to(torch.bfloat16) for k, v in state.items() if k != "net.2.bias"}
    assert_same(got, expected)
    export_weights(path, tmp_path / "w.pt", rename=rename, dtype=torch.float16)  # the plain form too
    halves = {"model." + k: v.half() for k, v in state.items() if k != "net.2.bias"}
    assert_same(torch.load(tmp_path / "w.pt", weights_only=True), halves)
    with pytest.raises(ValueError, match="maps both 'net.0.weight' and 'net.0.bias' to 'w'"):
        export_weights(path, tmp_path / "y.safetensors", rename=lambda key: "w")
    with pytest.raises(ValueError, match="floating-point"):
        export_weights(path, tmp_path / "y.safetensors", dtype=torch.int8)
    assert not (tmp_path / "y.safetensors").exists()


def test_plain_export(save: tuple[Path, dict], tmp_path: Path) -> None:
    assert trainer.export_weights is hf.export_weights
    trainer.export_weights(save[0], tmp_path / "weights.pt")
    assert_same(torch.load(tmp_path / "weights.pt", weights_only=True), save[1])
    net = Regression()
    net.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))


def test_open_weights_on_a_keel_save(save: tuple[Path, dict]) -> None:
    path, state = save
    with open_weights(path) as source:
        assert source.keys() == list(state)
        assert source.meta("net.0.weight") == (torch.Size([16, 8]), torch.float32)
        assert torch.equal(source.read("net.0.weight", (slice(1, 3),)), state["net.0.weight"][1:3])
        assert_same(source.read_many(["net.2.bias", "net.0.bias"]), {k: state[k] for k in ("net.2.bias", "net.0.bias")})
        with pytest.raises(KeyError, match="holds no tensor 'nope'"):
            source.read("nope")


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(6, 5, generator=g),
        "half": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "steps": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


@pytest.mark.parametrize("form", ["safetensors", "torch", "lightning"])
def test_open_weights_reads_files_written_by_others(tmp_path: Path, form: str) -> None:
    expected = tensors()
    if form == "safetensors":
        path = tmp_path / "w.safetensors"
        save_file(expected, str(path), metadata={"format": "pt"})  # the library's own writer
    elif form == "torch":
        path = tmp_path / "w.bin"
        torch.save(expected, path)
    else:
        path = tmp_path / "w.ckpt"
        torch.save({"state_dict": expected, "epoch": 3, "global_step": 7}, path)
    with open_weights(path) as source:
        assert sorted(source.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert source.meta(name) == (tensor.shape, tensor.dtype)
            read = source.read(name, (slice(1, 3),))
            assert read.is_contiguous() and torch.equal(read, tensor[1:3]), name
            assert torch.equal(source.read(name), tensor)
        full = expected["embed.weight"]
        assert torch.equal(source.read("embed.weight", (slice(2, 5), slice(1, 4))), full[2:5, 1:4])
    # and exported from any of them
    export_weights(path, tmp_path / "out.safetensors")
    assert_same(load_file(tmp_path / "out.safetensors"), expected)


def test_a_truncated_safetensors_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file(tensors(), str(path))
    data = path.read_bytes()
    for broken in (data[:-3], data[:20], b"\xff" * 8 + b"{}"):
        path.write_bytes(broken)
        with pytest.raises(CheckpointError, match="w.safetensors' is truncated or corrupt"):
            open_weights(path)


def test_a_missing_shard_is_refused_by_name(save: tuple[Path, dict], tmp_path: Path) -> None:
    export_weights(save[0], tmp_path / "hf", max_shard_size=SMALL_SHARDS)
    (tmp_path / "hf" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors") as info:
        open_weights(tmp_path / "hf")
    assert INDEX_FILE in str(info.value)


def test_an_unknown_folder_and_a_missing_file_are_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "readme.txt").write_text("hi")
    with pytest.raises(CheckpointError, match=r"other' is neither a Hugging Face weights folder"):
        open_weights(tmp_path / "other")
    with pytest.raises(CheckpointError, match=r"nothing\.safetensors' does not exist"):
        export_weights(tmp_path / "nothing.safetensors", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_keel_export_reads_one_output_shard_per_dcp_load(
    save: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    read_model = reader.read_model

    def counting(folder: Path, manifest: dict | None, keys: tuple[str, ...] = ("model",)) -> dict:
        calls.append(sorted(keys))
        return read_model(folder, manifest, keys)

    monkeypatch.setattr(reader, "read_model", counting)
    export_weights(save[0], tmp_path / "hf", max_shard_size=SMALL_SHARDS)
    assert calls == [sorted("model." + k for k in keys) for keys in SHARDS]
    calls.clear()
    export_weights(save[0], tmp_path / "x.safetensors", max_shard_size=SMALL_SHARDS)  # one file, read in batches
    assert calls == [sorted("model." + k for k in keys) for keys in SHARDS]
    assert_same(load_file(tmp_path / "x.safetensors"), save[1])


def test_the_writer_streams_checks_its_layout_and_needs_no_safetensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = tensors()
    layout = [(name, tuple(t.shape), t.dtype) for name, t in expected.items()]
    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` fails
    write_safetensors(tmp_path / "w.safetensors", layout, iter(expected.items()), metadata={"by": "keel"})
    with pytest.raises(ImportError, match=r"pip install 'keel-trainer\[hf\]'"):
        open_weights(tmp_path / "w.safetensors")
    monkeypatch.delitem(sys.modules, "safetensors")
    assert_same(load_file(tmp_path / "w.safetensors"), expected)
    # A tensor out of order, of another shape, or missing: refused, and the target never appears.
    wrong = [
        list(reversed(expected.items())),
        [(n, t.flatten() if n == "embed.weight" else t) for n, t in expected.items()],
        list(expected.items())[:-1],
    ]
    for stream in wrong:
        with pytest.raises(ValueError, match="x.safetensors"):
            write_safetensors(tmp_path / "x.safetensors", layout, iter(stream))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_import_trainer_does_not_import_safetensors() -> None:
    from launch import import_check

    code = (
        "import sys, trainer, trainer.checkpoint.hf; "
        "print(sorted(m for m in ('safetensors', 'torch.distributed.checkpoint') if m in sys.modules))"
    )
    assert import_check(code).stdout.strip() == "[]"


def test_export_weights_of_the_last_pointer_follows_it(tmp_path: Path) -> None:
    """The `last` pointer is a small JSON file; given to export_weights it names the save it points at (it used
    to be read as a checkpoint and refused as 'pickled objects')."""
    from trainer import Trainer
    from trainer.checkpoint.model_checkpoint import ModelCheckpoint

    trainer = Trainer(**quiet(max_steps=2, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2)]))
    trainer.fit(Regression(), loader(regression_data(16), batch_size=4))
    export_weights(tmp_path / "ck" / "last", tmp_path / "via-pointer.safetensors")
    export_weights(tmp_path / "ck" / "epoch=0-step=2.ckpt", tmp_path / "direct.safetensors")
    assert (tmp_path / "via-pointer.safetensors").read_bytes() == (tmp_path / "direct.safetensors").read_bytes()


# ---------------------------------------------------------------------- an export is whole or refused
def library_file(path: Path, state: dict[str, torch.Tensor]) -> Path:
    save_file(state, str(path))
    return path


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def loaded(folder: Path) -> dict[str, torch.Tensor]:
    with open_weights(folder) as source:
        return source.state_dict()


def fail_the_second_tensor(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The disk fills up while the second tensor is written (the first tensor of shard 2 at one tensor a shard)."""
    written: list[str] = []
    write_tensor = hf._write_tensor

    def filling(handle: Any, tensor: torch.Tensor) -> int:
        written.append(str(tuple(tensor.shape)))
        if len(written) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_tensor(handle, tensor)

    monkeypatch.setattr(hf, "_write_tensor", filling)
    return written


@pytest.mark.parametrize("shards", [1, SMALL_SHARDS], ids=["same-shard-names", "other-shard-names"])
def test_an_export_that_fails_part_way_leaves_the_previous_export_loadable_and_unchanged(
    save: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    """Export A (4 shards), then B into the same folder with the disk full at B's second shard: the folder still
    loads exactly A (it used to load B's first shard with A's others, under A's index), byte for byte as it was,
    and the error says so."""
    state_a = save[1]
    state_b = {k: v + 1 for k, v in state_a.items()}
    out = tmp_path / "hf"
    export_weights(library_file(tmp_path / "a.safetensors", state_a), out, max_shard_size=1)  # one tensor a shard
    assert len(json.loads((out / INDEX_FILE).read_text())["weight_map"]) == 4 and len(list(out.iterdir())) == 5
    before = contents(out)
    fail_the_second_tensor(monkeypatch)
    with pytest.raises(CheckpointSaveError) as info:
        export_weights(library_file(tmp_path / "b.safetensors", state_b), out, max_shard_size=shards)
    assert_same(loaded(out), state_a)  # not B's first shard with A's others
    assert contents(out) == before  # the same files, byte for byte, and no temporary one left
    text = str(info.value)
    assert "No space left on device (ENOSPC)" in text and str(out) in text, text
    assert f"previous export in {str(out)!r} is intact and unchanged" in text, text
    assert "temporary files were removed" in text and "Free space" in text, text
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    export_weights(tmp_path / "b.safetensors", out, max_shard_size=shards)  # and the export works once there is room
    assert_same(loaded(out), state_b)


@pytest.mark.parametrize("shards", [1, SMALL_SHARDS], ids=["same-shard-names", "other-shard-names"])
def test_an_export_whose_swap_fails_leaves_the_previous_export_or_nothing_that_loads(
    save: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    """The renames that put a written export in place fail after the first. Shards of new names: the previous
    export still loads, unchanged. Shards of the previous export's names: its index went first, so the folder
    refuses to load (never a mix), and the error says that."""
    state_a = save[1]
    out = tmp_path / "hf"
    export_weights(library_file(tmp_path / "a.safetensors", state_a), out, max_shard_size=1)
    before = contents(out)
    renames: list[str] = []
    replace = os.replace

    def failing(src: Any, dst: Any) -> None:
        if str(src).endswith(".export"):
            renames.append(str(dst))
            if len(renames) == 2:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(CheckpointSaveError) as info:
        export_weights(
            library_file(tmp_path / "b.safetensors", {k: -v for k, v in state_a.items()}), out, max_shard_size=shards
        )
    monkeypatch.undo()
    text = str(info.value)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left
    if shards == SMALL_SHARDS:
        assert f"previous export in {str(out)!r} is intact and unchanged" in text, text
        assert contents(out) == before
        assert_same(loaded(out), state_a)
    else:
        assert f"{str(out)!r} now holds no complete export" in text and "Export again" in text, text
        assert INDEX_FILE not in contents(out)
        with pytest.raises(CheckpointError, match="is neither a Hugging Face weights folder"):
            open_weights(out)


def test_an_export_to_object_storage_leaves_the_previous_export_or_nothing_that_loads(
    save: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Object storage has no rename: shards of new names are uploaded beside the previous export (which keeps
    loading until the new index replaces its index); shards of its names only after its index was removed."""
    import fsspec

    state_a = save[1]
    fs = fsspec.filesystem("memory")
    url = f"memory://keel-test/{tmp_path.name}/hf"

    def download() -> Path:
        local = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        local.mkdir()
        for key in fs.find(url):
            (local / key.rsplit("/", 1)[-1]).write_bytes(fs.cat_file(key))
        return local

    try:
        export_weights(library_file(tmp_path / "a.safetensors", state_a), url, max_shard_size=1)
        before = contents(download())
        assert len(before) == 5
        library_file(tmp_path / "b.safetensors", {k: v + 1 for k, v in state_a.items()})
        fail_the_second_tensor(monkeypatch)
        with pytest.raises(CheckpointSaveError) as info:
            export_weights(tmp_path / "b.safetensors", url, max_shard_size=SMALL_SHARDS)  # other shard names
        assert f"previous export in {url!r} is intact and unchanged" in str(info.value), info.value
        assert contents(download()) == before
        monkeypatch.undo()
        fail_the_second_tensor(monkeypatch)
        with pytest.raises(CheckpointSaveError) as info:
            export_weights(tmp_path / "b.safetensors", url, max_shard_size=1)  # the same shard names
        assert f"{url!r} now holds no complete export" in str(info.value), info.value
        with pytest.raises(CheckpointError, match="is neither a Hugging Face weights folder"):
            open_weights(download())
        monkeypatch.undo()
        export_weights(tmp_path / "b.safetensors", url, max_shard_size=1)
        assert_same(loaded(download()), {k: v + 1 for k, v in state_a.items()})
    finally:
        if fs.exists(url):
            fs.rm(url, recursive=True)


def test_a_failed_one_file_export_leaves_the_existing_file(
    save: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    export_weights(save[0], tmp_path / "x.safetensors")
    before = contents(tmp_path)
    fail_the_second_tensor(monkeypatch)
    with pytest.raises(CheckpointSaveError) as info:
        export_weights(
            library_file(tmp_path / "b.safetensors", {k: v + 1 for k, v in save[1].items()}), tmp_path / "x.safetensors"
        )
    assert f"existing {str(tmp_path / 'x.safetensors')!r} is unchanged" in str(info.value), info.value
    assert "ModelCheckpoint" not in str(info.value)  # the hint of a training checkpoint, not of an export
    assert contents(tmp_path) == before | {"b.safetensors": (tmp_path / "b.safetensors").read_bytes()}


# ---------------------------------------------------------------------- checksums
@pytest.mark.parametrize("form", ["file", "folder"])
def test_a_flipped_byte_in_an_exported_tensor_is_named_whole_or_sliced(
    save: tuple[Path, dict], tmp_path: Path, form: str
) -> None:
    out = tmp_path / ("x.safetensors" if form == "file" else "hf")
    export_weights(save[0], out, max_shard_size=SMALL_SHARDS)
    damaged = out if form == "file" else out / "model-00002-of-00003.safetensors"  # net.0.bias's shard
    flip_a_byte(damaged, "net.0.bias")
    for index in [(), (slice(2, 5),)]:  # read whole (checked as read), or a slice (its tensor checked first)
        with open_weights(out) as source:
            assert torch.equal(source.read("net.0.weight"), save[1]["net.0.weight"])  # the others are intact
            with pytest.raises(CheckpointError) as info:
                source.read("net.0.bias", index)
        text = str(info.value)
        assert f"{str(damaged)!r} is damaged: the bytes of tensor 'net.0.bias' do not match the CRC32" in text, text
    assert load_file(damaged)["net.0.bias"].shape == (16,)  # the safetensors library itself does not notice
    with pytest.raises(CheckpointError, match="'net.0.bias'"):
        export_weights(out, tmp_path / "again.safetensors")  # keel refuses to pass the damage on
    assert not (tmp_path / "again.safetensors").exists()
