"""Shared pytest configuration for keel's tests (independent of the ``trainer`` package)."""

from __future__ import annotations

import os
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
    config.addinivalue_line("markers", "slurm: runs jobs on the one-node SLURM cluster of tests/slurm/start.sh")
    config.addinivalue_line("markers", "slow: over a minute each; skipped unless --run-slow (or KEEL_RUN_SLOW=1)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow")


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
    if not (config.getoption("--run-slow") or os.environ.get("KEEL_RUN_SLOW") == "1"):
        skip_slow = pytest.mark.skip(reason="slow (over a minute): run with --run-slow or KEEL_RUN_SLOW=1")
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(skip_slow)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the parent of tests/)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def scripts_dir() -> Path:
    """tests/scripts/: small standalone scripts launched by the tests."""
    return TESTS_DIR / "scripts"


@pytest.fixture(scope="session")
def slurm_cluster():
    """The one-node SLURM cluster (tests/slurm/start.sh): reused when running, started when this is root and
    SLURM is installed (and stopped at the end), else the test is skipped with the reason."""
    from slurm.cluster import connect

    cluster, reason = connect()
    if cluster is None:
        pytest.skip(reason)
    yield cluster
    cluster.close()
