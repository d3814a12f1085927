"""The ``multiprocess`` marker is enforced (tests/conftest.py): a test without it cannot launch processes,
whichever way it tries, and cannot swallow the refusal by accident."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import launch
import pytest

SCRIPTS = launch.REPO_ROOT / "tests" / "scripts"


def test_launches_from_a_test_without_the_marker_are_refused() -> None:
    assert launch.running_test is not None and launch.running_test[1] is False  # recorded by conftest.py
    with pytest.raises(launch.MissingMarker, match=r"test_markers\.py::.* is not marked multiprocess"):
        launch.python("-c", "pass", timeout=60)  # the harness
    with pytest.raises(launch.MissingMarker, match="@pytest.mark.multiprocess"):
        launch.torchrun(SCRIPTS / "allreduce.py", nproc=2, timeout=60)
    for argv in (
        [sys.executable, "-c", "print('hi')"],  # subprocess directly: the audit hook
        [sys.executable, str(SCRIPTS / "allreduce.py")],
        [sys.executable, "-m", "recipes.train", "--help"],
        [sys.executable, "-m", "torch.distributed.run", "--help"],
        ["env", "-u", "RANK", "torchrun", "--help"],
    ):
        with pytest.raises(launch.MissingMarker):
            subprocess.run(argv, capture_output=True, timeout=60)
    with pytest.raises(launch.MissingMarker):
        subprocess.run(f"{sys.executable} -m trainer.doctor", shell=True, capture_output=True, timeout=60)
    with pytest.raises(launch.MissingMarker, match="spawn"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_an_except_exception_does_not_swallow_the_refusal() -> None:
    with pytest.raises(launch.MissingMarker):
        try:
            launch.python("-c", "pass", timeout=60)
        except Exception:  # what a test catching a failed launch would write
            pytest.fail("MissingMarker was caught as an Exception")


def test_what_is_not_a_launch_needs_no_marker() -> None:
    assert launch.import_check("import sys; print(len(sys.argv))").stdout.strip() == "1"  # the import checks
    assert subprocess.run([sys.executable, "--version"], capture_output=True, timeout=60).returncode == 0
    assert subprocess.run(["true"], timeout=60).returncode == 0  # another program's command-line tool


@pytest.mark.multiprocess
def test_a_marked_test_launches() -> None:
    assert "launched" in launch.python("-c", "print('launched')", timeout=60).check().stdout
    done = subprocess.run([sys.executable, "-c", "print('direct')"], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "direct"
