"""One writer per checkpoint folder, in one process: a fresh run writes beside another run's saves and deletes
nothing, a save of another run copied in is never resumed, a save is not committed once another run holds the
folder, and best / pruning / `last` do not depend on how the folder is reached. The claims of other processes (a
dead one taken over, a live one refused) are in tests/integration/test_run_claims.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from claim_runs import fit, listing
from models import Regression, loader, quiet, regression_data

from trainer import Callback, Trainer
from trainer.checkpoint import claim
from trainer.checkpoint.model_checkpoint import ModelCheckpoint


def test_a_new_run_writes_beside_another_runs_saves_and_never_touches_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As in Lightning, a new run (ckpt_path=None) may share a folder with a stopped run's saves: it is told so by
    name, and it neither resumes, prunes nor deletes them; 'last' then continues the newest run."""
    first = fit(tmp_path / "ck")
    before = listing(tmp_path / "ck")
    with caplog.at_level("WARNING"):
        second = fit(tmp_path / "ck", max_steps=6)
    assert f"save(s) of another run ({first.checkpointer.run_id!r}" in caplog.text
    after = listing(tmp_path / "ck")
    assert all(name in after for name in before if name.endswith(".ckpt") or ".ckpt/" in name)  # all still there
    resumed = fit(tmp_path / "ck", max_steps=8, ckpt_path="last")
    assert resumed.checkpointer.run_id == second.checkpointer.run_id != first.checkpointer.run_id
    assert resumed.ckpt_path is not None and resumed.ckpt_path.endswith("epoch=0-step=6.ckpt")


def test_a_save_of_another_run_copied_into_the_folder_is_never_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fit(tmp_path / "other", max_steps=8)
    mine = fit(tmp_path / "ck", max_steps=4)
    shutil.copytree(tmp_path / "other" / "epoch=0-step=8.ckpt", tmp_path / "ck" / "epoch=0-step=8.ckpt")
    (tmp_path / "ck" / "last").unlink()  # no pointer: `last` falls back to the newest committed save by step
    with caplog.at_level("WARNING"):
        resumed = fit(tmp_path / "ck", max_steps=6, ckpt_path="last")
    assert "epoch=0-step=8.ckpt: it was written by run" in caplog.text and "never resumes another run" in caplog.text
    assert resumed.checkpointer.run_id == mine.checkpointer.run_id
    assert resumed.ckpt_path is not None and resumed.ckpt_path.endswith("epoch=0-step=4.ckpt")


class Steal(Callback):
    """Another run takes the folder at step 3 (as a second writer would)."""

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.optimizer_stepped and trainer.global_step == 3:
            folder = Path(trainer.checkpoint_callback.dirpath)
            (folder / claim.CLAIM_FILE).write_text(json.dumps({"run": "keel:intruder", "host": "elsewhere", "pid": 1}))


def test_a_save_is_not_committed_once_another_run_holds_the_folder(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"is now held by run 'keel:intruder' \(pid 1 on elsewhere\)"):
        fit(tmp_path / "ck", callbacks=(Steal(),))
    saves = [p.name for p in (tmp_path / "ck").iterdir() if p.name.endswith(".ckpt")]
    assert saves == ["epoch=0-step=2.ckpt"]  # the step-2 save stays; the step-4 save was never committed


class Score(Regression):
    """Logs a validation score that improves every epoch, so save_top_k keeps the newest saves."""

    def validation_step(self, batch, batch_idx):
        self.log("score", torch.tensor(float(self.current_epoch)))


def fit_top_k(dirpath: str | Path, epochs: int, ckpt_path: str | None = None) -> tuple[Trainer, ModelCheckpoint]:
    callback = ModelCheckpoint(dirpath=dirpath, monitor="score", mode="max", save_top_k=2)
    trainer = Trainer(**quiet(max_epochs=epochs, enable_checkpointing=True), callbacks=[callback])
    data = loader(regression_data(16), batch_size=4)
    trainer.fit(Score(), data, data, ckpt_path=ckpt_path)
    return trainer, callback


