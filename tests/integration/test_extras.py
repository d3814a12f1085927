"""Each user-facing extra of setup.cfg resolves alone on a fresh machine: keel's extras are version ranges (a
library must not pin its users), so this is the check that they still install together with the torch that the
development lock pins, on the day it runs.

Marked ``index``: it needs the package index, which moves, so it is outside the default run
(``python -m pytest --run-index tests/integration/test_extras.py``; about a minute an extra). Each extra gets a new
virtual environment with the lock's torch, then ``pip install 'keel-trainer[EXTRA]'`` from a copy of the package's
sources (the build writes its egg-info beside them, never into the checkout), with pip's cache off."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch import REPO_ROOT

pytestmark = pytest.mark.index


def _user_extras() -> list[str]:
    """The extras a user installs; `dev` is the developers' and is installed from its lock (test_requirements.py)."""
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "setup.cfg")
    return sorted(name for name in config["options.extras_require"] if name != "dev")


SOURCES = (
    "setup.cfg",
    "setup.py",
    "pyproject.toml",
    "README.md",
    "MANIFEST.in",
    "trainer",
    "callbacks",
    "recipes",
    "conf",
)


def _locked_torch() -> str:
    text = (REPO_ROOT / "requirements" / "dev.txt").read_text()
    match = re.search(r"^torch==(\S+)$", text, re.MULTILINE)
    assert match, "requirements/dev.txt pins no torch"
    return match[1]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {"PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})


@pytest.mark.parametrize("extra", _user_extras())
def test_an_extra_installs_alone_into_a_fresh_environment_with_the_locked_torch(extra: str, tmp_path: Path) -> None:
    source = tmp_path / "keel"
    source.mkdir()
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    torch = _locked_torch()
    done = _run([python, "-m", "pip", "install", "-q", f"torch=={torch}"], timeout=900)
    assert done.returncode == 0, (
        f"the lock's torch {torch} did not install:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )
    done = _run([python, "-m", "pip", "install", "-q", f"{source}[{extra}]"], timeout=1800)
    assert done.returncode == 0, f".[{extra}] does not resolve beside torch {torch}:\n{done.stderr[-5000:]}"
    after = _run([python, "-c", "import torch, trainer; print(torch.__version__)"], timeout=300)
    assert after.returncode == 0 and after.stdout.strip() == torch, (after.stdout, after.stderr[-3000:])
