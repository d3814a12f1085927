"""A model whose weights are never whole on any rank: built on the meta device and materialised shard by shard,
trained, evaluated, checkpointed, resumed and exported under FSDP on 4 CPU ranks, with every tensor each rank
allocates counted (tests/harness/scripts/sharded_fit.py), and equal to one process with the global batch."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, python, spawn_ranks

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "sharded_fit.py"
RANKS = 4


def run(out: Path, *args: str, nproc: int = RANKS) -> dict:
    if nproc == 1:
        python(SCRIPT, str(out), "--strategy", "auto", "--batch", str(4 * RANKS), *args, timeout=300).check()
    else:
        spawn_ranks(SCRIPT, str(out), *args, nproc=nproc, timeout=300).check()
    return torch.load(out / "rank0.pt", weights_only=False)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_equal_runs(sharded: dict, single: dict) -> None:
    assert sharded["world_size"] == RANKS and single["world_size"] == 1
    assert max_diff(sharded["initial"], single["initial"]) == 0.0  # the initial weights ignore the world size
    assert sharded["global_step"] == single["global_step"] == 6
    assert max_diff(sharded["weights"], single["weights"]) < 1e-10
    for name, value in single["val"][0].items():  # 41 samples: uneven shards, every sample counted once
        assert abs(sharded["val"][0][name] - value) < 1e-10, name
    assert (sharded["predictions"] - single["predictions"]).abs().max() < 1e-10


def assert_within_shard(run: dict, *, init_holds: int) -> None:
    """Each phase's peak of live bytes on rank 0, against what FSDP may hold then: the shard of the parameters,
    their gradients and AdamW's two states (4 shards), plus the units gathered at that moment. The whole model
    (as many shards as ranks) held once more on top would break every bound."""
    peaks, size, ranks = run["peaks"], run["sizes"], run["world_size"]
    shard, unit, whole = size["shard"], size["unit"], size["whole"]
    assert shard * ranks >= whole > (ranks - 1) * shard  # the bounds below tell a shard from the model
    slack = 64 << 10  # the root's own small layers, batches and temporaries
    assert peaks["init"] <= init_holds + slack, peaks
    assert peaks["train"] <= 4 * shard + 5 * unit + slack, peaks  # 2 units gathered, their grads, one reducing
    assert peaks["eval"] <= 4 * shard + 2 * unit + slack, peaks  # the training state stays; 2 units gathered
    assert peaks.get("save", 0) <= 4 * shard + 2 * unit + slack, peaks
    assert peaks["train"] + 2 * unit < 4 * shard + whole  # (gathering the whole model would not fit the bound)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process with the global batch, the task built on the meta device."""
    return run(tmp_path_factory.mktemp("single") / "out", nproc=1)


