"""Hang watchdog (trainer/distributed/watchdog.py): stacks dumped, phase named, process ended."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from launch import python, torchrun

import trainer.distributed.watchdog as watchdog_module
from trainer.distributed.watchdog import (
    PHASE_TRAINING_STEP,
    Watchdog,
    describe_phase,
    nccl_flight_recorder_env_defaults,
)

SCRIPTS = Path(__file__).resolve().parents[1] / "harness" / "scripts"


def test_fires_after_timeout_and_names_the_sleeping_function(tmp_path, caplog):
    fired = threading.Event()
    watchdog = Watchdog(0.5, run_dir=tmp_path / "run", rank=3, on_fire=fired.set)
    watchdog.start()
    watchdog.beat(PHASE_TRAINING_STEP, 7)

    def sleeping_in_training_step() -> None:
        # "Hangs" until the watchdog fires: no fixed sleep, the wait ends as soon as it does.
        assert fired.wait(timeout=10), "the watchdog did not fire within 10 s"

    with caplog.at_level(logging.ERROR, logger="trainer.distributed.watchdog"):
        sleeping_in_training_step()
        watchdog.stop()

    assert watchdog.fired
    files = list((tmp_path / "run").glob("hang-rank3-*.txt"))
    assert [str(f) for f in files] == [watchdog.dump_path]
    text = files[0].read_text()
    assert "rank: 3" in text
    assert "last phase: training_step (inside training_step)" in text
    assert "last step: 7" in text
    assert "seconds since last beat: " in text
    assert "sleeping_in_training_step" in text  # faulthandler's stack of the main thread
    assert 'File "' in text and "test_watchdog.py" in text
    # One report; a second line naming the Flight Recorder dump only when the process has a group (not here).
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR and "Flight Recorder" not in r.getMessage()]
    message = record.getMessage()
    assert "Rank 3" in message and "inside training_step" in message
    assert "step 7" in message and watchdog.dump_path in message
    assert "sleeping_in_training_step" in message  # the main thread's innermost frame


class ManualClock:
    """The watchdog's clock in a test: it moves only when the test advances it, and counts its reads (the
    watchdog thread reads it once per poll)."""

    def __init__(self) -> None:
        self.now, self.reads, self._cond = 0.0, 0, threading.Condition()

    def monotonic(self) -> float:
        with self._cond:
            self.reads += 1
            self._cond.notify_all()
            return self.now

    def advance(self, seconds: float) -> int:
        """Move the clock on; returns the number of reads so far."""
        with self._cond:
            self.now += seconds
            return self.reads

    def wait_for_reads(self, count: int, after: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.reads >= after + count, timeout=30)


def test_beats_keep_it_quiet_and_stop_ends_it(tmp_path, monkeypatch):
    """18 beats 50 ms apart on the watchdog's clock (three timeouts' worth), each seen by its polls: it never
    fires. The test owns the clock, so a loaded machine cannot stretch a gap between two beats."""
    clock = ManualClock()
    monkeypatch.setattr(watchdog_module, "time", SimpleNamespace(monotonic=clock.monotonic, strftime=time.strftime))
    fired = threading.Event()
    watchdog = Watchdog(0.3, run_dir=tmp_path, rank=0, on_fire=fired.set, poll=0.01)
    watchdog.start()
    for step in range(18):
        watchdog.beat(PHASE_TRAINING_STEP, step)
        reads = clock.advance(0.05)
        # Two polls after the beat: the second read the beat's state (a poll reads the state, then the clock).
        assert clock.wait_for_reads(2, after=reads), "the watchdog thread stopped polling"
    watchdog.stop()
    assert not fired.is_set() and not watchdog.fired
    assert not list(tmp_path.iterdir())
    assert not watchdog._thread.is_alive()


def test_fires_once_when_never_beaten(tmp_path):
    calls = []
    done = threading.Event()
    watchdog = Watchdog(0.2, run_dir=tmp_path, rank=1, on_fire=lambda: (calls.append(1), done.set()), poll=0.01)
    watchdog.start()
    assert done.wait(timeout=10)
    watchdog.stop()
    assert calls == [1]
    text = Path(watchdog.dump_path).read_text()
    assert "last phase: start" in text and "last step: -1" in text


def test_arguments_and_phase_words():
    with pytest.raises(ValueError, match="timeout"):
        Watchdog(0, run_dir=".", rank=0)
    with pytest.raises(ValueError, match="poll"):
        Watchdog(1, run_dir=".", rank=0, poll=0)
    assert describe_phase("training_step") == "inside training_step"
    assert describe_phase("metrics_reduction") == "in a collective: metrics reduction"
    assert "gradient all-reduce" in describe_phase("backward")
    assert describe_phase("custom") == "in phase 'custom'"


def test_nccl_flight_recorder_env_defaults(tmp_path):
    import torch

    defaults = nccl_flight_recorder_env_defaults(tmp_path, environ={})
    fr_names = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 11)
    buffer_key = "TORCH_FR_BUFFER_SIZE" if fr_names else "TORCH_NCCL_TRACE_BUFFER_SIZE"
    file_key = "TORCH_FR_DUMP_TEMP_FILE" if fr_names else "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
    assert defaults == {
        buffer_key: "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        file_key: str(tmp_path / "nccl_trace_rank_"),
    }
    # Whatever the user (or torchrun) set, under either spelling, is left alone.
    user = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "50",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/trace_",
    }
    kept = nccl_flight_recorder_env_defaults(tmp_path, environ=user)
    assert set(kept) == {"TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING"}
    assert file_key not in nccl_flight_recorder_env_defaults(None, environ={})


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
