"""Hang watchdog: a rank that stops making progress dumps its stacks and exits.

docs/design.md section 10: no failure becomes a silent hang. Collectives time out on their
own (the process-group timeout), but a rank stuck in Python -- a deadlocked data
loader, a ``training_step`` waiting on a lock, a rank that skipped a collective the
others are blocked in -- needs a clock of its own. The Trainer calls
:meth:`Watchdog.beat` at every phase change; a daemon thread checks that beats keep
coming. After ``timeout`` seconds without one it

1. writes the Python stacks of all threads to ``<run_dir>/hang-rank<R>-<time>.txt``
   (a header with rank, last phase, last step and seconds since the last beat, then
   :func:`faulthandler.dump_traceback`),
2. writes the c10d Flight Recorder buffer next to it when a process group exists
   (``fr-trace-rank<R>-<time>.pkl``; read with ``torchfrtrace``),
3. logs an ERROR naming the rank, the phase ("inside training_step"), the step and
   the file,
4. calls ``on_fire``; the default flushes the logs and hard-exits with status 134
   (like ``abort()``), so torchrun / SLURM see a failed worker and restart the job.

Typical use (the Trainer does this)::

    for key, value in nccl_flight_recorder_env_defaults(run_dir).items():
        os.environ.setdefault(key, value)  # before the nccl group is created
    watchdog = Watchdog(600, run_dir=run_dir, rank=rank)
    watchdog.start()
    ...
    watchdog.beat(PHASE_TRAINING_STEP, step)
    ...
    watchdog.stop()

Every rank runs its own watchdog; when one rank stalls, the others soon stall in the
next collective and fire too, so each rank's file tells where it was.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TextIO, cast

logger = logging.getLogger(__name__)

# Phase names the Trainer passes to beat(), with the words used in the ERROR message.
PHASE_START = "start"
PHASE_SETUP = "setup"
PHASE_DATA = "data"
PHASE_TRAINING_STEP = "training_step"
PHASE_BACKWARD = "backward"
PHASE_OPTIMIZER_STEP = "optimizer_step"
PHASE_METRICS_REDUCTION = "metrics_reduction"
PHASE_CALLBACKS = "callbacks"
PHASE_VALIDATION_STEP = "validation_step"
PHASE_TEST_STEP = "test_step"
PHASE_PREDICT_STEP = "predict_step"
PHASE_PREEMPTION_CHECK = "preemption_check"
PHASE_CHECKPOINT = "checkpoint"
PHASE_BARRIER = "barrier"
PHASE_TEARDOWN = "teardown"

PHASE_DESCRIPTIONS: dict[str, str] = {
    PHASE_START: "before the first beat (setup, or the first batch, never reported progress)",
    PHASE_SETUP: "in setup (process group, model, optimizer)",
    PHASE_DATA: "waiting for the next batch from the DataLoader",
    PHASE_TRAINING_STEP: "inside training_step",
    PHASE_BACKWARD: "in backward, i.e. in the gradient all-reduce (DDP overlaps it with backward)",
    PHASE_OPTIMIZER_STEP: (
        "in the optimizer step (the loss-normaliser all-reduce, clipping, optimizer.step, schedulers)"
    ),
    PHASE_METRICS_REDUCTION: "in a collective: metrics reduction",
    PHASE_CALLBACKS: "in on_train_batch_end (the task's hook and the callbacks')",
    PHASE_VALIDATION_STEP: "inside validation_step",
    PHASE_TEST_STEP: "inside test_step",
    PHASE_PREDICT_STEP: "inside predict_step",
    PHASE_PREEMPTION_CHECK: "in a collective: preemption agreement",
    PHASE_CHECKPOINT: "saving or loading a checkpoint",
    PHASE_BARRIER: "in a collective: barrier",
    PHASE_TEARDOWN: "in teardown",
}

EXIT_CODE = 134  # 128 + SIGABRT: what a launcher sees from abort()
# The watchdog thread needs the GIL. If a C extension hangs while holding it, the thread
# never runs; faulthandler's C-level timer, re-armed on every poll, then dumps the stacks
# to stderr and exits (status 1) this many seconds after the watchdog should have fired.
BACKSTOP_GRACE_S = 30.0


def describe_phase(phase: str) -> str:
    """Returns the human words for a phase name ("inside training_step")."""
    return PHASE_DESCRIPTIONS.get(phase, f"in phase {phase!r}")


def _default_on_fire() -> None:
    """Flushes logs and streams, then exits hard (no atexit, no thread joins, no group teardown)."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(EXIT_CODE)


