"""Public LightningModules run unchanged but for the import (tests/lightning_ports/), in one process; and the
Lightning behaviours they rely on, one by one (issue 13). The ports on 2 ranks are in
tests/integration/test_lightning_modules.py."""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from pathlib import Path

import pytest
import torch
from models import Regression, quiet, regression_data
from ports_runner import HAS_TORCHMETRICS, SCRIPT
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import callbacks.lightning as L
from trainer import DataModule, TaskModule, Trainer
from trainer.hooks import warn_uncalled_hooks

needs_torchmetrics = pytest.mark.skipif(not HAS_TORCHMETRICS, reason="the ImageNet / hydra ports use torchmetrics")


def load_runner():
    spec = importlib.util.spec_from_file_location("lightning_ports_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def data(n: int = 32, batch_size: int = 8) -> DataLoader:
    return DataLoader(regression_data(n), batch_size=batch_size)


# ---------------------------------------------------------------------------- the ports, one process
def test_autoencoder_port_fits_with_a_positional_datamodule_then_tests_and_predicts_best(tmp_path: Path) -> None:
    result = load_runner().run("autoencoder", tmp_path)
    assert result["global_step"] == 20  # 80 samples / 8 per batch x 2 epochs
    assert result["ckpt_path"].endswith(".ckpt") and "test_loss" in result["tested"][0]
    assert result["predictions"] == [[8, 784]] * 4
    assert result["num_devices"] == result["processes"] == 1


def test_gan_port_without_batch_idx_and_with_two_optimizers(tmp_path: Path) -> None:
    result = load_runner().run("gan", tmp_path)
    assert result["global_step"] == 6  # manual optimization: one training iteration is one step
    assert set(result["metrics"]) == {"d_loss", "g_loss"}
    # Logged on_step values are in callback_metrics after EVERY step, as tensors (log_every_n_steps is 50).
    assert len(result["steps_seen"]) == 6 and all(set(s) == {"d_loss", "g_loss"} for s in result["steps_seen"])
    assert all(kind == "Tensor" for s in result["steps_seen"] for kind, _ in s.values())
    assert len(result["event_files"]) == 1  # logger.experiment.add_image in on_train_epoch_end


def test_transformer_port_trains_compiled_and_checkpoints_hold_plain_keys(tmp_path: Path) -> None:
    result = load_runner().run("transformer", tmp_path)
    assert result == {"global_step": 4, "keys_match": True, "trained_is_plain": True, "loss_finite": True}
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()


@needs_torchmetrics
def test_imagenet_template_port(tmp_path: Path) -> None:
    result = load_runner().run("imagenet", tmp_path)
    assert result["global_step"] == 2 and result["batch_size"] == 16  # not a ParallelStrategy in one process
    assert set(result["validated"][0]) == {"val_loss", "val_acc1", "val_acc5"}
    # a save folder's Lightning-format file: <save>.ckpt/lightning.pt (torch.load opens it; no second *.ckpt)
    assert result["best"].endswith(".ckpt/lightning.pt")


@needs_torchmetrics
def test_hydra_template_mnist_port_with_its_yaml_callbacks(tmp_path: Path) -> None:
    result = load_runner().run("hydra_mnist", tmp_path)
    assert result["global_step"] == 18  # 88 samples / 16 = 6 steps x 3 epochs
    # filename "epoch_{epoch:03d}", auto_insert_metric_name=False, save_last=True: Lightning's file names
    assert "last.ckpt" in result["files"] and any(f.startswith("epoch_00") for f in result["files"])
    assert result["ckpt_path"].startswith("epoch_00") and {"test/loss", "test/acc"} <= set(result["tested"][0])
    # read after test(): as in Lightning 2.6.6, callback_metrics then hold that stage's metrics only
    assert set(result["metrics"]) == {"test/loss", "test/acc"}
    assert result["dm_hparams"]["batch_size"] == 16 and result["per_device"] == 16


def test_nan_at_step_three_of_a_run_that_never_logs_is_caught(tmp_path: Path) -> None:
    result = load_runner().run("nan", tmp_path)
    assert result["error"] and "Non-finite training loss (nan) at step 3" in result["error"], result
    assert "at the end of epoch 0" in result["error"]


# ---------------------------------------------------------------------------- Trainer
def test_fit_takes_the_datamodule_positionally_and_validate_too() -> None:
    class Data(DataModule):
        def train_dataloader(self):
            return data()

        def val_dataloader(self):
            return data(16)

    trainer = Trainer(**quiet(max_epochs=1))
    dm = Data()
    trainer.fit(Regression(), dm)
    assert trainer.datamodule is dm and trainer.global_step == 4
    assert "val/loss" in trainer.validate(trainer.model, dm)[0]


def test_validation_data_without_validation_step_is_skipped_with_a_warning() -> None:
    class NoVal(Regression):
        validation_step = TaskModule.validation_step

    with pytest.warns(UserWarning, match="no validation_step: validation is skipped"):
        trainer = Trainer(**quiet(max_epochs=1, num_sanity_val_steps=2))
        trainer.fit(NoVal(), data(), data())
    assert trainer.global_step == 4 and "val/loss" not in trainer.callback_metrics


def test_limit_val_batches_zero_turns_off_validation_and_the_sanity_check() -> None:
    calls: list[str] = []

    class Counting(Regression):
        def validation_step(self, batch, batch_idx):
            calls.append("val")
            return super().validation_step(batch, batch_idx)

    Trainer(**quiet(max_epochs=1, num_sanity_val_steps=2, limit_val_batches=0)).fit(Counting(), data(), data())
    assert calls == []


@pytest.mark.parametrize("options, stop_at", [({"min_epochs": 3}, 3 * 4), ({"min_steps": 6}, 6)])
def test_min_epochs_and_min_steps_delay_a_stop_request(options: dict, stop_at: int) -> None:
    class StopAtOnce(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.should_stop = True

    trainer = Trainer(**quiet(max_epochs=10, callbacks=[StopAtOnce()], **options))
    trainer.fit(Regression(), data())
    assert trainer.global_step == stop_at


def test_benchmark_sets_cudnn_benchmark() -> None:
    before = torch.backends.cudnn.benchmark
    try:
        Trainer(benchmark=True, logger=False)
        assert torch.backends.cudnn.benchmark is True
        Trainer(benchmark=False, logger=False)
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = before


def test_lightning_attributes_of_trainer_strategy_and_module(tmp_path: Path) -> None:
    seen: dict = {}

    class Probe(Regression):
        def on_fit_start(self):
            t = self.trainer
            seen.update(
                model=t.model is self,
                num_devices=t.num_devices,
                num_nodes=t.num_nodes,
                processes=t.strategy.num_processes,
                root=str(t.strategy.root_device),
                reduced=float(t.strategy.reduce(torch.tensor(3.0))),
                gathered=self.all_gather(torch.ones(2)).shape,
                logger=self.logger,
                loggers=self.loggers,
                local_rank=self.local_rank,
                on_gpu=self.on_gpu,
                example=self.example_input_array,
            )
            t.strategy.barrier()
            seen["broadcast"] = t.strategy.broadcast({"a": 1})

    task = Probe()
    task.example_input_array = torch.zeros(1, 8)
    trainer = Trainer(**quiet(max_epochs=1, enable_checkpointing=True, default_root_dir=str(tmp_path)))
    trainer.fit(task, data())
    assert seen["model"] and seen["num_devices"] == seen["num_nodes"] == seen["processes"] == 1
    assert seen["root"] == "cpu" and seen["reduced"] == 3.0 and seen["gathered"] == (2,)
    assert seen["logger"] is None and seen["loggers"] == [] and seen["local_rank"] == 0 and not seen["on_gpu"]
    assert seen["example"].shape == (1, 8) and seen["broadcast"] == {"a": 1}
    trainer.fit(task, data(), ckpt_path="last")
    assert trainer.ckpt_path and trainer.ckpt_path.endswith(".ckpt")


def test_self_print_prints_on_rank_zero(capsys: pytest.CaptureFixture[str]) -> None:
    task = Regression()
    task.print("hello", 3)
    assert capsys.readouterr().out == "hello 3\n"


def test_training_step_without_batch_idx_is_decided_once() -> None:
    calls = []

    class NoIdx(Regression):
        def training_step(self, batch):
            calls.append(len(batch))
            return super().training_step(batch, 0)

        def validation_step(self, batch):
            return super().validation_step(batch, 0)

        def predict_step(self, batch):
            return self(batch[0])

    trainer = Trainer(**quiet(max_epochs=1))
    trainer.fit(NoIdx(), data(), data(16))
    assert len(calls) == 4 and len(trainer.predict(dataloaders=data(16))) == 2


def test_a_hook_keel_never_calls_is_named_in_a_warning() -> None:
    class Custom(Regression):
        def on_after_batch_transfer(self, batch, dataloader_idx):  # called (tests/unit/test_batch_transfer.py)
            return batch

        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            pass

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            pass

    with pytest.warns(UserWarning) as record:
        Trainer(**quiet(max_epochs=1)).fit(Custom(), data())
    text = "\n".join(str(w.message) for w in record)
    assert "Custom.optimizer_zero_grad is a Lightning hook that keel never calls" in text
    assert "on_after_batch_transfer" not in text
    assert "Custom.configure_gradient_clipping" in text and "gradient_clip_val" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_uncalled_hooks(Custom(), []) == []  # once per class


def test_task_prepare_data_runs_before_setup() -> None:
    order = []

    class Prepared(Regression):
        def prepare_data(self):
            order.append("prepare_data")

        def setup(self, stage):
            order.append(f"setup({stage})")

    Trainer(**quiet(max_epochs=1)).fit(Prepared(), data())
    assert order == ["prepare_data", "setup(fit)"]


def test_datamodule_save_hyperparameters() -> None:
    class Data(DataModule):
        def __init__(self, batch_size: int = 4, root: str = "x"):
            super().__init__()
            self.save_hyperparameters()

    dm = Data(batch_size=8)
    assert dict(dm.hparams) == {"batch_size": 8, "root": "x"} and dm.hparams.batch_size == 8


def test_trainer_fit_torch_compile_one_process(tmp_path: Path) -> None:
    task = Regression()
    checkpoint = L.ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    trainer = Trainer(**quiet(max_epochs=1, callbacks=[checkpoint]))
    trainer.fit(torch.compile(task, backend="aot_eager"), data())
    assert trainer.global_step == 4 and trainer.model is task
    # last.ckpt and best_model_path: Lightning's plain file, the compiled task's plain keys and trained weights
    for path in (tmp_path / "last.ckpt", checkpoint.best_model_path, checkpoint.last_model_path):
        loaded = torch.load(path, weights_only=True)
        assert {"state_dict", "epoch", "global_step", "hyper_parameters"} <= loaded.keys(), path
        assert (loaded["global_step"], loaded["epoch"]) == (4, 0) and sorted(loaded["state_dict"]) == sorted(
            task.state_dict()
        )
        assert all(torch.equal(loaded["state_dict"][k], v) for k, v in task.state_dict().items()), path


# ---------------------------------------------------------------------------- callbacks
def test_model_checkpoint_filename_format_specs_are_checked_when_built() -> None:
    L.ModelCheckpoint(filename="epoch_{epoch:03d}")
    L.ModelCheckpoint(filename="{epoch}-{val/loss:.2f}")
    with pytest.raises(ValueError, match=r"field \{val/loss:03d\} cannot format a float"):
        L.ModelCheckpoint(filename="{val/loss:03d}")
    with pytest.raises(ValueError, match="unbalanced braces"):
        L.ModelCheckpoint(filename="{epoch")


def test_model_checkpoint_lightning_keywords(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint = L.ModelCheckpoint(
        dirpath=str(tmp_path),
        filename="epoch_{epoch:03d}-{val/loss:.2f}",
        monitor="val/loss",
        verbose=True,
        save_last=True,
        auto_insert_metric_name=False,
        save_weights_only=True,
        save_on_train_epoch_end=False,
        save_top_k=2,
        enable_version_counter=True,
    )
    with caplog.at_level(logging.INFO, logger="trainer.checkpoint.model_checkpoint"):
        Trainer(**quiet(max_epochs=2, callbacks=[checkpoint])).fit(Regression(), data(), data(16))
    files = sorted(os.listdir(tmp_path))
    assert "last.ckpt" in files and any(f.startswith("epoch_000-") for f in files), files
    assert "saved" in caplog.text
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert "state_dict" in state and "optimizer_states" not in str(sorted(state))  # weights only
    with pytest.raises(Exception, match="weights only"):
        Trainer(**quiet(max_epochs=3)).fit(Regression(), data(), ckpt_path=str(tmp_path / "last.ckpt"))


def test_model_checkpoint_version_counter(tmp_path: Path) -> None:
    for _ in range(2):
        checkpoint = L.ModelCheckpoint(dirpath=str(tmp_path), filename="fixed", save_top_k=-1)
        Trainer(**quiet(max_epochs=1, callbacks=[checkpoint])).fit(Regression(), data())
    assert {"fixed.ckpt", "fixed-v1.ckpt"} <= set(os.listdir(tmp_path))


def test_early_stopping_takes_lightnings_positional_order_and_thresholds() -> None:
    stopper = L.EarlyStopping("val/loss", 0.01, 5, True, "max")
    assert (stopper.min_delta, stopper.patience, stopper.verbose, stopper.mode) == (0.01, 5, True, "max")

    class Falling(Regression):
        def validation_step(self, batch, batch_idx):
            self.log("val/metric", torch.tensor(10.0 - self.current_epoch))

    def stopped_after(**kwargs) -> int:
        stopper = L.EarlyStopping("val/metric", **kwargs)
        Trainer(**quiet(max_epochs=10, callbacks=[stopper])).fit(Falling(), data(), data(16))
        return stopper.stopped_epoch

    assert stopped_after(stopping_threshold=7.5) == 3  # 10, 9, 8, 7 < 7.5
    assert stopped_after(mode="max", divergence_threshold=8.5) == 2  # 10, 9, 8 < 8.5 diverges in "max"
    assert stopped_after(log_rank_zero_only=True, patience=100) == -1


def test_unknown_keyword_to_a_callback_names_the_valid_ones() -> None:
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['patiense'\] \(did you mean 'patience'"):
        L.EarlyStopping("val/loss", patiense=3)
    with pytest.raises(TypeError, match="valid keywords: .*every_n_train_steps"):
        L.ModelCheckpoint(every_n_steps=3)


def test_seed_everything_lightning_signature() -> None:
    assert L.seed_everything(7, workers=True) == 7
    first = torch.rand(1)
    L.seed_everything(7)
    assert torch.equal(first, torch.rand(1))


# ---------------------------------------------------------------------------- the lightning module
def test_lightning_names_and_what_keel_lacks() -> None:
    assert L.LightningModule is TaskModule and L.LightningDataModule is DataModule and issubclass(L.Trainer, Trainer)
    assert L.pytorch.callbacks.ModelCheckpoint is L.ModelCheckpoint and L.pytorch.LightningModule is TaskModule
    assert L.pytorch.utilities.rank_zero.rank_zero_only is L.rank_zero_only
    assert L.pytorch.cli.LightningCLI is L.LightningCLI and "LightningCLI" not in L.LACKING
    assert L.pytorch.callbacks.StochasticWeightAveraging is L.StochasticWeightAveraging
    with pytest.raises(AttributeError, match="torch.nn.utils.prune"):
        L.pytorch.callbacks.ModelPruning  # noqa: B018
    with pytest.raises(AttributeError, match="available"):
        L.NoSuchThing  # noqa: B018


def test_a_lightning_module_class_gets_a_porting_hint() -> None:
    fake = type("LightningModule", (nn.Module,), {"__module__": "lightning.pytorch.core.module"})()
    with pytest.raises(TypeError, match="Porting from Lightning"):
        Trainer(**quiet()).fit(fake, data())


# ---------------------------------------------------------------------------- nothing fails silently
def test_step_metrics_are_device_tensors_in_callback_metrics_after_every_step() -> None:
    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(trainer.callback_metrics["train/loss"])

    class Same(Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.last = loss.detach()
            return loss

    task = Same()
    Trainer(**quiet(max_epochs=1, log_every_n_steps=50, callbacks=[Record()])).fit(task, data())
    assert len(seen) == 4 and all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in seen)
    assert torch.equal(seen[-1], task.last)


@pytest.mark.parametrize("async_save", [False, True])
def test_nan_then_finite_loss_is_still_caught_before_a_checkpoint(tmp_path: Path, async_save: bool) -> None:
    class NaNOnce(Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if self.global_step == 1 else loss

        def on_before_optimizer_step(self, optimizer):
            for p in self.parameters():  # keep the weights finite: only the loss was NaN
                p.grad = torch.nan_to_num(p.grad, nan=0.0)

    checkpoint = L.ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=3, async_save=async_save)
    with pytest.raises(FloatingPointError, match=r"at step 2 on rank 0 \(caught before saving checkpoint"):
        Trainer(**quiet(max_epochs=1, callbacks=[checkpoint])).fit(NaNOnce(), data())
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".ckpt")]


def test_logger_experiment_on_another_rank_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.distributed import comm
    from trainer.loggers import TensorBoardLogger
    from trainer.loggers.logger import DummyExperiment

    logger = TensorBoardLogger(str(tmp_path), version=0)
    monkeypatch.setattr(comm, "get_rank", lambda: 1)
    experiment = logger.experiment
    assert isinstance(experiment, DummyExperiment)
    experiment.add_image("x", torch.zeros(3, 2, 2), 0)
    experiment.add_scalar("y", 1.0)
    assert not list(tmp_path.rglob("events.out.*"))


def test_manual_optimization_task_loss_is_checked_too() -> None:
    class ManualNaN(TaskModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            loss = F.mse_loss(self.net(x), y) * (float("nan") if self.global_step == 2 else 1.0)
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    with pytest.raises(FloatingPointError, match="at step 3"):
        Trainer(**quiet(max_epochs=1)).fit(ManualNaN(), data())


def test_lightning_keywords_of_validate_test_predict_and_log(caplog: pytest.LogCaptureFixture) -> None:
    class Extra(Regression):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log(
                "val/loss",
                F.mse_loss(self(x), y),
                sync_dist=True,
                sync_dist_group=None,
                add_dataloader_idx=False,
                enable_graph=False,
                metric_attribute=None,
            )

    trainer = Trainer(**quiet(max_epochs=1))
    task = Extra()
    trainer.fit(task, data())
    with caplog.at_level(logging.INFO, logger="trainer.evaluation"):
        results = trainer.validate(task, data(16), verbose=True)
    assert "Validate results: val/loss=" in caplog.text and "val/loss" in results[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer.evaluation"):
        trainer.test(task, data(16), verbose=False)
    assert "results" not in caplog.text
    assert trainer.predict(task, data(16), return_predictions=False) is None
