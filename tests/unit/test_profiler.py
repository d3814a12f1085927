"""Tests for trainer/observability/profiler.py: the Profiler contract, SimpleProfiler's table, PyTorchProfiler's
traces."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch

from trainer.observability.profiler import (
    PassThroughProfiler,
    Profiler,
    PyTorchProfiler,
    SimpleProfiler,
    resolve_profiler,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _simple_with_clock() -> tuple[SimpleProfiler, FakeClock]:
    profiler = SimpleProfiler()
    clock = FakeClock()
    profiler._clock = clock
    return profiler, clock


# ---------------------------------------------------------------------------------------------- option
def test_resolve_profiler_choices() -> None:
    assert type(resolve_profiler(None)) is PassThroughProfiler
    assert type(resolve_profiler("simple")) is SimpleProfiler
    assert type(resolve_profiler("Simple")) is SimpleProfiler
    assert type(resolve_profiler("pytorch")) is PyTorchProfiler
    assert type(resolve_profiler("passthrough")) is PassThroughProfiler
    mine = SimpleProfiler(extended=False)
    assert resolve_profiler(mine) is mine


@pytest.mark.parametrize("bad", ["advanced", "", 1, True, object()])
def test_resolve_profiler_rejects_other_values(bad: object) -> None:
    with pytest.raises(ValueError, match=r"profiler=.*'simple', 'pytorch'"):
        resolve_profiler(bad)


def test_only_passthrough_is_disabled() -> None:
    assert PassThroughProfiler.enabled is False
    assert SimpleProfiler.enabled is True and PyTorchProfiler.enabled is True
    off = PassThroughProfiler()
    with off.profile("x"):
        pass
    off.start("a")
    off.start("a")  # nothing is tracked, so nothing can be unbalanced
    off.stop("b")
    assert off.summary() == ""


# ---------------------------------------------------------------------------------------------- simple
def test_simple_profiler_counts_totals_and_table(tmp_path: Path) -> None:
    profiler, clock = _simple_with_clock()
    profiler.setup("fit", run_dir=str(tmp_path), rank=0)
    for step in range(3):
        profiler.start("data_wait")
        clock.now += 0.010
        profiler.stop("data_wait")
        with profiler.profile("forward_backward"):
            clock.now += 0.050 + 0.010 * step  # 50, 60, 70 ms
        clock.now += 0.005  # unprofiled
    profiler.start("optimizer_step")
    clock.now += 0.001
    profiler.stop("optimizer_step")
    assert profiler.recorded["data_wait"] == pytest.approx([3, 0.030, 0.010, 0.010])
    assert profiler.recorded["forward_backward"] == pytest.approx([3, 0.180, 0.050, 0.070])
    table = profiler.summary()
    lines = table.splitlines()
    assert lines[0].split("|")[1].strip() == "Action" and "Count" in lines[0] and "Total (s)" in lines[0]
    names = [line.split("|")[1].strip() for line in lines[2:]]
    assert names == ["Total (stage wall time)", "forward_backward", "data_wait", "optimizer_step"]  # slowest first
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]}
    wall = 3 * 0.065 + 0.001 + 0.030
    assert float(cells["Total (stage wall time)"][2]) == pytest.approx(wall, abs=1e-3)
    count, mean_ms, total_s, share, low_ms, high_ms = cells["forward_backward"]
    assert (count, mean_ms, total_s, low_ms, high_ms) == ("3", "60.000", "0.180", "50.000", "70.000")
    assert float(share) == pytest.approx(100 * 0.180 / wall, abs=0.1)


def test_simple_profiler_rejects_unbalanced_calls() -> None:
    profiler = SimpleProfiler()
    profiler.start("a")
    with pytest.raises(ValueError, match="started again"):
        profiler.start("a")
    profiler.stop("a")
    with pytest.raises(ValueError, match="never started"):
        profiler.stop("a")
    with pytest.raises(RuntimeError), profiler.profile("b"):
        raise RuntimeError("boom")
    assert profiler.recorded["b"][0] == 1  # stopped even though the block raised


def test_profile_iterable_times_each_next_and_stops_at_the_end() -> None:
    profiler, clock = _simple_with_clock()

    def slow():
        for i in range(4):
            clock.now += 0.002
            yield i

    assert list(profiler.profile_iterable(slow(), "data_wait")) == [0, 1, 2, 3]
    count, total, _, _ = profiler.recorded["data_wait"]
    assert count == 5  # 4 items + the next() that raised StopIteration
    assert total == pytest.approx(0.008)
    assert profiler._started == {}


def test_simple_profiler_teardown_logs_on_rank_zero_writes_file_and_resets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    profiler = SimpleProfiler(filename="perf")
    profiler.setup("fit", run_dir=str(tmp_path), rank=0)
    with profiler.profile("optimizer_step"):
        pass
    with caplog.at_level(logging.INFO, logger="trainer.observability.profiler"):
        profiler.teardown("fit")
    assert "Profiler summary (fit, rank 0)" in caplog.text and "optimizer_step" in caplog.text
    written = (tmp_path / "perf-fit-rank0.txt").read_text()
    assert "optimizer_step" in written
    assert profiler.recorded == {} and profiler.summary() == ""

    caplog.clear()
    other = SimpleProfiler(filename="perf")
    other.setup("fit", run_dir=str(tmp_path), rank=1)
    with other.profile("optimizer_step"):
        pass
    with caplog.at_level(logging.INFO, logger="trainer.observability.profiler"):
        other.teardown("fit")
    assert caplog.text == ""  # rank 1 logs nothing
    assert (tmp_path / "perf-fit-rank1.txt").is_file()  # but keeps its own numbers


# ---------------------------------------------------------------------------------------------- pytorch
_TRACE = re.compile(r"^rank(\d+)\.fit\.\d+\.pt\.trace\.json$")


def _run_steps(profiler: Profiler, steps: int) -> None:
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        with profiler.profile("forward_backward"):
            model(torch.randn(16, 8)).square().mean().backward()
        with profiler.profile("optimizer_step"):
            opt.step()
            opt.zero_grad()


def test_pytorch_profiler_writes_a_chrome_trace_per_rank(tmp_path: Path) -> None:
    for rank in (0, 1):
        profiler = PyTorchProfiler(filename="ops")
        profiler.setup("fit", run_dir=str(tmp_path), rank=rank)
        _run_steps(profiler, 6)  # wait 1, warmup 1, active 3: one window, written after step 5
        profiler.teardown("fit")
    traces = sorted(os.listdir(tmp_path / "profiler"))
    matched = [name for name in traces if _TRACE.match(name)]
    assert sorted(_TRACE.match(name).group(1) for name in matched) == ["0", "1"], traces
    events = json.loads((tmp_path / "profiler" / matched[0]).read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"forward_backward", "optimizer_step"} <= names  # the Trainer's actions as ranges
    assert any(str(name).startswith("aten::") for name in names)  # and the ops inside them
    steps = {name for name in names if str(name).startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}  # the active window only
    assert "aten::" in (tmp_path / "profiler" / "ops-fit-rank0.txt").read_text()  # the key_averages table


def test_pytorch_profiler_flushes_a_window_cut_short_by_teardown(tmp_path: Path) -> None:
    profiler = PyTorchProfiler(dirpath=tmp_path / "traces")
    profiler.setup("fit", run_dir=str(tmp_path), rank=0)
    _run_steps(profiler, 3)  # stage ends inside the active window
    profiler.teardown("fit")
    assert [name for name in os.listdir(tmp_path / "traces") if _TRACE.match(name)]
    assert "aten::" in profiler.summary()


def test_pytorch_trace_loads_in_tensorboard_profile_plugin(tmp_path: Path) -> None:
    """The plugin's own pipeline (what its RunLoader does per file, minus the worker processes)."""
    pytest.importorskip("torch_tb_profiler", reason="pip install torch-tb-profiler")
    from torch_tb_profiler import consts
    from torch_tb_profiler.profiler.data import RunProfileData
    from torch_tb_profiler.profiler.run_generator import RunGenerator

    profiler = PyTorchProfiler()
    profiler.setup("fit", run_dir=str(tmp_path), rank=0)
    _run_steps(profiler, 6)
    profiler.teardown("fit")
    (name,) = [n for n in os.listdir(tmp_path / "profiler") if _TRACE.match(n)]
    match = consts.WORKER_PATTERN.match(name)
    assert match and match.group(1) == "rank0.fit"  # the worker the plugin lists
    data = RunProfileData.parse(match.group(1), 1, str(tmp_path / "profiler" / name), str(tmp_path / "cache"))
    profile = RunGenerator(match.group(1), 1, data).generate_run_profile()
    assert profile.views and profile.overview  # the Overview / Operator views it would show


