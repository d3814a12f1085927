"""``Trainer(initial_weights=...)`` in one process: every kind of source (a file the safetensors library wrote, a
Hugging Face folder, a ``torch.save`` file, a keel checkpoint) starts the task with its weights; renaming; every
mismatch named before anything is loaded; a resumed checkpoint wins; the weights load once per task. The sharded
case (each of 4 ranks reading its slices) is tests/integration/test_sharded.py."""

from __future__ import annotations

import json
import logging
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from checkpoint_damage import flip_a_byte
from models import Regression, loader, quiet, regression_data
from torch import nn

from trainer import Callback, Trainer, export_weights
from trainer.checkpoint.files import CheckpointError

safetensors = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A keel save of a task trained for 3 steps (seed 1), and its weights."""
    root = tmp_path_factory.mktemp("pretrained")
    fit = Trainer(**quiet(max_steps=3, default_root_dir=str(root)))
    task = Regression(seed=1)
    fit.fit(task, loader(regression_data(), 16))
    fit.save_checkpoint(str(root / "save.ckpt"))
    return root / "save.ckpt", weights(task)


def weights(task: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in task.state_dict().items()}


def assert_weights(task: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = weights(task)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value.to(got[key].dtype)), key


def validated(path: str | Path, **options) -> Regression:
    """A fresh task (seed 0, other weights) after ``validate`` under ``initial_weights=path``."""
    task = Regression(seed=0)
    Trainer(**quiet(initial_weights=str(path), **options)).validate(task, loader(regression_data(), 16), verbose=False)
    return task


def test_every_kind_of_source_starts_the_task(pretrained: tuple[Path, dict], tmp_path: Path) -> None:
    save, state = pretrained
    assert not torch.equal(Regression(seed=0).state_dict()["net.0.weight"], state["net.0.weight"])
    safetensors.save_file(state, tmp_path / "library.safetensors")  # written by the safetensors library
    torch.save(state, tmp_path / "plain.pt")
    torch.save({"state_dict": state, "epoch": 3}, tmp_path / "lightning.pt")  # Lightning's layout
    export_weights(save, tmp_path / "hf", max_shard_size=100)  # a folder of shards with an index
    for source in ("library.safetensors", "plain.pt", "lightning.pt", "hf"):
        assert_weights(validated(tmp_path / source), state)
    assert_weights(validated(save), state)  # a keel checkpoint, read with DCP


def test_fit_starts_from_the_weights_and_a_resume_wins(pretrained: tuple[Path, dict], tmp_path: Path) -> None:
    save, state = pretrained
    safetensors.save_file(state, tmp_path / "w.safetensors")
    seen: dict[str, torch.Tensor] = {}

    class AtStart(Callback):
        def on_fit_start(self, trainer, task) -> None:
            seen.clear()
            seen.update(weights(task))

    def fit(ckpt_path=None) -> tuple[Trainer, Regression]:
        trainer = Trainer(**quiet(max_steps=2, initial_weights=str(tmp_path / "w.safetensors"), callbacks=[AtStart()]))
        task = Regression(seed=0)
        trainer.fit(task, loader(regression_data(), 16), ckpt_path=ckpt_path)
        return trainer, task

    trainer, task = fit()
    assert sorted(seen) == sorted(state) and all(torch.equal(seen[k], state[k]) for k in state)
    trained = weights(task)
    # Once per task: a later stage of the same task keeps what fit trained.
    trainer.validate(task, loader(regression_data(), 16), verbose=False)
    assert_weights(task, trained)
    # A checkpoint given to fit is restored instead (its weights, not the initial ones).
    other = {k: v + 1 for k, v in state.items()}
    safetensors.save_file(other, tmp_path / "w.safetensors")
    trainer, task = fit(ckpt_path=str(save))
    assert all(torch.equal(seen[k], state[k]) for k in state)
    resumed = weights(task)
    trainer.validate(task, loader(regression_data(), 16), verbose=False)  # nor after a resumed fit
    assert_weights(task, resumed)


def test_renaming_by_prefix_and_by_function(pretrained: tuple[Path, dict], tmp_path: Path) -> None:
    _, state = pretrained
    hf_names = {k.replace("net.", "model.layers."): v for k, v in state.items()}
    hf_names["lm_head.extra"] = torch.zeros(3)
    safetensors.save_file(hf_names, tmp_path / "w.safetensors")

    def rename(name: str) -> str | None:
        return None if name.startswith("lm_head.") else name.replace("model.layers.", "net.")

    assert_weights(validated(tmp_path / "w.safetensors", initial_weights_rename=rename), state)
    only = tmp_path / "only.safetensors"
    safetensors.save_file({k: v for k, v in hf_names.items() if k.startswith("model.")}, only)
    assert_weights(validated(only, initial_weights_rename={"model.layers.": "net."}), state)


def test_mismatches_are_named_and_nothing_is_loaded(
    pretrained: tuple[Path, dict], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, state = pretrained
    broken = dict(state)
    broken["net.0.bias"] = torch.zeros(15)  # another shape
    del broken["net.2.bias"]  # missing
    broken["head.weight"] = torch.zeros(2)  # unexpected
    safetensors.save_file(broken, tmp_path / "w.safetensors")
    task = Regression(seed=0)
    before = weights(task)
    with pytest.raises(CheckpointError) as info:
        Trainer(**quiet(initial_weights=str(tmp_path / "w.safetensors"))).validate(
            task, loader(regression_data(), 16), verbose=False
        )
    text = str(info.value)
    assert "net.0.bias: (15,) in the file, (16,) in the task" in text
    assert "task entries the file does not have: net.2.bias" in text
    assert "file entries the task does not have: head.weight" in text
    assert "initial_weights_rename" in text and "initial_weights_strict=False" in text
    assert_weights(task, before)  # nothing was loaded

    # strict=False: what does not match keeps its initialisation (a shape mismatch still refuses).
    del broken["net.0.bias"]
    safetensors.save_file(broken, tmp_path / "w.safetensors")
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint.initial"):
        task = validated(tmp_path / "w.safetensors", initial_weights_strict=False)
    assert "net.2.bias" in caplog.text and "head.weight" in caplog.text
    got = weights(task)
    assert torch.equal(got["net.0.weight"], state["net.0.weight"])
    assert torch.equal(got["net.2.bias"], before["net.2.bias"]) and torch.equal(got["net.0.bias"], before["net.0.bias"])


def test_bad_options_are_refused_when_the_trainer_is_built(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="initial_weights_rename"):
        Trainer(**quiet(initial_weights=str(tmp_path / "w.safetensors"), initial_weights_rename=["model."]))
    with pytest.raises(ValueError, match="initial_weights_strict"):
        Trainer(**quiet(initial_weights_strict="yes"))
    with pytest.raises(CheckpointError, match="does not exist"):
        validated(tmp_path / "missing.safetensors")


class Tied(Regression):
    """The output layer shares the input layer's weight (as a language model's head shares its embedding)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(features=16, seed=seed)
        self.net[2] = nn.Linear(16, 16)
        self.net.append(nn.Linear(16, 16, bias=False))
        self.net[3].weight = self.net[0].weight
        self.net.append(nn.Linear(16, 1))


