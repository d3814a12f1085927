"""DDP on 2 ranks equals one process with the global batch; two simulated nodes agree."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, python, spawn_ranks, two_nodes

from trainer.memory import estimate_memory

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "ddp_fit.py"
sys.path.insert(0, str(SCRIPT.parent))
from ddp_fit import Recording  # noqa: E402  (the task the script trains)


def load(out: Path, rank: int) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def assert_weights_close(a: dict, b: dict, tol: float) -> None:
    for name in a:
        assert torch.allclose(a[name], b[name], atol=tol, rtol=0), (name, (a[name] - b[name]).abs().max())


# Unshuffled is a slow variant of the shuffled case (the sampler's permutation is the harder half).
@pytest.mark.parametrize("shuffle", [pytest.param(False, marks=pytest.mark.slow), True])
def test_two_ranks_equal_one_process_with_global_batch(tmp_path: Path, shuffle: bool) -> None:
    flag = ["--shuffle"] if shuffle else []
    python(SCRIPT, str(tmp_path / "single"), "--batch", "16", *flag, timeout=120).check()
    spawn_ranks(SCRIPT, str(tmp_path / "ddp"), "--batch", "8", "--memory-plan", *flag, nproc=2, timeout=180).check()
    single = load(tmp_path / "single", 0)
    rank0, rank1 = load(tmp_path / "ddp", 0), load(tmp_path / "ddp", 1)
    assert rank0["world_size"] == 2 and single["global_step"] == rank0["global_step"] == 8
    # Identical on both ranks, and equal to the single process with the global batch.
    for name in rank0["weights"]:
        assert torch.equal(rank0["weights"][name], rank1["weights"][name]), name
    assert_weights_close(rank0["weights"], single["weights"], 1e-6)
    # Data: the ranks together see exactly the global batches of the single process.
    for epoch in (0, 1):
        seen = sorted(rank0["seen"][epoch] + rank1["seen"][epoch])
        assert seen == list(range(64))
        for step in range(4):
            merged = sorted(
                rank0["seen"][epoch][step * 8 : (step + 1) * 8] + rank1["seen"][epoch][step * 8 : (step + 1) * 8]
            )
            assert merged == sorted(single["seen"][epoch][step * 16 : (step + 1) * 16])
    if shuffle:
        assert single["seen"][0] != single["seen"][1], "shuffle=True must permute differently each epoch"
    else:
        assert single["seen"][0] == list(range(64))
    # Uneven-shard evaluation (37 samples on 2 ranks) equals the single-process metrics.
    for key, value in single["val"][0].items():
        assert math.isclose(rank0["val"][0][key], value, rel_tol=1e-12), key
        assert rank0["val"][0][key] == rank1["val"][0][key]
    assert rank0["val"][0]["val/count"] == 37
    for key, value in single["test"][0].items():
        assert math.isclose(rank0["test"][0][key], value, rel_tol=1e-12), key
    # Predictions come back in dataset order on every rank.
    assert rank0["predictions"] == rank1["predictions"] == single["predictions"] == list(range(37))
    # predict_return="rank_zero" sends the outputs to rank 0 only; return_predictions=False sends nothing.
    assert rank0["sent"]["all_ranks-True"] == rank1["sent"]["all_ranks-True"] == ["all_gather_object", "True"]
    assert rank0["sent"]["rank_zero-True"] == ["gather_object", "True"]
    assert rank1["sent"]["rank_zero-True"] == ["gather_object", "None"]
    assert rank0["sent"]["all_ranks-False"] == rank1["sent"]["all_ranks-False"] == ["None"]
    assert single["sent"]["rank_zero-True"] == ["True"]  # one process: nothing to gather
    # Trainer(memory_plan=True) logged, at the first batch, the estimate of this run (DDP at 2 ranks), made inside
    # the run's process group; training equals the single process all the same (above).
    batch = (torch.arange(8), torch.zeros(8, 8, dtype=torch.float64), torch.zeros(8, 1, dtype=torch.float64))
    planned = estimate_memory(Recording, batch, strategy="ddp", world_size=2, precision="64")
    assert rank0["plan"] == rank1["plan"] == f"Memory plan: {planned.summary()}" and "DDP x2" in rank0["plan"]
    assert single["plan"] is None


def test_shuffled_run_repeats_exactly(tmp_path: Path) -> None:
    spawn_ranks(SCRIPT, str(tmp_path / "a"), "--batch", "8", "--shuffle", nproc=2, timeout=180).check()
    spawn_ranks(SCRIPT, str(tmp_path / "b"), "--batch", "8", "--shuffle", nproc=2, timeout=180).check()
    for rank in (0, 1):
        a, b = load(tmp_path / "a", rank), load(tmp_path / "b", rank)
        assert a["seen"] == b["seen"]
        for name in a["weights"]:
            assert torch.equal(a["weights"][name], b["weights"][name])


def test_two_simulated_nodes_agree(tmp_path: Path) -> None:
    results = two_nodes(SCRIPT, str(tmp_path / "nodes"), "--batch", "8", nproc_per_node=1, timeout=180)
    for result in results:
        result.check()
    rank0, rank1 = load(tmp_path / "nodes", 0), load(tmp_path / "nodes", 1)
    assert rank0["world_size"] == 2
    for name in rank0["weights"]:
        assert torch.equal(rank0["weights"][name], rank1["weights"][name]), name
    assert rank0["predictions"] == list(range(37))


def test_the_same_first_batch_on_every_rank_is_warned_about() -> None:
    """An unsharded stream gives both ranks the same first batch: warned, on each rank (the fingerprints are
    digests, equal across processes whatever PYTHONHASHSEED); a stream sharded by rank is not."""
    script = REPO_ROOT / "tests" / "harness" / "scripts" / "unsharded.py"
    result = spawn_ranks(script, nproc=2, timeout=180, env={"PYTHONHASHSEED": "random"}).check()
    for rank in (0, 1):
        assert f"rank {rank} same 1" in result.stdout, result.tail()
        assert f"rank {rank} sharded 0" in result.stdout, result.tail()
