"""Hugging Face safetensors in and out (trainer/checkpoint/hf.py): exports of a real keel save to one file, to a
sharded folder and to a plain file; ``open_weights`` on files written by the safetensors library, by ``torch.save``
and by keel; the errors; and that an export reads a keel save one output shard at a time. In-process only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from models import Regression, loader, quiet, regression_data
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import trainer
from trainer import Trainer
from trainer.checkpoint import hf, reader
from trainer.checkpoint.files import CheckpointError
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
        assert handle.metadata() == {"format": "pt"}
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
