"""The Trainer calls hooks in the order documented in ``trainer/callback.py``, in one process (the program of
tests/harness/scripts/hook_order.py run in the test's process). The same order on 2 ranks:
tests/integration/test_hook_order.py."""

from __future__ import annotations

import importlib.util

from hook_events import SCRIPT, expected_events, first_difference


def load_script():
    spec = importlib.util.spec_from_file_location("hook_order_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_single_process_order_matches_the_docstring() -> None:
    events = load_script().record()
    expected = expected_events()
    assert events == expected, first_difference(events, expected)
