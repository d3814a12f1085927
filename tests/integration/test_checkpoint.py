"""Checkpoints: exact resume (1 and 2 ranks), crashes, SIGKILL under torchrun restarts, torn writes,
corrupt and malicious files, SIGTERM preemption, top-k and `last` bookkeeping."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, python, spawn_ranks, torchrun
from models import Regression, loader, quiet, regression_data

from trainer import Trainer
from trainer.checkpoint.files import CheckpointError, read_pointer
from trainer.checkpoint.hf import export_weights
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.checkpoint.reader import load_weights
from trainer.distributed.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "resume_fit.py"


def weights(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def assert_same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == 14
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name


@pytest.fixture(scope="module")
def single_reference(resume_fit_one_process: Path) -> dict:
    return weights(resume_fit_one_process)


@pytest.fixture(scope="module")
def ddp_reference(resume_fit_two_ranks: Path) -> list[dict]:
    ranks = [weights(resume_fit_two_ranks, r) for r in (0, 1)]
    assert_same(ranks[0], ranks[1])
    return ranks


@pytest.mark.parametrize(
    "crash_at", [4, pytest.param(9, marks=pytest.mark.slow)]
)  # 6 steps per epoch: mid-epoch in epochs 0 and 1 (a variant: slow)
def test_resume_after_crash_equals_uninterrupted(tmp_path: Path, single_reference: dict, crash_at: int) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = python(SCRIPT, *args, "--crash-at", str(crash_at), timeout=120)
    assert first.returncode != 0 and f"simulated crash at step {crash_at}" in first.stdout
    python(SCRIPT, *args, "--resumed", timeout=120).check()
    assert_same(weights(tmp_path / "out"), single_reference)


def test_two_rank_resume_equals_uninterrupted(tmp_path: Path, ddp_reference: list[dict]) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = spawn_ranks(SCRIPT, *args, "--crash-at", "4", nproc=2, timeout=180)
    assert first.returncode != 0
    spawn_ranks(SCRIPT, *args, "--resumed", nproc=2, timeout=180).check()
    for rank in (0, 1):
        assert_same(weights(tmp_path / "out", rank), ddp_reference[rank])


@pytest.mark.parametrize("kill_at,kill_rank", [pytest.param(3, 1, marks=pytest.mark.slow), (8, 0)])  # a variant: slow
def test_sigkill_under_torchrun_restarts_and_matches(
    tmp_path: Path, ddp_reference: list[dict], kill_at: int, kill_rank: int
) -> None:
    result = torchrun(
        SCRIPT,
        str(tmp_path / "out"),
        "--ckpt-dir",
        str(tmp_path / "ck"),
        "--kill-at",
        str(kill_at),
        "--kill-rank",
        str(kill_rank),
        nproc=2,
        max_restarts=2,
        timeout=240,
    ).check()
    assert "Resumed at global step" in result.stdout  # the restart really resumed
    for rank in (0, 1):
        assert_same(weights(tmp_path / "out", rank), ddp_reference[rank])


def test_writer_killed_mid_save_keeps_last_loadable(tmp_path: Path, single_reference: dict) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = python(SCRIPT, *args, "--kill-in-save-at", "5", timeout=120)
    assert first.returncode == -9
    names = read_pointer(tmp_path / "ck")
    assert names and "step=4" in names[0]
    load_weights(tmp_path / "ck" / names[0])  # `last` still loads, and verifies
    python(SCRIPT, *args, "--resumed", timeout=120).check()
    assert_same(weights(tmp_path / "out"), single_reference)


def test_sigterm_saves_at_the_current_step_and_resumes_exactly(tmp_path: Path, single_reference: dict) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = python(SCRIPT, *args, "--sigterm-at", "5", timeout=120)
    assert first.returncode == PREEMPTED_EXIT_CODE, first.tail()
    assert "Preempted (SIGTERM) at step 5" in first.stdout
    assert "preempted" in read_pointer(tmp_path / "ck")[0] and "step=5" in read_pointer(tmp_path / "ck")[0]
    python(SCRIPT, *args, "--resumed", timeout=120).check()
    assert_same(weights(tmp_path / "out"), single_reference)


def test_sigterm_on_one_rank_stops_both(tmp_path: Path, ddp_reference: list[dict]) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = spawn_ranks(SCRIPT, *args, "--sigterm-at", "3", "--kill-rank", "1", nproc=2, timeout=180)
    assert first.returncode != 0
    # Checked every 2 steps (preemption_check_interval=2): both ranks agree at step 4 and save there.
    assert "step=4-preempted" in read_pointer(tmp_path / "ck")[0]
    spawn_ranks(SCRIPT, *args, "--resumed", nproc=2, timeout=180).check()
    for rank in (0, 1):
        assert_same(weights(tmp_path / "out", rank), ddp_reference[rank])


def test_ctrl_c_on_two_ranks_saves_stops_quietly_and_resumes_exactly(tmp_path: Path, ddp_reference: list[dict]) -> None:
    """Ctrl-C reaches every rank (twice, as torchrun's agent forwards the terminal's SIGINT): the ranks agree at
    the next check (every 2 steps), save, rank 0 logs one line, and every rank exits 130 without a traceback."""
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = spawn_ranks(SCRIPT, *args, "--sigint-at", "3", nproc=2, timeout=180)
    assert first.returncode == INTERRUPTED_EXIT_CODE, first.tail()
    assert "step=4-interrupted" in read_pointer(tmp_path / "ck")[0]
    assert first.stdout.count("Stopped by Ctrl-C at step 4") == 1 and "Traceback" not in first.stdout
    assert first.stdout.count("SIGINT received at step 3") == 2  # each rank says once that it heard it
    spawn_ranks(SCRIPT, *args, "--resumed", nproc=2, timeout=180).check()
    for rank in (0, 1):
        assert_same(weights(tmp_path / "out", rank), ddp_reference[rank])


def test_a_signal_on_one_rank_is_acted_on_at_the_next_step_by_default(
    tmp_path: Path, ddp_reference: list[dict]
) -> None:
    """preemption_check_interval=None (the default) under DDP: the flags ride on every step's gradient all-reduce, so
    a SIGTERM to rank 1 in on_train_batch_end of step 4 (after that step's all-reduce) stops both ranks at step 5,
    the next step, where the interval of 2 (or the logging steps, every 3) would wait until step 6. Resumes exactly.
    A signal in step 3's hooks likewise stops at step 4 (with Ctrl-C on every rank, below), and under FSDP too."""
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck"), "--default-check"]
    first = spawn_ranks(SCRIPT, *args, "--sigterm-at", "4", "--kill-rank", "1", nproc=2, timeout=180)
    assert first.returncode != 0
    assert "step=5-preempted" in read_pointer(tmp_path / "ck")[0], first.tail()
    assert "SIGTERM received at step 4: the run saves and stops at the next step boundary" in first.stdout
    spawn_ranks(SCRIPT, *args, "--resumed", nproc=2, timeout=180).check()
    for rank in (0, 1):
        assert_same(weights(tmp_path / "out", rank), ddp_reference[rank])
    fsdp = tmp_path / "fsdp"  # FSDP: the flags go in one small asynchronous all-reduce a step, read a step later
    args = [str(fsdp / "out"), "--ckpt-dir", str(fsdp / "ck"), "--default-check", "--strategy", "fsdp"]
    third = spawn_ranks(SCRIPT, *args, "--sigterm-at", "4", "--kill-rank", "1", nproc=2, timeout=180)
    assert third.returncode != 0
    assert "step=5-preempted" in read_pointer(fsdp / "ck")[0], third.tail()
    interrupted = tmp_path / "ctrl-c"
    args = [str(interrupted / "out"), "--ckpt-dir", str(interrupted / "ck"), "--default-check"]
    second = spawn_ranks(SCRIPT, *args, "--sigint-at", "3", nproc=2, timeout=180)
    assert second.returncode == INTERRUPTED_EXIT_CODE, second.tail()
    assert "step=4-interrupted" in read_pointer(interrupted / "ck")[0]


# ---------------------------------------------------------------------- single-process file handling
def fit_with_checkpoints(tmp_path: Path, **ckpt_kwargs) -> tuple[Trainer, ModelCheckpoint]:
    cb = ModelCheckpoint(dirpath=tmp_path, **ckpt_kwargs)
    trainer = Trainer(**quiet(max_epochs=3, enable_checkpointing=True, callbacks=[cb]))
    trainer.fit(Regression(), loader(regression_data(), 16), loader(regression_data(24, seed=1), 8))
    return trainer, cb


def test_truncated_and_garbage_files(tmp_path: Path) -> None:
    trainer, cb = fit_with_checkpoints(tmp_path, save_top_k=-1)
    files = sorted(tmp_path.glob("*.ckpt"), key=os.path.getmtime)
    newest = Path(cb.last_model_path)
    data = newest / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match="__0_0.distcp is corrupt"):
        Trainer(**quiet(max_epochs=4)).fit(Regression(), loader(regression_data(), 16), ckpt_path=str(newest))
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(os.urandom(2048))
    with pytest.raises(CheckpointError, match="garbage.ckpt"):
        Trainer(**quiet(max_epochs=4)).fit(Regression(), loader(regression_data(), 16), ckpt_path=str(garbage))
    # "last" skips the truncated newest save with a warning and resumes from the one before it.
    resumed = Trainer(**quiet(max_epochs=4, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path)]))
    resumed.fit(Regression(), loader(regression_data(), 16), ckpt_path="last")
    assert resumed.global_step == 16  # resumed at epoch 2 (8 steps), trained epochs 2 and 3
    assert len(files) == 3