def test_a_meta_built_task_is_materialised_shard_by_shard_and_trains_as_one_process(
    tmp_path: Path, reference: dict
) -> None:
    sharded = run(tmp_path / "fsdp", "--ckpt-dir", str(tmp_path / "ckpt"))
    assert_equal_runs(sharded, reference)
    size = sharded["sizes"]
    # Initialisation holds this rank's shard and one module at full size (the one being initialised).
    assert_within_shard(sharded, init_holds=size["shard"] + size["module"])
    assert reference["peaks"]["init"] >= size["whole"]  # (the counting sees the whole model where it is whole)
    # The memory plan of this run, on fake tensors in one process, against what rank 0 counted phase by phase.
    sys.path.insert(0, str(SCRIPT.parent))
    from sharded_fit import Net, data

    from trainer.memory import estimate_memory

    x, y = data(4, 0, torch.float64).tensors
    plan = estimate_memory(lambda: Net("init", 128, 8), (x, y), strategy="fsdp", world_size=RANKS, precision="64")
    for phase in ("init", "train", "eval"):
        assert abs(plan.phases[phase] - sharded["peaks"][phase]) < 0.15 * sharded["peaks"][phase], (phase, plan)

    # Resume at step 3 of the same checkpoint folder (saves at steps 3 and 6): equal to the uninterrupted run.
    ckpt = tmp_path / "ckpt"
    resumed_dir = tmp_path / "resumed_ckpt"
    resumed_dir.mkdir()
    three = [p for p in ckpt.iterdir() if p.is_dir() and "step=3" in p.name]
    assert len(three) == 1, sorted(p.name for p in ckpt.iterdir())
    shutil.copytree(three[0], resumed_dir / three[0].name)
    resumed = run(tmp_path / "resumed", "--ckpt-dir", str(resumed_dir), "--resume")
    assert resumed["global_step"] == 6
    assert max_diff(resumed["weights"], sharded["weights"]) < 1e-12
    assert_within_shard(resumed, init_holds=size["shard"] * 4 + size["module"])  # the load: the saved state

    # The last save exported to Hugging Face's layout holds the trained weights.
    from trainer import export_weights

    six = next(p for p in ckpt.iterdir() if p.is_dir() and "step=6" in p.name)
    export_weights(six, tmp_path / "hf", max_shard_size=size["whole"] // 3)
    safetensors = pytest.importorskip("safetensors.torch")
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    exported = {k: v for shard in shards for k, v in safetensors.load_file(shard).items()}
    assert max_diff(exported, sharded["weights"]) == 0.0


# Slow variants: the 4-rank start from an export builds under init_module with the same checks
# (test_weights_exported_at_2_ranks_start_4_ranks_and_one_process), and a meta build is the first test's.
@pytest.mark.slow
@pytest.mark.parametrize(
    "build",
    [
        "init_module",  # configure_model under Lightning's trainer.init_module(empty_init=True)
        "configure",  # configure_model under torch.device("meta")
    ],
)
def test_layers_built_on_meta_in_configure_model_equal_one_process(tmp_path: Path, build: str) -> None:
    sharded = run(tmp_path / "fsdp", "--build", build)
    assert_equal_runs(sharded, run(tmp_path / "single", "--build", build, nproc=1))
    size = sharded["sizes"]
    assert_within_shard(sharded, init_holds=size["shard"] + size["module"])


def test_an_eagerly_built_task_is_sharded_without_a_second_copy(tmp_path: Path) -> None:
    """Built on the CPU in __init__: rank 0's weights go to every rank one tensor at a time, then each rank keeps
    its shard; the peak of initialisation is the task itself plus one tensor."""
    sharded = run(tmp_path / "fsdp", "--build", "eager")
    assert_equal_runs(sharded, run(tmp_path / "single", "--build", "eager", nproc=1))
    size = sharded["sizes"]
    assert_within_shard(sharded, init_holds=size["whole"] + size["module"])


def test_bf16_mixed_keeps_no_bf16_copy_of_the_weights_for_backward(tmp_path: Path) -> None:
    """Under bf16-mixed the units gather bf16 parameters and free them after their forward: what autograd keeps
    for backward once the forward is over is activations (a bf16 weight cast under autocast alone would stay,
    the whole model in bf16)."""
    out = run(tmp_path / "bf16", "--precision", "bf16-mixed", nproc=2)
    size = out["sizes"]
    whole_bf16 = size["whole"] // 2  # fp32 master weights
    width, depth, batch = 128, 8, 4
    activations = 6 * batch * width * 4 * (depth + 2)  # per layer at most six fp32 tensors of the batch
    root = 2 * (16 * width + width * 4 + width + 4)  # the root's own layers stay gathered (bf16)
    assert 0 < out["saved_bytes"][0] <= activations + root < whole_bf16 / 2
    assert_within_shard(out, init_holds=size["shard"] + size["module"])


def test_weights_exported_at_2_ranks_start_4_ranks_and_one_process(tmp_path: Path) -> None:
    """Trainer(initial_weights=an export to Hugging Face's layout): each of 4 ranks reads only its slices (the
    initialisation holds its shard and one module), and the run equals one process started from the same folder.
    Both build their blocks in configure_model under Lightning's trainer.init_module(empty_init=True)."""
    from trainer import export_weights

    two = run(tmp_path / "two", "--ckpt-dir", str(tmp_path / "ckpt"), "--steps", "3", nproc=2)
    (save,) = [p for p in (tmp_path / "ckpt").iterdir() if p.is_dir() and "step=3" in p.name]
    export_weights(save, tmp_path / "hf", max_shard_size=two["sizes"]["whole"] // 3)
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) >= 3
    start = ("--initial-weights", str(tmp_path / "hf"), "--build", "init_module")
    four, one = run(tmp_path / "four", *start), run(tmp_path / "one", *start, nproc=1)
    assert max_diff(four["initial"], two["weights"]) == 0.0  # the trained weights of the 2-rank run, exactly
    assert_equal_runs(four, one)
    size = four["sizes"]
    assert_within_shard(four, init_holds=size["shard"] + size["module"])


def test_ddp_materialises_a_meta_built_task_whole_and_a_rank_without_a_validation_batch_joins_in(
    tmp_path: Path, reference: dict
) -> None:
    """Under DDP a task built on the meta device is materialised whole, with the initial weights of one process.
    One validation sample on 2 ranks: rank 1's shard is empty, yet it runs validation with rank 0 (whether fit
    validates is agreed, not decided per rank: one rank skipping it would leave the other in a collective alone) and
    joins the metric reduction with nothing."""
    ddp = run(tmp_path / "ddp", "--strategy", "ddp", "--val", "1", nproc=2)
    assert ddp["world_size"] == 2 and ddp["global_step"] == 6
    assert max_diff(ddp["initial"], reference["initial"]) == 0.0
    assert ddp["sizes"]["shard"] == ddp["sizes"]["whole"]
    assert set(ddp["val"][0]) == {"val/loss", "val/acc"}


def test_a_rank_without_a_validation_batch_is_refused_on_every_rank_under_fsdp(tmp_path: Path) -> None:
    """The same under FSDP: every forward all-gathers from every rank and rank 1 has never run one to replay, so
    every rank raises, naming the fix (before, rank 1 skipped validation and the others aborted in gloo)."""
    failed = spawn_ranks(SCRIPT, str(tmp_path / "fsdp"), "--val", "1", "--steps", "3", nproc=2, timeout=300)
    assert failed.returncode != 0
    for rank in (0, 1):  # one line per rank (the tracebacks are in the run directory's failure-rank<N>.log)
        assert (
            f"keel: rank {rank} failed: RuntimeError: FSDP evaluation: rank(s) [1] of 2 data-parallel ranks got no "
            in (failed.stdout)
        ), failed.stdout[-3000:]
    assert "Give the loader at least 2 samples" in failed.stdout


def test_initial_weights_failing_on_one_rank_first_is_named_on_every_rank_at_every_step(tmp_path: Path) -> None:
    """One rank alone fails at each step of an initial_weights load (its path missing, its copy without the
    manifest, its task of another shape, another kind of source): both ranks raise, the other naming the failed
    rank and its error, never gloo's "Connection closed by peer" or a TypeError of collectives paired wrongly; and
    the good load after them works."""
    from models import Regression, loader, quiet, regression_data

    from trainer import Trainer, export_weights

    trainer = Trainer(**quiet(max_steps=2))
    task = Regression()
    trainer.fit(task, loader(regression_data(), 16))
    trainer.save_checkpoint(tmp_path / "save.ckpt")
    export_weights(tmp_path / "save.ckpt", tmp_path / "w.safetensors")
    script = REPO_ROOT / "tests" / "harness" / "scripts" / "initial_weights_faults.py"
    spawn_ranks(script, str(tmp_path / "save.ckpt"), str(tmp_path / "w.safetensors"), str(tmp_path / "out"), nproc=2)
    out = [json.loads((tmp_path / f"out.rank{rank}.json").read_text()) for rank in (0, 1)]
    failed = {"missing on rank 0": 0, "another shape on rank 0": 0}  # a local step failed: agreed after it
    for case, rank in failed.items():
        own, other = out[rank]["errors"][case], out[1 - rank]["errors"][case]
        assert own is not None and other is not None, case
        assert other.startswith("CheckpointError: initial_weights=") and f": rank {rank} failed: " in other, other
        assert own.split(": ", 1)[1] in other, (own, other)  # the failed rank's own error, word for word
    zero, one = (out[rank]["errors"]["no manifest on rank 1"] for rank in (0, 1))  # found by the ranks' joint check
    assert zero is not None and one is not None and "no-manifest' has no keel.json" in one, (zero, one)
    assert f"rank 1: {one.split('is damaged: ', 1)[1]}" in zero, (zero, one)  # rank 0 names rank 1's finding
    kinds = [out[rank]["errors"]["another kind on rank 1"] for rank in (0, 1)]
    assert all(
        k is not None and "is not the same source on every rank (rank 0: keel, rank 1: safetensors)" in k for k in kinds
    ), kinds
    assert out[0]["errors"]["good"] is None and out[1]["errors"]["good"] is None
    for rank in (0, 1):
        assert out[rank]["weights"] == {k: v.tolist() for k, v in task.state_dict().items()}
