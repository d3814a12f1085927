"""Porting a LightningModule, in one process: Trainer keywords, the docs' LitAutoEncoder, ReduceLROnPlateau, hparams,
and the checkpoint files Lightning programs read on one device. The same checkpoint files under DDP on 2 ranks:
tests/integration/test_lightning_port.py."""

from __future__ import annotations

import copy
import csv
import importlib.util
import inspect
import logging
import os
from pathlib import Path

import pytest
import torch
from lightning_ckpt_files import PORT_DDP, assert_same, check_lightning_checkpoint
from models import Regression, quiet, regression_data
from torch import nn, optim
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainer.trainer as trainer_module
from trainer import TaskModule, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.checkpoint.reader import load_weights
from trainer.distributed.launcher import detect_env
from trainer.loggers import CSVLogger
from trainer.options import LIGHTNING_UNSUPPORTED, TrainerOptions, check_lightning_keywords


def torchrun_env(world_size: int, local_world_size: int, rank: int = 0):
    return detect_env(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % local_world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "GROUP_RANK": str(rank // local_world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        }
    )


def slurm_env(nodes: int, per_node: int):
    return detect_env(
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": str(nodes * per_node),
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0",
            "SLURM_NNODES": str(nodes),
            "SLURM_NTASKS_PER_NODE": str(per_node),
            "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_JOB_ID": "7",
            "SLURM_STEP_NODELIST": "node[1-2]",
        }
    )


# ---------------------------------------------------------------------------- Lightning Trainer keywords


@pytest.mark.parametrize(
    "options, env",
    [
        ({}, detect_env({})),
        ({"devices": 1, "num_nodes": 1, "strategy": "auto"}, detect_env({})),
        ({"devices": "auto", "strategy": None}, torchrun_env(8, 4)),
        ({"devices": -1, "num_nodes": 2, "strategy": "ddp"}, torchrun_env(8, 4, rank=5)),
        ({"devices": 4, "num_nodes": 2}, torchrun_env(8, 4)),
        ({"devices": "4"}, torchrun_env(8, 4)),
        ({"devices": 2, "num_nodes": 2}, slurm_env(2, 2)),
    ],
)
def test_lightning_launch_keywords_that_match_the_launcher(options: dict, env) -> None:
    check_lightning_keywords(TrainerOptions(**options), env)


