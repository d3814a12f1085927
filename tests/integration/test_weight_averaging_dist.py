"""Weight averaging on several ranks (callbacks/weight_averaging.py): under DDP every rank keeps the whole average,
under FSDP each keeps the average of its own shards; both end where one process with the global batch ends, and a
run SIGKILLed midway and resumed with ckpt_path="last" ends where the uninterrupted run does (also when the
sharded save is resumed in one process). One process against Lightning: tests/unit/test_weight_averaging.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, python, spawn_ranks

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "weight_avg_fit.py"


def load(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def one(tmp: Path, name: str, *args: str) -> dict:
    python(SCRIPT, str(tmp / name), "--batch", "8", *args, timeout=180).check()
    return load(tmp / name)


def two(tmp: Path, name: str, *args: str, check: bool = True) -> dict:
    result = spawn_ranks(SCRIPT, str(tmp / name), "--batch", "4", *args, nproc=2, timeout=240)
    if not check:
        assert result.returncode != 0  # SIGKILLed
        return {}
    result.check()
    r0, r1 = load(tmp / name, 0), load(tmp / name, 1)
    assert max_diff(r0["weights"], r1["weights"]) == 0.0  # every rank ends with the same model
    return {"r0": r0, "r1": r1}


@pytest.mark.parametrize("case", ["swa", "ema"])
def test_two_ranks_under_ddp_and_fsdp_average_as_one_process_with_the_global_batch(tmp_path: Path, case: str) -> None:
    single = one(tmp_path, "one", "--case", case)
    ddp = two(tmp_path, "ddp", "--strategy", "ddp", "--case", case)
    fsdp = two(tmp_path, "fsdp", "--strategy", "fsdp", "--case", case)
    assert single["global_step"] == ddp["r0"]["global_step"] == fsdp["r0"]["global_step"] == 16
    # float64 throughout: the ranks' gradient mean and the one process's differ in rounding only.
    assert max_diff(ddp["r0"]["weights"], single["weights"]) < 1e-12
    assert max_diff(fsdp["r0"]["weights"], single["weights"]) < 1e-12
    # The average itself: DDP ranks hold it whole, FSDP ranks only their shards (rank 0 the first half of each
    # parameter's rows, rank 1 the rest), nothing gathered.
    whole = [tuple(t.shape) for t in single["kept"]]
    assert [tuple(t.shape) for t in ddp["r1"]["kept"]] == whole
    assert fsdp["r0"]["sharded"] and not ddp["r0"]["sharded"]
    for full, part0, part1 in zip(single["kept"], fsdp["r0"]["kept"], fsdp["r1"]["kept"]):
        assert part0.shape[0] == (full.shape[0] + 1) // 2 and part0.shape[0] + part1.shape[0] == full.shape[0]
        assert (torch.cat([part0, part1]) - full).abs().max() < 1e-12


@pytest.mark.parametrize("case", ["swa", pytest.param("ema", marks=pytest.mark.slow)])
def test_a_sigkilled_fsdp_run_resumes_to_the_uninterrupted_average_on_two_ranks_and_in_one_process(
    tmp_path: Path, case: str
) -> None:
    """Killed after step 7 (saves every 3 steps: resumed at step 6, inside SWA's first averaging epoch; EMA has
    averaged three times). Resumed on 2 ranks it ends bit for bit as the uninterrupted 2-rank run; the sharded save
    resumed in one process ends as the one-process run (the save reshards the average with the weights)."""
    whole = two(tmp_path, "whole", "--strategy", "fsdp", "--case", case)
    ckpt = str(tmp_path / "ckpt")
    two(tmp_path, "killed", "--strategy", "fsdp", "--case", case, "--ckpt-dir", ckpt, "--kill-at", "7", check=False)
    ckpt1 = str(tmp_path / "ckpt1")
    shutil.copytree(ckpt, ckpt1, symlinks=True)  # the killed run's saves, for the one-process resume
    resumed = two(tmp_path, "resumed", "--strategy", "fsdp", "--case", case, "--ckpt-dir", ckpt, "--resume")
    assert resumed["r0"]["global_step"] == 16
    assert max_diff(resumed["r0"]["weights"], whole["r0"]["weights"]) == 0.0
    single = one(tmp_path, "single", "--case", case)
    in_one = one(tmp_path, "in_one", "--case", case, "--ckpt-dir", ckpt1, "--resume")
    assert max_diff(in_one["weights"], single["weights"]) < 1e-12
