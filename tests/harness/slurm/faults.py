"""A test-only callback that SLURM jobs of ``recipes.train`` run from the command line (tests/ on PYTHONPATH)::

    KEEL_TEST_FAULTS_DIR=/tmp/f KEEL_TEST_WAIT_AT=4 srun python -m recipes.train \\
        +callbacks.fault._target_=slurm.faults.Faults

Set through the environment, so that the config (and so the checkpoints and ``config.yaml``) is the same
in a faulty job and in the uninterrupted job it is compared with. Acts in the first attempt of a job only
(``SLURM_RESTART_COUNT`` 0 or unset), so the requeued job runs to the end. Nothing in keel imports this.

* ``KEEL_TEST_FAULTS_DIR``: where each rank writes ``started-rank{R}`` (one JSON line per attempt: the step
  it started from, its ranks, the run directory, the job id) and ``waiting-rank{R}`` (its pid, when it waits).
* ``KEEL_TEST_WAIT_AT=S``: after optimizer step S, write ``waiting-rank{R}`` and wait (at most 120 s)
  until this rank received SIGUSR1; without a signal the test kills the job's processes meanwhile.
* ``KEEL_TEST_STEP_SLEEP=T``: sleep T seconds after every optimizer step (a slow job for a time limit).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from trainer import Callback

FAULTS_DIR = "KEEL_TEST_FAULTS_DIR"
WAIT_AT = "KEEL_TEST_WAIT_AT"
STEP_SLEEP = "KEEL_TEST_STEP_SLEEP"
WAIT_LIMIT_S = 120.0


class Faults(Callback):
    """Records each attempt's start step; in the first attempt waits at a step or sleeps after each."""

    def __init__(self) -> None:
        folder = os.environ.get(FAULTS_DIR)
        self.folder = Path(folder) if folder else None
        self.first_attempt = os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0")
        self.wait_at = int(os.environ.get(WAIT_AT, "-1") or -1)
        self.step_sleep = float(os.environ.get(STEP_SLEEP, "0") or 0)
        self.signalled = threading.Event()

    def on_train_start(self, trainer: Any, task: Any) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {
            "step": trainer.global_step,
            "rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
            "run_dir": os.path.abspath(trainer.log_dir),
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
        }
        with open(self.folder / f"started-rank{trainer.global_rank}", "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def on_train_batch_end(self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.folder is None or not self.first_attempt or not trainer.optimizer_stepped:
            return
        if trainer.global_step == self.wait_at:
            # Chained to keel's handler (installed once training runs): this rank sees the signal come.
            keel_handler = signal.getsignal(signal.SIGUSR1)

            def handler(signum: int, frame: Any) -> None:
                self.signalled.set()
                if callable(keel_handler):
                    keel_handler(signum, frame)

            signal.signal(signal.SIGUSR1, handler)
            (self.folder / f"waiting-rank{trainer.global_rank}").write_text(str(os.getpid()))
            deadline = time.monotonic() + WAIT_LIMIT_S
            while not self.signalled.wait(0.05) and time.monotonic() < deadline:
                pass
        if self.step_sleep > 0:
            (self.folder / f"step-rank{trainer.global_rank}").write_text(str(trainer.global_step))
            time.sleep(self.step_sleep)
