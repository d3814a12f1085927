"""Lightning's ``Tuner`` on keel (callbacks/tuner.py): ``lr_find`` and ``scale_batch_size`` find what Lightning
2.6.6 finds on the same seeded program, and leave the task, its optimizer and the Trainer as they were.

The program is tests/harness/tuner_program.py; it takes the Lightning package as an argument, so the measured run
and keel's differ only in that import. The constants below are Lightning 2.6.6's: ``python
tests/harness/tuner_program.py`` with Lightning 2.6.6 and torch 2.13 (CPU) installed, which prints them in this
form.

Tolerances: the learning rates are Lightning's formula in Python floats (compared to 1e-12). The losses come from
float32 training, smoothed in Python floats; keel's float32 steps are the same kernels in the same order, so on this
torch they agree to the last bit, and rel=1e-6 only leaves room for another torch build's float32 rounding. A
different algorithm shows at once: the smoothing's one-step-ahead bias correction alone changes the first loss by a
factor of two, an lr one step off changes ``lr1`` by 40%.
"""

from __future__ import annotations

import importlib
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import tuner_program as program
from models import quiet
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import callbacks.lightning as L
from callbacks.tuner import LRFinder, Tuner, is_oom_error

# Lightning 2.6.6: tuner_program.summary(lr_case(...)) for each of tuner_program.LR_CASES.
LIGHTNING_LR = {
    "exponential": {
        "steps": 97,  # stopped early: the smoothed loss passed 4x its best
        "suggestion": 1.0964781961431852e-07,
        "index": 12,
        "model_lr": 1.0964781961431852e-07,
        "lr1": 1.4454397707459274e-08,
        "lr_last": 0.5754399373371567,
        "finite": 97,
        "finite_sum": 919.3447003442938,
        "picks": [
            7.495335858277591,
            6.030252946021521,
            5.849902699269979,
            9.869938076807054,
            9.866704480317074,
            25.18677627158263,
        ],
    },
    "linear": {
        "steps": 50,
        "suggestion": 0.1300000074,
        "index": 12,
        "model_lr": 0.1300000074,
        "lr1": 0.020000009600000004,
        "lr_last": 0.5,
        "finite": 50,
        "finite_sum": 1935573.6037726435,
        "picks": [
            7.495335858277591,
            6.030252946021521,
            5.762019326769757,
            6.9561548751510225,
            8.828545039621877,
            1103134.2402691317,
        ],
    },
    "diverging": {  # the loss overflows at step 43; Lightning records NaN to the end, keel's fit stops at max_steps
        "steps": 60,
        "suggestion": 1.07977516232771e-05,
        "index": 12,
        "model_lr": 1.07977516232771e-05,
        "lr1": 2.9286445646252368e-08,
        "lr_last": 1000000.0,
        "finite": 43,
        "finite_sum": 9.959586148280635e29,
        "picks": [
            7.495335858277591,
            6.030252946021521,
            5.849902699269979,
            9.86983505980454,
            9.057787724142786,
            9.959488514248897e29,
        ],
    },
    "accumulate": {  # accumulate_grad_batches=2: Lightning records the step's last micro-batch's loss / 2
        "steps": 40,
        "suggestion": 3.981071705534973e-06,
        "index": 12,
        "model_lr": 3.981071705534973e-06,
        "lr1": 2.51188643150958e-08,
        "lr_last": 1.0,
        "finite": 40,
        "finite_sum": 196.27866942686975,
        "picks": [
            0.8049005209797552,
            2.9303971690687884,
            3.3678677511584607,
            4.375635229740047,
            4.93126729854165,
            14.334497432411837,
        ],
    },
}

