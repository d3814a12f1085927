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
