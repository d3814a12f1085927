"""Why is my run slow: per-rank phase times (always on) and the diagnosis rank 0 makes of them on logging steps.

The diagnosis is read from numbers (unit cases below) and from real 2-rank runs in which the cause is made to happen
(tests/scripts/slow_rank.py): a loader that sleeps on rank 1 only names rank 1 and its data wait, not rank 0 (which
waits for rank 1 in the gradient all-reduce); a training step that sleeps on rank 0 names rank 0's compute; a
loader that sleeps on every rank calls the job data-bound."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, torchrun

from trainer.observability.phases import PHASES, ROW, Diagnosis, PhaseClock

SCRIPT = REPO_ROOT / "tests" / "scripts" / "slow_rank.py"


def row(steps: int = 10, **ms_per_step: float) -> list[float]:
    """A rank's interval: ``ms_per_step`` of each named phase, for ``steps`` optimizer steps."""
    return [ms_per_step.get(p, 0.0) * steps / 1e3 for p in PHASES] + [float(steps)]


def test_a_rank_slow_in_its_loader_is_named_once_and_again_only_when_the_diagnosis_changes(caplog) -> None:
    diag = Diagnosis(hosts=["node-a", "node-b"], patience=3)
    fast, slow = row(data=2, forward=10, backward=50, optimizer=3), row(data=41, forward=10, backward=11, optimizer=3)
    with caplog.at_level(logging.WARNING, logger="trainer.observability.phases"):
        for _ in range(2):
            metrics = diag.update([fast, slow])
        assert diag.warnings == []  # two intervals: not yet (patience 3)
        for _ in range(5):
            metrics = diag.update([fast, slow])
    (said,) = diag.warnings
    assert said.startswith("rank 1 on node-b: data wait 41 ms/step vs median 22 ms: its loader is the bottleneck")
    assert [r.getMessage() for r in caplog.records] == [f"Slow run: {said}."]
    assert metrics["perf/slowest_rank"] == 1.0 and metrics["perf/steps_per_s"] == pytest.approx(1000 / 65)
    assert metrics["perf/data_wait_frac"] == pytest.approx((2 / 65 + 41 / 65) / 2)
    # The cause goes away for three intervals, then comes back on the other rank: said again, once each.
    for _ in range(3):
        diag.update([fast, fast])
    for _ in range(4):
        diag.update([slow, fast])
    assert len(diag.warnings) == 2 and diag.warnings[1].startswith("rank 0 on node-a: data wait")


def test_compute_collective_waits_and_data_bound_jobs() -> None:
    """Under DDP the forward waits for nobody: a rank slow there is named; a rank whose backward is long because it
    waits in the all-reduce is not. Under FSDP (forward_waits) the forward is not judged. Every rank waiting for
    data: data-bound."""
    slow_step, waiting = row(data=1, forward=50, backward=10), row(data=1, forward=10, backward=50)
    ddp, fsdp = Diagnosis(patience=2), Diagnosis(patience=2, forward_waits=True)
    for _ in range(2):
        ddp.update([slow_step, waiting])
        fsdp.update([slow_step, waiting])
    assert ddp.warnings == [
        "rank 0: forward 50 ms/step vs median 30 ms: its compute is slower (another job on its "
        "GPU or CPU, a throttled device, a larger batch)"
    ]
    assert fsdp.warnings == []
    bound = Diagnosis(patience=2)
    for _ in range(2):
        bound.update([row(data=40, forward=10), row(data=38, forward=12)])
    assert bound.warnings[0].startswith("every rank waits for data (39 ms a step, median; the step takes 50 ms)")
    assert Diagnosis().update([row(steps=0)]) == {}  # no optimizer step in the interval: nothing to say


