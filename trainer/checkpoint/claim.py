"""Who writes a folder: a run's claim on its checkpoint folder (one writer per folder, docs/checkpoints.md).

A claim is a small JSON file, ``keel.claim``, in the folder: the run's id and the process that holds it (host,
pid and the pid's start time, so a recycled pid is not mistaken for the holder). On object storage it is an
object. A run marks its claim released when its fit ends (``"released": true``); a released claim, or on this host
one whose process has ended, is stale and may be taken over.

Reading a claim, deciding and writing the new one is exclusive. In a local (or network-mounted) folder the whole
exchange runs under a lock on ``.keel.claim.lock`` (``flock``: the kernel drops it when its process dies, and NFS
v4 and the usual parallel filesystems honour it between hosts); where the folder had no claim it is also created
only if still absent (a hard link). On object storage every write is conditional on what was read
(``If-None-Match`` / ``If-Match`` on its ETag). So of any number of runs that start or restart together on one
folder, one takes it and every other reads the winner's live claim and is refused at fit start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trainer.checkpoint.files import write_atomic
from trainer.distributed.launcher import is_this_process, process_alive, run_identity, this_process
from trainer.storage import AnyPath, RemotePath, as_path

log = logging.getLogger(__name__)

CLAIM_FILE = "keel.claim"
LOCK_FILE = ".keel.claim.lock"
LOCK_WAIT_S = 60.0  # the lock is held for one read, a folder listing and one small write: never this long
# A filesystem that cannot lock (flock answers with one of these) still gets the exclusive create, with a warning.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def holder() -> dict[str, Any]:
    """This process, as a claim names it."""
    return this_process()


def read(folder: str | os.PathLike | AnyPath) -> dict[str, Any] | None:
    """The folder's claim, or None when it has none (or an unreadable one, which a new claim replaces)."""
    return read_for_replacing(folder)[0]


class Taken(Exception):
    """Another process claimed the folder between this one's read and its write."""


class Busy(Exception):
    """Another process held the folder's claim lock for longer than :data:`LOCK_WAIT_S`."""


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


@contextlib.contextmanager
def exclusive(folder: str | os.PathLike | AnyPath) -> Iterator[None]:
    """While this is held, no other keel process reads and replaces ``folder``'s claim: read, decide and write
    inside it. A local folder is created and locked (``.keel.claim.lock``, removed again on release); on object
    storage this holds nothing, the conditional writes of :func:`write` do the same.

    Raises:
        Busy: another process held the lock for :data:`LOCK_WAIT_S` seconds.
    """
    target = as_path(folder)
    if isinstance(target, RemotePath):
        yield
        return
    target.mkdir(parents=True, exist_ok=True)
    path = os.path.join(os.fspath(target), LOCK_FILE)
    fd = _lock(path)
    try:
        yield
    finally:
        if fd is not None:  # removed while held: the next process locks a new file (it checks which one it holds)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)


def _lock(path: str) -> int | None:
    """An open descriptor of ``path`` holding its exclusive lock; None where the filesystem cannot lock."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise Busy(path) from None
                    time.sleep(0.02)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_LOCKS:
                raise
            log.warning(
                "The filesystem of %s cannot lock files (%s): two runs that start in the same instant on this "
                "folder could both take a stale claim. Give each run its own checkpoint folder.",
                os.path.dirname(path),
                exc.strerror,
            )
            return None
        except BaseException:
            os.close(fd)
            raise
        try:  # the process before this one removes the file as it lets go: a lock on a removed file excludes none
            held = os.fstat(fd)
            now = os.stat(path)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def alive(claim: dict[str, Any]) -> bool | None:
    """Whether the process that wrote ``claim`` still runs: True or False on this host, None on another (it
    cannot be told from here). This process is not alive in this sense: a claim it wrote is its own."""
    return process_alive(claim)


def by_this_process(claim: dict[str, Any]) -> bool:
    """Whether this process wrote ``claim`` (for any run)."""
    return is_this_process(claim)


def mine(claim: dict[str, Any] | None, run: str) -> bool:
    """Whether ``claim`` is this process's claim for ``run`` (held, or released by it and not taken since)."""
    return claim is not None and claim.get("run") == run and by_this_process(claim)


def released(claim: dict[str, Any]) -> bool:
    """Whether the run that holds ``claim`` let go of it (its fit ended): anyone may take it over."""
    return claim.get("released") is True


def write(folder: str | os.PathLike | AnyPath, run: str, seen: Seen | None = None) -> None:
    """Claim ``folder`` for ``run`` (this process holds it). With ``seen`` (from :func:`read_for_replacing`): where
    no claim was there it is created only if still absent, and on object storage a claim that was there is
    replaced only if it is still the one read. Without ``seen`` any claim there is replaced. Call it inside
    :func:`exclusive`, having read ``seen`` there.

    Raises:
        Taken: another process claimed the folder since ``seen`` was read.
    """
    as_path(folder).mkdir(parents=True, exist_ok=True)
    _put(as_path(folder) / CLAIM_FILE, {"run": run, "launch": run_identity(), **holder()}, seen)


def release(folder: str | os.PathLike | AnyPath, run: str) -> bool:
    """Mark this process's claim on ``folder`` for ``run`` released (its fit ended); False when the folder holds
    another claim (taken over since), or none. The claim keeps naming the run: ``ckpt_path="last"`` continues it.
    A local folder removed meanwhile is not made again for it."""
    target = as_path(folder)
    if not isinstance(target, RemotePath) and not target.is_dir():
        return False
    with exclusive(folder):
        held, seen = read_for_replacing(folder)
        if held is None or not mine(held, run) or released(held):
            return False
        try:
            _put(as_path(folder) / CLAIM_FILE, {**held, "released": True}, seen)
        except Taken:
            return False
    return True


def _put(path: AnyPath, record: dict[str, Any], seen: Seen | None) -> None:
    body = json.dumps(record, sort_keys=True).encode()
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
