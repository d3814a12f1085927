"""One writer per checkpoint folder, against the claims of other processes: a dead run's claim (a process that has
exited) is taken over, and a live claim on this host (a process still running) is refused by name. The rules in one
process: tests/unit/test_run_claims_one_process.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from claim_runs import fit, listing

from trainer.checkpoint import claim
from trainer.checkpoint.files import CheckpointError
from trainer.distributed.launcher import _start_time


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
