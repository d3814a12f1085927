"""Elastic runs keep the global batch: node loss and node join under two torchrun agents equal the
uninterrupted run (float64, 1e-10). global_batch_size's derivation, schedules and resume checks, in one process:
tests/unit/test_global_batch.py.

The multi-agent tests run two ``torchrun --nnodes 1:2`` agents with one worker each on 127.0.0.1
(tests/harness/launch.py ``elastic_agents``). Rendezvous settings are those docs/elastic.md
recommends, scaled down for one machine; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` works around
TorchElastic's scale-up hang (see docs/elastic.md).
"""

from __future__ import annotations

import csv
import datetime
import re
import time
from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, elastic_agents, python, torchrun

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "elastic_fit.py"


# Global batch 16 for steps 1-8 (epochs 0 and 1, 4 steps each), 32 from global step 8 on (epoch 2, 2 steps).
STEPS, SAMPLES, MICRO = 10, 64, 4  # the script's defaults: global_batch_size={"step": {0: 16, 8: 32}}


def global_batch_at(step: int) -> int:
    """The global batch of optimizer step ``step`` (1-based: it runs at global_step ``step - 1``)."""
    return 16 if step - 1 < 8 else 32


RDZV = {
    "join_timeout": 60,
    "last_call_timeout": 2,
    "close_timeout": 5,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 4,
}