@pytest.mark.parametrize(
    "options, env, command",
    [
        ({"devices": 2}, detect_env({}), "torchrun --nnodes 1 --nproc-per-node 2 your_script.py"),
        ({"devices": 4, "num_nodes": 2}, detect_env({}), "torchrun --nnodes 2 --nproc-per-node 4 your_script.py"),
        ({"devices": 2}, torchrun_env(8, 4), "torchrun --nnodes 2 --nproc-per-node 2 your_script.py"),
        ({"num_nodes": 4}, torchrun_env(8, 4), "torchrun --nnodes 4 --nproc-per-node 4 your_script.py"),
        ({"devices": 8, "num_nodes": 1}, torchrun_env(8, 4), "torchrun --nnodes 1 --nproc-per-node 8 your_script.py"),
        ({"devices": 4}, slurm_env(2, 2), "srun --nodes 2 --ntasks-per-node 4 python your_script.py"),
    ],
)
def test_lightning_launch_keywords_that_do_not_match_show_the_command(options: dict, env, command: str) -> None:
    with pytest.raises(ValueError) as info:
        check_lightning_keywords(TrainerOptions(**options), env)
    message = str(info.value)
    assert command in message, message
    assert all(f"{k}={v!r}" in message for k, v in options.items() if k != "num_nodes" or v != 1), message
    assert "does not start processes" in message


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("devices", 0, "an int >= 1"),
        ("devices", [0, 1], "CUDA_VISIBLE_DEVICES"),
        ("devices", "0,1", "CUDA_VISIBLE_DEVICES"),
        ("num_nodes", 0, "an integer >= 1"),
        ("strategy", "deepspeed_stage_2", "no DeepSpeed"),
        ("strategy", "ddp_spawn", "does not spawn processes"),
        ("strategy", object(), "a strategy object such as DDPStrategy(find_unused_parameters=True)"),
    ],
)
def test_bad_lightning_launch_keywords(name: str, value, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        Trainer(**{name: value}, logger=False)
    message = str(info.value)
    assert f"Trainer option {name}=" in message and expected in message, message


def test_devices_auto_spellings_are_normalised() -> None:
    assert TrainerOptions(devices=-1).devices == TrainerOptions(devices="-1").devices == "auto"
    assert TrainerOptions(devices="2").devices == 2


@pytest.mark.parametrize(
    "name",
    [
        "inference_mode",
        "use_distributed_sampler",
        "reload_dataloaders_every_n_epochs",
        "barebones",
        "detect_anomaly",
        "plugins",
        "auto_lr_find",
        "overfit_batches",
        "max_time",
    ],
)
def test_unsupported_lightning_keywords_are_named_with_why(name: str) -> None:
    with pytest.raises(ValueError) as info:
        Trainer(**{name: True}, logger=False)
    message = str(info.value)
    assert f"Trainer option {name!r} is a Lightning option keel does not support: " in message, message
    assert LIGHTNING_UNSUPPORTED[name] in message
    assert "Unknown Trainer option" not in message


def test_unsupported_and_unknown_keywords_are_both_reported() -> None:
    with pytest.raises(ValueError) as info:
        Trainer(detect_anomaly=True, max_epoch=3, logger=False)
    message = str(info.value)
    assert "'detect_anomaly' is a Lightning option keel does not support" in message
    assert "Unknown Trainer option 'max_epoch': did you mean 'max_epochs'" in message


def test_limit_batches_keywords_are_supported() -> None:
    opts = Trainer(
        limit_train_batches=10, limit_val_batches=0.5, limit_test_batches=3, limit_predict_batches=1.0, logger=False
    ).options
    assert (opts.limit_train_batches, opts.limit_val_batches) == (10, 0.5)


def test_trainer_checks_devices_against_the_launcher() -> None:
    if "check_lightning_keywords" not in inspect.getsource(trainer_module):
        pytest.skip("pending the trainer/trainer.py patch: Trainer.__init__ must call check_lightning_keywords")
    with pytest.raises(ValueError, match="torchrun --nnodes 1 --nproc-per-node 2 your_script.py"):
        Trainer(devices=2, logger=False)


def test_lightning_launch_keywords_fit_in_one_process() -> None:
    trainer = Trainer(**quiet(devices=1, num_nodes=1, strategy="ddp", accelerator="cpu", max_epochs=1))
    trainer.fit(Regression(), DataLoader(regression_data(16), batch_size=8))
    assert trainer.global_step == 2


# ---------------------------------------------------------------------------- the docs' LitAutoEncoder


class LitAutoEncoder(TaskModule):  # Lightning: class LitAutoEncoder(L.LightningModule)
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def training_step(self, batch, batch_idx):
        # training_step defines the train loop.
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = F.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = optim.Adam(self.parameters(), lr=1e-3)
        return optimizer


def test_lit_autoencoder_trains_like_a_hand_written_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # default checkpoints land here
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.rand(120, 1, 28, 28, generator=g), torch.randint(0, 10, (120,), generator=g))
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
    decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))
    reference = nn.ModuleDict({"encoder": copy.deepcopy(encoder), "decoder": copy.deepcopy(decoder)})

    autoencoder = LitAutoEncoder(encoder, decoder)
    train_loader = DataLoader(dataset)  # the docs' loader: batch_size=1, no shuffle
    trainer = Trainer(limit_train_batches=100, max_epochs=1, log_every_n_steps=10, logger=CSVLogger(tmp_path))
    # The docs write fit(model=autoencoder, ...); keel's first parameter is named `task` (see
    # test_fit_accepts_lightnings_model_keyword), so it is passed positionally here.
    trainer.fit(autoencoder, train_dataloaders=train_loader)

    # The same thing by hand.
    opt = optim.Adam(reference.parameters(), lr=1e-3)
    losses = []
    for x, _ in DataLoader(dataset):
        if len(losses) == 100:
            break
        x = x.view(x.size(0), -1)
        loss = F.mse_loss(reference["decoder"](reference["encoder"](x)), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    assert trainer.global_step == 100
    with open(trainer.loggers[0].metrics_file_path, newline="") as f:
        logged = {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")}
    # Lightning 2.6.6's axis: the 10th, 20th, ... optimizer step is logged at step 9, 19, ... (its 0-based index).
    assert sorted(logged) == list(range(9, 100, 10))
    for step, value in logged.items():
        assert value == pytest.approx(losses[step], rel=1e-6, abs=1e-9), step
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(autoencoder.state_dict()[name], p, rtol=1e-5, atol=1e-7)


def test_fit_accepts_lightnings_model_keyword(tmp_path: Path) -> None:
    if "model" not in inspect.signature(Trainer.fit).parameters:
        pytest.skip("pending the trainer/trainer.py patch: fit/validate/test/predict(model=...) as in Lightning")
    trainer = Trainer(**quiet(max_epochs=1))
    task = Regression()
    data = DataLoader(regression_data(16), batch_size=8)
    trainer.fit(model=task, train_dataloaders=data, val_dataloaders=data)
    assert trainer.global_step == 2
    assert trainer.validate(model=task, dataloaders=data)[0].keys() == {"val/loss"}


# ---------------------------------------------------------------------------- ReduceLROnPlateau with monitor


class Plateau(TaskModule):
    """val_loss follows a crafted sequence per epoch; the LR is recorded at each epoch start."""

    def __init__(self, val_losses: list[float], monitor: str = "val_loss") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)
        self.val_losses, self.monitor, self.lrs = val_losses, monitor, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.tensor(self.val_losses[self.current_epoch]))

    def on_train_epoch_start(self) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        o = optim.SGD(self.parameters(), lr=0.1)
        s = optim.lr_scheduler.ReduceLROnPlateau(o, mode="min", factor=0.1, patience=1)
        return {"optimizer": o, "lr_scheduler": {"scheduler": s, "monitor": self.monitor}}


