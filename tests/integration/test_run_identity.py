"""A run is one thing: re-running the same command continues it, and one run writes a checkpoint folder.

The script (tests/harness/scripts/rerun_fit.py) always passes ``ckpt_path="last"``; only the environment of a
first launch makes it crash. Each rerun must land in the same run directory and end where the uninterrupted run
ends, bit for bit; a second live run on the folder is refused before it trains.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from launch import REPO_ROOT, python, torchrun

from trainer.checkpoint.claim import CLAIM_FILE

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "rerun_fit.py"


def weights(out: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(f"{out}.rank{rank}.pt", weights_only=True)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_rerunning_the_same_command_continues_the_run(tmp_path: Path) -> None:
    python(SCRIPT, str(tmp_path / "ref"), str(tmp_path / "ref"), timeout=120).check()
    args = (str(tmp_path / "run"), str(tmp_path / "out"))
    crashed = python(SCRIPT, *args, env={"RERUN_CRASH_AT": "12"}, timeout=120)  # epoch 0 (8 steps) was saved
    assert crashed.returncode != 0 and "crash at step 12" in crashed.stdout
    again = python(SCRIPT, *args, timeout=120).check()  # the same command: nothing says "resume"
    assert "Continuing the run in" in again.stdout and "Resumed at global step 8" in again.stdout
    assert sorted(os.listdir(tmp_path / "run" / "keel_logs")) == ["version_0"]  # no version_1
    assert_same(weights(tmp_path / "out"), weights(tmp_path / "ref"))
    fresh = python(SCRIPT, *args, "--fresh", timeout=120).check()  # ckpt_path=None: a new run, its own folder
    assert "run directory: " in fresh.stdout and fresh.stdout.split("run directory: ")[1].strip().endswith("version_1")


def test_a_relaunched_torchrun_continues_the_run_on_two_ranks(tmp_path: Path) -> None:
    """Each launch gets its own rendezvous id (a torchrun started again by hand): still the same run."""
    torchrun(SCRIPT, str(tmp_path / "ref"), str(tmp_path / "ref"), nproc=2, timeout=180).check()
    args = (str(tmp_path / "run"), str(tmp_path / "out"))
    crashed = torchrun(SCRIPT, *args, nproc=2, env={"RERUN_CRASH_AT": "6", "RERUN_CRASH_RANK": "-1"}, timeout=180)
    assert crashed.returncode != 0  # epoch 0 (4 steps on 2 ranks) was saved
    again = torchrun(SCRIPT, *args, nproc=2, timeout=180).check()
    assert "Resumed at global step 4" in again.stdout
    assert sorted(os.listdir(tmp_path / "run" / "keel_logs")) == ["version_0"]
    for rank in (0, 1):
        assert_same(weights(tmp_path / "out", rank), weights(tmp_path / "ref", rank))


def test_a_second_live_run_on_the_folder_is_refused_before_it_trains(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    first = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path / "a"), str(tmp_path / "a"), "--dirpath", str(folder)],
        env={**env, "RERUN_HOLD": "0.4"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not (folder / CLAIM_FILE).exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (folder / CLAIM_FILE).exists(), "the first run never claimed its folder"
        second = python(SCRIPT, str(tmp_path / "b"), str(tmp_path / "b"), "--dirpath", str(folder), timeout=120)
        assert second.returncode != 0
        assert "is being written by run" in second.stdout and f"(pid {first.pid} on" in second.stdout, second.tail()
        assert "Resumed" not in second.stdout and not Path(f"{tmp_path / 'b'}.rank0.pt").exists()
        output, _ = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0, output[-3000:]
    assert Path(f"{tmp_path / 'a'}.rank0.pt").exists()  # the first run finished, its saves untouched