AGENT_ENV = {"LOGLEVEL": "INFO", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def script_args(root: Path) -> list[str]:
    return [str(root / "out"), "--ckpt-dir", str(root / "ck"), "--log-dir", str(root / "logs")]


def load(root: Path, rank: int = 0) -> dict:
    return torch.load(root / "out" / f"rank{rank}.pt", weights_only=False)


def logged_rows(root: Path) -> list[tuple[int, int]]:
    """``(step, epoch)`` of every row of the run's metrics.csv, in the order written."""
    with open(root / "logs" / "version_0" / "metrics.csv") as handle:
        return [(int(row["step"]), int(float(row["epoch"]))) for row in csv.DictReader(handle)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted run: one process, global batch 16 = 1 x 4 x accumulate 4, then 32 = 1 x 4 x 8."""
    root = tmp_path_factory.mktemp("elastic_ref")
    python(SCRIPT, *script_args(root), timeout=120).check()
    return root, load(root)


def assert_same_run(root: Path, reference: tuple[Path, dict], *, ranks: int, resumed_at: int) -> None:
    """Same weights (1e-10), steps, per-step global sample order and logged step axis as the reference."""
    ref_root, ref = reference
    for rank in range(ranks):
        run = load(root, rank)
        assert run["step"] == ref["step"] == STEPS
        for name, value in ref["weights"].items():
            assert value.dtype == torch.float64
            assert torch.allclose(run["weights"][name], value, rtol=0, atol=1e-10), (
                name,
                (run["weights"][name] - value).abs().max().item(),
            )
        assert [o["step"] for o in run["order"]] == list(range(1, STEPS + 1))
        assert [o["samples"] for o in run["order"]] == [o["samples"] for o in ref["order"]]  # same global order
        for mine, theirs in zip(run["order"], ref["order"]):  # the same trajectory, step by step
            assert abs(mine["weights_sum"] - theirs["weights_sum"]) <= 1e-10, (mine["step"], mine, theirs)
        for epoch in range(3):
            seen = [i for o in run["order"] if o["epoch"] == epoch for i in o["samples"]]
            assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: every sample exactly once"
        for o in run["order"]:  # the derived accumulation: G / (world size x micro-batch), G on its schedule
            assert o["accumulate"] * o["world_size"] * MICRO == global_batch_at(o["step"]) == len(o["samples"])
    # The logged step axis continues from the resumed step (a lost step is logged again, by the survivor),
    # and every step is logged with the reference's epoch. Step N is logged at N - 1 (Lightning's axis).
    rows = logged_rows(root)
    steps = [step for step, _ in rows]
    back = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    assert len(back) <= 1, steps
    if back:
        assert steps[back[0]] == resumed_at, steps
    assert steps[back[0] if back else 0 :] == list(range(steps[back[0]] if back else 0, STEPS)), steps
    assert dict(rows) == dict(logged_rows(ref_root))


_GLOG = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) .*?\] (.*)$")


def _glog_time(line: str) -> tuple[float, str] | None:
    """Unix time and message of a torchelastic log line (``I1201 08:18:35.353000 pid file:line] msg``)."""
    match = _GLOG.match(line)
    if not match:
        return None
    year = datetime.date.today().year
    stamp = datetime.datetime.strptime(f"{year}{match.group(1)} {match.group(2)}", "%Y%m%d %H:%M:%S.%f")
    return time.mktime(stamp.timetuple()) + stamp.microsecond / 1e6, match.group(3)


LOSS_PHASES = (
    "failure detection (the peer's collective fails, the agent sees its worker exit)",
    "rendezvous (dead-node heartbeat expiry, then last_call_timeout)",
)


JOIN_PHASES = (
    "new agent starts; the running agent sees it waiting (monitor interval)",
    "worker stopped (keel saves on SIGTERM) + rendezvous of both",
)


def resume_breakdown(agent_output: str, event_at: float, phases: tuple[str, str]) -> dict[str, float]:
    """Seconds from a membership event to the first optimizer step after the restart, by phase (from the
    torchelastic log lines of the agent that stayed and the script's clock marks)."""
    marks: dict[str, float] = {}
    for line in agent_output.splitlines():
        parsed = _glog_time(line)
        if parsed is not None:
            when, message = parsed
            if "failed (exitcode" in message or "Detected 1 new nodes" in message:
                marks.setdefault("detected", when)
            elif "Rendezvous complete" in message and "detected" in marks:
                marks.setdefault("rendezvous", when)
        found = re.search(r"\[elastic_fit\] (imported|restored step \d+|first step \d+) .*?at ([\d.]+)", line)
        if found and "rendezvous" in marks:
            marks.setdefault(found.group(1).split()[0], float(found.group(2)))
    assert {"detected", "rendezvous", "imported", "restored", "first"} <= set(marks), (marks, agent_output[-3000:])
    return {
        phases[0]: marks["detected"] - event_at,
        phases[1]: marks["rendezvous"] - marks["detected"],
        "worker process start (python + torch import)": marks["imported"] - marks["rendezvous"],
        "process group + checkpoint load": marks["restored"] - marks["imported"],
        "first optimizer step": marks["first"] - marks["restored"],
        "total": marks["first"] - event_at,
    }


def _report(name: str, breakdown: dict[str, float], tmp_path: Path) -> None:
    text = "\n".join(f"{phase:>80}: {seconds:6.2f} s" for phase, seconds in breakdown.items())
    (tmp_path / f"{name}_breakdown.txt").write_text(text + "\n")
    print(f"\n{name}: node event -> first step after resume\n{text}")


# The same scenario runs by default with its checkpoints and logs on S3 (tests/integration/test_s3.py).
@pytest.mark.slow
def test_node_loss_continues_on_the_survivor_exactly(tmp_path: Path, reference) -> None:
    """2 agents; node 1's agent and worker are SIGKILLed after step 6 (before its checkpoint); node 0 resumes
    alone from `last` (step 5, mid-epoch 1) with accumulate 4 instead of 2 (8 instead of 4 once the global
    batch doubles at step 8) and ends equal to the reference."""
    agents = elastic_agents(
        SCRIPT,
        *script_args(tmp_path),
        "--die-at",
        "6",
        "--die-node",
        "1",
        max_restarts=2,
        rdzv_conf=RDZV,
        env=AGENT_ENV,
        timeout=150,
    )
    survivor, lost = agents
    assert lost.returncode == -9, lost.tail()
    survivor.check()
    assert "Resumed at global step 5" in survivor.stdout and "resuming on 1" in survivor.stdout
    assert_same_run(tmp_path, reference, ranks=1, resumed_at=5)
    assert [o["world_size"] for o in load(tmp_path)["order"]] == [2] * 5 + [1] * 5
    breakdown = resume_breakdown(survivor.stdout, float((tmp_path / "out" / "died").read_text()), LOSS_PHASES)
    _report("node loss", breakdown, tmp_path)
    assert all(seconds >= 0 for seconds in breakdown.values()), breakdown  # the phases happened in this order


def test_node_join_restarts_at_two_exactly(tmp_path: Path, reference) -> None:
    """1 agent trains alone; a second agent joins after step 3; the first agent stops its worker (keel saves
    at step 3 on SIGTERM), both restart at world size 2 with accumulate 2 and end equal to the reference."""
    reached = tmp_path / "out" / "reached"
    agents = elastic_agents(
        SCRIPT,
        *script_args(tmp_path),
        "--mark-at",
        "3",
        join_when=reached.exists,
        max_restarts=2,
        rdzv_conf=RDZV,
        env=AGENT_ENV,
        timeout=150,
    )
    assert len(agents) == 2, agents[0].tail()
    for agent in agents:
        agent.check()
    assert "Detected 1 new nodes" in agents[0].stdout and "Preempted (SIGTERM) at step 3" in agents[0].stdout
    assert_same_run(tmp_path, reference, ranks=2, resumed_at=3)
    assert [o["world_size"] for o in load(tmp_path)["order"]] == [1] * 3 + [2] * 7
    breakdown = resume_breakdown(agents[0].stdout, float(reached.read_text()), JOIN_PHASES)
    _report("node join", breakdown, tmp_path)
    assert all(seconds >= 0 for seconds in breakdown.values()), breakdown  # the phases happened in this order


def test_losing_the_rendezvous_host_ends_the_job_and_a_relaunch_resumes_exactly(tmp_path: Path, reference) -> None:
    """TorchElastic's limit: the c10d store lives in agent 0. When that node dies the survivor cannot
    re-rendezvous (RendezvousConnectionError) and exits; relaunching the job (what a scheduler's requeue does)
    resumes from `last` at the new world size, still equal to the reference."""
    agents = elastic_agents(
        SCRIPT,
        *script_args(tmp_path),
        "--die-at",
        "6",
        "--die-node",
        "0",
        max_restarts=2,
        rdzv_conf=RDZV,
        env=AGENT_ENV,
        timeout=150,
    )
    host, survivor = agents
    assert host.returncode == -9, host.tail()
    assert survivor.returncode != 0 and "RendezvousConnectionError" in survivor.stdout, survivor.tail()
    relaunch = torchrun(SCRIPT, *script_args(tmp_path), nproc=1, timeout=120).check()
    assert "Resumed at global step 5" in relaunch.stdout
    assert_same_run(tmp_path, reference, ranks=1, resumed_at=5)


def test_with_the_store_outside_the_job_any_node_may_die(tmp_path: Path, reference) -> None:
    """The supported setup for the limit above: a TCPStore in a process of its own (``is_host=false`` on every
    agent). Node 0, the one that would have hosted the store, dies; node 1 continues alone, exactly."""
    agents = elastic_agents(
        SCRIPT,
        *script_args(tmp_path),
        "--die-at",
        "6",
        "--die-node",
        "0",
        max_restarts=2,
        rdzv_conf=RDZV,
        env=AGENT_ENV,
        external_store=True,
        timeout=150,
    )
    lost, survivor = agents
    assert lost.returncode == -9, lost.tail()
    survivor.check()
    assert "Resumed at global step 5" in survivor.stdout
    assert_same_run(tmp_path, reference, ranks=1, resumed_at=5)
