"""Checkpoint integrity and security, in one process.

* Nothing in a save runs code: a pickle payload put into each file of a real save (keel.pt, .metadata, a
  DCP byte item, lightning.pt, a weights file) is refused by every way of loading it, and never runs.
* Silent corruption (a flipped bit, a data file of another save) is refused naming the file;
  ``ckpt_path="last"`` falls back to the previous committed save and then resumes exactly.
* The ``last`` pointer: unreadable, stale, uncommitted or escaping entries, missing saves, first runs.
* ``ckpt_path="best"`` skips damaged candidates, saying which and why.
* Optimizer / scheduler classes that differ from the save's are refused before anything is loaded.
* Teardown after a failure runs even when a hook raises, and its own errors are logged.

Two ranks falling back from a damaged data file of rank 1 (launched): tests/integration/test_checkpoint_integrity.py.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_damage import assert_same_weights, flip_bit, flip_tensor_bit, save_name, weights
from models import Regression, loader, quiet, regression_data
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from trainer import Callback, Trainer
from trainer.checkpoint.claim import CLAIM_FILE
from trainer.checkpoint.files import POINTER_NAME, CheckpointError, read_pointer
from trainer.checkpoint.hf import export_weights
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.checkpoint.reader import load_weights
from trainer.checkpoint.store import KEEL_FILE, LIGHTNING_FILE, MANIFEST_FILE, METADATA_FILE, manifest_body, quiet_dcp
from trainer.loggers.logger import Logger

DATA_FILE = "__0_0.distcp"


# ---------------------------------------------------------------------- helpers
def data() -> Any:
    return loader(regression_data(), 16, shuffle=True)


class Probe(Callback):
    """Where the fit starts: the step and the save it was restored from, and the weights then."""

    step: int | None = None
    path: str | None = None
    weights: dict[str, torch.Tensor] | None = None
    final_step: int | None = None

    def on_fit_start(self, trainer: Trainer, task: Any) -> None:
        self.step, self.path, self.weights = trainer.global_step, trainer.ckpt_path, weights(task)


def train(
    dirpath: Path,
    max_steps: int,
    *,
    task: Regression | None = None,
    ckpt_path: str | None = None,
    callbacks: tuple[Callback, ...] = (),
    **ckpt: Any,
) -> tuple[Trainer, Regression, ModelCheckpoint]:
    """A fit that saves every step into ``dirpath`` (keeping every save unless told otherwise)."""
    ckpt.setdefault("every_n_train_steps", 1)
    ckpt.setdefault("save_top_k", -1)
    cb = ModelCheckpoint(dirpath=dirpath, **ckpt)
    trainer = Trainer(**quiet(max_steps=max_steps, enable_checkpointing=True, callbacks=[cb, *callbacks]))
    task = task if task is not None else Regression()
    trainer.fit(task, data(), ckpt_path=ckpt_path)
    return trainer, task, cb


def reference_from(save: Path, max_steps: int) -> dict[str, torch.Tensor]:
    """The final weights of an undisturbed run resumed from ``save`` (no checkpointing: it reads only)."""
    task = Regression()
    Trainer(**quiet(max_steps=max_steps)).fit(task, data(), ckpt_path=str(save))
    return weights(task)


def reseal(folder: Path) -> None:
    """Rewrite ``keel.json`` so that its sizes and CRC32s, and its own CRC32, match the files now in
    ``folder``: after this only the unpickler stands between a crafted file and the loader."""
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST_FILE:
            raw = path.read_bytes()
            files[path.name] = [len(raw), zlib.crc32(raw)]
    body = manifest_body(manifest["identity"], files)
    (folder / MANIFEST_FILE).write_text(json.dumps(body, sort_keys=True, indent=1))


def trainer_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("trainer")]


# ---------------------------------------------------------------------- 1. nothing in a save runs code
class Payload:
    """Pickles as a call that creates ``marker``: what a crafted checkpoint would run on an unsafe load."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


ENTRY_POINTS = ("fit", "last", "load_from_checkpoint", "export_weights")


