"""WandbLogger and MLFlowLogger with the real libraries and no network, from a launched recipe: ``python -m
recipes.train`` logs its config and metrics to MLflow (a local SQLite store, read back with ``MlflowClient``) and to
W&B in offline mode (read back from the run file it writes).

The loggers in one process are tested in tests/unit/test_tracking_loggers_offline.py; the multi-process cases (2
ranks, kill and resume under torchrun) in tests/integration/test_tracking_dist.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from launch import captured
from tracking_readback import (
    TESTS,
    _client,
    _history,
    _offline_wandb,  # noqa: F401  (an autouse fixture: it applies to this module's tests)
)

from trainer.loggers import MLFlowLogger, wandb_records

pytest.importorskip("mlflow", reason="pip install -e '.[dev]' (or .[mlflow])")
pytest.importorskip("wandb", reason="pip install -e '.[dev]' (or .[wandb])")


# ---------------------------------------------------------------------------------------------- Hydra
def test_recipe_logs_config_and_metrics_to_both_trackers(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the digits recipe needs scikit-learn")
    hydra = [name for name in os.environ if name.startswith("HYDRA_")]
    args = [
        "logger=mlflow",
        "+logger@loggers.wandb=wandb",
        "loggers.wandb.offline=true",
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        f"output_dir={tmp_path}",
    ]
    proc = captured(
        ["-m", "recipes.train", *args], cwd=tmp_path, env={"PYTHONPATH": str(TESTS.parent)}, unset=hydra, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "digits" / "version_0"
    ml = MLFlowLogger(experiment_name="digits", save_dir=tmp_path, version=0)
    assert ml.experiment is not None  # opens the recipe's run again: found through <run dir>/mlflow_run.json
    # Lightning's axis: steps 1, 2, 3 are logged at 0, 1, 2; the test after fit at global_step, 3.
    assert [s for s, _ in _history(ml, "train/loss")] == [0, 1, 2]
    assert [s for s, _ in _history(ml, "test/acc")] == [3]
    run = _client(ml).get_run(ml.run_id)
    assert run.data.params["config/trainer/max_steps"] == "3" and run.data.params["trainer/max_steps"] == "3"
    assert run.data.params["config/task/_target_"] == "recipes.digits.DigitsCNN"
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    stored_id = json.loads((run_dir / "wandb_run.json").read_text())["id"]
    assert files and {i for f in files for i in wandb_records.run_ids(f)} == {stored_id}
    config = wandb_records.config(files[0])
    assert config["config"]["trainer"]["max_steps"] == 3 and config["trainer"]["max_steps"] == 3
    steps = sorted(row["_step"] for f in files for row in wandb_records.history(f) if "train/loss" in row)
    assert steps == [0, 1, 2]
