"""Per docs/design.md section 11: on a step that does not log there is no host-device sync and no collective
besides DDP's gradient all-reduce (one per bucket per optimizer step, none on no_sync micro-batches)."""

from __future__ import annotations

import json
from pathlib import Path

from launch import REPO_ROOT, spawn_ranks


def test_no_sync_and_no_collective_on_non_logging_steps(tmp_path: Path) -> None:
    spawn_ranks(
        REPO_ROOT / "tests" / "harness" / "scripts" / "count_syncs.py", str(tmp_path), nproc=2, timeout=180
    ).check()
    for rank in (0, 1):
        windows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(windows) == 24  # 12 steps x 2 micro-batches
        logging_windows = 0
        for window in windows:
            counts = window["counts"]
            step_end = window["batch_idx"] % 2 == 1
            step_after = window["step_before"] + (1 if step_end else 0)
            logs = step_end and step_after % 4 == 0
            syncs = {k: v for k, v in counts.items() if k.startswith("sync:")}
            collectives = {k: v for k, v in counts.items() if k.startswith("collective:")}
            if logs:
                logging_windows += 1
                assert syncs and collectives, window  # the logging step reads and reduces its metrics
            else:
                assert not syncs, window
                assert not collectives, window
            # DDP all-reduces once per bucket (1 bucket for this tiny model) on the step's last micro-batch only.
            assert counts.get("ddp_allreduce", 0) == (1 if step_end else 0), window
        assert logging_windows == 3
