"""WandbLogger and MLFlowLogger with the real libraries and no network, in one process: MLflow on a local SQLite
store, read back with ``MlflowClient``; W&B in offline mode, read back from the run file it writes.

The recipe logging to both trackers (``python -m recipes.train`` launched) is in
tests/integration/test_tracking_loggers.py; the multi-process cases (2 ranks, kill and resume under torchrun) in
tests/integration/test_tracking_dist.py.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from tracking_readback import (
    TESTS,
    _client,
    _history,
    _offline_wandb,  # noqa: F401  (an autouse fixture: it applies to this module's tests)
)

from trainer.loggers import Logger, MLFlowLogger, WandbLogger, wandb_records

pytest.importorskip("mlflow", reason="pip install -e '.[dev]' (or .[mlflow])")
pytest.importorskip("wandb", reason="pip install -e '.[dev]' (or .[wandb])")


def _offline_runs(logger: WandbLogger) -> list[Path]:
    return sorted((Path(logger.log_dir) / "wandb").glob("offline-run-*"))


def _wandb_file(run_dir: Path) -> Path:
    (found,) = run_dir.glob("run-*.wandb")
    return found


# ---------------------------------------------------------------------------------------------- constructors
# (That importing trainer.loggers loads neither library: tests/unit/test_layout.py's test_import_trainer_is_cheap.)
def test_lightning_constructor_names_and_folders(tmp_path: Path) -> None:
    wb = WandbLogger(name="baseline", save_dir=tmp_path, project="digits", offline=True, prefix="p")
    assert isinstance(wb, Logger)
    assert (wb.project, wb.display_name, wb.offline, wb.prefix) == ("digits", "baseline", True, "p")
    wb.resolve_version()
    assert wb.log_dir == str(tmp_path / "digits" / "version_0")
    pinned = WandbLogger(save_dir=tmp_path, project="digits", id="abc12345")
    assert pinned.log_dir == str(tmp_path / "digits" / "abc12345") and pinned.run_id == "abc12345"
    assert WandbLogger(save_dir=tmp_path, version="xyz").run_id == "xyz"  # Lightning: version is the run id
    ml = MLFlowLogger(experiment_name="digits", run_name="r", save_dir=tmp_path, tags={"a": 1}, version=2)
    assert ml.log_dir == str(tmp_path / "digits" / "version_2")
    assert ml.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert MLFlowLogger(tracking_uri="sqlite:///x.db").tracking_uri == "sqlite:///x.db"
    for cls in (WandbLogger, MLFlowLogger):
        with pytest.raises(ValueError, match="log_model='all'"):
            cls(log_model="all")


def test_mlflow_env_tracking_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/elsewhere.db")
    assert MLFlowLogger(save_dir=tmp_path).tracking_uri == f"sqlite:///{tmp_path}/elsewhere.db"


# ---------------------------------------------------------------------------------------------- MLflow
def test_mlflow_sqlite_round_trip(tmp_path: Path) -> None:
    logger = MLFlowLogger(experiment_name="exp", save_dir=tmp_path / "out", tags={"team": "keel"})
    logger.resolve_version()
    logger.log_hyperparams({"trainer": {"max_steps": 5, "precision": "32"}, "task": {"lr": 0.01}})
    logger.log_config({"task": {"lr": 0.01, "width": 8}, "data": {"batch_size": 4}})
    for step in (1, 2, 3):
        logger.log_metrics({"train/loss": 1.0 / step, "epoch": 0.0}, step=step)
    logger.log_metrics({"val/acc": 0.5}, step=3)
    logger.finalize("success")

    assert (tmp_path / "out" / "mlflow.db").is_file()  # the default store: SQLite in the output folder
    assert not (tmp_path / "mlruns").exists()  # nothing in the working directory
    assert _history(logger, "train/loss") == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert _history(logger, "val/acc") == [(3, 0.5)]
    run = _client(logger).get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer/max_steps"] == "5" and run.data.params["task/lr"] == "0.01"
    assert run.data.params["config/data/batch_size"] == "4"
    assert run.data.tags["team"] == "keel" and run.data.tags["keel.run_dir"] == logger.log_dir
    assert run.info.run_name == "exp/version_0"
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_relative_to(tmp_path / "out" / "mlartifacts")
    assert (artifacts / "config.yaml").read_text().startswith("data:")


def test_mlflow_resume_continues_the_run_without_duplicate_steps(tmp_path: Path, caplog) -> None:
    first = MLFlowLogger(experiment_name="exp", save_dir=tmp_path, version=0)
    first.log_hyperparams({"lr": 0.1, "seed": 1})
    for step in range(1, 6):
        first.log_metrics({"train/loss": float(step)}, step=step)
    run_id = first.run_id
    # killed: no finalize. The restart resumed from the checkpoint of step 3 and re-runs steps 4 and 5.
    again = MLFlowLogger(experiment_name="exp", save_dir=tmp_path, version=0)
    with caplog.at_level(logging.WARNING, logger="trainer.loggers.mlflow"):
        again.log_hyperparams({"lr": 0.2, "seed": 1, "new": "x"})
    assert again.run_id == run_id
    assert "lr: '0.1' -> '0.2'" in caplog.text
    for step in range(4, 8):
        again.log_metrics({"train/loss": float(step), "val/loss": 10.0 + step}, step=step)
    again.log_metrics({"train/loss": 99.0}, step=7)  # the same step twice: recorded once
    again.finalize("failed")
    assert _history(again, "train/loss") == [(s, float(s)) for s in range(1, 8)]
    assert _history(again, "val/loss") == [(s, 10.0 + s) for s in range(4, 8)]
    run = _client(again).get_run(run_id)
    assert run.data.params == {"lr": "0.1", "seed": "1", "new": "x"}  # first values kept
    assert run.info.status == "FAILED"
    assert len(_client(again).search_runs([run.info.experiment_id])) == 1


def test_mlflow_reopens_after_finalize_and_finds_its_run_without_the_state_file(tmp_path: Path) -> None:
    logger = MLFlowLogger(save_dir=tmp_path, version=0)
    logger.log_metrics({"x": 1.0}, step=1)
    logger.finalize("success")
    logger.log_metrics({"test/acc": 0.9}, step=1)  # test after fit: the same run, running again
    assert _client(logger).get_run(logger.run_id).info.status == "RUNNING"
    logger.finalize("success")
    os.remove(logger.state_path)  # killed between creating the run and writing the file
    found = MLFlowLogger(save_dir=tmp_path, version=0)
    found.log_metrics({"x": 2.0}, step=2)
    assert found.run_id == logger.run_id
    assert _history(found, "x") == [(1, 1.0), (2, 2.0)]


def test_mlflow_log_model_uploads_the_checkpoints(tmp_path: Path) -> None:
    logger = MLFlowLogger(save_dir=tmp_path, log_model=True, version=0)
    logger.log_metrics({"x": 1.0}, step=1)
    (Path(logger.log_dir) / "checkpoints").mkdir()
    (Path(logger.log_dir) / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    (Path(logger.log_dir) / "checkpoints" / ".last.ckpt.tmp").write_bytes(b"torn")
    logger.finalize("success")
    names = [f.path for f in _client(logger).list_artifacts(logger.run_id, "checkpoints")]
    assert names == ["checkpoints/last.ckpt"]


# ---------------------------------------------------------------------------------------------- W&B
def test_wandb_offline_run_file_holds_the_steps_keys_and_config(tmp_path: Path) -> None:
    logger = WandbLogger(save_dir=tmp_path, project="exp", offline=True)
    logger.resolve_version()
    logger.log_hyperparams({"trainer": {"max_steps": 3}, "task": {"lr": 0.01}})
    logger.log_config({"data": {"batch_size": 4}})
    for step in (1, 2, 3):
        logger.log_metrics({"train/loss": 1.0 / step}, step=step)
    logger.log_metrics({"val/acc": 0.5}, step=3)
    run_id = logger.run_id
    logger.finalize("success")

    (run_dir,) = _offline_runs(logger)  # one offline run, inside the keel run directory
    assert f"-{run_id}" in run_dir.name
    path = _wandb_file(run_dir)
    assert wandb_records.run_ids(path) == [run_id]
    rows = wandb_records.history(path)
    assert [row["_step"] for row in rows] == [1, 2, 3]
    assert [row["trainer/global_step"] for row in rows] == [1, 2, 3]
    assert [row.get("train/loss") for row in rows] == pytest.approx([1.0, 0.5, 1 / 3])
    assert rows[-1]["val/acc"] == 0.5  # merged into step 3's row
    config = wandb_records.config(path)
    assert config["trainer"] == {"max_steps": 3} and config["task"] == {"lr": 0.01}
    assert config["config"] == {"data": {"batch_size": 4}}
    assert (Path(logger.log_dir) / "wandb_run.json").is_file()


def test_wandb_resume_continues_the_run_id_and_skips_recorded_steps(tmp_path: Path) -> None:
    first = WandbLogger(save_dir=tmp_path, project="exp", offline=True, version=0)
    for step in range(1, 6):
        first.log_metrics({"train/loss": float(step)}, step=step)
    run_id = first.run_id
    run_file = first.experiment.settings.sync_file
    first.experiment.finish()  # as at the end of a process: the file is complete
    assert wandb_records.wait_for_exit(run_file, timeout=30)
    again = WandbLogger(save_dir=tmp_path, project="exp", offline=True, version=0)  # the restart
    for step in range(4, 8):  # resumed from step 3's checkpoint
        again.log_metrics({"train/loss": float(step), "val/loss": 10.0 + step}, step=step)
    again.finalize("success")
    assert again.run_id == run_id
    runs = _offline_runs(again)
    assert len(runs) == 2  # one offline folder per attempt, both of the one W&B run
    assert [wandb_records.run_ids(_wandb_file(run)) for run in runs] == [[run_id], [run_id]]
    seen = [
        (row["_step"], key)
        for run in runs
        for row in wandb_records.history(_wandb_file(run))
        for key in row
        if key in ("train/loss", "val/loss")
    ]
    assert sorted(s for s, key in seen if key == "train/loss") == [1, 2, 3, 4, 5, 6, 7]
    assert sorted(s for s, key in seen if key == "val/loss") == [4, 5, 6, 7]


def test_wandb_log_model_adds_a_model_artifact(tmp_path: Path) -> None:
    logger = WandbLogger(save_dir=tmp_path, offline=True, log_model=True, version=0, checkpoint_name="weights")
    logger.log_metrics({"x": 1.0}, step=1)
    (Path(logger.log_dir) / "checkpoints").mkdir()
    (Path(logger.log_dir) / "checkpoints" / "epoch=0-step=1.ckpt").write_bytes(b"weights")
    logger.finalize("success")
    (run_dir,) = _offline_runs(logger)
    artifacts = [
        r.artifact for r in wandb_records.records(_wandb_file(run_dir)) if r.WhichOneof("record_type") == "artifact"
    ]
    assert [(a.name, a.type) for a in artifacts] == [("weights", "model")]
    assert [entry.path for entry in artifacts[0].manifest.contents] == ["epoch=0-step=1.ckpt"]


# ---------------------------------------------------------------------------------------------- Hydra
def _compose(overrides: list[str]):
    pytest.importorskip("sklearn", reason="the digits recipe needs scikit-learn")
    from hydra import compose, initialize_config_dir

    import recipes.trainer_schema  # noqa: F401  (registers trainer/options_schema)

    with initialize_config_dir(config_dir=str(TESTS.parent / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_hydra_several_loggers_share_the_run_directory(tmp_path: Path) -> None:
    from recipes.train import build

    cfg = _compose(
        [
            "logger=mlflow",
            "+logger@loggers.wandb=wandb",
            "+logger@loggers.csv=csv",
            "logger.version=3",
            f"output_dir={tmp_path}",
        ]
    )
    trainer, _, _ = build(cfg)
    assert [type(lg).__name__ for lg in trainer.loggers] == ["MLFlowLogger", "WandbLogger", "CSVLogger"]
    assert {lg.log_dir for lg in trainer.loggers} == {str(tmp_path / "digits" / "version_3")}
    assert trainer.loggers[0].tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert trainer.loggers[1].project == "digits" and trainer.loggers[1].run_id is None  # chosen at first write


# ---------------------------------------------------------------------------------------------- W&B run file
def test_wandb_run_file_reader_stops_at_a_torn_tail_and_rejects_corruption(tmp_path: Path) -> None:
    logger = WandbLogger(save_dir=tmp_path, offline=True, version=0)
    for step in (1, 2, 3):
        logger.log_metrics({"x": float(step)}, step=step)
    logger.finalize("success")
    (run_dir,) = _offline_runs(logger)
    data = _wandb_file(run_dir).read_bytes()
    torn = tmp_path / "torn.wandb"
    full = wandb_records.history(_wandb_file(run_dir))
    assert [row["_step"] for row in full] == [1, 2, 3]
    torn.write_bytes(data[: len(data) - 5])  # a writer killed in the middle of its last chunk
    assert len(wandb_records.records(torn)) < len(wandb_records.records(_wandb_file(run_dir)))
    assert [row["_step"] for row in wandb_records.history(torn)] == [1, 2, 3]  # the history came before the end
    assert wandb_records.last_steps([torn]) == {"x": 3, "trainer/global_step": 3}
    flipped = bytearray(data)
    flipped[40] ^= 0xFF  # inside the first record
    (tmp_path / "bad.wandb").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="checksum"):
        wandb_records.records(tmp_path / "bad.wandb")
    (tmp_path / "other.bin").write_bytes(b"not a run file")
    with pytest.raises(ValueError, match="not a W&B run file"):
        wandb_records.records(tmp_path / "other.bin")
