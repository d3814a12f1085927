"""The Trainer calls hooks in the order documented in ``trainer/callback.py`` on 2 ranks (the same order in one
process: tests/unit/test_hook_order_one_process.py)."""

from __future__ import annotations

import json
from pathlib import Path

from hook_events import SCRIPT, expected_events, first_difference
from launch import spawn_ranks


def test_two_ranks_call_the_same_hooks_in_the_same_order(tmp_path: Path) -> None:
    spawn_ranks(SCRIPT, str(tmp_path), nproc=2, timeout=150).check()  # the harness kills it after 150 s
    expected = expected_events()
    for rank in (0, 1):
        events = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert events == expected, f"rank {rank}: " + first_difference(events, expected)
