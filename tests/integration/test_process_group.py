"""The process group is created on first use and destroyed at the end, also when an exception ends the run."""

from __future__ import annotations

from launch import REPO_ROOT, torchrun

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "pg_lifecycle.py"


def test_group_survives_a_caught_exception_and_is_destroyed_at_exit() -> None:
    out = torchrun(SCRIPT, nproc=2, timeout=120).check().stdout
    assert out.count("caught boom at step 2; initialized after exception: True") == 2, out
    assert "rank 0 initialized after fit: True world 2" in out and "rank 1 initialized after fit: True world 2" in out
    assert out.count("initialized at exit: False") == 2, out


def test_group_destroyed_when_an_exception_ends_the_run() -> None:
    result = torchrun(SCRIPT, "--uncaught", nproc=2, timeout=120)
    assert result.returncode != 0
    assert "boom at step 2" in result.stdout
    assert result.stdout.count("initialized at exit: False") == 2, result.stdout
