"""Manual optimization (automatic_optimization = False) with two optimizers: 2-rank DDP equals one process with the
global batch (tests/harness/scripts/gan_fit.py, launched). Against a hand-written loop in one process:
tests/unit/test_manual_optimization_one_process.py."""

from __future__ import annotations

from pathlib import Path

import torch
from launch import REPO_ROOT, python, spawn_ranks

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "gan_fit.py"


def test_gan_two_ranks_equal_one_process_with_global_batch(tmp_path: Path) -> None:
    python(SCRIPT, str(tmp_path / "one"), "16", timeout=120).check()
    spawn_ranks(SCRIPT, str(tmp_path / "two"), "8", nproc=2, timeout=180).check()
    one = torch.load(tmp_path / "one" / "rank0.pt", weights_only=False)
    ranks = [torch.load(tmp_path / "two" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for rank in ranks:
        assert rank["step"] == one["step"] == 8
        for name, value in one["weights"].items():
            assert torch.allclose(rank["weights"][name], value, atol=1e-10, rtol=0), name
    for name in ranks[0]["weights"]:
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
