"""WeightAveraging, EMAWeightAveraging and StochasticWeightAveraging (callbacks/weight_averaging.py): the same
program ends with Lightning 2.6.6's weights, a checkpoint holds the average as Lightning's does, and a fit killed
midway and resumed with ckpt_path="last" ends with the weights of the uninterrupted fit. Two ranks under DDP and
FSDP against one process: tests/integration/test_weight_averaging_dist.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import callbacks.lightning as L
from callbacks import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging
from trainer import Callback, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.checkpoint.reader import load_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import weight_averaging_program as program

# Lightning 2.6.6: `python tests/fixtures/weight_averaging_program.py` (lightning.pytorch, CPU, one process) printed
# these: the validation losses logged during fit, the validation loss of the final task, and each entry of its
# state_dict as (sum, sum of squares) in float64, rounded to 6 places.
LIGHTNING = {
    "swa": {
        "val_losses": [10.0428963, 3.7537465, 1.0610493, 0.4668898, 1.4720401],
        "final_loss": 1.8804688,
        "state": {
            "net.0.weight": (0.244111, 6.187243),
            "net.0.bias": (-0.768483, 0.877742),
            "net.1.weight": (8.65576, 10.301541),
            "net.1.bias": (0.38274, 0.348537),
            "net.1.running_mean": (-0.894958, 0.905438),
            "net.1.running_var": (6.751973, 7.937522),
            "net.1.num_batches_tracked": (4.0, 16.0),
            "net.3.weight": (-0.242846, 6.182537),
            "net.3.bias": (0.178133, 0.031731),
        },
    },
    "ema": {
        "val_losses": [11.9630337, 8.1210833, 4.6212206, 2.5432882],
        "final_loss": 3.3747122,
        "state": {
            "net.0.weight": (0.139694, 5.507715),
            "net.0.bias": (-0.768483, 0.877742),
            "net.1.weight": (8.363577, 9.182198),
            "net.1.bias": (0.091805, 0.200669),
            "net.1.running_mean": (-0.451084, 0.238656),
            "net.1.running_var": (6.841608, 6.281744),
            "net.1.num_batches_tracked": (6.0, 36.0),
            "net.3.weight": (-1.072258, 3.878611),
            "net.3.bias": (-0.037548, 0.00141),
        },
    },
    "wa": {
        "val_losses": [7.2816572, 4.1261497, 2.4811697, 1.7101295],
        "final_loss": 2.0679853,
        "state": {
            "net.0.weight": (0.230956, 5.75892),
            "net.0.bias": (-0.768483, 0.877742),
            "net.1.weight": (8.389607, 9.321282),
            "net.1.bias": (0.152131, 0.229913),
            "net.1.running_mean": (-0.45887, 0.241628),
            "net.1.running_var": (6.587313, 5.759566),
            "net.1.num_batches_tracked": (1.0, 1.0),
            "net.3.weight": (-0.876815, 4.556599),
            "net.3.bias": (-0.004041, 1.6e-05),
        },
    },
}


@pytest.mark.parametrize("case", ["swa", "ema", "wa"])
def test_the_program_ends_with_lightning_s_weights_and_validation_losses(case: str) -> None:
    """SWA (from epoch 2, annealed, with the BatchNorm pass at the end), EMA and the equal average of every step.
    The weights agree to the 6 places recorded (both compute in float32 in the same order); the validation losses to
    1e-5 relative, since keel reduces a logged mean in float64 and Lightning in float32, and CPUs differ in kernels.
    Lightning's SWA validates once more, after its extra BatchNorm epoch; keel recomputes the statistics when
    training ends and does not (docs/porting.md), so the fifth loss is Lightning's alone."""
    got = program.summary(program.run(L.pytorch, case))
    expected = LIGHTNING[case]
    assert got["state"].keys() == expected["state"].keys()
    for key, (total, squares) in expected["state"].items():
        assert got["state"][key] == pytest.approx((total, squares), abs=2e-6), key
    losses = expected["val_losses"][:4]
    # float32 kernels differ across CPUs by about 5e-7 relative (the constants' machine against an AMD EPYC)
    assert got["val_losses"] == pytest.approx(losses, rel=1e-5)
    assert got["final_loss"] == pytest.approx(expected["final_loss"], rel=1e-5)


# ---------------------------------------------------------------------- killed and resumed
class Killed(RuntimeError):
    pass


