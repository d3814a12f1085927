"""Async checkpoint saves (ModelCheckpoint(async_save=True), trainer/checkpoint/async_save.py) in launched runs of
tests/harness/scripts/async_fit.py: a run that crashes, is preempted or is SIGKILLed during a background write
resumes to the uninterrupted run's weights bit for bit, on one process and on 2 ranks, and a background write that
fails on one rank is raised on every rank at the same step. The machinery, failed saves and file modes, in one
process: tests/unit/test_async_checkpoint_saves.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from async_saves import SAVE_FILES, hidden, loop_of, weights_of
from launch import REPO_ROOT, python, spawn_ranks, torchrun

from trainer.checkpoint.files import read_pointer
from trainer.checkpoint.reader import committed
from trainer.distributed.preemption import PREEMPTED_EXIT_CODE

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "async_fit.py"


def result(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def assert_same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == 14
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name
    for key, state in a["optimizer"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"][key][name]), (key, name)


# ---------------------------------------------------------------------- exact resume (subprocesses)


@pytest.fixture(scope="module")
def sync_reference(resume_fit_one_process: Path) -> dict:
    return result(resume_fit_one_process)  # resume_fit.py's uninterrupted synchronous run (tests/conftest.py)


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted async fit on 2 ranks."""
    root = tmp_path_factory.mktemp("two_rank_ref")
    spawn_ranks(SCRIPT, str(root / "out"), "--ckpt-dir", str(root / "ck"), nproc=2, timeout=180).check()
    return [result(root / "out", r) for r in (0, 1)]


def test_async_fit_equals_sync_and_resumes_exactly_after_a_crash(tmp_path: Path, sync_reference: dict) -> None:
    python(
        SCRIPT, str(tmp_path / "ref"), "--ckpt-dir", str(tmp_path / "ref_ck"), "--slow-write", "0.05", timeout=120
    ).check()
    assert_same(result(tmp_path / "ref"), sync_reference)  # saving in the background changes nothing
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck"), "--slow-write", "0.2"]
    first = python(SCRIPT, *args, "--crash-at", "9", timeout=120)
    assert first.returncode != 0 and "simulated crash at step 9" in first.stdout
    assert read_pointer(tmp_path / "ck")[0] == "epoch=1-step=9.ckpt"  # the exception waited for the save in flight
    assert sorted(os.listdir(tmp_path / "ck")) == ["epoch=1-step=9.ckpt", "keel.claim", "last"]
    assert loop_of(tmp_path / "ck" / "epoch=1-step=9.ckpt")["global_step"] == 9
    second = python(SCRIPT, *args, "--resumed", timeout=120).check()
    assert "Resumed at global step 9" in second.stdout
    assert_same(result(tmp_path / "out"), sync_reference)


def test_preemption_waits_then_saves_synchronously_and_resumes_exactly(tmp_path: Path, sync_reference: dict) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck"), "--slow-write", "0.3"]
    first = python(SCRIPT, *args, "--sigterm-at", "5", timeout=120)
    assert first.returncode == PREEMPTED_EXIT_CODE, first.tail()
    names = read_pointer(tmp_path / "ck")
    assert names[:2] == ["epoch=0-step=5-preempted.ckpt", "epoch=0-step=5.ckpt"]  # the async one committed first
    assert not hidden(tmp_path / "ck")
    python(SCRIPT, *args, "--resumed", timeout=120).check()
    assert_same(result(tmp_path / "out"), sync_reference)


@pytest.mark.slow  # a variant: the SIGKILL test below resumes 2-rank async saves bit-identically by default
def test_two_rank_async_resume_equals_uninterrupted(
    tmp_path: Path, two_rank_reference: list[dict], resume_fit_two_ranks: Path
) -> None:
    assert_same(two_rank_reference[0], two_rank_reference[1])
    assert_same(result(resume_fit_two_ranks), two_rank_reference[0])  # async DDP == sync DDP (resume_fit.py)
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck"), "--slow-write", "0.2"]
    first = spawn_ranks(SCRIPT, *args, "--crash-at", "4", nproc=2, timeout=180)
    assert first.returncode != 0
    assert read_pointer(tmp_path / "ck")[0] == "epoch=1-step=4.ckpt"
    assert sorted(os.listdir(tmp_path / "ck" / "epoch=1-step=4.ckpt")) == sorted(SAVE_FILES + ["__1_0.distcp"])
    spawn_ranks(SCRIPT, *args, "--resumed", nproc=2, timeout=180).check()
    for rank in (0, 1):
        assert_same(result(tmp_path / "out", rank), two_rank_reference[rank])


def test_sigkill_during_a_background_write_under_torchrun_restarts_and_ends_bit_identical(
    tmp_path: Path, two_rank_reference: list[dict]
) -> None:
    out, ck = tmp_path / "out", tmp_path / "ck"
    run = torchrun(
        SCRIPT, str(out), "--ckpt-dir", str(ck), "--block-write-at", "5", nproc=2, max_restarts=1, timeout=240
    ).check()
    assert (out / "blocked").exists()  # rank 0 was SIGKILLed while writing step 5's data file
    found = json.loads((out / "restart1.json").read_text())  # what the restarted attempt found
    assert found["pointer"][0] == "epoch=1-step=4.ckpt"
    assert "epoch=1-step=4.ckpt" in found["entries"] and "epoch=1-step=5.ckpt" not in found["entries"]
    (tmp_name, tmp_files), *others = found["temporary"].items()
    assert not others and tmp_name.startswith(".epoch=1-step=5.ckpt.tmp-") and "__0_0.distcp" in tmp_files
    assert "keel.json" not in tmp_files and "keel.pt" not in tmp_files
    assert "Resumed at global step 4" in run.stdout
    for rank in (0, 1):
        assert_same(result(out, rank), two_rank_reference[rank])
    assert not hidden(ck) and len(committed(ck)) == 1  # the next save removed the leftover


def test_a_background_write_failing_on_one_rank_is_raised_on_every_rank_at_the_same_step(tmp_path: Path) -> None:
    out, ck = tmp_path / "out", tmp_path / "ck"
    run = spawn_ranks(SCRIPT, str(out), "--ckpt-dir", str(ck), "--fail-write-at", "5", "--fail-rank", "1", timeout=180)
    assert run.returncode != 0
    errors = [json.loads((out / f"error{rank}.json").read_text()) for rank in (0, 1)]
    assert errors[0]["step"] == errors[1]["step"] == 6, errors  # the next step boundary, on both ranks
    for error in errors:
        assert f"{str(ck / 'epoch=1-step=5.ckpt')!r}" in error["message"], error  # names the folder
        assert "previous checkpoint" in error["message"] and "intact" in error["message"]
    assert read_pointer(ck)[0] == "epoch=1-step=4.ckpt"
    assert sorted(os.listdir(ck)) == [
        "epoch=1-step=4.ckpt",
        "keel.claim",
        "last",
    ]  # nothing pruned, no temporary folder
    assert loop_of(ck / "epoch=1-step=4.ckpt")["global_step"] == 4 and weights_of(ck / "epoch=1-step=4.ckpt")