def test_reduce_lr_on_plateau_monitors_val_loss() -> None:
    values = [1.0, 0.5, 0.5, 0.5, 0.5, 0.5]
    task = Plateau(values)
    data = DataLoader(regression_data(16), batch_size=8)
    trainer = Trainer(**quiet(max_epochs=len(values)))
    trainer.fit(task, data, data)
    # Best at epoch 1; epochs 2 and 3 do not improve -> more than patience=1 bad epochs: x0.1 after
    # epoch 3, again after epoch 5.
    assert task.lrs == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.01, 0.01])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001)
    # The same as feeding the sequence to the scheduler by hand.
    reference = optim.lr_scheduler.ReduceLROnPlateau(
        optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), mode="min", factor=0.1, patience=1
    )
    for v in values:
        reference.step(v)
    assert reference.optimizer.param_groups[0]["lr"] == pytest.approx(0.001)


def test_reduce_lr_on_plateau_with_a_missing_monitor_lists_the_logged_keys() -> None:
    data = DataLoader(regression_data(16), batch_size=8)
    with pytest.raises(KeyError) as info:
        Trainer(**quiet(max_epochs=2)).fit(Plateau([1.0, 1.0], monitor="val/loss"), data, data)
    message = str(info.value)
    assert "'val/loss'" in message and "available metrics" in message and "'val_loss'" in message, message


# ---------------------------------------------------------------------------- hparams through a checkpoint