@pytest.mark.parametrize("how", ["absolute", "symlinked", "moved"])
def test_best_and_pruning_do_not_depend_on_how_the_folder_is_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Saved as the relative ``ck``; continued through another spelling, or after the folder was moved: the
    callback's state is found, ``best`` resolves, and save_top_k=2 still prunes what it kept before."""
    monkeypatch.chdir(tmp_path)
    fit_top_k("ck", epochs=3)
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.ckpt")) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    if how == "absolute":
        folder = tmp_path / "ck"
    elif how == "symlinked":
        (tmp_path / "link").symlink_to(tmp_path / "ck")
        folder = tmp_path / "link"
    else:
        (tmp_path / "ck").rename(tmp_path / "elsewhere")
        folder = tmp_path / "elsewhere"
    trainer, callback = fit_top_k(folder, epochs=5, ckpt_path="best")
    assert trainer.ckpt_path == str(folder / "epoch=2-step=12.ckpt")  # the best one, found in its new place
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["epoch=3-step=16.ckpt", "epoch=4-step=20.ckpt"]
    assert set(callback.best_k_models) == {str(folder / "epoch=3-step=16.ckpt"), str(folder / "epoch=4-step=20.ckpt")}


def test_a_failed_pointer_swap_names_the_committed_save_which_last_then_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.checkpoint import model_checkpoint
    from trainer.checkpoint.files import CheckpointSaveError, write_pointer

    calls = []

    def failing_once(path):
        calls.append(path)
        if len(calls) == 2:  # the step-4 save's swap
            raise OSError(28, "No space left on device")
        write_pointer(path)

    monkeypatch.setattr(model_checkpoint, "write_pointer", failing_once)
    with pytest.raises(CheckpointSaveError, match=r"epoch=0-step=4.ckpt' was committed, but the `last` pointer"):
        fit(tmp_path / "ck", max_steps=6)
    monkeypatch.setattr(model_checkpoint, "write_pointer", write_pointer)
    resumed = fit(tmp_path / "ck", max_steps=6, ckpt_path="last")
    assert resumed.ckpt_path is not None and resumed.ckpt_path.endswith("epoch=0-step=4.ckpt")


def test_a_failed_pointer_swap_says_so_and_what_it_left_is_pruned_once_a_later_swap_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up as the pointer is swapped to the step-4 save: the error names the pointer swap and its
    cause (not a save that "needs about 0 B"), the pointer still names step 2, which is kept; the run resumed from
    step 4 prunes step 2 (and step 4) once its own swap succeeds, leaving save_top_k=1 save."""
    import errno
    import os

    from trainer.checkpoint import files
    from trainer.checkpoint.files import CheckpointSaveError, read_pointer

    write_atomic, swaps = files.write_atomic, []

    def full_at_the_second_swap(target, write, **kwargs):
        if target.name == files.POINTER_NAME:
            swaps.append(target)
            if len(swaps) == 2:  # the step-4 save's swap: the real write path, on a disk that is full

                def full(handle):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

                return write_atomic(target, full, **kwargs)
        return write_atomic(target, write, **kwargs)

    monkeypatch.setattr(files, "write_atomic", full_at_the_second_swap)
    with pytest.raises(CheckpointSaveError) as info:
        fit(tmp_path / "ck", max_steps=6)
    text = str(info.value)
    assert "epoch=0-step=4.ckpt' was committed, but the `last` pointer" in text, text
    assert "could not be swapped to 'epoch=0-step=4.ckpt': No space left on device (ENOSPC)" in text, text
    assert "needs about" not in text and "nothing was written" not in text, text
    assert info.value.errno == errno.ENOSPC
    saves = sorted(p.name for p in (tmp_path / "ck").glob("*.ckpt"))
    assert saves == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]  # the pointer's save is never pruned by the failure
    assert read_pointer(tmp_path / "ck") == ["epoch=0-step=2.ckpt"]
    monkeypatch.setattr(files, "write_atomic", write_atomic)
    resumed = fit(tmp_path / "ck", max_steps=8, ckpt_path="last")
    assert resumed.ckpt_path is not None and resumed.ckpt_path.endswith("epoch=0-step=4.ckpt")
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.ckpt")) == ["epoch=0-step=8.ckpt"]
    assert read_pointer(tmp_path / "ck")[0] == "epoch=0-step=8.ckpt"
