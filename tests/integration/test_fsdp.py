"""strategy="fsdp" (FSDP2) in launched runs: the same maths as DDP, evaluation on the sharded task, sharded
crash-safe checkpoints that reshard, export to one plain file, and failed or refused sharded saves. Its settings,
refused before any process group, in one process: tests/unit/test_fsdp_settings.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, python, spawn_ranks, torchrun, two_nodes

from trainer.checkpoint.files import read_pointer

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "fsdp_fit.py"


def load(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def run2(tmp: Path, name: str, *args: str, timeout: float = 240) -> dict:
    spawn_ranks(SCRIPT, str(tmp / name), *args, nproc=2, timeout=timeout).check()
    r0, r1 = load(tmp / name, 0), load(tmp / name, 1)
    assert max_diff(r0["weights"], r1["weights"]) == 0.0  # every rank holds the same (gathered) model
    return r0


@pytest.mark.parametrize(
    "case",
    [
        # Both under activation checkpointing of the blocks (recomputing them changes no gradient: the
        # single-process test in test_strategies.py shows it bit for bit against no recompute).
        ["--accumulate", "2", "--clip", "0.05", "--recompute", "Block"],
        # The slow variant: without recompute, the token-normalised loss and the other reduce setting.
        pytest.param(["--accumulate", "2", "--items", "--reduce", "last_micro_batch"], marks=pytest.mark.slow),
    ],
)
def test_two_rank_fsdp_equals_two_rank_ddp(tmp_path: Path, case: list[str]) -> None:
    """Accumulation, global-norm clipping, token-normalised loss, both reduce settings, activation
    checkpointing: the DDP maths."""
    ddp = run2(tmp_path, "ddp", "--strategy", "ddp", *case)
    fsdp = run2(tmp_path, "fsdp", "--strategy", "fsdp", *case)
    assert fsdp["strategy"] == "FSDPStrategy" and ddp["strategy"] == "DDPStrategy"
    assert ddp["recomputed"] == fsdp["recomputed"] == (3 if "--recompute" in case else 0)  # the three blocks
    assert fsdp["global_step"] == ddp["global_step"] == 4  # 2 epochs of 3 micro-batches, windows of 2
    assert max_diff(fsdp["weights"], ddp["weights"]) < 1e-10
    # Evaluation, predict and task(x) on the sharded task (37 samples: uneven shards) equal DDP's.
    for key in ("val", "test"):
        for name, value in ddp[key][0].items():
            assert abs(fsdp[key][0][name] - value) < 1e-10, (key, name)
    assert (fsdp["predictions"] - ddp["predictions"]).abs().max() < 1e-10
    assert (fsdp["direct"] - ddp["direct"]).abs().max() < 1e-10
    # Trainer.export_weights after the fit: the gathered FSDP weights (and DDP's), exactly.
    from trainer.checkpoint.hf import open_weights

    for name, run in (("fsdp", fsdp), ("ddp", ddp)):
        with open_weights(tmp_path / name / "export.safetensors") as source:
            assert sorted(source.keys()) == sorted(run["weights"])
            assert all(torch.equal(source.read(k), run["weights"][k]) for k in source.keys()), name


def test_bf16_mixed_under_fsdp_does_the_arithmetic_of_autocast_under_ddp(tmp_path: Path) -> None:
    """precision="bf16-mixed": the blocks gather bf16 weights for their linears (the values autocast's cast gives)
    and fp32 for their LayerNorms, the root gathers fp32, so FSDP computes what DDP computes under autocast alone
    and 2 FSDP ranks end where 2 DDP ranks end, up to the order of fp32 sums."""
    args = ["--precision", "bf16-mixed", "--accumulate", "2"]
    ddp = run2(tmp_path, "ddp", "--strategy", "ddp", *args)
    fsdp = run2(tmp_path, "fsdp", "--strategy", "fsdp", *args)
    assert fsdp["global_step"] == ddp["global_step"] == 4
    assert {v.dtype for v in fsdp["weights"].values()} == {torch.float32}  # the master weights
    assert max_diff(fsdp["weights"], ddp["weights"]) < 1e-6
    assert abs(fsdp["val"][0]["val/loss"] - ddp["val"][0]["val/loss"]) < 1e-6
    assert (fsdp["direct"] - ddp["direct"]).abs().max() < 1e-6  # task(x) under torch.autocast
    # Called outside autocast, FSDP's task enters it (its units' weights are bf16): the same as inside; DDP's
    # computes in fp32.
    assert torch.equal(fsdp["outside"], fsdp["direct"]) and not torch.equal(ddp["outside"], ddp["direct"])


def test_fsdp_manual_optimization_and_configure_model_equal_ddp(tmp_path: Path) -> None:
    args = ["--manual", "--configure-model"]  # the task steps every micro-batch: no accumulation window
    ddp = run2(tmp_path, "ddp", "--strategy", "ddp", *args)
    fsdp = run2(tmp_path, "fsdp", "--strategy", "fsdp", "--units", "Block", *args)
    assert max_diff(fsdp["weights"], ddp["weights"]) < 1e-10


def test_one_rank_fsdp_equals_a_single_process(tmp_path: Path) -> None:
    """strategy='fsdp' without a launcher creates its own one-rank group; same result as no wrapper."""
    python(SCRIPT, str(tmp_path / "plain"), "--strategy", "auto", "--batch", "16", timeout=180).check()
    python(SCRIPT, str(tmp_path / "fsdp"), "--strategy", "fsdp", "--batch", "16", timeout=180).check()
    plain, fsdp = load(tmp_path / "plain"), load(tmp_path / "fsdp")
    assert fsdp["strategy"] == "FSDPStrategy" and fsdp["world_size"] == 1
    assert max_diff(fsdp["weights"], plain["weights"]) < 1e-12


# async: slow here; tests/integration/test_s3.py runs FSDP async saves through a SIGKILL, a reshard to one process and
# an export
@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_sigkill_under_torchrun_resumes_bit_identical_and_reshards_to_one_rank(tmp_path: Path, mode: str) -> None:
    """Also with ModelCheckpoint(async_save=True): shards staged to CPU, written on a gloo group of their
    own, committed later; a SIGKILL with a save in flight resumes from the previous committed folder."""
    saving = ["--async-save"] if mode == "async" else []
    reference = run2(tmp_path, "ref", "--strategy", "fsdp", "--ckpt-dir", str(tmp_path / "ref_ck"), *saving)
    ck = tmp_path / "ck"
    torchrun(
        SCRIPT,
        str(tmp_path / "killed"),
        "--strategy",
        "fsdp",
        "--ckpt-dir",
        str(ck),
        "--kill-at",
        "4",
        *saving,
        nproc=2,
        timeout=300,
        max_restarts=1,
    ).check()
    resumed = load(tmp_path / "killed")
    assert resumed["global_step"] == reference["global_step"] == 6
    # The kill comes before step 4's save: the restarted workers resume from step 3 (sync) and train 3
    # steps; with async saves step 3's save may still have been in flight: then from step 2.
    assert len(resumed["seen"]) in ((3 * 8,) if mode == "sync" else (3 * 8, 4 * 8)) and len(reference["seen"]) == 6 * 8
    assert max_diff(resumed["weights"], reference["weights"]) == 0.0  # bit for bit
    # The committed checkpoints are folders: each rank's shards, DCP's index, keel's own file, the manifest.
    last = Path(resumed["last"])
    assert last.is_dir() and {".metadata", "keel.pt", "keel.json", "__0_0.distcp", "__1_0.distcp"} <= set(
        os.listdir(last)
    )
    assert not [p for p in ck.iterdir() if ".tmp-" in p.name]
    # export_weights: one plain file from the 2-rank folder, no process group, loads into the bare task
    # (before the one-rank run below, whose saves prune this folder).
    out = tmp_path / "weights.pt"
    code = (
        "import sys, torch; sys.path.insert(0, 'tests/harness/scripts'); "
        "from trainer.checkpoint.hf import export_weights; "
        f"export_weights({str(last)!r}, {str(out)!r}); from fsdp_fit import BlockNet; t = BlockNet(); "
        f"t.load_state_dict(torch.load({str(out)!r}, weights_only=True)); "
        f"u = BlockNet.load_from_checkpoint({str(last)!r}); "
        "print('OK', all(torch.equal(a, b) for a, b in zip(t.state_dict().values(), u.state_dict().values())))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert "OK True" in done.stdout, done.stdout + done.stderr
    exported = torch.load(out, weights_only=True)
    assert max_diff(exported, reference["weights"]) == 0.0  # the final checkpoint is the final model
    # Saved at 2 ranks (end of epoch 1), resumed in one process (DCP reshards): epoch 2 at 1 rank, 6 steps.
    python(
        SCRIPT, str(tmp_path / "one"), "--strategy", "fsdp", "--ckpt-dir", str(ck), "--epochs", "3", timeout=180
    ).check()
    one = load(tmp_path / "one")
    assert one["global_step"] == 12 and one["world_size"] == 1


def test_hybrid_sharding_on_two_nodes_equals_one_process_and_resumes_under_fsdp_and_ddp(tmp_path: Path) -> None:
    """FSDPStrategy(replicate_size="auto") on 2 simulated nodes of 2 ranks: each node holds the model sharded in
    two and the nodes replicate it (a (replicate, shard) mesh); with the global batch of one process (8) and
    clipping, the weights, metrics and predictions equal one process's. Its save at step 3 (mid-epoch) resumes
    under plain FSDP and under DDP on 2 ranks and ends where one process ends."""
    same = ("--steps", "6", "--clip", "0.05")
    ck = tmp_path / "ck"
    hsdp_args = ("--strategy", "fsdp", "--replicate", "auto", "--batch", "2", "--ckpt-dir", str(ck), "--keep-saves")
    for result in two_nodes(SCRIPT, str(tmp_path / "hsdp"), *hsdp_args, *same, nproc_per_node=2, timeout=300):
        result.check()
    hsdp = load(tmp_path / "hsdp")
    assert hsdp["world_size"] == 4
    assert hsdp["mesh"] == {
        "replicate": 2,
        "shard": 2,
        "tensor_parallel": 1,
        "parameter": "replicate:Rxshard:S(0)",  # replicated across the nodes, sharded within each
    }
    python(SCRIPT, str(tmp_path / "one"), "--strategy", "auto", "--batch", "8", *same, timeout=180).check()
    one = load(tmp_path / "one")
    assert hsdp["global_step"] == one["global_step"] == 6
    assert max_diff(hsdp["weights"], one["weights"]) < 1e-10
    assert abs(hsdp["val"][0]["val/loss"] - one["val"][0]["val/loss"]) < 1e-10
    assert (hsdp["predictions"] - one["predictions"]).abs().max() < 1e-10

    (three,) = [p for p in ck.iterdir() if p.is_dir() and "step=3" in p.name]
    for strategy in ("fsdp", "ddp"):
        folder = tmp_path / f"{strategy}_ck"
        shutil.copytree(three, folder / three.name)
        resumed = run2(tmp_path, strategy, "--strategy", strategy, "--batch", "4", "--ckpt-dir", str(folder), *same)
        assert (
            resumed["global_step"] == 6
            and resumed["strategy"] == {"fsdp": "FSDPStrategy", "ddp": "DDPStrategy"}[strategy]
        )
        assert len(resumed["seen"]) == 3 * 4  # rank 0 saw its 4 samples of steps 4-6 only
        assert max_diff(resumed["weights"], one["weights"]) < 1e-10, strategy


def test_a_failed_sharded_save_names_the_folder_the_bytes_and_the_intact_checkpoint(tmp_path: Path) -> None:
    """Disk full while DCP writes the shards (simulated: the shard writer raises ENOSPC): the error names
    the folder, the bytes needed and free, and that the previous checkpoint is intact; no temp folder stays."""
    code = f"""
import errno, sys, torch
sys.path.insert(0, 'tests/harness/scripts')
from torch.utils.data import DataLoader
from torch.distributed.checkpoint import FileSystemWriter
from fsdp_fit import BlockNet, data
from trainer import Trainer
from trainer.checkpoint.files import CheckpointSaveError
trainer = Trainer(max_steps=2, strategy='fsdp', precision='64', logger=False, enable_progress_bar=False,
                  enable_checkpointing=False, num_sanity_val_steps=0)
task = BlockNet()
trainer.fit(task, DataLoader(data(48, 0), batch_size=8))
good = {str(tmp_path / "good.ckpt")!r}
trainer.save_checkpoint(good)
def full(self, *a, **k):
    raise OSError(errno.ENOSPC, 'No space left on device')
FileSystemWriter.write_data = full
try:
    trainer.save_checkpoint({str(tmp_path / "bad.ckpt")!r})
except CheckpointSaveError as exc:
    print('ERR', exc.errno == errno.ENOSPC, '|', exc)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert "ERR True" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    message = done.stdout.split("|", 1)[1]
    for part in ("bad.ckpt", "No space left on device", "needs about", "free in", "Nothing was replaced"):
        assert part in message, (part, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.ckpt"]  # the temporary folder was removed


def test_async_sharded_save_refuses_non_finite_weights_on_every_rank(tmp_path: Path) -> None:
    """A NaN in rank 1's shard only: the background check votes on the checkpoint group, and the vote also
    picks the step boundary where every rank raises (AsyncCheckpointer.vote), so both ranks raise at the same
    step, neither left to die in the next step's all-gather; nothing is committed for that step, and `last`
    stays at the step before."""
    ck = tmp_path / "ck"
    result = spawn_ranks(
        SCRIPT,
        str(tmp_path / "out"),
        "--strategy",
        "fsdp",
        "--ckpt-dir",
        str(ck),
        "--async-save",
        "--nan-at",
        "3",
        "--steps",
        "6",
        nproc=2,
        timeout=300,
    )
    assert result.returncode != 0
    assert result.stdout.count("FloatingPointError: Refusing to write checkpoint") >= 2, result.tail()
    raised = dict(re.findall(r"^rank (\d) raised FloatingPointError at step (\d+)$", result.stdout, re.M))
    assert set(raised) == {"0", "1"} and raised["0"] == raised["1"], result.tail()
    assert (
        "step=2" in read_pointer(ck)[0]
        and not list(ck.glob("*step=3*"))
        and not [p for p in ck.iterdir() if ".tmp-" in p.name]
    )
