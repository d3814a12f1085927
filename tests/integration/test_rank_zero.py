"""Rank-zero logging on 2 ranks (docs/design.md section 7) and callbacks that must agree across ranks."""

from __future__ import annotations

import collections
import csv
import json
import os
import re
from pathlib import Path

import pytest
from launch import REPO_ROOT, spawn_ranks

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "rank_zero_output.py"
# configure_logging's format: "HH:MM:SS LEVEL logger: [rank N] message"
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<name>\S+): (?P<message>.*)$")


def test_rank_zero_logging_and_rank_local_metrics(tmp_path: Path) -> None:
    # The harness kills every process after 150 s: a rank waiting in a collective the other never
    # entered (a key logged on one rank, a callback's broadcast) fails the test instead of hanging it.
    result = spawn_ranks(SCRIPT, str(tmp_path), nproc=2, timeout=150).check()
    records = [m.groupdict() for m in map(LOG_LINE.match, result.stdout.splitlines()) if m]
    info = [f"{r['name']}: {r['message']}" for r in records if r["level"] == "INFO"]

    # Every INFO line comes from rank 0, once.
    assert info, result.tail()
    assert all("[rank 0] " in line for line in info), [line for line in info if "[rank 0] " not in line]
    duplicates = [line for line, n in collections.Counter(info).items() if n > 1]
    assert not duplicates, duplicates
    for expected in (
        "trainer: [rank 0] user: trainer-logger info from rank 0",
        "trainer: [rank 0] user: rank_zero_info called on rank 0",
        "user_script: [rank 0] user: module-logger info from rank 0",
    ):
        assert expected in info, (expected, info)
    assert any(line.startswith("trainer.trainer: [rank 0] Trainer options:") for line in info)
    assert any(line.startswith("callbacks.model_summary: [rank 0] Task summary:") for line in info)
    assert "161 total params" in result.stdout
    assert "rank 1" not in "\n".join(info) and "called on rank 1" not in result.stdout
    # A warning from rank 1 is shown, tagged with its rank.
    warnings = [f"{r['name']}: {r['message']}" for r in records if r["level"] == "WARNING"]
    assert warnings.count("trainer: [rank 1] user: warning from rank 1") == 1, warnings

    # Keys logged on rank 0 only reach callback_metrics on both ranks, and every decision agrees.
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["world_size"] == 2
    assert rank0["callback_metrics"] == rank1["callback_metrics"]
    assert rank0["callback_metrics"]["only0"] == 15.0  # logged during step 16 (the last logging step)
    assert rank0["callback_metrics"]["val/only0"] == 4.4  # epoch 3's value
    for rank in (rank0, rank1):
        assert rank["stopped_epoch"] == 3 and rank["global_step"] == 16 and rank["current_epoch"] == 4
        assert rank["throughput_keys"] == [
            "throughput/data_wait_fraction",
            "throughput/items_per_sec",
            "throughput/samples_per_sec",
            "throughput/step_time",
        ]
    assert "Signaling Trainer to stop" in result.stdout

    # Rank 0 alone wrote the logs: one row per logging step for each source. Steps 2, 4, ..., 16 are logged at
    # 1, 3, ..., 15 (Lightning's axis), each with the value logged during it (global_step before it: the same).
    with open(tmp_path / "logs" / "keel_logs" / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = list(range(1, 16, 2))
    assert [int(r["step"]) for r in rows if r["only0"]] == steps
    assert [float(r["only0"]) for r in rows if r["only0"]] == [float(s) for s in steps]
    # LearningRateMonitor() (no scheduler): at each epoch start (0, 4, 8, 12) and each logging step, as Lightning.
    assert [int(r["step"]) for r in rows if r["lr-SGD"]] == sorted(steps + [0, 4, 8, 12])
    samples = [float(r["throughput/samples_per_sec"]) for r in rows if r["throughput/samples_per_sec"]]
    items = [float(r["throughput/items_per_sec"]) for r in rows if r["throughput/items_per_sec"]]
    assert len(samples) == len(steps)
    # num_items = the local batch size on each rank: summed over ranks it equals the global samples.
    assert items == pytest.approx(samples, rel=1e-9)
    assert [float(r["val/only0"]) for r in rows if r["val/only0"]] == [5.0, 4.0, 4.5, 4.4]


FAILING = """
import sys
import torch
from models import Regression, loader, regression_data
from trainer import Trainer


class Fails(Regression):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise ValueError("bad batch at 2\\nsecond line of the message")
        return super().training_step(batch, batch_idx)


Trainer(max_epochs=1, default_root_dir=sys.argv[1], enable_progress_bar=False).fit(
    Fails(), loader(regression_data(), 8)
)
"""


def test_a_failure_on_two_ranks_is_one_line_per_rank_with_the_tracebacks_in_the_run_directory(tmp_path: Path) -> None:
    from launch import python, torchrun

    script = tmp_path / "fails.py"
    script.write_text(FAILING)
    env = {"PYTHONPATH": str(REPO_ROOT / "tests" / "harness")}
    result = torchrun(script, str(tmp_path / "run"), nproc=2, timeout=150, env=env)
    assert result.returncode != 0
    run_dir = tmp_path / "run" / "keel_logs" / "version_0"
    for rank in (0, 1):
        line = (
            f"keel: rank {rank} failed: ValueError: bad batch at 2 (fails.py:11 in training_step); traceback in "
            f"{run_dir}/failure-rank{rank}.log"
        )
        assert result.stdout.count(line) >= 1, result.tail()  # the rank's line (torchrun's summary repeats it)
        saved = (run_dir / f"failure-rank{rank}.log").read_text()
        assert 'fails.py", line 11, in training_step' in saved and "second line of the message" in saved
    assert "Traceback" not in "\n".join(line for line in result.stdout.splitlines() if line.startswith("[rank"))
    # One process: Python's traceback, as a user debugging a script expects.
    alone = python(script, str(tmp_path / "alone"), timeout=120, env=env)
    assert alone.returncode != 0 and "Traceback (most recent call last)" in alone.stdout
    assert "keel: rank" not in alone.stdout and not list((tmp_path / "alone").rglob("failure-rank*.log"))


OWN_FOLDERS = """
import json, os, sys, tempfile
from models import Regression, loader, regression_data
from trainer import Trainer

rank = int(os.environ["RANK"])
root = tempfile.mkdtemp(prefix=f"rank{rank}-", dir=sys.argv[1])  # each rank its own, as Lightning's tests do
trainer = Trainer(max_epochs=1, default_root_dir=root, enable_progress_bar=False)
trainer.fit(Regression(), loader(regression_data(), 8))
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
    json.dump({"root": root, "dirpath": trainer.checkpoint_callback.dirpath, "log_dir": trainer.log_dir}, out)
"""


def test_each_rank_naming_its_own_folder_gets_rank_zeros_as_in_lightning(tmp_path: Path) -> None:
    """A program that gives each rank its own tempfile.mkdtemp() as default_root_dir: the checkpoint and log folders
    are rank 0's on every rank (Lightning resolves them on rank 0 and broadcasts them), so the first save works."""
    import json

    from launch import torchrun

    script = tmp_path / "own_folders.py"
    script.write_text(OWN_FOLDERS)
    env = {"PYTHONPATH": str(REPO_ROOT / "tests" / "harness")}
    torchrun(script, str(tmp_path), nproc=2, timeout=150, env=env).check()
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    run_dir = os.path.join(seen[0]["root"], "keel_logs", "version_0")
    assert seen[0]["root"] != seen[1]["root"]
    for rank in seen:
        assert rank["dirpath"] == os.path.join(run_dir, "checkpoints") and rank["log_dir"] == run_dir
    assert (Path(run_dir) / "checkpoints" / "epoch=0-step=4.ckpt" / "__1_0.distcp").is_file()  # 64 / 8 / 2 ranks
    assert list(Path(seen[1]["root"]).iterdir()) == []  # rank 1's own folder stays empty


DIFFERENT_MODELS = """
import os, sys
import torch
from models import Regression, loader, regression_data
from trainer import Trainer


class Task(Regression):
    def __init__(self):
        super().__init__()
        rank = int(os.environ["RANK"])
        self.extra = torch.nn.Linear(8, 4 + rank)  # a model that depends on the rank: a bug to name


Trainer(max_steps=2, strategy=sys.argv[2], default_root_dir=sys.argv[1], enable_progress_bar=False).fit(
    Task(), loader(regression_data(), 8)
)
"""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_that_built_different_models_are_named_before_any_collective_aborts(
    tmp_path: Path, strategy: str
) -> None:
    from launch import torchrun

    script = tmp_path / "different.py"
    script.write_text(DIFFERENT_MODELS)
    env = {"PYTHONPATH": str(REPO_ROOT / "tests" / "harness")}
    result = torchrun(script, str(tmp_path / "run"), strategy, nproc=2, timeout=150, env=env)
    assert result.returncode != 0
    message = (
        "ValueError: Rank 1 built a different Task from rank 0's (extra.weight: shape [4, 8] float32 on rank 0, "
        "shape [5, 8] float32 on rank 1)."
    )
    for rank in (0, 1):
        assert f"keel: rank {rank} failed: {message}" in result.stdout, result.tail()
    assert "terminate called" not in result.stdout and "Gloo" not in result.stdout