@pytest.mark.parametrize("held", ["net.0.weight", "net.3.weight"])
def test_a_tied_weight_loads_from_either_of_its_names(tmp_path: Path, held: str) -> None:
    state = weights(Tied(seed=1))
    del state["net.3.weight" if held == "net.0.weight" else "net.0.weight"]
    safetensors.save_file(state, tmp_path / "w.safetensors")
    task = Tied(seed=0)
    Trainer(**quiet(initial_weights=str(tmp_path / "w.safetensors"))).validate(
        task, loader(regression_data(features=16), 16), verbose=False
    )
    assert task.net[3].weight is task.net[0].weight
    assert torch.equal(task.net[0].weight.detach(), state[held])


@pytest.mark.parametrize("reader", ["load_from_checkpoint", "initial_weights"])
def test_a_flipped_bit_in_a_weights_file_is_named_not_loaded(tmp_path: Path, reader: str) -> None:
    """A plain weights file carries its zip records' CRC32s; both ways of reading one check them."""
    trainer = Trainer(**quiet(max_steps=2))
    task = Regression()
    trainer.fit(task, loader(regression_data(16), batch_size=4))
    trainer.save_checkpoint(tmp_path / "w.ckpt", weights_only=True)
    with zipfile.ZipFile(tmp_path / "w.ckpt") as archive:  # a bit inside the largest tensor's bytes
        record = max(archive.infolist(), key=lambda info: info.file_size)
        name_len, extra_len = struct.unpack("<HH", (tmp_path / "w.ckpt").read_bytes()[record.header_offset + 26 :][:4])
        offset = record.header_offset + 30 + name_len + extra_len
    data = bytearray((tmp_path / "w.ckpt").read_bytes())
    data[offset + 3] ^= 0x01
    (tmp_path / "w.ckpt").write_bytes(data)
    with pytest.raises(CheckpointError, match=r"is damaged: its record '.*' does not match the CRC32"):
        if reader == "load_from_checkpoint":
            Regression.load_from_checkpoint(tmp_path / "w.ckpt")
        else:
            Trainer(**quiet(max_steps=1, initial_weights=str(tmp_path / "w.ckpt"))).fit(
                Regression(), loader(regression_data(16), batch_size=4)
            )


