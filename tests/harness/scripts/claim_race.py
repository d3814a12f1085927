"""One of several runs restarted together on one checkpoint folder: ``python claim_race.py FOLDER BARRIER N``
fits with ``ckpt_path="last"`` into FOLDER, held between reading the folder's stale claim and writing its own until
N runs have read it (a file per run in BARRIER) or 3 s have passed: the race of runs that all read the same stale
claim. The run that trains waits at its start until every run has read the claim, so that each meets it live.
Prints ``pid <pid>`` first and ``trained <steps>`` once fit returns."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

from claim_runs import fit

from trainer import Callback
from trainer.checkpoint import claim


def wait_for(barrier: Path, runs: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while len(list(barrier.iterdir())) < runs and time.monotonic() < deadline:
        time.sleep(0.01)


class AllRead(Callback):
    def __init__(self, barrier: Path, runs: int) -> None:
        self.barrier, self.runs = barrier, runs

    def on_train_start(self, trainer, task) -> None:  # type: ignore[no-untyped-def]
        wait_for(self.barrier, self.runs, 60)


def main() -> None:
    folder, barrier, runs = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    print(f"pid {os.getpid()}", flush=True)
    read = claim.read_for_replacing

    def read_then_wait(where):  # type: ignore[no-untyped-def]
        found = read(where)
        claim.read_for_replacing = read  # only the claim taken at fit start is held
        (barrier / str(os.getpid())).touch()
        if found[0] is not None and claim.alive(found[0]) is False:  # a stale claim: wait for the others to read it
            wait_for(barrier, runs, 3)
        return found

    claim.read_for_replacing = read_then_wait
    trainer = fit(folder, max_steps=8, ckpt_path="last", callbacks=(AllRead(barrier, runs),))
    print(f"trained {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
