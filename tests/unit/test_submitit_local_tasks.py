"""Hydra's ``submitit_local`` launcher with ``tasks_per_node`` > 1 is refused by ``python -m recipes.train``
(checked in one process, on the variable submitit sets). The submitit sweeps themselves, on SLURM and local:
tests/integration/test_slurm_submitit.py."""

from __future__ import annotations

import pytest


def test_submitit_local_with_several_tasks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # hydra.launcher.tasks_per_node=2 under submitit_local: each copy has SUBMITIT_LOCAL_NTASKS=2.
    from recipes.train import _check_submitit_local_tasks

    monkeypatch.setenv("SUBMITIT_LOCAL_NTASKS", "2")
    with pytest.raises(SystemExit, match="submitit_local with tasks_per_node=2 starts 2 independent copies"):
        _check_submitit_local_tasks()
    monkeypatch.setenv("SUBMITIT_LOCAL_NTASKS", "1")
    _check_submitit_local_tasks()