@pytest.mark.parametrize("form", ["model.safetensors", "hf"])
def test_a_flipped_byte_in_an_exported_tensor_is_named_not_loaded(
    pretrained: tuple[Path, dict], tmp_path: Path, form: str
) -> None:
    """keel's safetensors carry each tensor's CRC32 in their header; initial_weights checks them. A file the
    safetensors library wrote (no checksums) loads as before."""
    save, state = pretrained
    export_weights(save, tmp_path / form, max_shard_size=100)  # hf: 3 shards, net.0.bias alone in the second
    damaged = tmp_path / form if form.endswith(".safetensors") else tmp_path / form / "model-00002-of-00003.safetensors"
    assert_weights(validated(tmp_path / form), state)  # intact: it loads, checked
    flip_a_byte(damaged, "net.0.bias")
    task = Regression(seed=0)
    before = weights(task)
    with pytest.raises(CheckpointError) as info:
        Trainer(**quiet(initial_weights=str(tmp_path / form))).validate(
            task, loader(regression_data(), 16), verbose=False
        )
    text = str(info.value)
    assert f"{str(damaged)!r} is damaged: the bytes of tensor 'net.0.bias' do not match the CRC32" in text, text
    assert torch.equal(weights(task)["net.0.bias"], before["net.0.bias"])
    unchecked = tmp_path / "library.safetensors"
    safetensors.save_file(state, unchecked)
    flip_a_byte(unchecked, "net.0.bias")  # no checksum to catch it: loads as it did before keel had them
    assert torch.equal(weights(validated(unchecked))["net.0.weight"], state["net.0.weight"])


def test_an_index_naming_a_5000_character_shard_is_refused_by_name(
    pretrained: tuple[Path, dict], tmp_path: Path
) -> None:
    """It used to raise a bare OSError: [Errno 36] File name too long."""
    save, _ = pretrained
    export_weights(save, tmp_path / "hf", max_shard_size=100)
    index = tmp_path / "hf" / "model.safetensors.index.json"
    body = json.loads(index.read_text())
    body["weight_map"]["net.0.bias"] = "a" * 5000 + ".safetensors"
    index.write_text(json.dumps(body))
    with pytest.raises(CheckpointError) as info:
        validated(tmp_path / "hf")
    text = str(info.value)
    assert f"Index {str(index)!r} names the shard 'aaaa" in text and "a.safetensors' (5,012 characters)" in text, text
    assert "for 'net.0.bias'" in text and "download the folder again" in text, text
    assert len(text) < 800, text  # the name is shortened
