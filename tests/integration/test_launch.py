"""Tests of the multi-process launch harness (tests/harness/launch.py): its launches. Its parts that launch nothing
(free ports, a result's check, a launch's state) are in tests/unit/test_launch_harness.py."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from launch import LaunchResult, python, spawn_ranks, torchrun, two_nodes

SCRIPTS = Path(__file__).resolve().parents[1] / "harness" / "scripts"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _read_pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def test_torchrun_allreduce():
    r = torchrun(SCRIPTS / "allreduce.py", nproc=2, timeout=90).check()
    assert re.search(r"^rank 0 sum 3 group 0 world 2$", r.stdout, re.M), r.tail()
    assert re.search(r"^rank 1 sum 3 group 0 world 2$", r.stdout, re.M), r.tail()


def test_two_nodes_allreduce():
    results = two_nodes(SCRIPTS / "allreduce.py", nproc_per_node=1, timeout=120)
    assert len(results) == 2
    for r in results:
        r.check()
    out = "\n".join(r.stdout for r in results)
    lines = dict(re.findall(r"^rank (\d) sum 3 group (\d) world 2$", out, re.M))
    assert set(lines) == {"0", "1"}, out
    assert lines["0"] != lines["1"], f"GROUP_RANK should differ between the nodes: {lines}"


def test_dead_rank_fails_fast():
    timeout = 60
    r = torchrun(SCRIPTS / "die.py", nproc=2, timeout=timeout)  # returns: a timeout would raise AssertionError
    assert r.returncode != 0, r.tail()
    assert re.search(r"exitcode\s*:\s*3\b", r.stdout), r.tail()  # torchrun names the dead rank's exit code
    assert "UNEXPECTED" not in r.stdout
    with pytest.raises(AssertionError, match="returncode"):
        r.check()


def test_hang_times_out_and_leaves_nothing(tmp_path):
    with pytest.raises(AssertionError, match="timed out after 5s") as info:
        torchrun(SCRIPTS / "hang.py", str(tmp_path), nproc=2, timeout=5)
    assert "rank 0 hanging" in str(info.value) or "rank 1 hanging" in str(info.value)
    pid_files = sorted(tmp_path.glob("rank*.pid"))
    assert len(pid_files) == 2, "workers did not start within the timeout"
    for f in pid_files:
        worker, agent = _read_pids(f)
        assert _gone(worker), f"worker {worker} still alive (or an unreaped zombie)"
        assert _gone(agent), f"torchrun agent {agent} still alive"
        # where each process stood when the launch timed out: py-spy's stacks, taken before the kill
        stacks = str(info.value).split(f"--- stacks of process {worker}: ", 1)[1].split("\n--- ", 1)[0]
        assert re.search(r"<module> \(hang\.py:\d+\)", stacks), stacks
    assert f"--- stacks of process {agent}: " in str(info.value)  # the agent's too


def test_stubborn_processes_are_killed_and_reaped(tmp_path):
    """A launcher ignoring SIGTERM, with a grandchild in its own session: SIGKILL after the grace, no zombie."""
    with pytest.raises(AssertionError, match="python timed out after 2s"):
        python(SCRIPTS / "stubborn.py", str(tmp_path), timeout=2)
    parent, grandchild = _read_pids(tmp_path / "stubborn.pid")
    assert _gone(parent)
    assert _gone(grandchild), "orphaned grandchild still alive (or an unreaped zombie)"


def test_max_restarts():
    r = torchrun(SCRIPTS / "restart.py", nproc=2, max_restarts=1, timeout=90).check()
    assert "attempt 0 failing on purpose" in r.stdout
    assert re.search(r"^rank 0 attempt 1 sum 3$", r.stdout, re.M), r.tail()
    assert re.search(r"^rank 1 attempt 1 sum 3$", r.stdout, re.M), r.tail()


def test_two_nodes_dead_rank_fails_both():
    timeout = 90
    results = two_nodes(SCRIPTS / "die.py", nproc_per_node=1, timeout=timeout)  # a timeout would raise
    assert all(r.returncode != 0 for r in results), "\n=====\n".join(r.tail() for r in results)
    assert any(re.search(r"exitcode\s*:\s*3\b", r.stdout) for r in results)


def _abort_once_state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir()
    (state / "count").write_text("0")
    (state / "keep").write_text("")
    return state


def test_a_launch_retried_after_the_known_abort_starts_from_the_files_it_found(tmp_path: Path) -> None:
    """The first attempt changes, removes and creates files under the paths it is given, then aborts; the retry
    finds them as they were before the first attempt (a run that resumes from `last` would otherwise resume from
    its own final save and train nothing)."""
    state, out = _abort_once_state(tmp_path), tmp_path / "out"
    result = spawn_ranks(SCRIPTS / "abort_once.py", str(state), str(out), nproc=1, timeout=60)
    assert result.check().stdout.startswith("[launch] first attempt hit"), result.tail()
    assert (tmp_path / "attempts.log").read_text().count("attempt") == 2
    assert (out / "saw").read_text() == "0" and (state / "count").read_text() == "1"


def test_a_launch_whose_remote_state_cannot_be_put_back_is_not_retried(tmp_path: Path) -> None:
    state, out = _abort_once_state(tmp_path), tmp_path / "out"
    result = spawn_ranks(SCRIPTS / "abort_once.py", str(state), str(out), "gs://keel-bucket/ck", nproc=1, timeout=60)
    assert result.returncode != 0 and (tmp_path / "attempts.log").read_text().count("attempt") == 1
    assert "not retried: it names gs://keel-bucket/ck, whose state this harness cannot put back" in result.stdout


# ------------------------------------------------------------------ launches forked from the preloaded server
PROBE = SCRIPTS / "fork_probe.py"


def _probe(tmp_path: Path, mode: str, *, fork: bool, env: dict[str, str] | None = None) -> tuple[LaunchResult, dict]:
    import json

    result = python(PROBE, str(tmp_path), mode, env={"KEEL_TEST_FORK": "1" if fork else "0", **(env or {})})
    return result, json.loads(result.stdout.splitlines()[0])


def test_a_forked_launch_sees_what_a_fresh_interpreter_sees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness forks python() and spawn_ranks() launches from a server that imported torch once
    (tests/harness/zygote.py): the program must not tell the difference, but for the imports it skips."""
    import launch

    monkeypatch.setenv("KEEL_TEST_FORK", "0")
    fresh, fresh_state = _probe(tmp_path, "ok", fork=False, env={"KEEL_PROBE": "x"})
    monkeypatch.delenv("KEEL_TEST_FORK")
    before = launch.launches
    forked, forked_state = _probe(tmp_path, "ok", fork=True, env={"KEEL_PROBE": "x"})
    again, again_state = _probe(tmp_path, "ok", fork=True, env={"KEEL_PROBE": "x"})
    assert launch.launches == before + 2 and launch._zygote_server is not None
    for result in (fresh, forked, again):
        assert result.returncode == 0 and "to stderr" in result.stdout, result.stdout
    assert forked_state["preloaded"] and not fresh_state["preloaded"]
    same = ("name", "argv", "path0", "pythonpath", "probe", "session_leader", "stdin", "main_file", "parent")
    assert {k: forked_state[k] for k in same} == {k: fresh_state[k] for k in same}
    assert forked_state["name"] == "__main__" and forked_state["probe"] == "x" and forked_state["session_leader"]
    assert forked_state["pythonpath"] and forked_state["path0"] == str(SCRIPTS)
    assert forked_state["cwd"] != again_state["cwd"] and str(launch.REPO_ROOT) not in forked_state["cwd"]
    # Seeded afresh, as a new interpreter's are: two forks do not share Python's or NumPy's random stream.
    assert forked_state["random"] != again_state["random"] and forked_state["numpy"] != again_state["numpy"]


