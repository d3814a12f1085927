"""The folder rule of tests/conftest.py: a test of tests/unit/ that carries the ``multiprocess`` marker fails its
module's collection, naming the module and where it belongs; tests of tests/integration/ get the marker from their
folder."""

from __future__ import annotations

import sys
import types

import pytest


def _conftest() -> types.ModuleType:
    module = sys.modules.get("conftest")
    assert module is not None and hasattr(module, "pytest_make_collect_report"), "tests/conftest.py is not loaded"
    return module


def _collect(collector: pytest.Collector, result: list) -> types.SimpleNamespace:
    """tests/conftest.py's collection-report hook wrapper around a collection that produced ``result``."""
    report = types.SimpleNamespace(passed=True, outcome="passed", longrepr=None, result=result)
    wrapper = _conftest().pytest_make_collect_report(collector)
    next(wrapper)
    with pytest.raises(StopIteration) as done:
        wrapper.send(report)
    return done.value.value


def test_a_unit_test_carrying_the_multiprocess_marker_fails_its_module_collection(
    request: pytest.FixtureRequest,
) -> None:
    module = request.node.getparent(pytest.Module)
    clean = _collect(module, [request.node])
    assert clean.outcome == "passed" and clean.result == [request.node]
    request.node.add_marker(pytest.mark.multiprocess)  # as a decorator or the module's pytestmark would
    report = _collect(module, [request.node])
    assert report.outcome == "failed" and report.result == []
    assert "tests/unit/test_tiers.py" in report.longrepr and request.node.name in report.longrepr
    assert "move test_tiers.py to tests/integration/" in report.longrepr


def test_a_test_of_the_integration_folder_gets_the_marker_from_it(request: pytest.FixtureRequest) -> None:
    item = types.SimpleNamespace(path=_conftest().INTEGRATION_DIR / "test_x.py", markers=[])
    item.add_marker = item.markers.append
    item.get_closest_marker = lambda name: next((m for m in item.markers if m.name == name), None)
    _conftest().pytest_collection_modifyitems(request.config, [item])
    assert [m.name for m in item.markers] == ["multiprocess"]
    assert request.node.get_closest_marker("multiprocess") is None  # this module is in tests/unit/


def test_a_path_that_appears_in_the_checkout_during_the_run_is_named_and_the_runners_own_files_are_not() -> None:
    """tests/conftest.py compares ``git status --porcelain --ignored`` at the start and the end of the run."""
    conftest = _conftest()
    before = {"?? notes.txt", " M README.md"}
    after = before | {"?? failure-rank0.log", "!! outputs/run/"}
    assert conftest.written_into_checkout(before, after) == ["failure-rank0.log", "outputs/run/"]
    assert conftest.written_into_checkout(before, before) == []
    for runner in ("tests/__pycache__/x.pyc", ".mypy_cache/3.10/cache.db", ".venv/bin/python", "keel.egg-info/"):
        assert conftest._RUNNER_FILES.search(runner), runner
    assert not conftest._RUNNER_FILES.search("failure-rank0.log")
