"""Hang watchdog (trainer/distributed/watchdog.py) in launched processes: the backstop catches a hang that holds the
GIL, and a stalled rank dumps its stacks and ends the job. The watchdog's thread in one process:
tests/unit/test_watchdog.py."""

from __future__ import annotations

from pathlib import Path

from launch import python, torchrun

SCRIPTS = Path(__file__).resolve().parents[1] / "harness" / "scripts"

_HOLD_THE_GIL = """
import ctypes, sys, time
import trainer.distributed.watchdog as w
w.BACKSTOP_GRACE_S = 1.0
watchdog = w.Watchdog(0.5, run_dir=sys.argv[1], rank=0, on_fire=lambda: print("on_fire ran"), poll=0.05)
watchdog.start()
watchdog.beat("training_step", 1)
time.sleep(0.2)  # the watchdog thread arms faulthandler's timer on its first polls

def hold_the_gil():
    ctypes.PyDLL(None).sleep(30)  # a C call that never releases the GIL

hold_the_gil()
"""


def test_backstop_catches_a_hang_that_holds_the_gil(tmp_path):
    # The watchdog thread cannot run; faulthandler's C timer must dump the stacks and exit.
    result = python("-c", _HOLD_THE_GIL, str(tmp_path), timeout=60)
    # Exit code 1 and faulthandler's "Timeout" dump: the backstop ended it (after the 30 s C sleep the
    # process would exit 0, and the harness's timeout bounds the run).
    assert result.returncode == 1, result.tail()
    assert "Timeout" in result.stdout and "hold_the_gil" in result.stdout
    assert "on_fire ran" not in result.stdout and not list(tmp_path.iterdir())


def test_stalled_rank_dumps_stacks_and_ends_the_job(tmp_path):
    """``Trainer(watchdog_timeout=3)`` on 2 ranks; rank 1 sleeps an hour inside training_step at step 3. Only its
    watchdog can end the job within the launch timeout (the harness raises on a timeout): one stacks file of
    rank 1 naming the phase, the step and the sleeping function, the log line, the Flight Recorder dump."""
    result = torchrun(SCRIPTS / "watchdog_sleep.py", str(tmp_path), "3", nproc=2, timeout=120)
    assert result.returncode != 0, result.tail()
    assert "finished without the watchdog firing" not in result.stdout
    files = sorted(tmp_path.rglob("hang-rank1-*.txt"))
    assert len(files) == 1, f"{sorted(p.name for p in tmp_path.rglob('*'))}\n{result.tail()}"
    text = files[0].read_text()
    assert "sleep_inside_training_step" in text and "training_step" in text
    assert "last phase: training_step" in text and "last step: 3" in text
    assert "Rank 1 made no progress" in result.stdout and "inside training_step at step 3" in result.stdout
    assert "fr-trace-rank1-" in result.stdout  # the gloo group's Flight Recorder was dumped too
    assert list(tmp_path.rglob("fr-trace-rank1-*.pkl"))
