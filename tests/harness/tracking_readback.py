"""Strictly offline W&B (an autouse fixture: a module that imports it applies it to its tests) and MLflow's metric
history read back, for the tracking logger tests (tests/unit/test_tracking_loggers_offline.py and
tests/integration/test_tracking_loggers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.loggers import MLFlowLogger

TESTS = Path(__file__).resolve().parents[1]  # tests/


@pytest.fixture(autouse=True)
def _offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strictly offline W&B, with its config and cache folders inside the test's temporary folder."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / ".wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / ".wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / ".wandb-data"),
        "WANDB_DISABLE_GIT": "true",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # anything written relative to the cwd would show up here


def _client(logger: MLFlowLogger):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=logger.tracking_uri)


def _history(logger: MLFlowLogger, key: str) -> list[tuple[int, float]]:
    return [
        (m.step, m.value)
        for m in sorted(_client(logger).get_metric_history(logger.run_id, key), key=lambda m: (m.step, m.timestamp))
    ]