class Watchdog:
    """Fires when :meth:`beat` is not called for ``timeout`` seconds.

    Contract: the Trainer creates one per process (it owns faulthandler's single
    ``dump_traceback_later`` timer, its GIL-free backstop), calls :meth:`start` once the run
    directory is known, :meth:`beat` at every phase change and step boundary (main
    thread), and :meth:`stop` at the end of the stage, on success and on error. It
    fires at most once; silence is measured from :meth:`start` or the last beat, with
    a resolution of ``poll`` seconds.

    Args:
        timeout: Seconds without a beat before firing; must exceed the longest
            legitimate gap between beats (a slow validation batch, a checkpoint save).
        run_dir: Where the stack dump goes; created when needed.
        rank: Global rank, for the file name and the message.
        on_fire: Called (on the watchdog thread) after the dump and the log; default
            flushes the logs and calls ``os._exit(134)``. If it returns, the watchdog
            thread ends.
        poll: Seconds between checks; default ``timeout / 10`` clamped to [0.01, 1].

    Raises:
        ValueError: ``timeout`` or ``poll`` is not > 0.
    """

    def __init__(
        self,
        timeout: float,
        *,
        run_dir: str | os.PathLike,
        rank: int,
        on_fire: Callable[[], None] | None = None,
        poll: float | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"Watchdog timeout must be > 0 seconds, got {timeout!r}.")
        if poll is None:
            poll = min(max(timeout / 10, 0.01), 1.0)
        if not poll > 0:
            raise ValueError(f"Watchdog poll must be > 0 seconds, got {poll!r}.")
        self.timeout = float(timeout)
        self.poll = float(poll)
        self.run_dir = os.fspath(run_dir)
        self.rank = rank
        self.on_fire = on_fire if on_fire is not None else _default_on_fire
        # The whole beat is one attribute store of a fresh tuple (atomic under the GIL).
        # The watchdog thread keeps a reference to the last tuple it saw, so a new beat
        # is exactly "a different object" -- no clock read, lock or syscall in beat().
        self._state: tuple[str, int] = (PHASE_START, -1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False
        self.dump_path: str | None = None  # the stacks file, once fired

    def start(self) -> None:
        """Starts the daemon thread; the silence clock starts now.

        Raises:
            RuntimeError: Already started.
        """
        if self._thread is not None:
            raise RuntimeError("Watchdog.start() called twice.")
        self._thread = threading.Thread(target=self._run, name=f"keel-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()

    def beat(self, phase: str, step: int) -> None:
        """Records progress: this rank is entering ``phase`` at optimizer step ``step``.

        About 0.1 µs: one attribute store, safe from any thread.
        """
        self._state = (phase, step)

    def stop(self) -> None:
        """Stops the thread (idempotent); a watchdog that fired or never started is fine."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(5.0, 2 * self.poll))
        if thread is not None:
            faulthandler.cancel_dump_traceback_later()

    # ------------------------------------------------------------------ watchdog thread
    def _run(self) -> None:
        seen = self._state
        last_change = time.monotonic()
        backstop = True
        while not self._stop.wait(self.poll):
            if backstop:
                backstop = _arm_backstop(self.timeout + BACKSTOP_GRACE_S)
            state = self._state
            now = time.monotonic()
            if state is not seen:
                seen, last_change = state, now
            elif now - last_change >= self.timeout:
                if self._stop.is_set():  # stop() raced with the last poll
                    return
                self._fire(state, now - last_change)
                return

    def _fire(self, state: tuple[str, int], silent_for: float) -> None:
        faulthandler.cancel_dump_traceback_later()  # the dumps below may take seconds
        self.fired = True
        phase, step = state
        stamp = time.strftime("%Y%m%d-%H%M%S")
        try:
            self.dump_path = self._write_stacks(phase, step, silent_for, stamp)
            where = self.dump_path
        except OSError as exc:
            # Never lose the stacks: an unwritable run directory sends them to stderr.
            where = f"stderr (could not write to {self.run_dir}: {exc})"
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        logger.error(
            "Rank %d made no progress for %.1f s (watchdog timeout %g s): stuck %s at step %d%s. "
            "Python stacks of all threads: %s. Exiting so the launcher can restart the job.",
            self.rank,
            silent_for,
            self.timeout,
            describe_phase(phase),
            step,
            _main_thread_location(),
            where,
        )
        # After the log line: the first dump in a process can take seconds (torch imports lazily).
        fr_path = self._write_flight_recorder(stamp)
        if fr_path is not None:
            logger.error(
                "Rank %d: collectives in flight are in the c10d Flight Recorder dump %s "
                "(read all ranks' dumps with `torchfrtrace`).",
                self.rank,
                fr_path,
            )
        self.on_fire()

    def _write_stacks(self, phase: str, step: int, silent_for: float, stamp: str) -> str:
        os.makedirs(self.run_dir, exist_ok=True)
        path = os.path.join(self.run_dir, f"hang-rank{self.rank}-{stamp}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(
                f"keel watchdog: rank {self.rank} made no progress for {silent_for:.1f} s "
                f"(timeout {self.timeout:g} s)\n"
                f"rank: {self.rank}\n"
                f"host: {socket.gethostname()}  pid: {os.getpid()}\n"
                f"time: {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n"
                f"last phase: {phase} ({describe_phase(phase)})\n"
                f"last step: {step}\n"
                f"seconds since last beat: {silent_for:.1f}\n\n"
                "Python stacks, all threads (most recent call first):\n"
            )
            f.flush()  # faulthandler writes to the fd directly, after our buffered text
            faulthandler.dump_traceback(f, all_threads=True)
        return path

    def _write_flight_recorder(self, stamp: str) -> str | None:
        """Dumps the c10d Flight Recorder, bounded in time: a dump must never turn into a hang."""
        result: list[str | None] = [None]

        def dump() -> None:
            try:
                from trainer.distributed import comm  # the only module that touches torch.distributed

                data = comm.flight_recorder_dump()
                if data:
                    path = os.path.join(self.run_dir, f"fr-trace-rank{self.rank}-{stamp}.pkl")
                    with open(path, "wb") as f:
                        f.write(data)
                    result[0] = path
            except Exception as exc:
                logger.debug("Flight Recorder dump failed: %s: %s", type(exc).__name__, exc)

        thread = threading.Thread(target=dump, name="keel-watchdog-fr-dump", daemon=True)
        thread.start()
        thread.join(timeout=10.0)
        return result[0]


def _arm_backstop(seconds: float) -> bool:
    """(Re)arms faulthandler's GIL-free timer on the real stderr; False if it cannot be used."""
    try:
        # sys.__stderr__ is None without a console: faulthandler then falls back to sys.stderr or raises (below).
        faulthandler.dump_traceback_later(seconds, exit=True, file=cast(TextIO, sys.__stderr__))
        return True
    except (AttributeError, ValueError, RuntimeError, OSError) as exc:  # no usable stderr fd
        logger.debug("No faulthandler backstop for the watchdog: %s", exc)
        return False


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.join(paths[k], "") for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def _main_thread_location() -> str:
    """Where the main thread is: its innermost frame and, when that is library code
    (``time.sleep`` has no frame, but ``threading.wait`` or torch does), the innermost
    frame of the calling program. ``""`` if the main thread is gone."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return ""
    frames = traceback.extract_stack(frame)
    if not frames:
        return ""

    def where(f: traceback.FrameSummary) -> str:
        return f"{f.name} at {os.path.basename(f.filename)}:{f.lineno}"

    text = f" (main thread in {where(frames[-1])}"
    library = _library_dirs()
    if frames[-1].filename.startswith(library):
        caller = next((f for f in reversed(frames) if not f.filename.startswith(library)), None)
        if caller is not None:
            text += f", called from {where(caller)}"
    return text + ")"


def nccl_flight_recorder_env_defaults(
    run_dir: str | os.PathLike | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment defaults that make an nccl timeout leave evidence and a dead process.

    The Trainer applies them with ``os.environ.setdefault`` before it creates an nccl
    group (they are read when the group is created):

    * Flight Recorder buffer of 2000 collectives (``TORCH_FR_BUFFER_SIZE``; torch < 2.11
      reads ``TORCH_NCCL_TRACE_BUFFER_SIZE``, which 2.11+ warns is deprecated);
    * ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: on a collective timeout each rank writes its
      buffer to ``<run_dir>/nccl_trace_rank_<R>`` (``TORCH_FR_DUMP_TEMP_FILE``, formerly
      ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; omitted when ``run_dir`` is None: torch then
      uses its default ``/tmp/nccl_trace_rank_``);
    * ``TORCH_NCCL_ENABLE_MONITORING=1``: needed for the dump, and kills a process whose
      nccl watchdog itself is stuck;
    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (SkipCleanUp): a timed-out collective
      aborts the process without waiting on the hung communicator, so torchrun
      restarts the job instead of it hanging in teardown.

    A key is left out when the user already set it or one of its aliases.

    Args:
        run_dir: The run directory; the dump file prefix goes under it.
        environ: The environment to check for user settings; ``os.environ`` when None.

    Returns:
        Variable name -> value, to ``setdefault``.
    """
    import torch

    environ = os.environ if environ is None else environ
    major_minor = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit())
    fr_names = major_minor >= (2, 11)
    buffer_names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    file_names = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    candidates: list[tuple[tuple[str, ...], str]] = [
        (buffer_names if fr_names else buffer_names[::-1], "2000"),
        (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),
        (("TORCH_NCCL_ENABLE_MONITORING",), "1"),
        (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"), "3"),
    ]
    if run_dir is not None:
        prefix = os.path.join(os.path.abspath(os.fspath(run_dir)), "nccl_trace_rank_")
        candidates.append((file_names if fr_names else file_names[::-1], prefix))
    return {names[0]: value for names, value in candidates if not any(name in environ for name in names)}


def start_for_run(
    timeout: float | None, *, world_size: int, process_group_timeout: float, run_dir: str, rank: int
) -> Watchdog | None:
    """The Trainer's watchdog for one stage, started; None when off. ``timeout`` None means the default:
    ``min(600, process_group_timeout)`` seconds in a distributed run, off in a single process."""
    if timeout is None and world_size > 1:
        timeout = min(600.0, process_group_timeout)
    if timeout is None:
        return None
    watchdog = Watchdog(timeout, run_dir=run_dir, rank=rank)
    watchdog.start()
    return watchdog
