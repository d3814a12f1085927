"""Distributed failures become fast, clear errors: init timeouts, uneven data, non-finite losses, DDP's unused
parameters, and torchrun's root-cause summary. (A stalled rank and the hang watchdog:
tests/integration/test_watchdog_hangs.py and tests/unit/test_watchdog.py.)"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, free_port, python, spawn_ranks, torchrun

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "robustness.py"


@pytest.mark.parametrize(
    "rank", ["0", pytest.param("1", marks=pytest.mark.slow)]
)  # rank 0: nobody joins its store; rank 1: no store to reach (a variant: slow)
def test_unreachable_rendezvous_fails_within_the_init_timeout(rank: str) -> None:
    env = {
        "RANK": rank,
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    result = python(SCRIPT, "--case", "init-timeout", env=env, timeout=60)
    assert result.returncode == 3, result.tail()
    line = next(line for line in result.stdout.splitlines() if line.startswith("init failed after"))
    # It gave up after init_timeout=3 (the message names it), not torch's 30-minute default; the launch
    # timeout (60 s) bounds the run.
    assert f"within {datetime.timedelta(seconds=3)}" in line, line
    assert f"Rank {rank} of 2 could not initialise the gloo process group at 127.0.0.1" in line
    assert "Likely causes" in line


def test_nan_loss_error_stops_all_ranks_at_that_step(tmp_path: Path) -> None:
    result = spawn_ranks(SCRIPT, "--case", "nan-error", "--out", str(tmp_path), nproc=2, timeout=120)
    assert result.returncode != 0
    assert "Non-finite training loss (nan) at step 3" in result.stdout
    for rank in (0, 1):  # the loop stopped inside step 3: its on_train_batch_end never ran
        assert max(torch.load(tmp_path / f"weights{rank}.pt")) == 2


def test_nan_loss_skip_keeps_the_previous_weights_and_continues(tmp_path: Path) -> None:
    result = spawn_ranks(SCRIPT, "--case", "nan-skip", "--out", str(tmp_path), nproc=2, timeout=120).check()
    assert "rank 0 finished at step 6" in result.stdout and "rank 1 finished at step 6" in result.stdout
    assert "Non-finite loss at step 3: the optimizer step is skipped" in result.stdout
    for rank in (0, 1):
        history = torch.load(tmp_path / f"weights{rank}.pt")
        assert all(torch.isfinite(w).all() for w in history.values())
    a, b = (torch.load(tmp_path / f"weights{r}.pt") for r in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unused_parameters_error_names_them() -> None:
    result = spawn_ranks(SCRIPT, "--case", "unused", nproc=2, timeout=120)
    assert result.returncode != 0
    assert "spare.weight" in result.stdout and "find_unused_parameters=True" in result.stdout


@pytest.mark.parametrize("case,steps", [("uneven-sampler", 6), ("uneven-stream", 4)])
def test_ranks_with_different_batch_counts_do_not_hang(case: str, steps: int) -> None:
    result = spawn_ranks(SCRIPT, "--case", case, nproc=2, timeout=120).check()
    assert f"rank 0 done: {steps} steps" in result.stdout and f"rank 1 done: {steps} steps" in result.stdout


def test_uneven_batches_error_policy() -> None:
    result = spawn_ranks(SCRIPT, "--case", "uneven-sampler-error", nproc=2, timeout=120)
    assert result.returncode != 0 and "different numbers of training batches" in result.stdout


def test_torchrun_summary_shows_the_root_cause() -> None:
    result = torchrun(SCRIPT, "--case", "record", nproc=1, timeout=60)
    assert result.returncode != 0
    root = result.stdout[result.stdout.index("Root Cause") :]
    assert "root cause from failing_main" in root