def assert_refused_everywhere(
    tmp_path: Path, dirpath: Path, target: Path, marker: Path, *names: str, only: tuple[str, ...] = ENTRY_POINTS
) -> list[str]:
    """Every way of loading ``target``: a fit resumed from it, ``ckpt_path="last"`` in ``dirpath`` (where
    it is the only save), ``load_from_checkpoint`` and ``export_weights``, refuses with a CheckpointError
    naming one of ``names``; nothing ran. Returns the messages."""
    messages = []
    attempts = {
        "fit": lambda: Trainer(**quiet(max_steps=8)).fit(Regression(), data(), ckpt_path=str(target)),
        "last": lambda: Trainer(
            **quiet(
                max_steps=8,
                enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=100)],
            )
        ).fit(Regression(), data(), ckpt_path="last"),
        "load_from_checkpoint": lambda: Regression.load_from_checkpoint(str(target)),
        "export_weights": lambda: export_weights(target, tmp_path / "exported.pt"),
    }
    for what in only:
        attempt = attempts[what]
        with pytest.raises(CheckpointError) as info:
            attempt()
        text = str(info.value)
        assert any(name in text for name in names), f"{what}: {text}"
        assert "is corrupt or from another save" not in text, f"{what}: refused by the checksum, not the unpickler"
        assert not marker.exists(), f"{what} ran the payload"
        messages.append(text)
    assert not (tmp_path / "exported.pt").exists()
    return messages


def one_save(dirpath: Path, **ckpt: Any) -> tuple[Trainer, Regression, Path]:
    """A run of 2 steps that keeps only its newest save (so ``ckpt_path="last"`` has no fallback)."""
    trainer, task, cb = train(dirpath, 2, save_top_k=1, **ckpt)
    saves = [p for p in dirpath.iterdir() if p.name not in (POINTER_NAME, CLAIM_FILE)]
    assert [p.name for p in saves] == [save_name(2)]
    return trainer, task, saves[0]


def test_payload_in_keel_pt_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _, _, save = one_save(tmp_path / "ck")
    state = torch.load(save / KEEL_FILE, weights_only=True)
    state["callbacks"]["payload"] = Payload(marker)
    torch.save(state, save / KEEL_FILE)
    reseal(save)
    assert_refused_everywhere(tmp_path, tmp_path / "ck", save, marker, str(save / KEEL_FILE))
    torch.load(save / KEEL_FILE, weights_only=False)  # control: the payload is live
    assert marker.exists()


