"""A run's claim on its checkpoint folder is made exclusively: of two runs that read the folder unclaimed (or
holding the same stale claim) in the same instant, one gets it and the other is refused at fit start. (The store
side, If-None-Match / If-Match on the S3 server, is in tests/integration/test_s3.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from models import Regression, loader, quiet, regression_data

from callbacks import ModelCheckpoint
from trainer import Trainer
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
