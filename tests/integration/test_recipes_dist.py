"""``torchrun -m recipes.train`` with 2 processes (gloo, CPU): one run directory per run, the same on
every rank, written by rank 0 only; a torchrun restart after a SIGKILLed rank resumes in that directory.

The launches go through tests/harness/launch.py (c10d rendezvous on 127.0.0.1 with a unique ``--rdzv-id``, the
run id the loggers use to find a restarted job's folder), so every launch ends within its timeout.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason="the digits recipe needs scikit-learn (pip install -e '.[dev]')")

from launch import REPO_ROOT, torchrun

from trainer.loggers.logger import RUN_ID_MARKER

HARNESS_DIR = Path(__file__).resolve().parents[1] / "harness"  # recipe_faults
# A few optimizer steps of the digits recipe (64 images per rank per step), no test split.
SHORT = ["trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "trainer.num_sanity_val_steps=0", "test=false"]


def _files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


def _event_writer_pids(run_dir: Path) -> set[str]:
    """The pid field of TensorBoard event files: ``events.out.tfevents.<time>.<host>.<pid>.<n>``."""
    return {name.rsplit(".", 2)[-2] for name in os.listdir(run_dir) if name.startswith("events.out.tfevents")}


def test_torchrun_makes_one_run_directory_written_by_rank_zero(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = torchrun(
        "recipes.train",
        *SHORT,
        "trainer.max_steps=3",
        f"output_dir={out}",
        nproc=2,
        module=True,
        cwd=tmp_path,
        timeout=180,
    ).check()
    assert os.listdir(tmp_path) == ["out"], "Hydra or a rank wrote outside output_dir (or changed directory)"
    assert os.listdir(out / "digits") == ["version_0"], _files(out)
    run_dir = out / "digits" / "version_0"
    assert not any(".hydra" in name for name in _files(tmp_path))
    assert (run_dir / RUN_ID_MARKER).read_text().startswith("torchrun:")
    assert (run_dir / "config.yaml").is_file() and list((run_dir / "checkpoints").glob("*.ckpt"))
    assert len(_event_writer_pids(run_dir)) == 1, "TensorBoard events from more than one process"
    assert result.stdout.count("keel run summary") == 1  # printed by rank 0 only
    assert re.search(r"^run dir\s+" + re.escape(str(run_dir)) + "$", result.stdout, re.M), result.tail()
    assert "world_size=2" in result.stdout


def test_torchrun_restart_after_a_killed_rank_resumes_in_the_same_run_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = torchrun(
        "recipes.train",
        *SHORT,
        "trainer.max_steps=5",
        f"output_dir={out}",
        "callbacks.checkpoint.every_n_train_steps=2",
        "callbacks.checkpoint.monitor=null",
        "callbacks.checkpoint.filename='{epoch}-{step}'",
        "+callbacks.killer._target_=recipe_faults.KillAtStep",
        nproc=2,
        module=True,
        cwd=tmp_path,
        timeout=180,
        max_restarts=1,
        env={
            "KEEL_TEST_KILL_AT_STEP": "3",
            "KEEL_TEST_KILL_RANK": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(HARNESS_DIR)]),
        },
    ).check()
    # Rank 1 died after step 3; the last checkpoint was step 2; the restarted job resumed from it.
    assert "Resumed at global step 2" in result.stdout, result.tail()
    assert os.listdir(out / "digits") == ["version_0"], _files(out)
    run_dir = out / "digits" / "version_0"
    assert re.search(r"^trained\s+5 steps", result.stdout, re.M), result.tail()
    assert result.stdout.count("keel run summary") == 1
    # The same config both times: no config.1.yaml, no difference reported.
    assert not (run_dir / "config.1.yaml").exists() and "config differs" not in result.stdout
    # One events file per attempt, each from that attempt's rank 0.
    assert len(_event_writer_pids(run_dir)) == 2
