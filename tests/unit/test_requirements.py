"""The locked development environment (requirements/dev.txt) is what setup.cfg asks for, compiled by the documented
command: every requirement of keel, of its ``dev`` extra and of requirements/dev.in is pinned there exactly, within
its range, and the torch pin is requirements/cpu.txt's. A dependency added to setup.cfg without a refreshed lock
fails here, before a fresh machine installs without it (the lock is installed with --no-deps)."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "dev.txt"
# What docs/development.md gives as the one command that regenerates the lock (the lock's header names it too).
COMPILE = (
    "uv pip compile setup.cfg requirements/dev.in --extra dev -c requirements/cpu.txt --python-version 3.11 "
    "--no-emit-package torchvision -o requirements/dev.txt"
)


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in LOCK.read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9._\[\],-]+)==(\S+)", line.strip())
        if match:
            pins[canonicalize_name(match[1].split("[")[0])] = Version(match[2])
    return pins


def _asked_for() -> list[Requirement]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines() + config["options.extras_require"]["dev"].splitlines()
    lines += (ROOT / "requirements" / "dev.in").read_text().splitlines()
    return [Requirement(line) for line in (line.split("#")[0].strip() for line in lines) if line]


def test_every_requirement_of_keel_and_its_dev_extra_is_pinned_in_the_lock_within_its_range() -> None:
    pins = _pins()
    asked = _asked_for()
    assert len(asked) > 20, asked
    missing = [str(req) for req in asked if canonicalize_name(req.name) not in pins]
    assert not missing, f"not in requirements/dev.txt: {missing}; regenerate it ({COMPILE})"
    outside = [
        f"{req} (locked {pins[canonicalize_name(req.name)]})"
        for req in asked
        if not req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True)
    ]
    assert not outside, f"requirements/dev.txt pins versions setup.cfg excludes: {outside}; regenerate it ({COMPILE})"


def test_the_lock_pins_the_cpu_torch_and_leaves_torchvision_out() -> None:
    pins = _pins()
    torch = next(
        Requirement(line) for line in (ROOT / "requirements" / "cpu.txt").read_text().splitlines() if line[:1].isalpha()
    )
    assert torch.name == "torch" and torch.specifier.contains(pins["torch"]), (torch, pins["torch"])
    assert "torchvision" not in pins  # litdata asks for it; PyPI's build does not load beside the CPU torch
    assert not [name for name in pins if name.startswith("nvidia-")], "the lock was compiled against a CUDA torch"


def test_the_lock_names_the_documented_command_and_the_docs_give_it() -> None:
    header = LOCK.read_text().splitlines()[:2]
    assert header[1].strip("# ") == COMPILE, header
    assert COMPILE in " ".join((ROOT / "docs" / "development.md").read_text().split())