def test_malicious_checkpoint_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = tmp_path / "evil.ckpt"
    torch.save({"keel_format_version": 1, "state_dict": {}, "payload": Payload()}, evil)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refuses to load"):
        load_weights(evil)
    with pytest.raises(CheckpointError):
        Regression.load_from_checkpoint(str(evil))
    assert not marker.exists()
    raw = tmp_path / "raw.ckpt"
    raw.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError):
        load_weights(raw)
    assert not marker.exists()


def test_last_is_a_no_op_on_a_first_run(tmp_path: Path) -> None:
    trainer = Trainer(**quiet(max_epochs=1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path)]))
    trainer.fit(Regression(), loader(regression_data(), 16), ckpt_path="last")
    assert trainer.global_step == 4 and read_pointer(tmp_path)


def test_top_k_and_last_bookkeeping_across_resumes(tmp_path: Path) -> None:
    _, cb = fit_with_checkpoints(tmp_path, monitor="val/loss", save_top_k=2, save_last=True)
    best, best_score = cb.best_model_path, cb.best_model_score
    assert len(cb.best_k_models) == 2 and Path(best).exists()
    cb2 = ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", save_top_k=2, save_last=True)
    trainer = Trainer(**quiet(max_epochs=5, enable_checkpointing=True, callbacks=[cb2]))
    trainer.fit(Regression(), loader(regression_data(), 16), loader(regression_data(24, seed=1), 8), ckpt_path="last")
    names = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert not any("-v1" in n for n in names)
    assert set(cb2.best_k_models) <= {str(p) for p in tmp_path.glob("*.ckpt")}
    assert len(cb2.best_k_models) == 2
    assert cb2.best_model_score <= best_score  # the best is never lost
    assert Path(cb2.last_model_path).exists() and "epoch=4" in cb2.last_model_path
    # ckpt_path="best" in a fresh process reads the callback state from the last checkpoint.
    fresh = Trainer(
        **quiet(enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, monitor="val/loss")])
    )
    (metrics,) = fresh.validate(Regression(), loader(regression_data(24, seed=1), 8), ckpt_path="best")
    assert metrics["val/loss"] == pytest.approx(cb2.best_model_score, rel=1e-6)


