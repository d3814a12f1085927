"""The folder rule is enforced (tests/conftest.py): a test outside tests/integration/ (without the ``multiprocess``
marker the folder sets) cannot launch processes, whichever way it tries, and cannot swallow the refusal by accident.

This module launches, so it lives in tests/integration/, where every test carries the marker; the refusals are
checked from tests that run as a test of tests/unit/ does (the ``as_a_unit_test`` fixture)."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import launch
import pytest

SCRIPTS = launch.REPO_ROOT / "tests" / "harness" / "scripts"


@pytest.fixture
def as_a_unit_test(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The test runs as one without the marker (a test of tests/unit/): conftest.py recorded it as marked, since
    the folder marks every test here."""
    recorded = launch.running_test
    assert recorded == (request.node.nodeid, True), recorded  # the folder set the marker
    launch.running_test = (request.node.nodeid, False)
    yield
    launch.running_test = recorded


@pytest.mark.usefixtures("as_a_unit_test")
def test_launches_from_a_test_without_the_marker_are_refused() -> None:
    assert launch.running_test is not None and launch.running_test[1] is False  # as_a_unit_test
    with pytest.raises(launch.MissingMarker, match=r"test_markers\.py::.* is not marked multiprocess"):
        launch.python("-c", "pass", timeout=60)  # the harness
    with pytest.raises(launch.MissingMarker, match="move the test .* to tests/integration/"):
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


@pytest.mark.usefixtures("as_a_unit_test")
def test_an_except_exception_does_not_swallow_the_refusal() -> None:
    with pytest.raises(launch.MissingMarker):
        try:
            launch.python("-c", "pass", timeout=60)
        except Exception:  # what a test catching a failed launch would write
            pytest.fail("MissingMarker was caught as an Exception")


@pytest.mark.usefixtures("as_a_unit_test")
def test_what_is_not_a_launch_needs_no_marker() -> None:
    assert launch.import_check("import sys; print(len(sys.argv))").stdout.strip() == "1"  # the import checks
    assert subprocess.run([sys.executable, "--version"], capture_output=True, timeout=60).returncode == 0
    assert subprocess.run(["true"], timeout=60).returncode == 0  # another program's command-line tool


def test_a_marked_test_launches() -> None:
    assert launch.running_test is not None and launch.running_test[1] is True  # the folder set the marker
    assert "launched" in launch.python("-c", "print('launched')", timeout=60).check().stdout
    done = subprocess.run([sys.executable, "-c", "print('direct')"], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "direct"
