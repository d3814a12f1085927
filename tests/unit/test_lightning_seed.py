"""``seed_everything(n)`` is respected (issue 23, item 6): a Trainer built without ``seed=`` uses the seed of the
program's ``seed_everything(n)`` (which sets ``PL_GLOBAL_SEED``, as Lightning's does), ``Trainer(seed=...)`` wins
over it, and without either keel's default 0 is used. Each stage logs the seed and where it came from.

In Lightning 2.6.6 ``seed_everything(42)`` seeds the global generators once and sets ``PL_GLOBAL_SEED=42``, which
its distributed sampler reads as its shuffle seed; it never reseeds at a stage start. keel reseeds every stage
with ``seed + global_rank`` and shuffles with ``seed``, so what matters is that ``seed`` is the program's 42.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from models import make_net, quiet, regression_data
from torch import nn
from torch.utils.data import DataLoader

import callbacks.lightning as L
from trainer import TaskModule, Trainer, seed_everything


class Noisy(TaskModule):
    """Training depends on the seed: a shuffled loader (keel's sampler shuffles with ``seed``) and dropout (the
    global generator, seeded ``seed + rank`` at the stage start). The initial weights do not (``make_net``
    seeds its own 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.drop = nn.Dropout(0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(self.drop(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def train_loader() -> DataLoader:
    return DataLoader(regression_data(32), batch_size=8, shuffle=True)


def fit(**options: Any) -> tuple[Trainer, dict[str, torch.Tensor]]:
    task = Noisy()
    trainer = Trainer(**quiet(max_epochs=2, **options))
    trainer.fit(task, train_loader())
    return trainer, {k: v.clone() for k, v in task.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def by_option() -> dict[int, dict[str, torch.Tensor]]:
    """Final weights of ``Trainer(seed=n)`` for the seeds the tests compare against."""
    return {seed: fit(seed=seed)[1] for seed in (0, 7, 42)}


def test_seed_everything_before_trainer_is_the_runs_seed(by_option: dict) -> None:
    seed_everything(42)
    trainer, weights = fit()
    assert trainer.options.seed == 42
    assert same(weights, by_option[42]) and not same(weights, by_option[0])


def test_lightning_import_path_too(by_option: dict) -> None:
    L.seed_everything(42, workers=True)
    assert os.environ["PL_GLOBAL_SEED"] == "42"
    assert same(fit()[1], by_option[42])


def test_trainer_seed_wins_over_seed_everything(by_option: dict) -> None:
    seed_everything(42)
    trainer, weights = fit(seed=7)
    assert trainer.options.seed == 7 and same(weights, by_option[7])


def test_neither_uses_keels_default_zero(by_option: dict) -> None:
    assert "PL_GLOBAL_SEED" not in os.environ  # tests/conftest.py: no test inherits another's seed_everything
    trainer, weights = fit()
    assert trainer.options.seed == 0 and same(weights, by_option[0])


def test_seed_everything_after_trainer_counts_at_the_next_stage(by_option: dict) -> None:
    task, trainer = Noisy(), Trainer(**quiet(max_epochs=2))
    seed_everything(42)  # Lightning: the generators are seeded now, and the sampler reads PL_GLOBAL_SEED at fit
    trainer.fit(task, train_loader())
    assert trainer.options.seed == 42 and same(task.state_dict(), by_option[42])


def test_each_stage_logs_the_seed_and_its_source(caplog: pytest.LogCaptureFixture) -> None:
    loader = DataLoader(regression_data(8), batch_size=4)
    with caplog.at_level(logging.DEBUG, logger="trainer.lifecycle"):
        Trainer(**quiet(max_steps=1)).fit(Noisy(), loader)
        seed_everything(42)
        Trainer(**quiet(max_steps=1)).fit(Noisy(), loader)
        Trainer(**quiet(max_steps=1, seed=7)).fit(Noisy(), loader)
        Trainer(**quiet(max_steps=1, seed=None)).fit(Noisy(), loader)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "trainer.lifecycle" and "eed" in r.getMessage() and r.levelno == logging.INFO
    ]
    # One process: no "each rank seeds ..."; a seed seed_everything announced is not announced again at INFO.
    assert lines == [
        "Seed 0 for fit, from keel's default: no Trainer(seed=...), no seed_everything.",
        "Seed set to 42",  # seed_everything's own line (Lightning's wording)
        "Seed 7 for fit, from Trainer(seed=...).",
        "Seed: none for fit (Trainer(seed=None)): the global generators are not seeded.",
    ]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "eed" in r.getMessage()]
    assert debug == ["Seed 42 for fit, from seed_everything (PL_GLOBAL_SEED)."]


def test_a_bad_pl_global_seed_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", "forty-two")
    with pytest.raises(ValueError, match=r"PL_GLOBAL_SEED='forty-two' .* not an integer.*Trainer\(seed=n\)"):
        Trainer(**quiet())


@pytest.mark.parametrize("reseed_on_resume", [True, False])
def test_resume_after_seed_everything_is_exact(tmp_path: Path, reseed_on_resume: bool) -> None:
    """The resumed process calls ``seed_everything(42)`` again (the same script), or not: the checkpoint holds
    the sampler's seed and every rank's generators, so the resumed run matches the uninterrupted one."""
    seed_everything(42)
    _, uninterrupted = fit()
    seed_everything(42)
    first = Trainer(**quiet(max_epochs=2, max_steps=5, enable_checkpointing=True, default_root_dir=str(tmp_path)))
    first.fit(Noisy(), train_loader())
    ckpt = first.checkpoint_callback.last_model_path
    os.environ.pop("PL_GLOBAL_SEED")
    if reseed_on_resume:
        seed_everything(42)
    task = Noisy()
    Trainer(**quiet(max_epochs=2, default_root_dir=str(tmp_path))).fit(task, train_loader(), ckpt_path=ckpt)
    assert same(task.state_dict(), uninterrupted)


def test_resume_with_another_seed_keeps_it_and_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seed_everything(42)
    first = Trainer(**quiet(max_epochs=2, max_steps=5, enable_checkpointing=True, default_root_dir=str(tmp_path)))
    first.fit(Noisy(), train_loader())
    resumed = Trainer(**quiet(max_epochs=2, seed=7, default_root_dir=str(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="trainer.lifecycle"):
        resumed.fit(Noisy(), train_loader(), ckpt_path=first.checkpoint_callback.last_model_path)
    assert resumed.options.seed == 7
    assert "written by a run with seed 42; this run uses seed 7 (from Trainer(seed=...))" in caplog.text
