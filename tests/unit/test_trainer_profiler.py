"""``Trainer(profiler=...)`` in one process: the phase table of a real fit, the string choices, nothing called when
off, and PyTorchProfiler's traces of a fit. Traces per rank on 2 ranks: tests/integration/test_profiler_trainer.py
(the profilers themselves: test_profiler.py)."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer import TaskModule, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.observability.profiler import PassThroughProfiler, Profiler, PyTorchProfiler, SimpleProfiler


class Tiny(TaskModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    return DataLoader(data, batch_size=4), DataLoader(data, batch_size=8)


def _fit(tmp_path: Path, **options) -> Trainer:
    train, val = _loaders()
    trainer = Trainer(
        max_steps=8,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        logger=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        callbacks=[ModelCheckpoint(every_n_train_steps=4)],
        **options,
    )
    trainer.fit(Tiny(), train, val)
    return trainer


class Recording(SimpleProfiler):
    """Keeps the table of each stage (teardown resets the numbers)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, dict[str, list[float]]] = {}

    def teardown(self, stage: str | None = None) -> None:
        self._end_phase()
        self.tables[self.stage] = {name: list(stats) for name, stats in self.recorded.items()}
        super().teardown(stage)


def test_simple_profiler_table_of_a_fit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    profiler = Recording()
    with caplog.at_level(logging.INFO, logger="trainer.observability.profiler"):
        trainer = _fit(tmp_path, profiler=profiler)
    assert trainer.profiler is profiler
    counts = {name: int(stats[0]) for name, stats in profiler.tables["fit"].items()}
    # 8 steps of 2 micro-batches: 16 forwards and backwards, 8 optimizer steps; logging every 2 steps;
    # ModelCheckpoint every 4 steps (and at the end of an epoch).
    assert counts["forward"] == 16 and counts["backward"] == 16 and counts["optimizer_step"] == 8
    assert counts["data_wait"] >= 16 and counts["logging"] >= 4 and counts["checkpoint"] >= 2
    assert counts["validation"] >= 1
    table = caplog.text[caplog.text.index("Profiler summary (fit, rank 0)") :]
    for name in (
        "data_wait",
        "forward",
        "backward",
        "optimizer_step",
        "logging",
        "checkpoint",
        "validation",
        "Total (stage wall time)",
    ):
        assert re.search(rf"\| {re.escape(name)} +\|", table), (name, table)
    wall = float(next(line for line in table.splitlines() if "Total (stage wall time)" in line).split("|")[4])
    assert sum(stats[1] for stats in profiler.tables["fit"].values()) <= wall + 1e-3  # phases partition the stage


def test_string_choices_and_the_default(tmp_path: Path) -> None:
    assert type(Trainer(logger=False).profiler) is PassThroughProfiler
    assert type(Trainer(logger=False, profiler="simple").profiler) is SimpleProfiler
    assert type(Trainer(logger=False, profiler="pytorch").profiler) is PyTorchProfiler
    assert Trainer(logger=False, profiler="simple").options.resolved()["profiler"] == "SimpleProfiler"
    assert Trainer(logger=False).options.resolved()["profiler"] == "PassThroughProfiler"
    mine = SimpleProfiler(extended=False)
    assert Trainer(logger=False, profiler=mine).profiler is mine


class Untouchable(Profiler):
    """Disabled: the Trainer must not call anything of it on the hot path."""

    enabled = False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def setup(self, stage: str, run_dir: str | None = None, rank: int = 0) -> None:
        self.calls.append("setup")

    def teardown(self, stage: str | None = None) -> None:
        self.calls.append("teardown")

    def transition(self, phase: str) -> None:
        raise AssertionError("transition called while profiling is off")

    def start(self, action_name: str) -> None:
        raise AssertionError("start called while profiling is off")

    def stop(self, action_name: str) -> None:
        raise AssertionError("stop called while profiling is off")

    def summary(self) -> str:
        return ""


def test_disabled_profiler_is_never_called_in_the_loop(tmp_path: Path) -> None:
    profiler = Untouchable()
    _fit(tmp_path, profiler=profiler)
    assert profiler.calls == ["setup", "teardown"]  # once per stage, outside the loop


def test_pytorch_profiler_traces_of_a_fit(tmp_path: Path) -> None:
    trainer = _fit(tmp_path, profiler="pytorch")
    folder = Path(trainer.log_dir) / "profiler"
    (name,) = [n for n in os.listdir(folder) if n.endswith(".pt.trace.json")]
    assert name.startswith("rank0.fit.")
    names = {e.get("name") for e in json.loads((folder / name).read_text())["traceEvents"]}
    assert {"forward", "backward", "optimizer_step", "data_wait"} <= names
    assert {n for n in names if str(n).startswith("ProfilerStep#")} == {
        "ProfilerStep#2",
        "ProfilerStep#3",
        "ProfilerStep#4",
    }