def test_filename_template_with_metrics(tmp_path: Path) -> None:
    _, cb = fit_with_checkpoints(tmp_path, filename="{epoch}-{step}-{val/loss:.3f}", monitor="val/loss")
    name = Path(cb.best_model_path).name
    assert name.startswith("epoch=") and "-step=" in name and "-val_loss=" in name and name.endswith(".ckpt")


def test_load_from_checkpoint_and_plain_export(tmp_path: Path) -> None:
    trainer, cb = fit_with_checkpoints(tmp_path)
    task = trainer.task
    loaded = Regression.load_from_checkpoint(cb.last_model_path)
    x = regression_data(5).tensors[0]
    with torch.no_grad():
        assert torch.equal(loaded(x), task(x))
    export_weights(cb.last_model_path, tmp_path / "weights.pt")
    net = Regression()
    net.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
    with torch.no_grad():
        assert torch.equal(net(x), task(x))


def test_checkpoint_from_two_ranks_resumes_on_one_at_the_global_cursor(tmp_path: Path) -> None:
    """2 ranks x batch 4 crash at step 4 (epoch 1, 16 of 48 samples consumed); 1 rank x batch 8 resumes at
    sample 16 of epoch 1's permutation: nothing re-read, nothing skipped."""
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = spawn_ranks(
        SCRIPT, *args, "--crash-at", "4", "--save-on-crash-dir", str(tmp_path / "crash"), nproc=2, timeout=180
    )
    assert first.returncode != 0
    before = [torch.load(tmp_path / "crash" / f"seen{r}.pt", weights_only=False) for r in (0, 1)]
    result = python(SCRIPT, *args, "--resumed", "--batch", "8", timeout=120).check()
    assert "resuming on 1" in result.stdout
    after = weights(tmp_path / "out")["seen"]
    consumed_before = before[0][1] + before[1][1]
    assert len(consumed_before) == 16
    assert sorted(consumed_before + after[1]) == list(range(48))