# Lightning 2.6.6: tuner_program.bs_case(...) for each of tuner_program.BS_CASES: the size found, the attribute
# afterwards, and the batch size of every step the trials ran (a fake CUDA OOM above the model's limit).
LIGHTNING_BS = {
    "power": {"found": 32, "attribute": 32, "seen": [2, 2, 2, 4, 4, 4, 8, 8, 8, 16, 16, 16, 32, 32, 32, 64]},
    "binsearch": {
        "found": 45,  # 48 fits, 49 does not; less the 5% margin
        "attribute": 45,
        "seen": [2, 2, 2, 4, 4, 4, 8, 8, 8, 16, 16, 16, 32, 32, 32, 64, 48, 48, 48, 56, 52, 50, 49],
    },
    "hparams_max_trials": {"found": 24, "attribute": 24, "seen": [2, 2, 2, 6, 6, 6, 12, 12, 12, 24, 24, 24]},
    "datamodule_small_dataset": {  # 128 >= the 100 samples: the search stops there
        "found": 128,
        "attribute": 128,
        "seen": [7, 7, 7, 8, 8, 8, 16, 16, 16, 32, 32, 32, 64, 36, 64, 100, 100, 100],
    },
    "validate_binsearch": {
        "found": 95,
        "attribute": 95,
        "seen": [2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, 128, 96, 96, 112, 104, 100, 100, 102, 101],
    },
}


@pytest.mark.parametrize("case", sorted(program.LR_CASES))
def test_lr_find_finds_what_lightning_finds(case: str, tmp_path: Path) -> None:
    got = program.summary(program.lr_case(L, Tuner, str(tmp_path), **program.LR_CASES[case]))
    expected = LIGHTNING_LR[case]
    assert (got["steps"], got["finite"], got["index"]) == (expected["steps"], expected["finite"], expected["index"])
    for key in ("suggestion", "model_lr", "lr1", "lr_last"):
        assert got[key] == pytest.approx(expected[key], rel=1e-12), key
    # The losses are float32 training: CPUs differ in kernels (the constants' machine against an AMD EPYC: 3e-6
    # relative after 40 steps; once a loss has blown up past 1e6 the two differ by up to 18x, chaos). The decisions
    # above are exact; a blown-up loss must have blown up here too.
    for got_loss, want in zip([got["finite_sum"], *got["picks"]], [expected["finite_sum"], *expected["picks"]]):
        if abs(want) < 1e6:
            assert got_loss == pytest.approx(want, rel=1e-4)
        else:
            assert abs(got_loss) > 1e4, (got_loss, want)


@pytest.mark.parametrize("case", sorted(program.BS_CASES))
def test_scale_batch_size_finds_what_lightning_finds(case: str, tmp_path: Path) -> None:
    spec = program.BS_CASES[case]
    got = program.bs_case(L, Tuner, str(tmp_path), **spec)
    expected = LIGHTNING_BS[case]
    assert (got["found"], got["attribute"]) == (expected["found"], expected["attribute"])
    steps = spec.get("steps_per_trial", 3)
    init_val = spec.get("init_val", 2)
    # Lightning 2.6.6 builds the first trial's loader before it sets init_val, so its first trial runs at the
    # attribute's old value (7 or 2 above, reported as init_val); keel's runs at init_val. The rest is step for step.
    assert got["seen"][:steps] == [init_val] * steps
    assert got["seen"][steps:] == expected["seen"][steps:]


