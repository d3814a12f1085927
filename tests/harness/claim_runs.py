"""A short fit that saves into a checkpoint folder, and the folder's listing, for the tests of checkpoint folder
claims (tests/unit/test_run_claims_one_process.py and tests/integration/test_run_claims.py)."""

from __future__ import annotations

from pathlib import Path

from models import Regression, loader, quiet, regression_data

from trainer import Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint


def fit(folder: Path, *, max_steps: int = 4, ckpt_path: str | None = None, callbacks: tuple = ()) -> Trainer:
    trainer = Trainer(
        **quiet(max_steps=max_steps, enable_checkpointing=True),
        callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=2), *callbacks],
    )
    trainer.fit(Regression(), loader(regression_data(32), batch_size=4), ckpt_path=ckpt_path)
    return trainer


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
