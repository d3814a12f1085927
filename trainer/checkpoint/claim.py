"""Who writes a folder: a run's claim on its checkpoint folder (one writer per folder, docs/checkpoints.md).

A claim is a small JSON file, ``keel.claim``, in the folder: the run's id and the process that holds it (host,
pid and the pid's start time, so a recycled pid is not mistaken for the holder). On object storage it is an
object; there is no exclusive create there, so two runs that start in the same second may both claim a prefix.
"""

from __future__ import annotations

import json
import os
from typing import Any

from trainer.checkpoint.files import write_atomic
from trainer.distributed.launcher import is_this_process, process_alive, run_identity, this_process
from trainer.storage import AnyPath, as_path

CLAIM_FILE = "keel.claim"


def holder() -> dict[str, Any]:
    """This process, as a claim names it."""
    return this_process()


def read(folder: str | os.PathLike | AnyPath) -> dict[str, Any] | None:
    """The folder's claim, or None when it has none (or an unreadable one, which a new claim replaces)."""
    try:
        claim = json.loads((as_path(folder) / CLAIM_FILE).read_bytes())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return claim if isinstance(claim, dict) else None


def alive(claim: dict[str, Any]) -> bool | None:
    """Whether the process that wrote ``claim`` still runs: True or False on this host, None on another (it
    cannot be told from here). This process is not alive in this sense: a claim it wrote is its own."""
    return process_alive(claim)


def by_this_process(claim: dict[str, Any]) -> bool:
    """Whether this process wrote ``claim`` (for any run)."""
    return is_this_process(claim)


def mine(claim: dict[str, Any] | None, run: str) -> bool:
    """Whether ``claim`` is this process's claim for ``run``."""
    return claim is not None and claim.get("run") == run and by_this_process(claim)


def write(folder: str | os.PathLike | AnyPath, run: str) -> None:
    """Claim ``folder`` for ``run`` (this process holds it), replacing any claim there."""
    target = as_path(folder)
    target.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"run": run, "launch": run_identity(), **holder()}, sort_keys=True).encode()
    write_atomic(target / CLAIM_FILE, lambda handle: handle.write(body))


def same_launch(claim: dict[str, Any]) -> bool:
    """Whether ``claim`` was written by an earlier incarnation of this launched job (a torchrun restart, a SLURM
    requeue): its processes may still be exiting, and the folder is this job's to take over."""
    launch = run_identity()
    return launch is not None and claim.get("launch") == launch


def describe(claim: dict[str, Any]) -> str:
    return f"run {claim.get('run')!r} (pid {claim.get('pid')} on {claim.get('host')})"
