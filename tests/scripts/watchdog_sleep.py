"""A fake training loop with a keel Watchdog; rank 1 stalls inside its training step.

Launched by torchrun (gloo). Usage: ``watchdog_sleep.py RUN_DIR [TIMEOUT_S]``.
Every rank beats the watchdog each step and all-reduces a fake gradient; at step 3
rank 1 calls :func:`sleep_inside_training_step` (60 s). Its watchdog must fire after
TIMEOUT_S (default 2), dump its stacks to RUN_DIR and exit 134; torchrun then stops rank 0.
"""

import datetime
import logging
import sys
import time

import torch

from trainer.distributed import comm, launcher
from trainer.distributed.watchdog import PHASE_BACKWARD, PHASE_TRAINING_STEP, Watchdog

STALL_STEP = 3


def sleep_inside_training_step() -> None:
    time.sleep(60)


def main() -> None:
    run_dir = sys.argv[1]
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    env = launcher.detect_env()
    # The group timeout is far longer than the watchdog's: the watchdog must be what ends the job.
    comm.init_process_group(env, backend="gloo", timeout=datetime.timedelta(seconds=300))
    rank = comm.get_rank()
    # Rank 0 waits longer than rank 1, so the stalled rank always fires (and is reported)
    # first; with equal timeouts torchrun may kill rank 1 when rank 0 exits a moment earlier.
    watchdog = Watchdog(timeout if rank == 1 else 3 * timeout, run_dir=run_dir, rank=rank)
    watchdog.start()
    grad = torch.zeros(4)
    for step in range(1000):
        watchdog.beat(PHASE_TRAINING_STEP, step)
        if rank == 1 and step == STALL_STEP:
            sleep_inside_training_step()
        time.sleep(0.01)
        watchdog.beat(PHASE_BACKWARD, step)
        comm.all_reduce(grad)
    watchdog.stop()
    print(f"rank {rank} finished without the watchdog firing", flush=True)


if __name__ == "__main__":
    main()