def test_forced_save_before_the_monitored_metric_exists(tmp_path: Path) -> None:
    """Preemption before the first validation: saved as `last`, outside the top-k, name marks the gap."""
    cb = ModelCheckpoint(
        dirpath=tmp_path, filename="{epoch}-{val/loss:.3f}", monitor="val/loss", every_n_train_steps=100
    )
    trainer = Trainer(**quiet(max_steps=2, enable_checkpointing=True, callbacks=[cb]))
    trainer.fit(Regression(), loader(regression_data(), 16))  # no validation data: val/loss never logged
    path = cb.save(trainer, suffix="-preempted", force=True)
    assert path is not None and Path(path).exists() and "val_loss=na" in path
    assert read_pointer(tmp_path)[0] == Path(path).name and cb.best_k_models == {}
    with pytest.raises(KeyError, match="val/loss"):
        cb.save(trainer)


class _FailsAtFirstStep(Regression):
    """Fails at the second batch it trains on: one optimizer step after the resume, so the state differs from
    the save it resumed from (a failure with nothing new to save saves nothing)."""

    def on_train_start(self):
        self.batches = 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        if self.batches == 2:
            raise RuntimeError("boom at the first step")
        return super().training_step(batch, batch_idx)


def test_forced_save_without_the_monitored_value_when_top_k_is_full(tmp_path: Path) -> None:
    """A resumed run that fails after one step, before its first validation (no ``val/loss`` yet), while top-k
    is full still saves on exception, as ``last``, outside the top-k; the run's own error is what the caller
    sees (before the fix, comparing the missing score with the worst kept one raised TypeError inside the
    save)."""
    _, cb = fit_with_checkpoints(tmp_path, monitor="val/loss", save_top_k=1)
    assert len(cb.best_k_models) == 1
    kept = dict(cb.best_k_models)
    cb2 = ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", save_top_k=1, save_on_exception=True)
    trainer = Trainer(**quiet(max_epochs=5, enable_checkpointing=True, callbacks=[cb2]))
    with pytest.raises(RuntimeError, match="boom at the first step"):
        trainer.fit(
            _FailsAtFirstStep(), loader(regression_data(), 16), loader(regression_data(24, seed=1), 8), ckpt_path="last"
        )
    assert cb2.best_k_models == kept  # the failed run's save is not ranked
    assert "-exception" in cb2.last_model_path and Path(cb2.last_model_path).exists()
    assert read_pointer(tmp_path)[0] == Path(cb2.last_model_path).name  # what ckpt_path="last" resumes from


