"""Checkpoints in launched runs: exact resume (1 and 2 ranks, and a 2-rank save resumed on one rank at the global
cursor), crashes, SIGKILL under torchrun restarts, torn writes, SIGTERM and Ctrl-C preemption. Corrupt and
malicious files, top-k and `last` bookkeeping, in one process: tests/unit/test_checkpoint_files.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, python, spawn_ranks, torchrun

from trainer.checkpoint.files import read_pointer
from trainer.checkpoint.reader import load_weights
from trainer.distributed.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "resume_fit.py"


def weights(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def assert_same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == 14
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name


@pytest.fixture(scope="module")
def single_reference(resume_fit_one_process: Path) -> dict:
    return weights(resume_fit_one_process)


@pytest.fixture(scope="module")
def ddp_reference(resume_fit_two_ranks: Path) -> list[dict]:
    ranks = [weights(resume_fit_two_ranks, r) for r in (0, 1)]
    assert_same(ranks[0], ranks[1])
    return ranks


@pytest.mark.parametrize(
    "crash_at", [4, pytest.param(9, marks=pytest.mark.slow)]
)  # 6 steps per epoch: mid-epoch in epochs 0 and 1 (a variant: slow)
def test_resume_after_crash_equals_uninterrupted(tmp_path: Path, single_reference: dict, crash_at: int) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = python(SCRIPT, *args, "--crash-at", str(crash_at), timeout=120)
    assert first.returncode != 0 and f"simulated crash at step {crash_at}" in first.stdout
    python(SCRIPT, *args, "--resumed", timeout=120).check()
    assert_same(weights(tmp_path / "out"), single_reference)


def test_two_rank_resume_equals_uninterrupted(tmp_path: Path, ddp_reference: list[dict]) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = spawn_ranks(SCRIPT, *args, "--crash-at", "4", nproc=2, timeout=180)
    assert first.returncode != 0
    spawn_ranks(SCRIPT, *args, "--resumed", nproc=2, timeout=180).check()
    for rank in (0, 1):
        assert_same(weights(tmp_path / "out", rank), ddp_reference[rank])


@pytest.mark.parametrize("kill_at,kill_rank", [pytest.param(3, 1, marks=pytest.mark.slow), (8, 0)])  # a variant: slow
def test_sigkill_under_torchrun_restarts_and_matches(
    tmp_path: Path, ddp_reference: list[dict], kill_at: int, kill_rank: int
) -> None:
    result = torchrun(
        SCRIPT,
        str(tmp_path / "out"),
        "--ckpt-dir",
        str(tmp_path / "ck"),
        "--kill-at",
        str(kill_at),
        "--kill-rank",
        str(kill_rank),
        nproc=2,
        max_restarts=2,
        timeout=240,
    ).check()
    assert "Resumed at global step" in result.stdout  # the restart really resumed
    for rank in (0, 1):
        assert_same(weights(tmp_path / "out", rank), ddp_reference[rank])


def test_writer_killed_mid_save_keeps_last_loadable(tmp_path: Path, single_reference: dict) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = python(SCRIPT, *args, "--kill-in-save-at", "5", timeout=120)
    assert first.returncode == -9
    names = read_pointer(tmp_path / "ck")
    assert names and "step=4" in names[0]
    load_weights(tmp_path / "ck" / names[0])  # `last` still loads, and verifies
    python(SCRIPT, *args, "--resumed", timeout=120).check()
    assert_same(weights(tmp_path / "out"), single_reference)


def test_sigterm_saves_at_the_current_step_and_resumes_exactly(tmp_path: Path, single_reference: dict) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = python(SCRIPT, *args, "--sigterm-at", "5", timeout=120)
    assert first.returncode == PREEMPTED_EXIT_CODE, first.tail()
    assert "Preempted (SIGTERM) at step 5" in first.stdout
    assert "preempted" in read_pointer(tmp_path / "ck")[0] and "step=5" in read_pointer(tmp_path / "ck")[0]
    python(SCRIPT, *args, "--resumed", timeout=120).check()
    assert_same(weights(tmp_path / "out"), single_reference)


def test_sigterm_on_one_rank_stops_both(tmp_path: Path, ddp_reference: list[dict]) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = spawn_ranks(SCRIPT, *args, "--sigterm-at", "3", "--kill-rank", "1", nproc=2, timeout=180)
    assert first.returncode != 0
    # Checked every 2 steps (preemption_check_interval=2): both ranks agree at step 4 and save there.
    assert "step=4-preempted" in read_pointer(tmp_path / "ck")[0]
    spawn_ranks(SCRIPT, *args, "--resumed", nproc=2, timeout=180).check()
    for rank in (0, 1):
        assert_same(weights(tmp_path / "out", rank), ddp_reference[rank])


def test_ctrl_c_on_two_ranks_saves_stops_quietly_and_resumes_exactly(tmp_path: Path, ddp_reference: list[dict]) -> None:
    """Ctrl-C reaches every rank (twice, as torchrun's agent forwards the terminal's SIGINT): the ranks agree at
    the next check (every 2 steps), save, rank 0 logs one line, and every rank exits 130 without a traceback."""
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = spawn_ranks(SCRIPT, *args, "--sigint-at", "3", nproc=2, timeout=180)
    assert first.returncode == INTERRUPTED_EXIT_CODE, first.tail()
    assert "step=4-interrupted" in read_pointer(tmp_path / "ck")[0]
    assert first.stdout.count("Stopped by Ctrl-C at step 4") == 1 and "Traceback" not in first.stdout
    assert first.stdout.count("SIGINT received at step 3") == 2  # each rank says once that it heard it
    spawn_ranks(SCRIPT, *args, "--resumed", nproc=2, timeout=180).check()
    for rank in (0, 1):
        assert_same(weights(tmp_path / "out", rank), ddp_reference[rank])


def test_a_signal_on_one_rank_is_acted_on_at_the_next_step_by_default(
    tmp_path: Path, ddp_reference: list[dict]
) -> None:
    """preemption_check_interval=None (the default) under DDP: the flags ride on every step's gradient all-reduce, so
    a SIGTERM to rank 1 in on_train_batch_end of step 4 (after that step's all-reduce) stops both ranks at step 5,
    the next step, where the interval of 2 (or the logging steps, every 3) would wait until step 6. Resumes exactly.
    A signal in step 3's hooks likewise stops at step 4 (with Ctrl-C on every rank, below), and under FSDP too."""
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck"), "--default-check"]
    first = spawn_ranks(SCRIPT, *args, "--sigterm-at", "4", "--kill-rank", "1", nproc=2, timeout=180)
    assert first.returncode != 0
    assert "step=5-preempted" in read_pointer(tmp_path / "ck")[0], first.tail()
    assert "SIGTERM received at step 4: the run saves and stops at the next step boundary" in first.stdout
    spawn_ranks(SCRIPT, *args, "--resumed", nproc=2, timeout=180).check()
    for rank in (0, 1):
        assert_same(weights(tmp_path / "out", rank), ddp_reference[rank])
    fsdp = tmp_path / "fsdp"  # FSDP: the flags go in one small asynchronous all-reduce a step, read a step later
    args = [str(fsdp / "out"), "--ckpt-dir", str(fsdp / "ck"), "--default-check", "--strategy", "fsdp"]
    third = spawn_ranks(SCRIPT, *args, "--sigterm-at", "4", "--kill-rank", "1", nproc=2, timeout=180)
    assert third.returncode != 0
    assert "step=5-preempted" in read_pointer(fsdp / "ck")[0], third.tail()
    interrupted = tmp_path / "ctrl-c"
    args = [str(interrupted / "out"), "--ckpt-dir", str(interrupted / "ck"), "--default-check"]
    second = spawn_ranks(SCRIPT, *args, "--sigint-at", "3", nproc=2, timeout=180)
    assert second.returncode == INTERRUPTED_EXIT_CODE, second.tail()
    assert "step=4-interrupted" in read_pointer(interrupted / "ck")[0]


def test_checkpoint_from_two_ranks_resumes_on_one_at_the_global_cursor(tmp_path: Path) -> None:
    """2 ranks x batch 4 crash at step 4 (epoch 1, 16 of 48 samples consumed); 1 rank x batch 8 resumes at
    sample 16 of epoch 1's permutation: nothing re-read, nothing skipped."""
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = spawn_ranks(
        SCRIPT, *args, "--crash-at", "4", "--save-on-crash-dir", str(tmp_path / "crash"), nproc=2, timeout=180
    )
    assert first.returncode != 0
    before = [torch.load(tmp_path / "crash" / f"seen{r}.pt", weights_only=False) for r in (0, 1)]
    result = python(SCRIPT, *args, "--resumed", "--batch", "8", timeout=120).check()
    assert "resuming on 1" in result.stdout
    after = weights(tmp_path / "out")["seen"]
    consumed_before = before[0][1] + before[1][1]
    assert len(consumed_before) == 16
    assert sorted(consumed_before + after[1]) == list(range(48))
