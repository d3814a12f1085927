"""Run the ported LightningModules of tests/lightning_ports/ (one process or under torchrun).

Usage: lightning_ports_run.py OUT_DIR CASE [CASE ...]   (CASE: autoencoder, gan, transformer, imagenet,
hydra_mnist, nan; "all": the first five). Writes OUT_DIR/<case>/rank{R}.json with what the test checks.
tests/unit/test_lightning_modules_one_process.py imports :func:`run` for the single-process runs;
tests/integration/test_lightning_modules.py launches this script on 2 ranks.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ (lightning_ports)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from torch.utils.data import DataLoader

CASES = ("autoencoder", "gan", "transformer", "imagenet", "hydra_mnist")
QUIET = dict(enable_progress_bar=False, enable_model_summary=False)


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def autoencoder(out: Path) -> dict[str, Any]:
    from lightning_ports import autoencoder as port

    result = port.main(max_epochs=2, default_root_dir=str(out), logger=False, **QUIET)
    trainer = result["trainer"]
    return {
        "global_step": trainer.global_step,
        "tested": result["tested"],
        "ckpt_path": trainer.ckpt_path,
        "predictions": [list(p.shape) for p in result["predictions"]],
        "num_devices": trainer.num_devices,
        "processes": trainer.strategy.num_processes,
    }


def gan(out: Path) -> dict[str, Any]:
    from lightning_ports import gan as port
    from lightning_ports.standins import MNIST

    import callbacks.lightning as L

    seen: list[dict[str, Any]] = []

    class StepMetrics(L.Callback):  # callback_metrics after EVERY step, as Lightning has them
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(
                {
                    k: [type(v).__name__, str(v.device) if isinstance(v, torch.Tensor) else ""]
                    for k, v in trainer.callback_metrics.items()
                }
            )

    L.seed_everything(0, workers=True)
    logger = L.pytorch.loggers.TensorBoardLogger(str(out / "tb"), name="gan")
    trainer = L.Trainer(
        max_epochs=2,
        limit_train_batches=3,
        logger=logger,
        callbacks=[StepMetrics()],
        enable_checkpointing=False,
        **QUIET,
    )
    model = port.GAN(latent_dim=32)
    trainer.fit(model, DataLoader(MNIST(), batch_size=8))
    events = sorted(os.path.relpath(p, out) for p in glob.glob(str(out / "tb" / "**" / "events.out.*"), recursive=True))
    return {
        "global_step": trainer.global_step,
        "metrics": _floats(trainer.callback_metrics),
        "steps_seen": seen,
        "event_files": events,
        "rank": trainer.global_rank,
    }


def transformer(out: Path) -> dict[str, Any]:
    from lightning_ports import transformer as port

    import callbacks.lightning as L

    L.seed_everything(42)
    dataset = port.WikiText2()
    dataloader = DataLoader(dataset, batch_size=4)
    model = port.LightningTransformer(vocab_size=dataset.vocab_size)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(out / "ckpt"), save_last=True, every_n_train_steps=2)
    trainer = L.Trainer(max_steps=4, logger=False, callbacks=[checkpoint], **QUIET)
    trainer.fit(model=torch.compile(model, backend="eager"), train_dataloaders=dataloader)  # Lightning's idiom
    state = torch.load(out / "ckpt" / "last.ckpt", weights_only=True) if trainer.is_global_zero else {}
    return {
        "global_step": trainer.global_step,
        "keys_match": sorted(state.get("state_dict", {})) == sorted(model.state_dict())
        if trainer.is_global_zero
        else True,
        "trained_is_plain": trainer.model is model,
        "loss_finite": bool(
            torch.isfinite(torch.as_tensor([float(p.detach().abs().sum()) for p in model.parameters()])).all()
        ),
    }


def imagenet(out: Path) -> dict[str, Any]:
    from lightning_ports import imagenet as port

    result = port.main(
        str(out), max_epochs=1, devices="auto", limit_train_batches=2, limit_val_batches=2, enable_model_summary=False
    )
    trainer, model = result["trainer"], result["model"]
    return {
        "global_step": trainer.global_step,
        "batch_size": model.batch_size,
        "validated": result["validated"],
        "best": trainer.checkpoint_callback.best_model_path,
    }


def hydra_mnist(out: Path) -> dict[str, Any]:
    import hydra.utils
    from lightning_ports import hydra_mnist as port
    from omegaconf import OmegaConf

    import callbacks.lightning as L

    config = OmegaConf.create(port.CALLBACKS_YAML)
    config.paths = {"output_dir": str(out)}
    callbacks = [
        hydra.utils.instantiate(config[name])
        for name in ("model_checkpoint", "early_stopping", "model_summary", "rich_progress_bar")
    ]
    model = port.MNISTLitModule(
        net=port.SimpleDenseNet(lin1_size=32, lin2_size=32, lin3_size=32),
        optimizer=functools.partial(torch.optim.Adam, lr=0.001, weight_decay=0.0),
        scheduler=functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, mode="min", factor=0.1, patience=10),
        compile=False,
    )
    datamodule = port.MNISTDataModule(batch_size=16)
    trainer = L.Trainer(
        min_epochs=1,
        max_epochs=3,
        callbacks=callbacks,
        logger=False,
        default_root_dir=str(out),
        enable_model_summary=False,
    )
    trainer.fit(model=model, datamodule=datamodule)
    tested = trainer.test(model=model, datamodule=datamodule, ckpt_path="best")
    files = sorted(os.listdir(out / "checkpoints"))
    return {
        "global_step": trainer.global_step,
        "files": files,
        "tested": tested,
        "ckpt_path": os.path.basename(trainer.ckpt_path or ""),
        "metrics": _floats(trainer.callback_metrics),
        "dm_hparams": dict(datamodule.hparams),
        "per_device": datamodule.batch_size_per_device,
    }


def nan(out: Path) -> dict[str, Any]:
    """A NaN loss at step 3 (rank 1 only when there are two) of a 24-step run, log_every_n_steps=50."""
    from models import Regression, regression_data

    import callbacks.lightning as L

    class NaNAtThree(Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.global_step == 2 and self.global_rank == self.world_size - 1:
                loss = loss * float("nan")
            return loss

    trainer = L.Trainer(max_steps=24, logger=False, enable_checkpointing=False, **QUIET)
    try:
        trainer.fit(NaNAtThree(), DataLoader(regression_data(24 * 8 * trainer.world_size), batch_size=8))
    except FloatingPointError as exc:
        return {"error": str(exc), "global_step": trainer.global_step}
    return {"error": None, "global_step": trainer.global_step}


def run(case: str, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    return globals()[case](out)


def main() -> None:
    out = Path(sys.argv[1])
    cases = CASES if sys.argv[2:] == ["all"] else sys.argv[2:]
    rank = int(os.environ.get("RANK", "0"))
    for case in cases:
        result = run(case, out / case)
        (out / case / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
