"""benchmarks/overhead.py and benchmarks/step_overhead.py (single process, --quick) and benchmarks/startup.py (one
repeat) run end to end. No timing assertions: they are reports."""

from __future__ import annotations

import json
import re

from launch import REPO_ROOT, python


def test_overhead_benchmark_quick_single_process(tmp_path) -> None:
    out = tmp_path / "overhead.json"
    result = python(
        REPO_ROOT / "benchmarks" / "overhead.py",
        "--quick",
        "--single-only",
        "--json",
        str(out),
        timeout=120,
        cwd=REPO_ROOT,
    ).check()
    # One table row per model: "case | loop steps/s | trainer steps/s | ratio | cpu ratio | target PASS/MISS".
    for model in ("tiny", "mlp1m"):
        number = r"\s*[\d.]+\s*\|"
        row = rf"^{model} \(.*params\), 1 proc\s*\|{number * 4} <= [\d.]+ (PASS|MISS)$"
        assert re.search(row, result.stdout, re.M), result.tail()
    assert re.search(r"self\.log [+-][\d.]+ us/call", result.stdout), result.tail()
    record = json.loads(out.read_text())
    assert record["benchmark"] == "keel-overhead" and record["quick"] is True
    assert [(c["model"], c["procs"]) for c in record["cases"]] == [("tiny", 1), ("mlp1m", 1)]
    for case in record["cases"]:
        assert case["ratio"] > 0 and case["loop_steps_per_s"] > 0 and case["trainer_steps_per_s"] > 0
    assert json.loads(result.stdout.strip().splitlines()[-1]) == record  # the same line is printed last


def test_step_overhead_benchmark_quick_single_process(tmp_path) -> None:
    out = tmp_path / "step.json"
    result = python(
        REPO_ROOT / "benchmarks" / "step_overhead.py",
        "--quick",
        "--single-only",
        "--json",
        str(out),
        timeout=120,
        cwd=REPO_ROOT,
    ).check()
    number = r"\s*[\d.]+\s*\|"
    signed = r"\s*[+-][\d.]+\s*\|"
    for label in ("hand loop", "hand loop \\+ task"):
        row = rf"\|\s*{label}\s*\|{number * 2}{signed * 2}\s*[\d.]+\s*\| <= 10 us (PASS|MISS)$"
        assert re.search(row, result.stdout, re.M), result.tail()
    record = json.loads(out.read_text())
    assert record["benchmark"] == "keel-step-overhead" and record["steps"] == 200
    (case,) = record["cases"]
    assert case["procs"] == 1 and case["median"]["keel_us"] > 0 and case["median"]["hand_us"] > 0


def test_gpu_benchmark_refuses_without_cuda_and_runs_its_cpu_smoke(tmp_path) -> None:
    refused = python(REPO_ROOT / "benchmarks" / "gpu.py", timeout=60, cwd=REPO_ROOT)
    assert (
        refused.returncode != 0 and "needs a CUDA GPU" in refused.stdout and "is_available() is False" in refused.stdout
    )
    smoke = python(REPO_ROOT / "benchmarks" / "gpu.py", "--smoke-on-cpu", timeout=240, cwd=REPO_ROOT).check()
    row = json.loads(smoke.stdout.strip().splitlines()[-1])
    assert row["benchmark"] == "keel-gpu" and row["params"] > 0
    for run in ("loop_ddp", "keel_ddp", "loop_fsdp", "keel_fsdp"):
        assert row[run]["tokens_per_s"] > 0
    for run in ("keel_ddp", "keel_fsdp"):
        assert set(row[run]["save_blocked_s"]) == {"sync", "async"}


def test_startup_benchmark_one_repeat_in_one_process() -> None:
    result = python(
        REPO_ROOT / "benchmarks" / "startup.py", "--repeats", "1", "--layouts", "1", timeout=240, cwd=REPO_ROOT
    ).check()
    rows = re.findall(
        r"^\| 1 \| (loop|keel|keel quiet) \| ([\d.]+) \| ([\d.]+) \| ([\d.-]+) \| ([\d.]+) \|", result.stdout, re.M
    )
    assert [row[0] for row in rows] == ["loop", "keel", "keel quiet"], result.tail()
    record = json.loads(result.stdout.strip().splitlines()[-1])["startup"]["1"]
    for case in ("loop", "keel", "keel quiet"):
        marks = record[case]
        assert 0 < marks["imported"] <= marks["built"] <= marks["first step"], (case, marks)
    assert record["keel"]["built"] <= record["keel"]["fit set up"] <= record["keel"]["first step"]