def test_a_forked_launch_exits_and_fails_as_a_fresh_interpreter_does(tmp_path: Path) -> None:
    for fork in (False, True):
        exited, _ = _probe(tmp_path, "exit", fork=fork)
        assert exited.returncode == 3, exited.stdout
        raised, _ = _probe(tmp_path, "raise", fork=fork)
        assert raised.returncode == 1 and "ValueError: probe failure" in raised.stdout, raised.stdout
        frames = re.findall(r'File "([^"]+)"', raised.stdout)
        assert [Path(f).name for f in frames] == ["fork_probe.py", "fork_probe.py"], raised.stdout


def test_a_variable_read_at_start_up_gets_a_fresh_interpreter(tmp_path: Path) -> None:
    """PYTHONHASHSEED is read when the interpreter starts: a fork would keep the server's, so such a launch
    execs."""
    _, state = _probe(tmp_path, "ok", fork=True, env={"PYTHONHASHSEED": "0"})
    _, again = _probe(tmp_path, "ok", fork=True, env={"PYTHONHASHSEED": "0"})
    _, other = _probe(tmp_path, "ok", fork=True, env={"PYTHONHASHSEED": "1"})
    assert state["hash"] == again["hash"] != other["hash"]
    assert not state["preloaded"] and not other["preloaded"]


def test_torchruns_workers_fork_through_their_stand_in_and_see_the_agent_as_their_parent(tmp_path: Path) -> None:
    """torchrun starts each worker with PYTHON_EXEC: the harness's stand-in (tests/harness/fork_worker.py) has the
    server fork the program; the worker sees its agent as its parent, and its exit code reaches the agent."""
    import json

    result = torchrun(PROBE, str(tmp_path), "ok", nproc=2, timeout=120).check()
    states = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(state["rank"] for state in states) == ["0", "1"], result.stdout
    assert all(state["preloaded"] for state in states), result.stdout
    assert len({state["parent"] for state in states}) == 1  # one agent, the parent of both
    failed = torchrun(PROBE, str(tmp_path), "exit", nproc=2, timeout=120)
    assert failed.returncode != 0 and re.search(r"exitcode\s*:\s*3\b", failed.stdout), failed.stdout
    fresh = torchrun(PROBE, str(tmp_path), "ok", nproc=2, timeout=120, env={"PYTHONHASHSEED": "0"}).check()
    assert not any(json.loads(line)["preloaded"] for line in fresh.stdout.splitlines() if line.startswith("{"))


def test_what_a_forked_launch_forks_and_leaves_behind_is_killed(tmp_path: Path) -> None:
    """A forked launch's /proc environ is the server's, so its descendants are found by session, not by marker."""
    result, _ = _probe(tmp_path, "orphan", fork=True)
    orphan = int((tmp_path / "orphan.pid").read_text())
    assert result.returncode == 0 and "stray process" in result.stdout, result.stdout
    deadline = time.monotonic() + 10
    while not _gone(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(orphan)
