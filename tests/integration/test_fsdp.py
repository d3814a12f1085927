"""strategy="fsdp" (FSDP2): the same maths as DDP, evaluation on the sharded task, sharded crash-safe
checkpoints that reshard, export to one plain file, and options refused before any process group."""

from __future__ import annotations

import os
import pickle
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


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_folder_without_a_manifest_is_never_read(tmp_path: Path) -> None:
    """A folder with keel.pt and a hostile .metadata but no keel.json was never committed: refused before a byte
    of it is unpickled (a committed save with a hostile file: tests/integration/test_checkpoint_integrity.py)."""
    from trainer.checkpoint.files import CorruptCheckpointError
    from trainer.checkpoint.reader import load_weights

    folder = tmp_path / "epoch=0-step=1.ckpt"
    folder.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"keel_format_version": 1, "state_dict": {}}, folder / "keel.pt")
    (folder / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CorruptCheckpointError, match="has no keel.json: it was never committed"):
        load_weights(folder)
    assert not marker.exists()  # refused before anything in it ran


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"reduce_grads": "sometimes"}, "FSDPStrategy(reduce_grads='sometimes'): expected 'every_micro_batch'"),
        ({"units": [3]}, "FSDPStrategy(units=[3]): expected a non-empty list of module class names"),
        ({"cpu_offload": 1}, "FSDPStrategy(cpu_offload=1): expected True or False"),
        ({"replicate_size": 0}, "FSDPStrategy(replicate_size=0): expected a whole number >= 1"),
        ({"replicate_size": "nodes"}, "or 'auto' (one group per node)"),
        (
            {"replicate_size": 2},
            "FSDPStrategy(replicate_size=2) gives 2 replica groups, which do not divide the 1 data-parallel ranks",
        ),
    ],
)
def test_bad_fsdp_settings_are_refused_before_any_group(
    settings: dict, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed

    from trainer import FSDPStrategy, Trainer

    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("a group was made"))
    with pytest.raises(ValueError) as info:
        Trainer(logger=False, strategy=FSDPStrategy(**settings))
    assert expected in str(info.value)


@pytest.mark.parametrize(
    "option, value, new_form",
    [
        ("fsdp_units", ["Block"], "Trainer(strategy=FSDPStrategy(units=['Block']))"),
        ("fsdp_cpu_offload", True, "Trainer(strategy=FSDPStrategy(cpu_offload=True))"),
        ("fsdp_reduce_grads", "last_micro_batch", "FSDPStrategy(reduce_grads='last_micro_batch')"),
        ("find_unused_parameters", True, "Trainer(strategy=DDPStrategy(find_unused_parameters=True))"),
        ("bucket_cap_mb", 50, "DDPStrategy(bucket_cap_mb=50)"),
    ],
)
def test_the_old_strategy_keywords_fail_showing_the_new_form(option: str, value: object, new_form: str) -> None:
    from trainer import Trainer

    with pytest.raises(ValueError) as info:
        Trainer(logger=False, strategy="fsdp", **{option: value})
    message = str(info.value)
    assert f"Trainer option {option!r} is now a setting of the strategy object" in message, message
    assert new_form in message and "_target_: trainer." in message, message


def test_strategy_objects_carry_their_settings_into_the_run() -> None:
    """The string forms build the defaults (Lightning's registered names their settings); the object given is the
    strategy the Trainer runs, and its settings are what the options record (plain values, classes by name)."""
    from trainer import DDPStrategy, FSDPStrategy, Trainer

    fsdp = FSDPStrategy(units=[torch.nn.Linear, "Block"], cpu_offload=True, reduce_grads="last_micro_batch")
    trainer = Trainer(logger=False, strategy=fsdp, enable_progress_bar=False)
    assert trainer.strategy is fsdp and trainer.strategy.world_size == 1
    recorded = trainer.options.resolved()["strategy"]
    assert recorded == {
        "name": "FSDPStrategy",
        "units": ["Linear", "Block"],
        "reshard_after_forward": True,
        "cpu_offload": True,
        "reduce_grads": "last_micro_batch",
        "activation_checkpointing": None,
        "tensor_parallel_size": 1,
        "replicate_size": 1,
    }
    assert "cpu_offload=True" in repr(fsdp) and "world_size=1" in repr(fsdp)
    assert Trainer(logger=False, strategy="fsdp_cpu_offload").strategy.cpu_offload is True
    # One process: a DDP strategy runs as the single-device one, as strategy="ddp" does.
    assert Trainer(logger=False, strategy=DDPStrategy(static_graph=True)).strategy.name == "single"
    with pytest.raises(ValueError, match=r"DDPStrategy\(bucket_cap_mb=0\): expected a number of megabytes > 0"):
        DDPStrategy(bucket_cap_mb=0)
    with pytest.raises(TypeError):
        DDPStrategy(True)  # keyword-only: a positional setting is a mistake


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


def test_async_staging_reuses_its_cpu_buffers_and_always_copies_the_current_values() -> None:
    from trainer.checkpoint.dcp_io import ReusedStaging

    w = torch.arange(4.0)
    state = {
        "model": {"w": w},
        "optimizers": [{"state": {"w": {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1}]}],
    }
    stager = ReusedStaging()
    first = stager.stage(state)
    w.add_(10)
    state["optimizers"][0]["param_groups"][0]["lr"] = 0.05
    second = stager.stage(state)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr() != w.data_ptr()  # one buffer, reused
    assert (
        second["model"]["w"].tolist() == [10.0, 11.0, 12.0, 13.0]
        and second["optimizers"][0]["param_groups"][0]["lr"] == 0.05
    )
    w.add_(1)
    assert second["model"]["w"].tolist() == [10.0, 11.0, 12.0, 13.0]  # training goes on; the staged copy stays
    state["optimizers"][0]["state"]["w"]["exp_avg"] = torch.zeros(4)  # new optimizer state: a new layout
    third = stager.stage(state)
    assert (
        third["optimizers"][0]["state"]["w"]["exp_avg"].tolist() == [0.0] * 4
        and third["model"]["w"].tolist()[0] == 11.0
    )


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
