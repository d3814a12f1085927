"""Who writes a folder: a run's claim on its checkpoint folder (one writer per folder, docs/checkpoints.md).

A claim is a small JSON file, ``keel.claim``, in the folder: the run's id and the process that holds it (host,
pid and the pid's start time, so a recycled pid is not mistaken for the holder). On object storage it is an
object. A claim is made exclusively: where the folder has none, it is created only if still absent (a hard link on
disk, ``If-None-Match`` on S3-compatible stores), and a stale claim is replaced on object storage only if it is
still the one read (``If-Match`` on its ETag), so of two runs that start in the same instant one gets the folder
and the other is refused at fit start.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any

from trainer.checkpoint.files import write_atomic
from trainer.distributed.launcher import is_this_process, process_alive, run_identity, this_process
from trainer.storage import AnyPath, RemotePath, as_path

CLAIM_FILE = "keel.claim"


def holder() -> dict[str, Any]:
    """This process, as a claim names it."""
    return this_process()


def read(folder: str | os.PathLike | AnyPath) -> dict[str, Any] | None:
    """The folder's claim, or None when it has none (or an unreadable one, which a new claim replaces)."""
    return read_for_replacing(folder)[0]


class Taken(Exception):
    """Another process claimed the folder between this one's read and its write."""


def read_for_replacing(folder: str | os.PathLike | AnyPath) -> tuple[dict[str, Any] | None, Seen]:
    """The folder's claim (None as :func:`read`), and what :func:`write` needs to replace exactly that one: whether
    a claim file is there, and on object storage its ETag."""
    path = as_path(folder) / CLAIM_FILE
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None, Seen(present=False, tag=None)
    tag = path.tag() if isinstance(path, RemotePath) else None
    try:
        claim = json.loads(data)
    except ValueError:
        claim = None
    return (claim if isinstance(claim, dict) else None), Seen(present=True, tag=tag)


@dataclass(frozen=True)
class Seen:
    """The claim file as :func:`read_for_replacing` found it."""

    present: bool
    tag: str | None


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


def write(folder: str | os.PathLike | AnyPath, run: str, seen: Seen | None = None) -> None:
    """Claim ``folder`` for ``run`` (this process holds it). With ``seen`` (from :func:`read_for_replacing`): where
    no claim was there it is created only if still absent, and on object storage a claim that was there is
    replaced only if it is still the one read. Without ``seen`` any claim there is replaced.

    Raises:
        Taken: another process claimed the folder since ``seen`` was read.
    """
    target = as_path(folder)
    target.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"run": run, "launch": run_identity(), **holder()}, sort_keys=True).encode()
    path = target / CLAIM_FILE
    try:
        if seen is not None and not seen.present:
            _create(path, body)
        elif seen is not None and isinstance(path, RemotePath):
            path.write_bytes_if(body, tag=seen.tag)
        else:
            write_atomic(path, lambda handle: handle.write(body))
    except FileExistsError as exc:
        raise Taken(str(exc)) from None


def _create(path: AnyPath, body: bytes) -> None:
    """Write ``path`` only if it does not exist (FileExistsError otherwise), whole or not at all."""
    if isinstance(path, RemotePath):
        path.write_bytes_if(body, absent=True)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_atomic(tmp, lambda handle: handle.write(body))
        os.link(tmp, path)  # fails if a claim appeared meanwhile: the one exclusive create a POSIX folder has
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def same_launch(claim: dict[str, Any]) -> bool:
    """Whether ``claim`` was written by an earlier incarnation of this launched job (a torchrun restart, a SLURM
    requeue): its processes may still be exiting, and the folder is this job's to take over."""
    launch = run_identity()
    return launch is not None and claim.get("launch") == launch


def describe(claim: dict[str, Any]) -> str:
    return f"run {claim.get('run')!r} (pid {claim.get('pid')} on {claim.get('host')})"
