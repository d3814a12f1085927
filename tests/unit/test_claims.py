"""A run's claim on its checkpoint folder is made exclusively: of two runs that read the folder unclaimed (or
holding the same stale claim) in the same instant, one gets it and the other is refused at fit start. (The store
side, If-None-Match / If-Match on the S3 server, is in tests/integration/test_s3.py.)"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
from pathlib import Path

import pytest
from models import Regression, loader, quiet, regression_data

from callbacks import ModelCheckpoint
from trainer import Callback, Trainer
from trainer.checkpoint import claim
from trainer.checkpoint.files import CheckpointError


def test_a_claim_made_on_an_unclaimed_folder_loses_to_one_made_in_between(tmp_path: Path) -> None:
    held, seen = claim.read_for_replacing(tmp_path)
    assert held is None and not seen.present
    claim.write(tmp_path, "other-run")  # another run, between this one's read and its write
    with pytest.raises(claim.Taken):
        claim.write(tmp_path, "this-run", seen)
    assert claim.read(tmp_path)["run"] == "other-run"  # theirs stands
    held, seen = claim.read_for_replacing(tmp_path)
    claim.write(tmp_path, "this-run", seen)  # a claim that was read is replaced (locally: a dead holder's)
    assert claim.read(tmp_path)["run"] == "this-run"


def test_fit_start_is_refused_when_another_run_claims_the_folder_in_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = claim.read_for_replacing

    def read_then_lose_the_race(folder):  # type: ignore[no-untyped-def]
        found = read(folder)
        claim.write(folder, "run-that-started-at-the-same-instant")
        return found

    monkeypatch.setattr(claim, "read_for_replacing", read_then_lose_the_race)
    trainer = Trainer(**quiet(max_steps=2, callbacks=[ModelCheckpoint(dirpath=tmp_path)], enable_checkpointing=True))
    with pytest.raises(CheckpointError, match="was claimed by run 'run-that-started-at-the-same-instant'"):
        trainer.fit(Regression(), loader(regression_data(), 16))
    assert trainer.global_step == 0 and not list(tmp_path.glob("*.ckpt"))  # refused before any training


def test_the_claim_exchange_excludes_every_other_process_and_leaves_no_lock_file(tmp_path: Path) -> None:
    """Four holders each read a number, wait, and write it plus one: under :func:`claim.exclusive` (one open of
    the lock file each, as separate processes have) none is lost, though each holder removes the lock file as it
    lets go."""
    count = tmp_path / "count"
    count.write_text("0")

    def add_one() -> None:
        with claim.exclusive(tmp_path):
            seen = int(count.read_text())
            time.sleep(0.05)
            count.write_text(str(seen + 1))

    threads = [threading.Thread(target=add_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert count.read_text() == "4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["count"]


def test_fit_start_names_a_claim_lock_held_too_long(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claim, "LOCK_WAIT_S", 0.2)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with claim.exclusive(tmp_path):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        held.wait(30)
        trainer = Trainer(
            **quiet(max_steps=2, callbacks=[ModelCheckpoint(dirpath=tmp_path)], enable_checkpointing=True)
        )
        with pytest.raises(CheckpointError, match=r"another process held its claim lock .* for 0.2 s"):
            trainer.fit(Regression(), loader(regression_data(), 16))
    finally:
        release.set()
        holder.join(30)
    assert trainer.global_step == 0 and not (tmp_path / claim.CLAIM_FILE).exists()


def test_a_filesystem_without_locks_still_claims_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    trainer = Trainer(**quiet(max_steps=2, callbacks=[ModelCheckpoint(dirpath=tmp_path)], enable_checkpointing=True))
    trainer.fit(Regression(), loader(regression_data(), 16))
    assert claim.mine(claim.read(tmp_path), trainer.checkpointer.run_id)
    assert "cannot lock files (No locks available)" in caplog.text


def fit_on(folder: Path, ckpt_path: str | None = None, max_steps: int = 2) -> Trainer:
    trainer = Trainer(
        **quiet(max_steps=max_steps, callbacks=[ModelCheckpoint(dirpath=folder)], enable_checkpointing=True)
    )
    trainer.fit(Regression(), loader(regression_data(), 16), ckpt_path=ckpt_path)
    return trainer


def test_a_run_releases_its_claim_when_fit_ends_and_a_rerun_from_any_host_continues_it(tmp_path: Path) -> None:
    first = fit_on(tmp_path)
    held = claim.read(tmp_path)
    assert claim.mine(held, first.checkpointer.run_id) and claim.released(held)
    first.save_checkpoint(tmp_path / "after-fit.ckpt")  # after fit: still this process's to write
    assert (tmp_path / "after-fit.ckpt").is_dir() and claim.read(tmp_path) == held
    (tmp_path / claim.CLAIM_FILE).write_text(json.dumps({**held, "host": "elsewhere", "pid": 1}))  # ended there
    again = fit_on(tmp_path, ckpt_path="last", max_steps=4)
    assert again.checkpointer.run_id == first.checkpointer.run_id and again.global_step == 4


def test_a_run_that_raised_releases_its_claim(tmp_path: Path) -> None:
    class Boom(Regression):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            raise RuntimeError("boom")

    trainer = Trainer(**quiet(max_steps=2, callbacks=[ModelCheckpoint(dirpath=tmp_path)], enable_checkpointing=True))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Boom(), loader(regression_data(), 16))
    assert claim.released(claim.read(tmp_path))


class SameRunElsewhere(Callback):
    """At step 3, another process of this very run (same run id, another host) takes the folder."""

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.optimizer_stepped and trainer.global_step == 3:
            record = {"run": trainer.checkpointer.run_id, "host": "elsewhere", "pid": 1}
            (Path(trainer.checkpoint_callback.dirpath) / claim.CLAIM_FILE).write_text(json.dumps(record))


def test_a_save_refused_for_another_process_of_the_same_run_names_the_run_once(tmp_path: Path) -> None:
    trainer = Trainer(
        **quiet(max_steps=4, enable_checkpointing=True),
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2), SameRunElsewhere()],
    )
    with pytest.raises(RuntimeError, match="was not committed") as refused:  # the save's error names the claim's
        trainer.fit(Regression(), loader(regression_data(32), batch_size=4))
    message, run = str(refused.value), trainer.checkpointer.run_id
    assert f"is now held by run {run!r} (pid 1 on elsewhere), not by this process (pid {os.getpid()} on" in message
    assert message.count(run) == 1


def test_releasing_a_claim_on_a_folder_removed_meanwhile_makes_nothing(tmp_path: Path) -> None:
    assert claim.release(tmp_path / "gone", "keel:run") is False
    assert not (tmp_path / "gone").exists()
