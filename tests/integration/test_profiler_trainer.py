"""``Trainer(profiler=...)`` on 2 ranks: one trace per rank, and rank 0 alone logs the phase table. A fit's table,
the choices and a profiler that is off, in one process: tests/unit/test_trainer_profiler.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

from launch import spawn_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "harness" / "scripts" / "profiler_fit.py"


def test_two_ranks_write_one_trace_each_and_rank_zero_logs_the_table(tmp_path: Path) -> None:
    result = spawn_ranks(SCRIPT, str(tmp_path / "run"), nproc=2, timeout=180).check()
    traces = sorted(n for n in os.listdir(tmp_path / "run" / "profiler") if n.endswith(".pt.trace.json"))
    assert [n.split(".")[:2] for n in traces] == [["rank0", "fit"], ["rank1", "fit"]], traces
    for name in traces:  # every rank's trace holds its own phases
        names = {e.get("name") for e in json.loads((tmp_path / "run" / "profiler" / name).read_text())["traceEvents"]}
        assert {"forward", "backward", "optimizer_step"} <= names
    assert result.stdout.count("Profiler summary (fit, rank 0)") == 1, result.stdout  # rank 0 only
