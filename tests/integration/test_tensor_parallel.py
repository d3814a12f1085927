"""Tensor parallelism composed with FSDP on a 2-D (data_parallel, tensor_parallel) mesh of gloo ranks, in float64:
the same maths as one process with the global batch, checkpoints that resume at another mesh at the exact sample,
and Lightning's ModelParallelStrategy. The settings refused before any process group, in one process:
tests/unit/test_tensor_parallel_settings.py."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from launch import REPO_ROOT, python, spawn_ranks

from trainer.distributed.fsdp import FSDPStrategy
from trainer.memory import estimate_memory

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "tp_fit.py"
sys.path.insert(0, str(SCRIPT.parent))
from tp_fit import MLPNet  # noqa: E402  (the task the script trains)


def fake_batch() -> tuple[torch.Tensor, ...]:
    """A micro-batch as tp_fit's loader yields it: (indices, 6 features, target)."""
    return torch.arange(2), torch.randn(2, 6, dtype=torch.float64), torch.randn(2, dtype=torch.float64)


def load(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def by_index(predictions: torch.Tensor) -> torch.Tensor:
    return predictions[predictions[:, 0].argsort()]


def single(tmp: Path, name: str, *args: str) -> dict:
    python(SCRIPT, str(tmp / name), "--strategy", "single", *args, timeout=120).check()
    return load(tmp / name)


def launch(tmp: Path, name: str, nproc: int, *args: str) -> list[dict]:
    spawn_ranks(SCRIPT, str(tmp / name), *args, nproc=nproc, timeout=240).check()
    ranks = [load(tmp / name, r) for r in range(nproc)]
    for other in ranks[1:]:
        assert max_diff(other["weights"], ranks[0]["weights"]) == 0.0  # every rank gathers the same model
    return ranks


def samples(ranks: list[dict], tp: int) -> list[int]:
    """The samples the run trained on: one rank per tensor-parallel group (its ranks read the same batches)."""
    for r, rank in enumerate(ranks):
        assert rank["seen"] == ranks[r - r % tp]["seen"]
    return sorted(i for rank in ranks[::tp] for i in rank["seen"])


def test_hybrid_sharding_composes_with_tensor_parallelism(tmp_path: Path) -> None:
    """4 ranks as (replicate 2, shard 1, tensor-parallel 2): the split layers live on the 3-D mesh, each
    replicated across the two groups; with global-norm clipping the weights equal one process within 1e-10."""
    ref = single(tmp_path, "single", "--clip", "0.05")
    r0 = launch(tmp_path, "hsdp_tp", 4, "--tp", "2", "--replicate", "2", "--clip", "0.05")[0]
    assert r0["mesh"] == (2, 1, 2) and r0["global_step"] == ref["global_step"] == 6
    assert r0["placements"]["blocks.0.down.weight"].startswith("(Replicate(), Shard(dim=0)"), r0["placements"]
    assert max_diff(r0["weights"], ref["weights"]) < 1e-10


def test_dp2_tp2_equals_one_process_and_resumes_at_another_mesh_at_the_exact_sample(tmp_path: Path) -> None:
    """4 ranks as (dp=2, tp=2), global batch 8 of micro-batches of 2 (accumulation 2) with global-norm clipping:
    equal to one process (accumulation 4) within 1e-10, and so are evaluation, predict and a summed self.log. A
    save at step 3 of a (2, 2) run resumes at (1, 2) (2 ranks, accumulation 4) and at (4, 1) (accumulation 1)."""
    ref = single(tmp_path, "single", "--clip", "0.05")
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt"), "--save-every", "3"]
    full = launch(tmp_path, "dp2tp2", 4, "--tp", "2", "--clip", "0.05", "--memory-plan", *ckpt)
    r0 = full[0]
    assert r0["mesh"] == (2, 2) and r0["accumulate"] == 2 and ref["accumulate"] == 4
    assert "Shard(dim=1)" in r0["placements"]["blocks.0.down.weight"]  # split by the plan, sharded by FSDP
    assert r0["placements"]["head.weight"] == "(Shard(dim=0),)"  # outside the plan: the data-parallel dim only
    assert r0["global_step"] == ref["global_step"] == 6
    # The memory plan of this run (fake tensors, one process) holds what its rank 0 held: parameters and AdamW state.
    planned = estimate_memory(
        MLPNet, fake_batch(), strategy=FSDPStrategy(tensor_parallel_size=2), world_size=4, precision="64"
    )
    assert planned.setting == "FSDP + TP 2" and planned.world_size == 4
    assert (planned.params, planned.optimizer) == (r0["held"]["params"], r0["held"]["optimizer"]), r0["held"]
    # Trainer(memory_plan=True) made the same estimate at the run's first batch, on fake groups over its 4 ranks.
    assert r0["plan"] == f"Memory plan: {planned.summary()}", (r0["plan"], planned.summary())
    assert max_diff(r0["weights"], ref["weights"]) < 1e-10
    assert samples(full, tp=2) == sorted(ref["seen"]) == list(range(48))
    # A sum over ranks counts each tensor-parallel group once: 48 samples in the epoch, as in one process.
    assert r0["fit_metrics"]["samples"] == ref["fit_metrics"]["samples"] == 48.0
    assert abs(r0["val"][0]["val/loss"] - ref["val"][0]["val/loss"]) < 1e-10
    assert r0["predictions"].shape == ref["predictions"].shape == (37, 2)  # predicted once per replica
    assert (by_index(r0["predictions"]) - by_index(ref["predictions"])).abs().max() < 1e-10

    # The same run kept its save of step 3; it resumes at (1, 2) and at (4, 1).
    step3 = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    before = sorted(i for rank in full[::2] for i in rank["seen"][:12])  # 3 steps x accumulation 2 x micro-batch 2
    assert before == sorted(ref["seen"][:24])
    for name, nproc, tp, accumulate in (("at12", 2, 2, 4), ("at41", 4, 1, 1)):
        resumed = launch(tmp_path, name, nproc, "--tp", str(tp), "--clip", "0.05", "--resume", str(step3))
        assert resumed[0]["mesh"] == (nproc // tp, tp) and resumed[0]["accumulate"] == accumulate, name
        assert resumed[0]["global_step"] == 6
        assert max_diff(resumed[0]["weights"], ref["weights"]) < 1e-10, name
        assert samples(resumed, tp=tp) == sorted(ref["seen"][24:]), name  # exactly the samples not yet trained on


def test_lightning_model_parallel_strategy_task_that_shards_itself(tmp_path: Path) -> None:
    """Lightning's ModelParallelStrategy (through callbacks.lightning) on 2 ranks as (dp=1, tp=2), a task whose
    configure_model reads self.device_mesh, applies its plan and calls fully_shard itself (Lightning's way), with
    the token-normalised loss: keel shards nothing twice and the run equals one process."""
    ref = single(tmp_path, "single", "--items")
    run = launch(tmp_path, "lightning", 2, "--strategy", "lightning", "--tp", "2", "--items")
    assert run[0]["mesh"] == (1, 2) and run[0]["global_step"] == ref["global_step"] == 6
    assert max_diff(run[0]["weights"], ref["weights"]) < 1e-10
    assert samples(run, tp=2) == list(range(48))