def test_the_time_budget_sums_every_interval_and_names_the_slowest_rank() -> None:
    diag = Diagnosis(hosts=["a", "b"], patience=9)
    for _ in range(3):
        diag.update([row(data=1, forward=10, backward=9), row(data=30, forward=10, backward=0)])
    diag.add([row(steps=2, data=1, forward=10, backward=9), row(steps=2, data=30, forward=10, backward=0)])
    budget = diag.budget()
    assert budget["steps"] == 32 and budget["slowest_rank"] == 1 and budget["wall_s"] == pytest.approx(1.28)
    assert budget["per_rank_seconds"][0]["forward"] == pytest.approx(0.32)
    assert budget["share_of_slowest"]["data"] == pytest.approx(30 / 40)
    assert diag.budget_line().startswith("Time budget of fit: 32 steps in 1.3 s; the slowest rank, 1 on b: data 75%")


def test_the_phase_clock_adds_each_mark_to_the_phase_it_closes(monkeypatch) -> None:
    now = iter([0.0, 1.0, 1.5, 4.0, 4.25, 5.0])
    monkeypatch.setattr("trainer.observability.phases.time.perf_counter", lambda: next(now))
    clock = PhaseClock(global_step=3)  # t=0, "other"
    clock.enter("data")  # t=1: other += 1
    clock.enter("training_step")  # 1.5: data += 0.5
    clock.enter("backward")  # 4: forward += 2.5
    clock.enter("optimizer_step")  # 4.25: backward += 0.25
    taken = clock.take(global_step=5)  # 5: optimizer += 0.75
    assert len(taken) == ROW and taken == row(steps=2, data=250, forward=1250, backward=125, optimizer=375, other=500)
    assert clock.totals == [0.0] * len(PHASES)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "cause, said",
    [
        ("data_rank1", "rank 1 on {host}: data wait"),
        ("step_rank0", "rank 0 on {host}: forward"),
        ("data_all", "every rank waits for data"),
    ],
)
def test_two_ranks_name_the_cause_that_was_made_to_happen(tmp_path: Path, cause: str, said: str) -> None:
    torchrun(SCRIPT, str(tmp_path), "--cause", cause, nproc=2, timeout=180).check()
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["global_step"] == 16
    assert ranks[0]["warnings"] == ranks[1]["warnings"]  # every rank reads the same rows (rank 0 logs them)
    (warning,) = ranks[0]["warnings"]
    assert warning.startswith(said.format(host=socket.gethostname())), warning
    assert ranks[0]["perf"] == ranks[1]["perf"] and 0 < ranks[0]["perf"]["perf/steps_per_s"] < 25  # 40 ms sleeps
    # The time budget of the fit, in the run directory: every rank's seconds per phase and the diagnoses given.
    budget = json.loads((tmp_path / "run" / "version_0" / "efficiency.json").read_text())
    assert budget["steps"] == 16 and budget["diagnoses"] == [warning] and budget["hosts"] == [socket.gethostname()] * 2
    slept = 16 * 0.04  # what the script made happen: 40 ms a batch on the ranks that sleep
    sleepers = {"data_rank1": [(1, "data")], "step_rank0": [(0, "forward")], "data_all": [(0, "data"), (1, "data")]}
    for rank, phase in sleepers[cause]:
        assert slept <= budget["per_rank_seconds"][rank][phase] < slept + 1.0, budget
    assert budget["wall_s"] == max(sum(r.values()) for r in budget["per_rank_seconds"])


def test_the_forward_is_judged_only_where_it_waits_for_nobody() -> None:
    """DDP or one device with automatic optimization: the forward holds no collective. Manual optimization times
    the whole step (its backward and gradient all-reduce too) as the forward, so it is not judged there."""
    from models import Regression, quiet, regression_data
    from torch.utils.data import DataLoader

    from trainer import Trainer

    class Manual(Regression):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            opt.step()

    waits = {}
    for task in (Regression(), Manual()):
        trainer = Trainer(**quiet(max_steps=2))
        trainer.fit(task, DataLoader(regression_data(16), batch_size=4))
        waits[type(task).__name__] = trainer._diagnosis.forward_waits
    assert waits == {"Regression": False, "Manual": True}