@pytest.mark.parametrize("save_last", [True, "link"])
def test_save_last_leaves_the_final_state_whatever_the_periodic_triggers(tmp_path: Path, save_last) -> None:
    """every_n_epochs larger than the run: no periodic save fires, yet the fit ends with last.ckpt of its final
    state (Lightning's on_train_end does the same). With every_n_epochs=2 of 3 epochs the epoch-2 save stays in the
    top-k and the final state is saved as last.ckpt beside it. A resume of the finished run saves nothing again.
    A later save replaces last.ckpt by the alias to itself (below)."""
    ckpt_dir = tmp_path / "never"
    trainer = Trainer(
        **quiet(
            max_epochs=3,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=10, save_last=save_last)],
        )
    )
    trainer.fit(Regression(), loader(regression_data(), 16))
    final = {k: v.clone() for k, v in trainer.task.state_dict().items()}
    # A save made only because of save_last is named last.ckpt, as Lightning names it: no epoch-named save that a
    # program globbing for its epoch checkpoints would find.
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["keel.claim", "last", "last.ckpt"]
    assert (ckpt_dir / "last.ckpt").is_dir() and not os.path.islink(ckpt_dir / "last.ckpt")
    assert read_pointer(ckpt_dir) == ["last.ckpt"]
    restored = load_weights(str(ckpt_dir / "last.ckpt"))["state_dict"]
    assert all(torch.equal(restored[k], final[k]) for k in final)

    ckpt_dir = tmp_path / "every2"
    cb = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=2, save_last=save_last)
    Trainer(**quiet(max_epochs=3, enable_checkpointing=True, callbacks=[cb])).fit(
        Regression(), loader(regression_data(), 16)
    )
    names = sorted(p.name for p in ckpt_dir.iterdir())
    assert names == ["epoch=1-step=8.ckpt", "keel.claim", "last", "last.ckpt"]
    assert cb.best_model_path.endswith("epoch=1-step=8.ckpt") and cb.last_model_path.endswith("last.ckpt")
    assert (ckpt_dir / "last.ckpt").is_dir() and not os.path.islink(ckpt_dir / "last.ckpt")

    again = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=2, save_last=save_last)
    Trainer(**quiet(max_epochs=3, enable_checkpointing=True, callbacks=[again])).fit(
        Regression(), loader(regression_data(), 16), ckpt_path="last"
    )
    assert sorted(p.name for p in ckpt_dir.iterdir()) == names  # nothing saved twice, nothing pruned

    # A 4th epoch: its save is periodic (every_n_epochs=2), so the save made for save_last and the epoch-1 save
    # (top-1 without a monitor keeps the newest) are pruned, and last.ckpt becomes the alias to the newest save.
    more = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=2, save_last=save_last)
    Trainer(**quiet(max_epochs=4, enable_checkpointing=True, callbacks=[more])).fit(
        Regression(), loader(regression_data(), 16), ckpt_path="last"
    )
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [
        "epoch=3-step=16.ckpt",
        "keel.claim",
        "last",
        "last.ckpt",
    ]
    assert (
        os.readlink(ckpt_dir / "last.ckpt") == "epoch=3-step=16.ckpt"
        and read_pointer(ckpt_dir)[0] == "epoch=3-step=16.ckpt"
    )


def test_save_last_rejects_unknown_modes() -> None:
    with pytest.raises(ValueError, match="save_last='copy'"):
        ModelCheckpoint(save_last="copy")
