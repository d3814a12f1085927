"""Shared pytest configuration for keel's tests (independent of the ``trainer`` package)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent

# Make `import launch` (tests/launch.py) work whatever pytest's import mode is.
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    config.addinivalue_line("markers", "multiprocess: launches real processes (torchrun / gloo)")


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA; torch.cuda.is_available() is False")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the parent of tests/)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def scripts_dir() -> Path:
    """tests/scripts/: small standalone scripts launched by the tests."""
    return TESTS_DIR / "scripts"
