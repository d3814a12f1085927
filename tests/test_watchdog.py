"""Hang watchdog (trainer/distributed/watchdog.py): stacks dumped, phase named, process ended."""

from __future__ import annotations

import logging
import threading
import time
import timeit
from pathlib import Path

import pytest
from launch import python, torchrun

from trainer.distributed.watchdog import (
    PHASE_TRAINING_STEP,
    Watchdog,
    describe_phase,
    nccl_flight_recorder_env_defaults,
)

SCRIPTS = Path(__file__).resolve().parent / "scripts"


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
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = record.getMessage()
    assert "Rank 3" in message and "inside training_step" in message
    assert "step 7" in message and watchdog.dump_path in message
    assert "sleeping_in_training_step" in message  # the main thread's innermost frame


def test_beats_keep_it_quiet_and_stop_ends_it(tmp_path):
    fired = threading.Event()
    watchdog = Watchdog(0.3, run_dir=tmp_path, rank=0, on_fire=fired.set, poll=0.02)
    watchdog.start()
    deadline = time.monotonic() + 0.9  # three timeouts' worth of steps, a beat every 50 ms
    step = 0
    while time.monotonic() < deadline:
        watchdog.beat(PHASE_TRAINING_STEP, step)
        step += 1
        time.sleep(0.05)
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


def test_beat_is_cheap():
    watchdog = Watchdog(60, run_dir="unused", rank=0)
    n = 200_000
    seconds = timeit.timeit(lambda: watchdog.beat("backward", 12), number=n) / n
    assert seconds < 5e-6, f"beat() takes {seconds * 1e6:.2f} us"


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
    assert result.returncode == 1, result.tail()
    assert result.elapsed < 25, result.tail()
    assert "Timeout" in result.stdout and "hold_the_gil" in result.stdout
    assert "on_fire ran" not in result.stdout and not list(tmp_path.iterdir())


@pytest.mark.multiprocess
def test_stalled_rank_dumps_stacks_and_ends_the_job(tmp_path):
    result = torchrun(SCRIPTS / "watchdog_sleep.py", str(tmp_path), "2", nproc=2, timeout=90)
    assert result.returncode != 0, result.tail()
    assert result.elapsed < 45, f"took {result.elapsed:.0f} s; rank 1 sleeps 60 s\n{result.tail()}"
    assert "finished without the watchdog firing" not in result.stdout
    files = sorted(tmp_path.glob("hang-rank1-*.txt"))
    assert len(files) == 1, f"{sorted(p.name for p in tmp_path.iterdir())}\n{result.tail()}"
    text = files[0].read_text()
    assert "sleep_inside_training_step" in text
    assert "last phase: training_step" in text and "last step: 3" in text
    assert "Rank 1 made no progress" in result.stdout and "inside training_step at step 3" in result.stdout
    assert "fr-trace-rank1-" in result.stdout  # the gloo group's Flight Recorder was dumped too
    assert list(tmp_path.glob("fr-trace-rank1-*.pkl"))
