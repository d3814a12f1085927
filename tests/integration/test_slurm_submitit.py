"""Hydra's submitit launcher for real: ``python -m recipes.train -m hydra/launcher=submitit_slurm`` submits
a two-value sweep as two SLURM jobs to the one-node cluster of tests/harness/slurm/start.sh, each trains on 2 ranks
in its own run directory, and the results and submitit's logs land where docs/slurm.md says.
``submitit_local`` runs the same sweep as two local processes at the same time, one run directory each. A few
optimizer steps of the digits recipe per job. That ``tasks_per_node`` > 1 is refused under ``submitit_local``:
tests/unit/test_submitit_local_tasks.py.
"""

from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

pytest.importorskip("sklearn", reason="the digits recipe needs scikit-learn (pip install -e '.[dev]')")
pytest.importorskip(
    "hydra_plugins.hydra_submitit_launcher",
    reason="needs hydra-submitit-launcher: pip install -e '.[slurm]' (also in '.[dev]')",
)

from launch import python
from slurm import cluster as slurm

TINY = [
    "logger=csv",
    "test=false",
    "trainer.max_steps=3",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "hydra.launcher.timeout_min=5",
]
SWEEP = "task.lr=0.001,0.002"


def run_dirs(out: Path) -> list[Path]:
    return sorted(p for p in (out / "digits").iterdir() if p.name.startswith("version_"))


def swept_lrs(dirs: list[Path]) -> set[float]:
    return {OmegaConf.load(d / "config.yaml").task.lr for d in dirs}


@pytest.mark.slurm
def test_submitit_slurm_sweep_is_two_jobs_of_two_ranks_each(slurm_cluster: slurm.Cluster, tmp_path: Path) -> None:
    if slurm_cluster.cpus < 2:
        pytest.skip(f"the SLURM test node has {slurm_cluster.cpus} CPU(s); 2 tasks need 2")
    out, name = tmp_path / "out", f"keel-sweep-{uuid.uuid4().hex[:8]}"
    try:
        result = slurm_cluster.command(
            sys.executable,
            "-m",
            "recipes.train",
            "-m",
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.tasks_per_node=2",
            f"hydra.launcher.name={name}",
            *TINY,
            f"output_dir={out}",
            SWEEP,
            timeout=300,
            cwd=tmp_path,
        ).check()
    finally:
        slurm_cluster.cancel_by_name(name)
    assert "Submitit 'slurm' sweep output dir" in result.stdout, result.tail()
    dirs = run_dirs(out)
    assert [d.name for d in dirs] == ["version_0", "version_1"] and swept_lrs(dirs) == {0.001, 0.002}
    identities = [(d / ".keel_run_id").read_text() for d in dirs]
    assert all(re.fullmatch(r"slurm:\d+\.0", i) for i in identities) and len(set(identities)) == 2, identities
    for d in dirs:
        assert (d / "metrics.csv").is_file() and (d / "checkpoints" / "last").is_file()
    # submitit's logs: <sweep dir>/.submitit/<array id>_<index>/<array id>_<index>_<task>_log.{out,err}
    (sweep,) = (out / "digits" / "multirun").iterdir()
    jobs = sorted(p for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert [j.name.split("_")[1] for j in jobs] == ["0", "1"], list((sweep / ".submitit").iterdir())
    for job in jobs:
        err0 = (job / f"{job.name}_0_log.err").read_text()
        assert "launcher slurm" in err0 and "world_size=2" in err0, err0
        assert "[rank 1]" in (job / f"{job.name}_1_log.err").read_text()  # rank 1 ran (its warnings tagged)
        assert "keel run summary" in (job / f"{job.name}_0_log.out").read_text()  # rank 0 prints it
        assert "keel run summary" not in (job / f"{job.name}_1_log.out").read_text()


def test_submitit_local_sweep_runs_jobs_side_by_side_in_their_own_run_directories(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = python(
        "recipes.train",
        "-m",
        "hydra/launcher=submitit_local",
        *TINY,
        f"output_dir={out}",
        SWEEP,
        module=True,
        cwd=tmp_path,
        timeout=240,
    ).check()
    assert "Submitit 'local' sweep output dir" in result.stdout, result.tail()
    dirs = run_dirs(out)
    assert [d.name for d in dirs] == ["version_0", "version_1"] and swept_lrs(dirs) == {0.001, 0.002}
    identities = [(d / ".keel_run_id").read_text() for d in dirs]
    assert all(i.startswith("submitit-local:") for i in identities) and len(set(identities)) == 2, identities
    assert not list(out.glob("digits/version_*/config.1.yaml"))  # neither job resumed the other