class HParamTask(TaskModule):
    def __init__(self, hidden: int = 4, lr: float = 0.05, activation: str = "tanh", widths: list | None = None):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(hidden)
        act = nn.Tanh() if activation == "tanh" else nn.ReLU()
        self.net = nn.Sequential(nn.Linear(8, hidden), act, nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return optim.SGD(self.parameters(), lr=self.hparams.lr)


class BackboneTask(HParamTask):
    def __init__(self, backbone: nn.Module, lr: float = 0.05):
        TaskModule.__init__(self)
        self.save_hyperparameters()  # backbone is a module: kept in memory, left out of checkpoints
        self.backbone = backbone
        self.net = nn.Sequential(backbone, nn.Linear(4, 1))


def fit_with_checkpoint(task: TaskModule, tmp_path: Path) -> str:
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    trainer = Trainer(**quiet(max_epochs=2, enable_checkpointing=True, callbacks=[callback]))
    trainer.fit(task, DataLoader(regression_data(16), batch_size=8))
    assert callback.last_model_path or callback.best_model_path
    return callback.last_model_path or callback.best_model_path


def test_hparams_and_weights_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    task = HParamTask(hidden=6, lr=0.02, activation="relu", widths=[3, 5])
    assert dict(task.hparams) == {"hidden": 6, "lr": 0.02, "activation": "relu", "widths": [3, 5]}
    path = fit_with_checkpoint(task, tmp_path)
    loaded = HParamTask.load_from_checkpoint(path)
    assert dict(loaded.hparams) == dict(task.hparams) and loaded.hparams.lr == 0.02
    assert not loaded.training
    for name, value in task.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert HParamTask.load_from_checkpoint(path, lr=0.5).hparams.lr == 0.5  # overrides win


def test_module_valued_hparam_is_left_out_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    task = BackboneTask(nn.Linear(8, 4), lr=0.03)
    assert isinstance(task.hparams.backbone, nn.Linear)  # in memory, as in Lightning
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint.stateful"):
        path = fit_with_checkpoint(task, tmp_path)
    assert "hparams['backbone'] (Linear) is not a plain value" in caplog.text
    state = torch.load(Path(path) / "keel.pt", weights_only=True)  # nothing in the save needs unpickling of code
    assert state["hyper_parameters"] == {"lr": 0.03}
    assert load_weights(path)["hyper_parameters"] == {"lr": 0.03}
    with pytest.raises(TypeError, match="backbone"):
        BackboneTask.load_from_checkpoint(path)  # not saved: the caller must pass it
    loaded = BackboneTask.load_from_checkpoint(path, backbone=nn.Linear(8, 4))
    assert loaded.hparams.lr == 0.03
    for name, value in task.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


# ---------------------------------------------------------------------------- Lightning's checkpoint files
def load_port_ddp():
    spec = importlib.util.spec_from_file_location("lightning_port_ddp", PORT_DDP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lightning_model_checkpoint_paths_load_with_torch_load_on_one_device(tmp_path: Path) -> None:
    result = load_port_ddp().lightning_checkpoint(tmp_path)
    assert result["strategy"] == "SingleDeviceStrategy"
    check_lightning_checkpoint(result, world_size=1)


def test_keel_model_checkpoint_reports_the_save_folder(tmp_path: Path) -> None:
    """keel's own ModelCheckpoint (and Lightning's with lightning_file=False) report the save folder itself:
    no Lightning file is written; last.ckpt is a symlink to the folder; the folder loads as ckpt_path."""
    import callbacks.lightning as L

    for name, callback in (
        ("keel", ModelCheckpoint(dirpath=tmp_path / "keel", save_last=True)),
        ("off", L.ModelCheckpoint(dirpath=tmp_path / "off", save_last=True, lightning_file=False)),
    ):
        task = HParamTask(hidden=5)
        data = DataLoader(regression_data(16), batch_size=8)
        trainer = Trainer(**quiet(max_epochs=2, enable_checkpointing=True, callbacks=[callback]))
        trainer.fit(task, data)
        for path in (Path(callback.best_model_path), Path(callback.last_model_path)):
            assert path.is_dir() and path.parent == tmp_path / name and (path / "keel.json").is_file(), path
            assert "lightning.pt" not in os.listdir(path)
        link = tmp_path / name / "last.ckpt"
        assert link.is_symlink() and link.resolve() == Path(callback.last_model_path).resolve()
        assert_same(load_weights(callback.last_model_path)["state_dict"], task.state_dict())
        resumed = Trainer(**quiet(max_epochs=3))
        resumed.fit(HParamTask(hidden=5), data, ckpt_path=callback.last_model_path)
        assert resumed.global_step == 3 * 2


def test_lightning_last_ckpt_passed_back_as_ckpt_path_resumes_the_fit(tmp_path: Path) -> None:
    import callbacks.lightning as L

    data = DataLoader(regression_data(16), batch_size=8)
    whole = Regression()
    Trainer(**quiet(max_epochs=2)).fit(whole, data)
    callback = L.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    Trainer(**quiet(max_epochs=1, enable_checkpointing=True, callbacks=[callback])).fit(Regression(), data)
    resumed, task = Trainer(**quiet(max_epochs=2)), Regression()
    resumed.fit(task, data, ckpt_path=str(tmp_path / "last.ckpt"))  # Lightning's idiom
    assert resumed.global_step == 4
    assert_same(task.state_dict(), whole.state_dict())