class KillAt(Callback):
    """Kills the fit after step ``step``; step -1: as training ends, before the averaging callback's hook."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise Killed(f"killed at step {self.step}")

    def on_train_end(self, trainer: Trainer, task: Any) -> None:
        if self.step == -1:
            raise Killed("killed as training ends")


def averaging(case: str) -> Callback:
    if case == "swa":
        return StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=2)
    if case == "ema":
        return EMAWeightAveraging(decay=0.9, update_starting_at_step=2, update_every_n_steps=2)
    return WeightAveraging(device="cpu")


def fit(root: Path, case: str, *, kill_at: int | None = None, ckpt_path: str | None = None) -> Any:
    task = program.task(L.pytorch)
    # Saves every 3 steps; into the folder "end", at each epoch end instead (the last one before training ends).
    every = {"every_n_epochs": 1} if root.name == "end" else {"every_n_train_steps": 3}
    callbacks: list[Callback] = [averaging(case), ModelCheckpoint(dirpath=root, save_last=True, **every)]
    if kill_at is not None:
        callbacks.insert(0, KillAt(kill_at))
    trainer = Trainer(
        max_epochs=4,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
    )
    trainer.fit(task, program.data(32, seed=1), program.data(16, seed=2), ckpt_path=ckpt_path)
    return task


@pytest.mark.parametrize(("case", "kill_at"), [("swa", 7), ("swa", 13), ("swa", -1), ("ema", 10), ("wa", 5)])
def test_a_fit_killed_midway_and_resumed_from_last_ends_with_the_uninterrupted_weights(
    tmp_path: Path, case: str, kill_at: int
) -> None:
    """Saves every 3 steps (4 steps an epoch), killed after a save: SWA at step 7 resumes at step 6 (in its first
    averaging epoch: SWALR's state and the average come back), at step 13 at step 12 (the last epoch's start, whose
    update is not repeated), and (-1) after the last epoch's save, before SWA copied its average in (the resumed fit
    runs no step: it copies the restored average and recomputes the BatchNorm statistics); EMA (every second step
    from step 2) and the per-step equal average mid-epoch. The final weights, buffers and BatchNorm statistics
    equal the uninterrupted fit's exactly."""
    whole = fit(tmp_path / "whole", case)
    folder = tmp_path / ("end" if kill_at == -1 else "killed")
    with pytest.raises(Killed):
        fit(folder, case, kill_at=kill_at)
    resumed = fit(folder, case, ckpt_path="last")
    expected, got = whole.state_dict(), resumed.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_a_checkpoint_holds_the_averaged_weights_as_its_state_dict_and_the_training_ones_beside(tmp_path: Path) -> None:
    """Lightning's layout: ``state_dict`` is the average (what load_from_checkpoint and validate(ckpt_path=...)
    read), ``current_model_state`` the weights being trained, ``averaging_state`` the count; each save's
    ``lightning.pt`` (callbacks.lightning's ModelCheckpoint) holds the average as its ``state_dict``."""
    seen: dict[str, Any] = {}

    class Look(Callback):
        def on_train_end(self, trainer: Trainer, task: Any) -> None:
            seen["trained"] = {k: v.clone() for k, v in task.state_dict().items()}  # WeightAveraging runs after

    task = program.task(L.pytorch)
    trainer = L.Trainer(
        max_epochs=1,
        callbacks=[Look(), WeightAveraging(), L.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4)],
        logger=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(task, program.data(32, seed=1))
    save = trainer.checkpoint_callback.best_model_path  # the step-4 save: the end of the only epoch
    checkpoint = load_weights(save)
    averaged = task.state_dict()  # on_train_end copied the average in
    for key, value in averaged.items():
        assert torch.equal(checkpoint["state_dict"][key], value), key
    assert int(checkpoint["averaging_state"]["n_averaged"]) == 4
    assert save.endswith("lightning.pt")
    plain = torch.load(save, weights_only=True)
    assert torch.equal(plain["state_dict"]["net.0.weight"], averaged["net.0.weight"])
    # The weights being trained differ from the average; a fit resumed from the save continues from them, and ends
    # (at max_epochs already: no step runs) with the average copied in again.
    trained = seen.pop("trained")
    assert not torch.equal(trained["net.0.weight"], averaged["net.0.weight"])
    resumed = program.task(L.pytorch)
    options = dict(logger=False, enable_progress_bar=False, enable_checkpointing=False)
    Trainer(max_epochs=1, callbacks=[Look(), WeightAveraging()], **options).fit(
        resumed, program.data(32, seed=1), ckpt_path=save
    )
    for key, value in trained.items():
        assert torch.equal(seen["trained"][key], value), key
        assert torch.equal(resumed.state_dict()[key], averaged[key]), key


def test_bad_arguments_are_refused_naming_them() -> None:
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['decay'\].*avg_fn"):
        WeightAveraging(decay=0.9)
    with pytest.raises(ValueError, match="swa_epoch_start=0"):
        StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=0)
    with pytest.raises(ValueError, match="swa_lrs=-1.0"):
        StochasticWeightAveraging(swa_lrs=-1.0)
    with pytest.raises(ValueError, match="annealing_strategy='exp'"):
        StochasticWeightAveraging(swa_lrs=0.1, annealing_strategy="exp")  # type: ignore[arg-type]
