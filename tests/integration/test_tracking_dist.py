"""W&B (offline) and MLflow (SQLite) under torchrun with 2 ranks: every step logged once, by rank 0 only,
to one tracked run; and a run whose rank 0 is SIGKILLed mid-training, restarted by torchrun and resumed
from its last checkpoint, continues the same W&B run and MLflow run with every step exactly once and the
values of the uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import torchrun

from trainer.loggers import wandb_records

# One test worker runs the whole module: its module-scoped runs are made once (tests/conftest.py, --dist loadgroup).
pytestmark = pytest.mark.xdist_group("tracking_dist")

pytest.importorskip("mlflow", reason="pip install -e '.[dev]' (or .[mlflow])")
pytest.importorskip("wandb", reason="pip install -e '.[dev]' (or .[wandb])")

SCRIPT = Path(__file__).resolve().parents[1] / "harness" / "scripts" / "tracking_fit.py"
STEPS = 8  # 32 samples, batch 4, 2 ranks: 4 steps per epoch; validation at steps 4 and 8


def _env(root: Path) -> dict[str, str]:
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CONFIG_DIR": str(root / ".wandb-config"),
        "WANDB_CACHE_DIR": str(root / ".wandb-cache"),
        "WANDB_DATA_DIR": str(root / ".wandb-data"),
        "MLFLOW_TRACKING_URI": "",
    }


def _mlflow(result: dict) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=result["tracking_uri"])
    (experiment,) = [e for e in client.search_experiments() if e.name == "exp"]
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_id for run in runs] == [result["mlflow"]]  # one MLflow run for the job
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.params["trainer/max_steps"] == str(STEPS)
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(result["mlflow"], key))
        for key in ("train/loss", "val/loss", "epoch")
    }


def _wandb(result: dict, attempts: int) -> dict[str, list[tuple[int, float]]]:
    files = sorted(Path(result["run_dir"], "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == attempts, files  # one per process of rank 0; rank 1 opens nothing
    assert all(wandb_records.run_ids(f) == [result["wandb"]] for f in files)  # all the same W&B run
    assert all(wandb_records.config(f)["trainer"]["max_steps"] == STEPS for f in files)
    seen: dict[str, list[tuple[int, float]]] = {}
    for f in files:
        for row in wandb_records.history(f):
            for key in ("train/loss", "val/loss", "epoch"):
                if key in row:
                    seen.setdefault(key, []).append((row["_step"], row[key]))
    return {key: sorted(points) for key, points in seen.items()}


def _check_steps(logged: dict[str, list[tuple[int, float]]]) -> None:
    # Lightning's axis: optimizer step N is logged at N - 1, and so is the validation it triggers.
    assert [s for s, _ in logged["train/loss"]] == list(range(STEPS))
    assert [s for s, _ in logged["epoch"]] == list(range(STEPS))
    assert [s for s, _ in logged["val/loss"]] == [3, 7]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("clean")
    torchrun(SCRIPT, str(root), "--steps", str(STEPS), nproc=2, timeout=240, env=_env(root)).check()
    result = json.loads((root / "result-attempt0.json").read_text())
    assert result["world_size"] == 2
    return {"result": result, "mlflow": _mlflow(result), "wandb": _wandb(result, attempts=1)}


def test_two_ranks_log_each_step_once_to_one_run(uninterrupted: dict) -> None:
    for logged in (uninterrupted["mlflow"], uninterrupted["wandb"]):
        _check_steps(logged)
    mlflow_loss = [v for _, v in uninterrupted["mlflow"]["train/loss"]]
    assert [v for _, v in uninterrupted["wandb"]["train/loss"]] == pytest.approx(mlflow_loss, rel=1e-6)


def test_killed_and_resumed_run_continues_the_same_runs_without_gaps_or_repeats(
    tmp_path: Path, uninterrupted: dict
) -> None:
    result = torchrun(
        SCRIPT,
        str(tmp_path),
        "--steps",
        str(STEPS),
        "--kill-at",
        "6",
        "--kill-rank",
        "0",
        nproc=2,
        timeout=300,
        max_restarts=1,
        env=_env(tmp_path),
    )
    result.check()
    assert not (tmp_path / "result-attempt0.json").exists()  # the first attempt died
    resumed = json.loads((tmp_path / "result-attempt1.json").read_text())
    assert "Resumed at global step 5" in result.stdout
    mlflow_logged, wandb_logged = _mlflow(resumed), _wandb(resumed, attempts=2)
    for logged, reference in ((mlflow_logged, uninterrupted["mlflow"]), (wandb_logged, uninterrupted["wandb"])):
        _check_steps(logged)
        for key in ("train/loss", "val/loss"):  # exact resume: the values of the uninterrupted run
            assert [v for _, v in logged[key]] == pytest.approx([v for _, v in reference[key]], rel=1e-6), key


# A slow variant: the SIGKILL test above restarts into the same tracked runs; SIGTERM saves are test_checkpoint.py's.
@pytest.mark.slow
def test_preempted_and_restarted_run_continues_the_same_runs(tmp_path: Path, uninterrupted: dict) -> None:
    """SIGTERM (a cluster's preemption notice): keel saves at the step boundary and exits 75, closing both
    tracked runs cleanly (nothing lost, no delay needed); the restart resumes from that checkpoint."""
    result = torchrun(
        SCRIPT,
        str(tmp_path),
        "--steps",
        str(STEPS),
        "--kill-at",
        "6",
        "--kill-rank",
        "1",
        "--kill-signal",
        "TERM",
        "--kill-delay",
        "0",
        nproc=2,
        timeout=300,
        max_restarts=1,
        env=_env(tmp_path),
    )
    result.check()
    resumed = json.loads((tmp_path / "result-attempt1.json").read_text())
    assert "Resumed at global step 6" in result.stdout
    for logged, reference in (
        (_mlflow(resumed), uninterrupted["mlflow"]),
        (_wandb(resumed, attempts=2), uninterrupted["wandb"]),
    ):
        _check_steps(logged)
        for key in ("train/loss", "val/loss"):
            assert [v for _, v in logged[key]] == pytest.approx([v for _, v in reference[key]], rel=1e-6), key
