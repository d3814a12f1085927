"""Gradient accumulation: token-weighted equivalence across (accumulation, ranks, micro-batch) splits, one process
and 2 ranks launched. Short windows, schedules on the step clock and bad input, in one process:
tests/unit/test_accumulation_steps.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, python, spawn_ranks

TOKENS = REPO_ROOT / "tests" / "harness" / "scripts" / "token_accum.py"


def test_token_weighted_loss_is_split_invariant(tmp_path: Path) -> None:
    """(k=1, 1 rank, B=16) == (k=4, 1 rank, 4) == (k=2, 2 ranks, 4), to 1e-12 in float64."""
    python(TOKENS, str(tmp_path / "a"), "--batch", "16", "--accumulate", "1", timeout=120).check()
    python(TOKENS, str(tmp_path / "b"), "--batch", "4", "--accumulate", "4", timeout=120).check()
    spawn_ranks(TOKENS, str(tmp_path / "c"), "--batch", "4", "--accumulate", "2", nproc=2, timeout=180).check()
    runs = [torch.load(tmp_path / d / "rank0.pt", weights_only=False) for d in "abc"]
    runs.append(torch.load(tmp_path / "c" / "rank1.pt", weights_only=False))
    reference = runs[0]
    assert reference["steps"] == 6
    for other in runs[1:]:
        for name, grad in reference["grads"].items():
            assert torch.allclose(other["grads"][name], grad, atol=1e-12, rtol=0), name
        for name, weight in reference["weights"].items():
            assert torch.allclose(other["weights"][name], weight, atol=1e-12, rtol=0), name
        assert other["loss"] == pytest.approx(reference["loss"], rel=1e-12, abs=1e-12)