# ---------------------------------------------------------------------------------------------- phase clock
def test_transition_partitions_the_stage_into_phases(tmp_path: Path) -> None:
    profiler, clock = _simple_with_clock()
    profiler.setup("fit", run_dir=str(tmp_path))
    for phase, seconds in [
        ("setup", 0.5),
        ("data", 0.01),
        ("training_step", 0.02),
        ("backward", 0.03),
        ("optimizer_step", 0.004),
        ("data", 0.01),
        ("data", 0.01),
        ("training_step", 0.02),
        ("my_phase", 0.1),
    ]:
        profiler.transition(phase)
        clock.now += seconds
    profiler._end_phase()
    recorded = {name: (int(stats[0]), stats[1]) for name, stats in profiler.recorded.items()}
    assert recorded == {
        "setup": (1, pytest.approx(0.5)),
        "data_wait": (2, pytest.approx(0.03)),  # data, data: one phase
        "forward": (2, pytest.approx(0.04)),
        "backward": (1, pytest.approx(0.03)),
        "optimizer_step": (1, pytest.approx(0.004)),
        "my_phase": (1, pytest.approx(0.1)),
    }
    assert sum(total for _, total in recorded.values()) == pytest.approx(clock.now)  # nothing counted twice


def test_teardown_ends_the_phase_in_progress(tmp_path: Path) -> None:
    profiler, clock = _simple_with_clock()
    profiler.setup("fit", run_dir=str(tmp_path))
    profiler.transition("optimizer_step")
    clock.now += 1.0
    profiler.teardown("fit")
    assert profiler._phase is None and profiler._started == {}
    off = PassThroughProfiler()
    off.transition("data")
    off.teardown("fit")


def test_pytorch_profiler_steps_its_schedule_on_the_phase_clock(tmp_path: Path) -> None:
    profiler = PyTorchProfiler()
    profiler.setup("fit", run_dir=str(tmp_path), rank=0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(6):
        profiler.transition("data")
        batch = torch.randn(16, 8)
        profiler.transition("training_step")
        loss = model(batch).square().mean()
        profiler.transition("backward")
        loss.backward()
        profiler.transition("optimizer_step")
        opt.step()
        opt.zero_grad()
    profiler.teardown("fit")
    (name,) = [n for n in os.listdir(tmp_path / "profiler") if _TRACE.match(n)]
    names = {event.get("name") for event in json.loads((tmp_path / "profiler" / name).read_text())["traceEvents"]}
    assert {"data_wait", "forward", "backward", "optimizer_step"} <= names
    assert {n for n in names if str(n).startswith("ProfilerStep#")} == {
        "ProfilerStep#2",
        "ProfilerStep#3",
        "ProfilerStep#4",
    }