def test_payload_in_metadata_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _, _, save = one_save(tmp_path / "ck")
    with open(save / METADATA_FILE, "rb") as handle:
        metadata = pickle.load(handle)  # the genuine index, with the payload riding along
    metadata.planner_data = {"payload": Payload(marker)}
    (save / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    reseal(save)
    messages = assert_refused_everywhere(tmp_path, tmp_path / "ck", save, marker, str(save / METADATA_FILE))
    assert all("builtins.exec" in m for m in messages)
    pickle.loads((save / METADATA_FILE).read_bytes())  # control: the payload is live
    assert marker.exists()


def dcp_payload_save(tmp_path: Path, marker: Path) -> Path:
    """A genuine DCP save of a run's state in which an optimizer hyperparameter and a model entry are
    pickled objects; keel.pt and keel.json are the run's own, re-pointed at the new files."""
    trainer, task, save = one_save(tmp_path / "ck")
    model = dict(trainer.strategy.model_state_dict(task), payload=Payload(marker))
    optimizer = trainer.strategy.optimizer_state_dict(task, trainer.optimizers[0])
    optimizer["param_groups"][0]["lr"] = Payload(marker)
    (save / DATA_FILE).unlink()
    (save / METADATA_FILE).unlink()
    with quiet_dcp():
        dcp.save({"model": model, "optimizers": [optimizer]}, storage_writer=FileSystemWriter(save))
    reseal(save)
    assert not marker.exists()
    return save


def test_payload_in_a_dcp_byte_item_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    save = dcp_payload_save(tmp_path, marker)
    lr = "optimizers.0.param_groups.0.lr"  # the item a fit reads
    messages = assert_refused_everywhere(tmp_path, tmp_path / "ck", save, marker, lr, only=("fit", "last"))
    assert all(lr in m and "refuses to load" in m for m in messages)
    # The weights readers read the model's items: refused too, and nothing runs (the error's type is
    # test_dcp_byte_item_refusal_is_a_checkpoint_error's business).
    for attempt in (
        lambda: Regression.load_from_checkpoint(str(save)),
        lambda: export_weights(save, tmp_path / "exported.pt"),
    ):
        with pytest.raises(BaseException, match="'model.payload' holds pickled objects"):
            attempt()
        assert not marker.exists()
    assert not (tmp_path / "exported.pt").exists()
    # Control: DCP's own planner unpickles byte items freely; the payload runs.
    fresh = Regression()
    opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    with quiet_dcp():
        dcp.load({"optimizers": [get_optimizer_state_dict(fresh, opt)]}, storage_reader=FileSystemReader(save))
    assert marker.exists()


def test_dcp_byte_item_refusal_is_a_checkpoint_error(tmp_path: Path) -> None:
    save = dcp_payload_save(tmp_path, tmp_path / "pwned")
    with pytest.raises(CheckpointError, match="model.payload"):
        try:
            export_weights(save, tmp_path / "exported.pt")
        except Exception:
            raise
        except BaseException as exc:  # noqa: B036 - what escapes today: turned into a plain test failure
            raise AssertionError(f"{type(exc).__module__}.{type(exc).__name__} escaped") from exc


def test_payload_in_the_lightning_file_runs_nothing(tmp_path: Path) -> None:
    """lightning.pt is for programs that ``torch.load`` it; keel never unpickles it: tampered, the save
    is refused by its checksum; resealed, it loads from DCP without reading lightning.pt; copied out as a
    plain file, it is refused by ``weights_only``."""
    marker = tmp_path / "pwned"
    _, task, save = one_save(tmp_path / "ck", lightning_file=True)
    inner = save / LIGHTNING_FILE
    state = torch.load(inner, weights_only=True)
    state["payload"] = Payload(marker)
    torch.save(state, inner)
    # Tampered, not resealed: every entry point refuses the save, naming lightning.pt.
    for target in (save, inner):
        with pytest.raises(CheckpointError, match=f"{LIGHTNING_FILE} is corrupt or from another save"):
            Trainer(**quiet(max_steps=8)).fit(Regression(), data(), ckpt_path=str(target))
        with pytest.raises(CheckpointError, match=LIGHTNING_FILE):
            Regression.load_from_checkpoint(str(target))
        with pytest.raises(CheckpointError, match=LIGHTNING_FILE):
            export_weights(target, tmp_path / "exported.pt")
    last = Trainer(
        **quiet(max_steps=8, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck")])
    )
    with pytest.raises(CheckpointError, match=LIGHTNING_FILE):
        last.fit(Regression(), data(), ckpt_path="last")
    assert not marker.exists()
    # Resealed: the save loads (from its DCP files) and the Lightning file is never unpickled.
    reseal(save)
    probe = Probe()
    Trainer(**quiet(max_steps=2, callbacks=[probe])).fit(Regression(), data(), ckpt_path=str(inner))
    assert probe.step == 2
    assert_same_weights(probe.weights, weights(task))
    assert_same_weights(weights(Regression.load_from_checkpoint(str(inner))), weights(task))
    export_weights(inner, tmp_path / "exported.pt")
    assert_same_weights(torch.load(tmp_path / "exported.pt", weights_only=True), weights(task))
    assert not marker.exists()
    # Copied out as the one file a Lightning program would pass around: refused by weights_only.
    alone = tmp_path / "alone" / "model.ckpt"
    alone.parent.mkdir()
    shutil.copy(inner, alone)
    (tmp_path / "exported.pt").unlink()
    messages = assert_refused_everywhere(tmp_path, alone.parent, alone, marker, str(alone))
    assert all("refuses to load" in m for m in messages)
    torch.load(alone, weights_only=False)  # control: the payload is live
    assert marker.exists()


def test_payload_in_a_weights_file_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _, _, save = one_save(tmp_path / "ck", save_weights_only=True)
    assert save.is_file()
    state = torch.load(save, weights_only=True)
    state["payload"] = Payload(marker)
    torch.save(state, save)
    messages = assert_refused_everywhere(tmp_path, tmp_path / "ck", save, marker, str(save))
    assert all("refuses to load" in m for m in messages)
    torch.load(save, weights_only=False)  # control: the payload is live
    assert marker.exists()


# ---------------------------------------------------------------------- 2. silent corruption
def damage_flip_data(ck: Path, newest: Path) -> str:
    return flip_tensor_bit(newest, "model.net.0.weight")


def damage_flip_keel(ck: Path, newest: Path) -> str:
    size = (newest / KEEL_FILE).stat().st_size
    flip_bit(newest / KEEL_FILE, size // 2)
    return KEEL_FILE


def damage_swap_data(ck: Path, newest: Path) -> str:
    older = ck / save_name(4)
    assert (older / DATA_FILE).read_bytes() != (newest / DATA_FILE).read_bytes()
    shutil.copy(older / DATA_FILE, newest / DATA_FILE)
    return DATA_FILE


@pytest.mark.parametrize("damage", [damage_flip_data, damage_flip_keel, damage_swap_data], ids=lambda f: f.__name__)
def test_damaged_newest_save_is_refused_and_last_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any
) -> None:
    ck = tmp_path / "ck"
    train(ck, 6)  # saves at steps 1..6
    newest, previous = ck / save_name(6), ck / save_name(5)
    reference = reference_from(previous, 9)
    name = damage(ck, newest)
    # Named, and never a fallback for an explicit path.
    explicit = Trainer(**quiet(max_steps=9))
    with pytest.raises(CheckpointError, match=f"{name}.*(corrupt|from another save)") as info:
        explicit.fit(Regression(), data(), ckpt_path=str(newest))
    assert str(newest) in str(info.value) and explicit.global_step == 0
    # "last": a WARNING naming the damaged file and the save it loads instead, then an exact resume.
    caplog.clear()
    probe = Probe()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer, task, _ = train(ck, 9, ckpt_path="last", callbacks=(probe,))
    (fallback,) = trainer_warnings(caplog)  # one warning, and no other
    assert "Falling back" in fallback and name in fallback and str(newest) in fallback and str(previous) in fallback
    assert probe.step == 5 and probe.path == str(previous)
    assert trainer.global_step == 9
    assert_same_weights(weights(task), reference)


# ---------------------------------------------------------------------- 3. the pointer
@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run that saved at steps 1, 2 and 3 (the pointer names step 3 first)."""
    ck = tmp_path / "run" / "ck"
    train(ck, 3)
    assert read_pointer(ck) == [save_name(3), save_name(2), save_name(1)]
    return ck


@pytest.fixture(scope="module")
def other_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid save of ANOTHER run, at step 7: loading it by mistake would show as global_step 7."""
    ck = tmp_path_factory.mktemp("other") / "ck"
    train(ck, 7, every_n_train_steps=7)
    save = ck / save_name(7)
    probe = Probe()
    Trainer(**quiet(max_steps=7, callbacks=[probe])).fit(Regression(), data(), ckpt_path=str(save))
    assert probe.step == 7  # it loads: not following it below is the pointer's refusal
    return save


def write_pointer_json(ck: Path, names: list[str]) -> None:
    (ck / POINTER_NAME).write_text(json.dumps({"last": names[0], "history": names}))


def resume_last(ck: Path, caplog: pytest.LogCaptureFixture) -> tuple[Probe, list[str]]:
    """``ckpt_path="last"`` into a fit that ends at step 3 (nothing to train after a restore there) and
    saves nothing."""
    caplog.clear()
    probe = Probe()
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer, _, _ = train(ck, 3, ckpt_path="last", callbacks=(probe,), every_n_train_steps=100)
    probe.final_step = trainer.global_step
    return probe, trainer_warnings(caplog)


def assert_resumed_newest(ck: Path, probe: Probe, warnings: list[str], *named: str, newest: int = 3) -> None:
    assert probe.step == newest and probe.path == str(ck / save_name(newest))
    assert len(warnings) == 1, warnings  # one warning per resolution
    for text in named:
        assert text in warnings[0], warnings[0]


@pytest.mark.parametrize(
    "pointer",
    [b'{"last": "epoch=0-step=3.ck', b"\xff\xfe\x00garbage", b"[]", b'{"history": []}', b'{"last": 3}'],
    ids=["truncated", "not-utf8", "a-list", "empty-history", "not-a-name"],
)
def test_unreadable_pointer_resumes_from_the_newest_committed_save(
    run_dir: Path, caplog: pytest.LogCaptureFixture, pointer: bytes
) -> None:
    (run_dir / POINTER_NAME).write_bytes(pointer)
    probe, warnings = resume_last(run_dir, caplog)
    assert_resumed_newest(run_dir, probe, warnings, str(run_dir / POINTER_NAME))


def test_pointer_that_is_a_directory_resumes_from_the_newest_committed_save(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (run_dir / POINTER_NAME).unlink()
    (run_dir / POINTER_NAME).mkdir()  # unreadable even for root (chmod 000 is not)
    probe, warnings = resume_last(run_dir, caplog)
    assert_resumed_newest(run_dir, probe, warnings, str(run_dir / POINTER_NAME))


def test_pointer_that_is_a_directory_is_replaced_by_the_next_save(run_dir: Path) -> None:
    (run_dir / POINTER_NAME).unlink()
    (run_dir / POINTER_NAME).mkdir()
    trainer, _, _ = train(run_dir, 4, ckpt_path="last")
    assert trainer.global_step == 4 and read_pointer(run_dir)[0] == save_name(4)


def test_pointer_to_a_missing_save_resumes_from_the_newest_committed_save(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The newest entries are gone (pruned, or deleted by hand): ONE warning, not one per entry.
    write_pointer_json(run_dir, [save_name(9), save_name(8), save_name(7), save_name(3), save_name(2)])
    probe, warnings = resume_last(run_dir, caplog)
    assert_resumed_newest(run_dir, probe, warnings, save_name(9))
    # Only the newest save is gone: the next one down is resumed, and said so.
    shutil.rmtree(run_dir / save_name(3))
    write_pointer_json(run_dir, [save_name(3), save_name(2), save_name(1)])
    probe, warnings = resume_last(run_dir, caplog)
    assert_resumed_newest(run_dir, probe, warnings, save_name(3), f"newest committed save, {save_name(2)}", newest=2)


def test_pointer_to_an_uncommitted_folder_resumes_from_the_newest_committed_save(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder with DCP's data but no keel.pt and no manifest (never committed) is not a save."""
    partial = run_dir / save_name(4)
    partial.mkdir()
    for name in (DATA_FILE, METADATA_FILE):
        shutil.copy(run_dir / save_name(3) / name, partial / name)
    write_pointer_json(run_dir, [save_name(4), save_name(3), save_name(2)])
    probe, warnings = resume_last(run_dir, caplog)
    assert_resumed_newest(run_dir, probe, warnings, save_name(4))


def test_save_without_its_manifest_is_not_loaded(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A save whose keel.json is missing is uncommitted (or damaged): ``last`` must not load it unverified."""
    newest = run_dir / save_name(3)
    (newest / MANIFEST_FILE).unlink()
    flip_tensor_bit(newest, "model.net.0.weight")  # loading it unverified would go unnoticed
    probe, warnings = resume_last(run_dir, caplog)
    assert_resumed_newest(run_dir, probe, warnings, save_name(3), newest=2)


def test_folder_in_place_of_a_manifest_does_not_hide_older_saves(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    newest = run_dir / save_name(3)
    (newest / MANIFEST_FILE).unlink()
    (newest / MANIFEST_FILE).mkdir()
    probe, warnings = resume_last(run_dir, caplog)
    assert_resumed_newest(run_dir, probe, warnings, save_name(3), newest=2)
    (run_dir / POINTER_NAME).unlink()  # without the pointer too: the intact older save is found
    probe, warnings = resume_last(run_dir, caplog)
    assert_resumed_newest(run_dir, probe, warnings, "no pointer", newest=2)


@pytest.mark.parametrize("kind", ["dotdot", "etc-passwd", "absolute", "subfolder", "hidden-tmp"])
def test_pointer_entry_outside_its_folder_is_never_followed(
    run_dir: Path, other_run: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    escaped = run_dir.parent / "escaped" / "x.ckpt"
    entries = {
        "dotdot": ("../escaped/x.ckpt", escaped),
        "etc-passwd": ("../../etc/passwd", None),
        "absolute": (str(escaped), escaped),
        "subfolder": ("other_run/x.ckpt", run_dir / "other_run" / "x.ckpt"),
        "hidden-tmp": (f".{save_name(9)}.tmp-0123abcd", run_dir / f".{save_name(9)}.tmp-0123abcd"),
    }
    entry, location = entries[kind]
    if location is not None:  # a valid save of another run (step 7) where the entry leads
        shutil.copytree(other_run, location)
    write_pointer_json(run_dir, [entry, save_name(3)])
    probe, warnings = resume_last(run_dir, caplog)
    # Step 3: this run's save, not the other run's step 7; refused as an escape, not merely as missing.
    assert_resumed_newest(run_dir, probe, warnings, repr(entry), "not the plain name of a save in its folder")


def test_pointer_without_any_committed_save_refuses_to_start_over(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (1, 2, 3):
        shutil.rmtree(run_dir / save_name(step))
    before = sorted(p.name for p in run_dir.iterdir())
    trainer = Trainer(
        **quiet(
            max_steps=3, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=run_dir, every_n_train_steps=1)]
        )
    )
    with pytest.raises(CheckpointError, match="will not start over") as info:
        trainer.fit(Regression(), data(), ckpt_path="last")
    assert str(run_dir) in str(info.value) and save_name(3) in str(info.value)
    assert trainer.global_step == 0 and sorted(p.name for p in run_dir.iterdir()) == before  # nothing trained


def test_no_pointer_and_no_saves_is_a_first_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    probe, warnings = resume_last(tmp_path / "ck", caplog)
    assert probe.step == 0 and probe.path is None and warnings == []
    assert any("starting from scratch" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    assert probe.final_step == 3  # and it trained from step 0


def test_saves_without_a_pointer_resume_from_the_newest(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    (run_dir / POINTER_NAME).unlink()
    probe, warnings = resume_last(run_dir, caplog)
    assert_resumed_newest(run_dir, probe, warnings, "no pointer", save_name(3))


# ---------------------------------------------------------------------- 4. "best"
def test_best_skips_damaged_candidates_and_loads_the_best_intact_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = tmp_path / "ck"
    val = loader(regression_data(24, seed=1), 8)
    cb = ModelCheckpoint(dirpath=ck, monitor="val/loss", save_top_k=3)
    Trainer(**quiet(max_epochs=5, enable_checkpointing=True, callbacks=[cb])).fit(Regression(), data(), val)
    ranked = [Path(p) for p in sorted(cb.best_k_models, key=cb.best_k_models.__getitem__)]  # best first
    assert len(ranked) == 3
    # A fresh process reads the top-k from the newest save's keel.pt: keep that file, damage its data.
    newest = max(ranked, key=lambda p: int(p.name.split("step=")[1].split(".")[0]))
    damaged = newest if newest in ranked[:2] else ranked[0]
    (gone,) = [p for p in ranked[:2] if p != damaged]
    flip_tensor_bit(damaged, "model.net.2.weight")
    shutil.rmtree(gone)
    expected = load_weights(ranked[2])["state_dict"]
    caplog.clear()
    probe = Probe()
    fresh = ModelCheckpoint(dirpath=ck, monitor="val/loss", save_top_k=3)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        Trainer(**quiet(max_epochs=5, enable_checkpointing=True, callbacks=[fresh, probe])).fit(
            Regression(), data(), val, ckpt_path="best"
        )
    warnings = trainer_warnings(caplog)
    about_damaged = [w for w in warnings if f"{damaged}'" in w or f"{damaged}:" in w]
    about_gone = [w for w in warnings if f"{gone}:" in w]
    assert len(about_damaged) == 1 and f"{DATA_FILE} is corrupt" in about_damaged[0], warnings
    assert len(about_gone) == 1 and "not a committed save" in about_gone[0], warnings
    assert len(warnings) == 2, warnings  # nothing else skipped
    assert probe.path == str(ranked[2])
    assert_same_weights(probe.weights, expected)


# ---------------------------------------------------------------------- 5. classes
class ExponentialScheduler(Regression):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.net.parameters(), lr=self.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)}


class TwoOptimizers(Regression):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
        return loss

    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.net[0].parameters(), lr=self.lr, momentum=0.9),
            torch.optim.SGD(self.net[2].parameters(), lr=self.lr, momentum=0.9),
        ]


@pytest.mark.parametrize(
    "saved,resumed_class,names",
    [
        (dict(optimizer="adamw"), Regression, ["torch.optim.adamw.AdamW", "torch.optim.sgd.SGD"]),
        (dict(scheduler="step"), ExponentialScheduler, ["StepLR", "ExponentialLR"]),
        (dict(), TwoOptimizers, ["['torch.optim.sgd.SGD']", "['torch.optim.sgd.SGD', 'torch.optim.sgd.SGD']"]),
    ],
    ids=["optimizer-class", "scheduler-class", "optimizer-count"],
)
def test_other_optimizer_or_scheduler_is_refused_before_anything_loads(
    tmp_path: Path, saved: dict[str, Any], resumed_class: type[Regression], names: list[str]
) -> None:
    ck = tmp_path / "ck"
    train(ck, 3, task=Regression(**saved))
    resumed = resumed_class()
    resumed.net[0].weight.data.add_(1.0)  # unlike the save's weights, so that a partial load would show
    before = weights(resumed)
    for ckpt_path in (str(ck / save_name(3)), "last"):  # a class mismatch is no damage: "last" does not fall back
        trainer = Trainer(
            **quiet(
                max_steps=6, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=ck, every_n_train_steps=1)]
            )
        )
        with pytest.raises(CheckpointError) as info:
            trainer.fit(resumed, data(), ckpt_path=ckpt_path)
        for name in names:
            assert name in str(info.value)
        assert trainer.global_step == 0
        assert all(not o.state for o in trainer.optimizers)  # no step taken, no optimizer state loaded
        assert_same_weights(weights(resumed), before)
    assert sorted(p.name for p in ck.iterdir() if p.name not in (POINTER_NAME, CLAIM_FILE)) == [
        save_name(s) for s in (1, 2, 3)
    ]


# ---------------------------------------------------------------------- 6. teardown after a failure
class RecordingLogger(Logger):
    def __init__(self, save_dir: Path, fail_finalize: bool = False) -> None:
        super().__init__(save_dir, name=None, version=0)
        self.fail_finalize, self.finalized = fail_finalize, []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        pass

    def finalize(self, status: str) -> None:
        self.finalized.append(status)
        if self.fail_finalize:
            raise OSError("the log disk went away while finalizing")


class FailsAtStep2(Regression):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            raise RuntimeError("boom at step 2")
        return super().training_step(batch, batch_idx)


class Hooks(Callback):
    def __init__(self, *, raise_on_exception: bool = False, raise_in_teardown: bool = False) -> None:
        self.raise_on_exception, self.raise_in_teardown = raise_on_exception, raise_in_teardown
        self.seen: list[str] = []

    def on_exception(self, trainer: Trainer, task: Any, exception: BaseException) -> None:
        self.seen.append(f"on_exception:{type(exception).__name__}")
        if self.raise_on_exception:
            raise ValueError("on_exception hook failed")

    def teardown(self, trainer: Trainer, task: Any, stage: str) -> None:
        self.seen.append(f"teardown:{stage}")
        if self.raise_in_teardown:
            raise KeyError("teardown hook failed")


def failing_fit(tmp_path: Path, logger: Logger, *callbacks: Callback) -> Trainer:
    trainer = Trainer(**quiet(max_steps=6, logger=logger, callbacks=list(callbacks), default_root_dir=str(tmp_path)))
    with pytest.raises(RuntimeError, match="boom at step 2"):  # the run's own error, nothing else
        trainer.fit(FailsAtStep2(), data())
    return trainer


def test_raising_on_exception_hook_does_not_skip_teardown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    logger, first, second = RecordingLogger(tmp_path), Hooks(raise_on_exception=True), Hooks()
    with caplog.at_level(logging.ERROR, logger="trainer"):
        trainer = failing_fit(tmp_path, logger, first, second)
    assert first.seen == second.seen == ["on_exception:RuntimeError", "teardown:fit"]  # the next hook ran too
    assert logger.finalized == ["failed"]
    assert trainer.state_stage is None and trainer._model is None  # the strategy's teardown ran
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("on_exception raised ValueError" in e and "boom at step 2" in e for e in errors), errors


def test_failing_logger_finalize_after_a_failure_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    logger, hooks = RecordingLogger(tmp_path, fail_finalize=True), Hooks()
    with caplog.at_level(logging.ERROR, logger="trainer"):
        trainer = failing_fit(tmp_path, logger, hooks)
    assert logger.finalized == ["failed"] and hooks.seen == ["on_exception:RuntimeError", "teardown:fit"]
    assert trainer.state_stage is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("the log disk went away" in e and "boom at step 2" in e for e in errors), errors


def test_failing_callback_teardown_after_a_failure_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    logger, hooks, after = RecordingLogger(tmp_path), Hooks(raise_in_teardown=True), Hooks()
    with caplog.at_level(logging.ERROR, logger="trainer"):
        failing_fit(tmp_path, logger, hooks, after)
    assert after.seen == ["on_exception:RuntimeError", "teardown:fit"] and logger.finalized == ["failed"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("teardown hook failed" in e for e in errors), errors


# ---------------------------------------------------------------------- a folder not every rank sees
def test_a_save_rank_0_cannot_see_whole_is_refused_naming_the_files(tmp_path: Path, monkeypatch) -> None:
    """On node-local disks rank 0's folder lacks the other nodes' data files: never committed as a save."""
    from trainer.checkpoint import store

    finish = store._finish
    monkeypatch.setattr(store, "_finish", lambda job, files: finish(job, dict(files, **{"__1_0.distcp": [8, 0]})))
    trainer = Trainer(**quiet(max_steps=2))
    trainer.fit(Regression(), data())
    with pytest.raises(RuntimeError, match=r"not shared by every rank: rank 0 cannot see \['__1_0.distcp'\]"):
        trainer.save_checkpoint(tmp_path / "x.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing committed, the temporary folder removed


def test_a_save_of_a_newer_format_stops_the_resume_instead_of_falling_back(tmp_path: Path) -> None:
    """A newer keel wrote the newest save: resuming an older save would silently lose the newer steps."""
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    Trainer(**quiet(max_steps=4, callbacks=[cb], enable_checkpointing=True)).fit(Regression(), data())
    manifest_path = tmp_path / save_name(4) / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    body = {k: manifest[k] for k in ("format", "keel_version", "identity", "files")} | {"format": 3}
    manifest_path.write_text(json.dumps(dict(body, crc32=zlib.crc32(json.dumps(body, sort_keys=True).encode()))))
    resumed = Trainer(**quiet(max_steps=6, callbacks=[ModelCheckpoint(dirpath=tmp_path)], enable_checkpointing=True))
    with pytest.raises(CheckpointError, match="format version 3, newer than this keel"):
        resumed.fit(Regression(), data(), ckpt_path="last")
    assert resumed.global_step == 0


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_lightning_file_must_be_a_bool(value: Any) -> None:
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(lightning_file=.*\): expected True or False"):
        ModelCheckpoint(lightning_file=value)
