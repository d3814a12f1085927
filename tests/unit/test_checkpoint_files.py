"""Checkpoint files in one process: truncated, garbage and malicious files are refused and run nothing, top-k and
`last` bookkeeping across resumes, filename templates, load_from_checkpoint and the plain export, forced saves
before the monitored metric exists, and save_last's modes. Exact resume after crashes, SIGKILL under torchrun, torn
writes and SIGTERM preemption (1 and 2 ranks) is launched: tests/integration/test_checkpoint.py."""

from __future__ import annotations

import contextlib
import os
import pickle
from pathlib import Path

import pytest
import torch
from models import Regression, loader, quiet, regression_data

from trainer import Trainer
from trainer.checkpoint.files import CheckpointError, read_pointer
from trainer.checkpoint.hf import export_weights
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.checkpoint.reader import load_weights


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


@pytest.mark.parametrize(
    ("monitor", "warned"), [("val/accuracy", True), ("val/loss", False), ("train/loss", False), ("train/los", True)]
)
def test_a_monitor_nothing_logged_is_reported_at_the_first_step_not_an_epoch_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monitor: str, warned: bool
) -> None:
    """The sanity check's validation and the first step show every key a plain task logs: a monitor none of them
    has is named three steps in, with what was logged, where the KeyError used to wait for the first save (an
    epoch). Only a warning: a metric logged later (an epoch-end hook, every few batches) is legitimate."""
    callback = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor=monitor)
    trainer = Trainer(**quiet(max_steps=3, num_sanity_val_steps=2, callbacks=[callback], enable_checkpointing=True))
    # The save at the end of fit still fails as it did (a KeyError naming the monitor); the warning came first.
    failure = pytest.raises(KeyError, match="no such metric was logged") if warned else contextlib.nullcontext()
    with caplog.at_level("WARNING", logger="trainer.checkpoint.model_checkpoint"), failure:
        trainer.fit(Regression(), loader(regression_data(64), batch_size=4), loader(regression_data(16), batch_size=4))
    lines = [r.getMessage() for r in caplog.records if f"ModelCheckpoint(monitor={monitor!r})" in r.getMessage()]
    if not warned:
        assert lines == []
        return
    (line,) = lines
    assert "nothing has been logged under that name by the sanity check's validation or the first training step" in line
    assert "'train/loss'" in line and "'val/loss'" in line


def test_trainer_export_weights_writes_the_fitted_weights_in_each_form(tmp_path: Path) -> None:
    from trainer.checkpoint.hf import open_weights

    with pytest.raises(RuntimeError, match=r"needs the task: call it after fit\(\)"):
        Trainer(**quiet()).export_weights(tmp_path / "early")
    task = Regression()
    trainer = Trainer(**quiet(max_steps=3))
    trainer.fit(task, loader(regression_data(32), batch_size=8))
    expected = {k: v.detach().clone() for k, v in task.state_dict().items()}
    for out in (tmp_path / "hf", tmp_path / "one.safetensors", tmp_path / "plain.pt"):
        trainer.export_weights(out)
        with open_weights(out) as source:
            got = source.read_many(source.keys())
        assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected), out
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    trainer.export_weights(tmp_path / "half.safetensors", dtype=torch.bfloat16, rename=lambda k: "model." + k)
    with open_weights(tmp_path / "half.safetensors") as source:
        assert all(k.startswith("model.") and source.meta(k)[1] == torch.bfloat16 for k in source.keys())
