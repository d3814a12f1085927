"""Per-call cost of three calls on the training step's hot path, each against its budget.

    python benchmarks/hot_calls.py              # 200,000 beats, 20,000 profiler pairs, best of 5 repeats
    python benchmarks/hot_calls.py --json out.json

- ``Trainer._beat(phase)`` with no watchdog and the profiler off (the default): the phase clock's mark
  (trainer/observability/phases.py, always on) and the two listener checks. The loop makes 6 a step, so 1% of the
  tiny model's 0.46 ms step (benchmarks/results/overhead.md) is 0.77 us a beat. Budget: 0.77 us per call.
- ``Watchdog.beat(phase, step)`` (trainer/distributed/watchdog.py): an attribute write, called at every phase of
  every step when a watchdog or profiler listens. Budget: 5 us per call.
- ``SimpleProfiler.start(name)`` + ``stop(name)`` (trainer/observability/profiler.py): one pair per profiled
  phase. Budget: 50 us per pair.

These were timing assertions in the test suite; a wall-clock bound fails on a loaded machine, so they are
measured here instead. Reported: the best repeat (the least disturbed by other processes), in microseconds,
and whether it is within the budget. Exit code 0 either way: this is a report.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import Trainer
from trainer.distributed.watchdog import Watchdog
from trainer.observability.profiler import SimpleProfiler

BUDGETS_US = {"trainer_beat": 0.77, "watchdog_beat": 5.0, "simple_profiler_pair": 50.0}


def trainer_beat(n: int, repeats: int) -> float:
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    beat = trainer._beat
    return min(timeit.repeat(lambda: beat("backward"), number=n, repeat=repeats)) / n


def watchdog_beat(n: int, repeats: int) -> float:
    watchdog = Watchdog(60, run_dir="unused", rank=0)  # never started: beat() is the same attribute write
    return min(timeit.repeat(lambda: watchdog.beat("backward", 12), number=n, repeat=repeats)) / n


def simple_profiler_pair(n: int, repeats: int) -> float:
    profiler = SimpleProfiler()
    profiler.setup("fit")

    def pair() -> None:
        profiler.start("x")
        profiler.stop("x")

    return min(timeit.repeat(pair, number=n, repeat=repeats)) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beats", type=int, default=200_000, help="beat() calls per repeat")
    parser.add_argument("--pairs", type=int, default=20_000, help="start/stop pairs per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    seconds = {
        "trainer_beat": trainer_beat(args.beats, args.repeats),
        "watchdog_beat": watchdog_beat(args.beats, args.repeats),
        "simple_profiler_pair": simple_profiler_pair(args.pairs, args.repeats),
    }
    rows = {}
    for name, value in seconds.items():
        us = value * 1e6
        rows[name] = {"us": round(us, 3), "budget_us": BUDGETS_US[name], "within_budget": us < BUDGETS_US[name]}
        verdict = "ok" if rows[name]["within_budget"] else "OVER BUDGET"
        print(f"{name:>22}: {us:8.3f} us per call (budget {BUDGETS_US[name]:g} us) {verdict}")
    line = json.dumps({"benchmark": "keel-hot-calls", **rows})
    print(line)
    if args.json is not None:
        args.json.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