# ---------------------------------------------------------------------- what the search leaves behind
class Kept(L.LightningModule):
    """Keeps its optimizer (and scheduler) across fits, so what the search did to them shows."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        self.opt: torch.optim.Optimizer | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        if self.opt is None:
            self.opt = torch.optim.Adam(self.parameters(), lr=self.lr)
            self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=5)
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": self.sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(program.regression(256), batch_size=16)


def _state(task: Kept) -> dict[str, Any]:
    return {
        "weights": {k: v.clone() for k, v in task.state_dict().items()},
        "optimizer": repr(task.opt.state_dict()) if task.opt is not None else None,
        "scheduler": dict(task.sched.state_dict()) if task.opt is not None else None,
    }


def test_lr_find_leaves_weights_optimizer_scheduler_trainer_and_rng_as_they_were(tmp_path: Path) -> None:
    L.seed_everything(3, verbose=False)
    task = Kept()
    trainer = L.Trainer(**quiet(max_epochs=3, default_root_dir=str(tmp_path), enable_progress_bar=True))
    trainer.fit(task)  # trained: the optimizer has state, the scheduler has stepped, global_step is 48
    callbacks, loggers, options = list(trainer.callbacks), trainer.loggers, dict(vars(trainer.options))
    before, step, rng = _state(task), trainer.global_step, torch.get_rng_state()
    lr = task.opt.param_groups[0]["lr"]
    finder = Tuner(trainer).lr_find(task, num_training=20, update_attr=False)
    assert finder is not None and len(finder.results["lr"]) == len(finder.results["loss"]) == 20
    after = _state(task)
    assert after["optimizer"] == before["optimizer"] and after["scheduler"] == before["scheduler"]
    assert all(torch.equal(after["weights"][k], v) for k, v in before["weights"].items())  # BatchNorm's stats too
    assert task.opt.param_groups[0]["lr"] == lr  # not the search's last learning rate
    assert trainer.callbacks == callbacks and trainer.loggers is loggers and vars(trainer.options) == options
    assert trainer.global_step == step and not trainer.should_stop
    assert torch.equal(torch.get_rng_state(), rng)
    assert task.lr == 0.01
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written (Lightning removes its checkpoint)


def test_update_attr_sets_the_suggestion_on_the_task_and_its_kept_optimizer(tmp_path: Path) -> None:
    L.seed_everything(3, verbose=False)
    task = Kept()
    trainer = L.Trainer(**quiet(max_epochs=3, default_root_dir=str(tmp_path)))
    finder = Tuner(trainer).lr_find(task, num_training=30)
    assert finder is not None and task.lr == finder.suggestion() and task.lr is not None
    assert [g["lr"] for g in task.opt.param_groups] == [task.lr]  # as Lightning sets the active optimizer's


def test_fit_after_lr_find_trains_as_a_fit_without_it(tmp_path: Path) -> None:
    """lr_find, then fit: the same weights as a fresh, identically seeded task fitted with the learning rate found
    (the search changed nothing but the learning rate). With the default logger: the search writes no files, the
    real fit writes lightning_logs/version_0."""
    classes = program.build(L)

    def fitted(lr: float | None) -> tuple[dict[str, torch.Tensor], float]:
        L.seed_everything(42, verbose=False)
        model, dm = classes["Net"](), classes["Data"]()
        trainer = L.Trainer(**program.trainer_kwargs(str(tmp_path / str(lr)), max_epochs=2, logger=True))
        if lr is None:
            Tuner(trainer).lr_find(model, datamodule=dm, num_training=40)
            assert not (tmp_path / "None").exists()
        else:
            model.hparams.lr = lr
        trainer.fit(model, datamodule=dm)
        assert trainer.global_step == 64
        return model.state_dict(), model.hparams.lr

    tuned, lr = fitted(None)
    assert (tmp_path / "None" / "lightning_logs").is_dir()
    assert [p.name for p in (tmp_path / "None" / "lightning_logs").iterdir()] == ["version_0"]
    plain, _ = fitted(lr)
    assert lr != 1e-3 and all(torch.equal(tuned[k], plain[k]) for k in plain)


# ---------------------------------------------------------------------- the suggestion and the plot
def finder_with(losses: list[float], mode: str = "exponential") -> LRFinder:
    finder = LRFinder(mode, 1e-4, 1.0, len(losses))
    finder.results = {"lr": [finder.lr_at(i) for i in range(len(losses))], "loss": losses}
    return finder


def steepest(finder: LRFinder, begin: int, end: int) -> int:
    """The index of the steepest descent of the finite losses in ``[begin, end)``, by the documented rule."""
    idx = [i for i in range(begin, end) if math.isfinite(finder.results["loss"][i])]
    losses = torch.tensor([finder.results["loss"][i] for i in idx])
    lrs = torch.tensor([finder.results["lr"][i] for i in idx])
    return idx[int(torch.argmin(torch.gradient(losses, spacing=[lrs])[0]))]


def test_suggestion_is_the_steepest_descent_between_the_skipped_ends() -> None:
    losses = [5.0] * 12 + [4.9, 4.5, 3.0, 2.9, 2.8, 2.7, 0.5]
    finder = finder_with(losses)
    assert finder.suggestion() == finder.results["lr"][steepest(finder, 10, 18)]  # the last point is skipped
    assert finder._optimal_idx == 13  # the central difference over the drop 4.9 -> 4.5 -> 3.0
    assert finder.suggestion(skip_begin=2, skip_end=3) == finder.results["lr"][steepest(finder, 2, 16)]
    assert finder.suggestion(skip_end=0) == finder.results["lr"][steepest(finder, 10, 19)]  # Lightning: None
    losses[13] = float("nan")  # left out: the steepest descent moves
    nan = finder_with(losses)
    assert nan.suggestion() == nan.results["lr"][steepest(nan, 10, 18)] and nan._optimal_idx != 13
    assert finder_with([1.0] * 11).suggestion() is None  # fewer than two points after skip_begin


def test_plot_draws_the_curve_and_marks_the_suggestion() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    finder = finder_with([5.0] * 12 + [4.9, 4.5, 3.0, 2.9, 2.8, 5.0, 1.0])
    fig = finder.plot(suggest=True)
    ax = fig.axes[0]
    curve, marker = ax.lines
    assert list(curve.get_xdata()) == finder.results["lr"] and ax.get_xscale() == "log"
    assert list(marker.get_xdata()) == [finder.suggestion()] and marker.get_color() == "red"


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ModuleNotFoundError, match="pip install matplotlib"):
        finder_with([1.0] * 20).plot()


# ---------------------------------------------------------------------- refusals and errors
def test_lr_find_refuses_what_lightning_refuses(tmp_path: Path) -> None:
    classes = program.build(L)
    trainer = L.Trainer(**program.trainer_kwargs(str(tmp_path), enable_progress_bar=True))
    callbacks = list(trainer.callbacks)
    tuner, model, dm = Tuner(trainer), classes["Net"](), classes["Data"]()
    with pytest.raises(ValueError, match="method='fit' is the only valid"):
        tuner.lr_find(model, datamodule=dm, method="validate")
    with pytest.raises(ValueError, match="`dataloaders` argument should be None"):
        tuner.lr_find(model, dataloaders=dm.train_dataloader())
    with pytest.raises(ValueError, match="mode should be either of"):
        tuner.lr_find(model, datamodule=dm, mode="cosine")
    with pytest.raises(AttributeError, match="could not find this as a field"):
        tuner.lr_find(model, datamodule=dm, attr_name="rate_of_learning")

    class TwoOptimizers(classes["Net"]):
        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]

    with pytest.raises(
        ValueError, match="returned 2 optimizers, but the learning rate finder only works with a single"
    ):
        tuner.lr_find(TwoOptimizers(), datamodule=dm)
    assert trainer.callbacks == callbacks != [] and trainer.global_step == 0  # put back after the failed search

    class NoRate(classes["Net"]):
        def __init__(self) -> None:
            super().__init__()
            self.hparams.clear()

        def rate(self) -> float:
            return 0.1

    with pytest.raises(AttributeError, match=r"\('lr', 'learning_rate'\).*attr_name="):
        tuner.lr_find(NoRate(), datamodule=dm)
    finder = tuner.lr_find(NoRate(), datamodule=dm, update_attr=False, num_training=15)
    assert finder is not None and len(finder.results["loss"]) == 15


def test_fast_dev_run_skips_the_searches(tmp_path: Path) -> None:
    classes = program.build(L)
    tuner = Tuner(L.Trainer(**program.trainer_kwargs(str(tmp_path), fast_dev_run=True)))
    with pytest.warns(UserWarning, match="Skipping learning rate finder since `fast_dev_run` is enabled"):
        assert tuner.lr_find(classes["Net"](), datamodule=classes["Data"]()) is None
    with pytest.warns(UserWarning, match="Skipping batch size scaler since `fast_dev_run` is enabled"):
        assert tuner.scale_batch_size(classes["Hungry"](), datamodule=classes["HungryData"]()) is None


def test_scale_batch_size_refusals_and_errors_that_are_not_oom(tmp_path: Path) -> None:
    classes = program.build(L)
    trainer = L.Trainer(**program.trainer_kwargs(str(tmp_path), enable_progress_bar=True))
    callbacks = list(trainer.callbacks)
    tuner, dm = Tuner(trainer), classes["HungryData"]()
    with pytest.raises(ValueError, match="cannot be used with dataloaders passed directly"):
        tuner.scale_batch_size(classes["Hungry"](), dm.train_dataloader())
    with pytest.raises(ValueError, match="should be either of"):
        tuner.scale_batch_size(classes["Hungry"](), datamodule=dm, mode="linear")
    with pytest.raises(ValueError, match="`margin` should be between 0 and 1"):
        tuner.scale_batch_size(classes["Hungry"](), datamodule=dm, margin=1.0)
    with pytest.raises(AttributeError, match="Field micro_batch not found in `model`, `datamodule`"):
        tuner.scale_batch_size(classes["Hungry"](), datamodule=dm, batch_arg_name="micro_batch")

    class Broken(classes["Hungry"]):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if len(batch[0]) > 4:
                raise RuntimeError("shape mismatch")  # not memory: the search stops with it
            return super().training_step(batch, batch_idx)

    task = Broken(own=False)
    weights = {k: v.clone() for k, v in task.state_dict().items()}
    with pytest.raises(RuntimeError, match="shape mismatch"):
        tuner.scale_batch_size(task, datamodule=dm)
    assert dm.batch_size == 8 and trainer.callbacks == callbacks != [] and trainer.global_step == 0
    assert all(torch.equal(v, task.state_dict()[k]) for k, v in weights.items())  # trained two trials: put back


def test_both_batch_size_attributes_warn_and_the_task_s_is_read(tmp_path: Path) -> None:
    classes = program.build(L)
    task = classes["Hungry"](hparams=True, batch_size=4)
    task.batch_size = 4
    task.train_dataloader = lambda: DataLoader(program.regression(1000), batch_size=task.batch_size)
    tuner = Tuner(L.Trainer(**program.trainer_kwargs(str(tmp_path))))
    with pytest.warns(UserWarning, match="are mutually exclusive"):
        assert tuner.scale_batch_size(task, max_trials=2, init_val=4) == 8
    assert task.batch_size == task.hparams.batch_size == 8  # both holders set, as Lightning sets them


@pytest.mark.parametrize(
    ("error", "oom"),
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ..."), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: 8 GB"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (RuntimeError("out of memory", "and a second argument"), False),
        (MemoryError("out of memory"), False),
    ],
)
def test_what_counts_as_out_of_memory(error: BaseException, oom: bool) -> None:
    assert is_oom_error(error) is oom


def test_lightning_s_import_paths_give_keel_s_tuner() -> None:
    from callbacks.lightning.pytorch.tuner import Tuner as T1
    from callbacks.lightning.pytorch.tuner.tuning import Tuner as T2
    from callbacks.lightning.tuner import Tuner as T3

    assert T1 is T2 is T3 is Tuner and L.tuner.Tuner is Tuner
    for module in ("callbacks.lightning.pytorch.tuner.lr_finder", "callbacks.lightning.tuner.batch_size_scaling"):
        assert importlib.import_module(module).__all__ == []  # Lightning's modules of private helpers

    with pytest.raises(ImportError, match=r"keel has no lightning\.pytorch\.callbacks\.LearningRateFinder: .*Tuner"):
        from callbacks.lightning.pytorch.callbacks import LearningRateFinder  # noqa: F401
    with pytest.raises(ImportError, match=r"keel has no lightning\.pytorch\.callbacks\.BatchSizeFinder: .*Tuner"):
        from callbacks.lightning.pytorch.callbacks import BatchSizeFinder  # noqa: F401


def test_the_search_logs_what_lightning_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="callbacks.tuner")
    program.lr_case(L, Tuner, str(tmp_path), **program.LR_CASES["exponential"])
    assert "LR finder stopped early after 97 steps due to diverging loss." in caplog.text
    assert f"Learning rate set to {LIGHTNING_LR['exponential']['suggestion']}" in caplog.text
    caplog.clear()
    program.bs_case(L, Tuner, str(tmp_path), **program.BS_CASES["power"])
    assert "Batch size 32 succeeded, trying batch size 64" in caplog.text
    assert "Batch size 64 failed, trying batch size 32" in caplog.text
    assert "Finished batch size finder, will continue with full run using batch size 32" in caplog.text
