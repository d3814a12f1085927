"""One writer per checkpoint folder, against the claims of other processes: a dead run's claim (a process that has
exited) is taken over, a live claim on this host (a process still running) is refused by name, of runs restarted
together exactly one trains, and a claim held on another host is never taken over until its run releases it. The
rules in one process: tests/unit/test_run_claims_one_process.py and tests/unit/test_claims.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from claim_runs import fit, listing
from launch import REPO_ROOT, run_together

from trainer.checkpoint import claim
from trainer.checkpoint.files import CheckpointError
from trainer.distributed.launcher import _start_time

RACE = REPO_ROOT / "tests" / "harness" / "scripts" / "claim_race.py"
NO_PID = 4_194_305  # above Linux's largest pid_max: no process has it
RERUN = REPO_ROOT / "tests" / "harness" / "scripts" / "rerun_fit.py"


def test_a_dead_runs_claim_is_taken_over(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "ck"
    folder.mkdir()
    dead = {"run": "keel:someone", **claim.holder(), "pid": int(done.stdout)}  # that process has exited
    (folder / claim.CLAIM_FILE).write_text(json.dumps(dead))
    trainer = fit(folder)
    assert claim.mine(claim.read(folder), trainer.checkpointer.run_id)


def test_a_live_claim_on_this_host_is_refused_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    folder.mkdir()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as other:
        try:
            live = {"run": "keel:other", **claim.holder(), "pid": other.pid, "started": _start_time(other.pid)}
            (folder / claim.CLAIM_FILE).write_text(json.dumps(live))
            with pytest.raises(CheckpointError, match=rf"is being written by run 'keel:other' \(pid {other.pid} on"):
                fit(folder)
        finally:
            other.kill()
    assert listing(folder) == [claim.CLAIM_FILE]  # nothing trained, nothing written


def test_runs_restarted_together_on_a_killed_runs_folder_one_trains_and_the_rest_are_refused(
    tmp_path: Path,
) -> None:
    """Three runs (ckpt_path="last") restarted at once on a folder whose run was killed: each is held between
    reading the stale claim and writing its own until all three have read it, or 3 s. Exactly one takes the folder
    and trains; the others are refused at fit start, naming the winner once."""
    folder, barrier = tmp_path / "ck", tmp_path / "barrier"
    barrier.mkdir()
    fit(folder, max_steps=4)  # saves at steps 2 and 4; then its process "is killed": an unreleased, dead claim
    killed = {**json.loads((folder / claim.CLAIM_FILE).read_text()), "pid": NO_PID}
    killed.pop("released", None)
    (folder / claim.CLAIM_FILE).write_text(json.dumps(killed))
    runs = run_together(*[(RACE, str(folder), str(barrier), "3")] * 3, timeout=180)
    pids = [int(r.stdout.split("pid ", 1)[1].split()[0]) for r in runs]
    winners = [i for i, r in enumerate(runs) if r.returncode == 0]
    assert len(winners) == 1, "\n=====\n".join(r.stdout for r in runs)
    assert "trained 8" in runs[winners[0]].stdout
    for loser in (r for r in runs if r.returncode != 0):
        assert f"is being written by run {killed['run']!r} (pid {pids[winners[0]]} on" in loser.stdout, loser.tail()
        assert "trained" not in loser.stdout and loser.stdout.count(killed["run"]) == 1, loser.tail()
    assert not list(folder.glob(".*"))  # no lock or temporary file left
    assert claim.released(claim.read(folder)) and claim.read(folder)["pid"] == pids[winners[0]]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_a_live_claim_from_another_host_is_never_taken_over_whatever_ckpt_path_says(tmp_path: Path) -> None:
    """A run on another host (its own UTS namespace, hostname keel-other-host) holds the folder: a run here is
    refused with ckpt_path "last" and None alike, naming the host, the pid and the file to delete. Once that run
    ends it releases its claim, and a rerun here continues it."""
    folder, go = tmp_path / "ck", tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    other = subprocess.Popen(
        ["unshare", "--uts", "sh", "-c", 'hostname keel-other-host && exec "$0" "$@"', sys.executable, str(RERUN)]
        + [str(tmp_path / "root"), str(tmp_path / "out"), "--dirpath", str(folder)],
        env={**env, "RERUN_WAIT_FOR": str(go)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not (folder / claim.CLAIM_FILE).exists() and other.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        held = claim.read(folder)
        assert held is not None and held["host"] == "keel-other-host", held
        for ckpt_path in ("last", None):
            with pytest.raises(CheckpointError) as refused:
                fit(folder, ckpt_path=ckpt_path)
            message = str(refused.value)
            assert f"(pid {other.pid} on keel-other-host)" in message and "another host" in message, message
            assert f"delete {folder / claim.CLAIM_FILE}" in message and message.count(held["run"]) == 1, message
        assert claim.read(folder) == held  # untouched
        go.touch()
        output, _ = other.communicate(timeout=120)
    finally:
        other.kill()
    assert other.returncode == 0, output[-3000:]
    assert claim.released(claim.read(folder))  # it let go when its fit ended: any host may continue it
    trainer = fit(folder, max_steps=30, ckpt_path="last")
    assert trainer.checkpointer.run_id == held["run"] and trainer.global_step == 30
    assert "step=24" in str(trainer.ckpt_path)  # resumed where that run ended (3 epochs of 8 steps)
