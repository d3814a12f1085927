"""Hang watchdog (trainer/distributed/watchdog.py) in one process: it fires after its timeout, dumping the stacks and
naming the sleeping function and the phase; beats keep it quiet and stop ends it; its arguments and NCCL's flight
recorder defaults. A hang that holds the GIL and a stalled rank ending the job (launched):
tests/integration/test_watchdog_hangs.py. (The first test finds this file's name in the stacks the watchdog dumps.)"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import trainer.distributed.watchdog as watchdog_module
from trainer.distributed.watchdog import (
    PHASE_TRAINING_STEP,
    Watchdog,
    describe_phase,
    nccl_flight_recorder_env_defaults,
)


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
