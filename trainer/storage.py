"""Where keel reads and writes: local paths, and object storage URLs (``s3://``, ``gs://``, any fsspec filesystem).

A path enters keel through :func:`location` (``default_root_dir``, ``ModelCheckpoint(dirpath=...)``, a logger's
``save_dir``, ``ckpt_path``, ``save_checkpoint``, ``export_weights``): a local path comes back as a path (``file://``
URLs unwrapped, ``~`` expanded), a URL as a URL once the filesystem for its scheme is importable. Nothing containing
``://`` is ever used as a local folder name (``Path("s3://b/run")`` is ``s3:/b/run``, a local folder).

:class:`RemotePath` gives the checkpoint code the few ``pathlib.Path`` operations it uses, over fsspec, so one
checkpoint path serves both; :func:`as_path` picks one. Objects are written whole: a PUT (or a multipart upload,
completed at close) makes an object appear complete or not at all, so a plain file needs no temporary name there;
what a save of several objects needs instead is the commit protocol of trainer/checkpoint/store.py.

Credentials and the endpoint come only from where the AWS SDK and s3fs look (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_PROFILE`` and ``~/.aws``, instance roles): keel takes none as an
option, so none is ever written to an option dump, a saved config, a log or a checkpoint. :func:`check_writable` is
the fit-start check that they work.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

# scheme -> (the package fsspec needs, the pip install that brings it)
_EXTRAS = {
    "s3": ("s3fs", "pip install 'keel-trainer[s3]'  (s3fs)"),
    "s3a": ("s3fs", "pip install 'keel-trainer[s3]'  (s3fs)"),
    "gs": ("gcsfs", "pip install gcsfs"),
    "gcs": ("gcsfs", "pip install gcsfs"),
    "az": ("adlfs", "pip install adlfs"),
    "abfs": ("adlfs", "pip install adlfs"),
    "abfss": ("adlfs", "pip install adlfs"),
}


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL of a scheme other than ``file://``."""
    if isinstance(path, RemotePath):
        return True
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
    return isinstance(text, str) and bool(_URL.match(text)) and not text.lower().startswith("file://")


def location(path: str | os.PathLike[str], what: str) -> str:
    """``path`` as keel uses it: a local path (``file://`` unwrapped, ``~`` expanded) or a URL (no trailing ``/``)
    whose filesystem is installed.

    Args:
        path: A path or a URL.
        what: The option or argument it came from, for the error (``"Trainer(default_root_dir=...)"``).

    Raises:
        ValueError: a ``file://`` URL of another host, or a URL whose scheme has no installed filesystem (naming what
            to install).
    """
    text = os.fspath(path)
    if not isinstance(text, str) or not _URL.match(text):
        return os.path.expanduser(text)
    scheme = text.split("://", 1)[0].lower()
    if scheme == "file":
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{what}: {text!r} names another host; give a local path.")
        return unquote(parsed.path)
    _filesystem_class(scheme, text, what)
    if not text.split("://", 1)[1].strip("/"):
        raise ValueError(f"{what}: {text!r} names no bucket; give {scheme}://BUCKET/PREFIX.")
    return text.rstrip("/")


def _filesystem_class(scheme: str, url: str, what: str) -> Any:
    try:
        import fsspec
        from fsspec.registry import get_filesystem_class
    except ImportError:  # pragma: no cover - fsspec comes with torch's and datasets' dependencies
        fsspec = None
    package, install = _EXTRAS.get(
        scheme, (f"the fsspec filesystem for {scheme}://", f"pip install fsspec and {scheme}'s filesystem package")
    )
    if fsspec is None:  # pragma: no cover
        raise ValueError(f"{what}: {url!r} needs fsspec and {package}: {install}.")
    try:
        return get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        raise ValueError(
            f"{what}: {url!r} is a {scheme}:// URL, and no filesystem for {scheme}:// is installed ({exc}). "
            f"Install it: {install}. (keel never writes a URL as a local folder name.)"
        ) from None


@functools.cache
def _filesystem(scheme: str, pid: int) -> Any:
    import fsspec

    # No listings cache: ranks and restarted processes must see each other's objects at once.
    return fsspec.filesystem(scheme, use_listings_cache=False, skip_instance_cache=True)


def filesystem(url: str) -> Any:
    """The fsspec filesystem of ``url``'s scheme (one per process; credentials from the standard places)."""
    return _filesystem(url.split("://", 1)[0].lower(), os.getpid())


class _Stat:
    def __init__(self, size: int, mtime: float) -> None:
        self.st_size, self.st_mtime = size, mtime


class RemotePath:
    """The ``pathlib.Path`` operations keel's checkpoint code uses, for an object storage URL.

    A "folder" is a prefix: it exists when an object lies under it; ``mkdir`` does nothing.
    """

    def __init__(self, url: str | RemotePath) -> None:
        self.url = str(url).rstrip("/")
        self.scheme, self.key = self.url.split("://", 1)

    def __str__(self) -> str:
        return self.url

    def __fspath__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}") if name else self

    @property
    def fs(self) -> Any:
        return filesystem(self.url)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        return os.path.splitext(self.name)[1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(f"{self.scheme}://{self.key.rsplit('/', 1)[0]}") if "/" in self.key else self

    def exists(self) -> bool:
        return bool(self.fs.exists(self.url))

    def is_file(self) -> bool:
        """Whether an object has this name. A store that fails raises (fsspec's ``isfile`` answers False on any
        error, which would make an intact save look uncommitted during an outage)."""
        try:
            return bool(self.fs.info(self.url).get("type") == "file")
        except FileNotFoundError:
            return False

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.url))

    def is_symlink(self) -> bool:
        return False

    def resolve(self) -> RemotePath:
        return self

    def iterdir(self) -> Iterator[RemotePath]:
        for key in self.fs.ls(self.url, detail=False):
            name = str(key).rstrip("/").rsplit("/", 1)[-1]
            if name:
                yield self / name

    def files(self) -> dict[str, int]:
        """Every object under this prefix: name relative to it -> size (one listing)."""
        found = self.fs.find(self.url, detail=True)
        prefix = self.fs._strip_protocol(self.url).rstrip("/") + "/"
        return {k[len(prefix) :]: int(v["size"]) for k, v in found.items() if k.startswith(prefix)}

    def stat(self) -> _Stat:
        info = self.fs.info(self.url)
        modified = info.get("LastModified") or info.get("mtime") or info.get("updated")
        if isinstance(modified, datetime.datetime):
            mtime = modified.timestamp()
        else:
            mtime = float(modified) if isinstance(modified, (int, float)) else 0.0
        return _Stat(int(info.get("size") or 0), mtime)

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.url))

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def open(self, mode: str = "rb") -> Any:
        return self.fs.open(self.url, mode)

    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.url, data)

    def tag(self) -> str | None:
        """The object's ETag (what a conditional write compares), None when the store gives none."""
        info = self.fs.info(self.url)
        tag = info.get("ETag") or info.get("etag")
        return str(tag) if tag else None

    def write_bytes_if(self, data: bytes, *, absent: bool = False, tag: str | None = None) -> None:
        """Write only if the object is still absent (``absent``), or still has the ETag ``tag``. S3-compatible
        stores check it on the server (``If-None-Match`` / ``If-Match``); other filesystems write as
        :meth:`write_bytes` does (``absent`` is still honoured by fsspec, though not atomically).

        Raises:
            FileExistsError: the store refused the condition: another writer came first.
        """
        s3 = "s3" in (self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,))
        conditions: dict[str, Any] = {"mode": "create"} if absent else ({"IfMatch": tag} if s3 and tag else {})
        try:
            self.fs.pipe_file(self.url, data, **conditions)
        except FileExistsError:
            raise
        except OSError as exc:
            if "pre-condition" in str(exc) or "PreconditionFailed" in str(exc):
                raise FileExistsError(f"{self.url}: another writer came first ({describe_error(exc)})") from exc
            raise

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing: a prefix exists once an object is written under it."""

    def unlink(self) -> None:
        self.fs.rm_file(self.url)

    def rmtree(self) -> None:
        if self.fs.exists(self.url):
            self.fs.rm(self.url, recursive=True)


AnyPath = Path | RemotePath


def as_path(path: str | os.PathLike[str] | RemotePath) -> Path | RemotePath:
    """A :class:`RemotePath` for a URL, a ``pathlib.Path`` for anything else."""
    if isinstance(path, (Path, RemotePath)):
        return path
    return RemotePath(os.fspath(path)) if is_url(path) else Path(path)


def join(base: str, *names: str) -> str:
    """``os.path.join`` for a path or a URL (a URL is joined with ``/`` and never normalised)."""
    if is_url(base):
        return "/".join([base.rstrip("/"), *(n.strip("/") for n in names)])
    return os.path.join(base, *names)


def describe_error(exc: BaseException) -> str:
    """One line for an object store's failure: its class and first line (botocore's and aiohttp's errors
    name the endpoint and the cause)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_writable(url: str, what: str) -> None:
    """Write and delete one small object under ``url``: the credentials, the endpoint and the bucket work.

    Raises:
        PermissionError: naming the URL and what failed (no credentials, a wrong key, no such bucket, no write
            permission, an endpoint that does not answer), and where keel looks for credentials.
    """
    probe = RemotePath(url) / f".keel-write-check-{uuid.uuid4().hex[:12]}"
    try:
        probe.write_bytes(b"keel")
        probe.unlink()
    except Exception as exc:
        cause = describe_error(exc)
        kind = type(exc).__name__
        if "NoCredentials" in kind or "credentials" in cause.lower() and "not" in cause.lower():
            hint = "no credentials were found"
        elif "NoSuchBucket" in cause or isinstance(exc, FileNotFoundError):
            hint = "the bucket does not exist (create it first)"
        elif (
            "InvalidAccessKeyId" in cause
            or "SignatureDoesNotMatch" in cause
            or "AccessDenied" in cause
            or isinstance(exc, PermissionError)
        ):
            hint = "the credentials were refused or may not write there"
        elif (
            "connect" in cause.lower()
            or "endpoint" in cause.lower()
            or isinstance(exc, (ConnectionError, TimeoutError))
        ):
            hint = "the endpoint did not answer"
        else:
            hint = "the store refused a write"
        raise PermissionError(
            f"{what}: cannot write to {url!r}: {hint} ({cause}). keel reads credentials and the endpoint only from the "
            "standard places: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE and ~/.aws/credentials, or an "
            "instance role), AWS_ENDPOINT_URL for a store that is not AWS, AWS_DEFAULT_REGION. Checked when fit "
            "starts, so that no save fails later."
        ) from None


# ---------------------------------------------------------------------- run directories on object storage
# What writes plain local files (the CSV and TensorBoard loggers, config.yaml, profiler traces, hang reports) writes
# a run directory on object storage through a local mirror: a folder on this node that is uploaded to the URL after
# each committed checkpoint and when a stage ends (sync_mirrors). A restart on another node first downloads what
# the store holds, so the CSV and TensorBoard logs continue rather than start over.
_MIRRORS: dict[str, tuple[str, dict[str, tuple[int, int]]]] = {}  # url -> (local folder, uploaded: rel -> stamp)
_DOWNLOADED: set[str] = set()
_NOT_MIRRORED = ("checkpoints",)  # the checkpoints under a run directory are written to the store directly


def mirror_root() -> str:
    """Where local mirrors live: ``$KEEL_MIRROR_DIR``, else ``<tmp>/keel-mirror-<uid>``."""
    import tempfile

    return os.environ.get("KEEL_MIRROR_DIR") or os.path.join(tempfile.gettempdir(), f"keel-mirror-{os.getuid()}")


def local_dir(path: str, *, download: bool = False) -> str:
    """A folder local files can be written to for ``path``: ``path`` itself, or for a URL its local mirror
    (created; with ``download``, first filled with what the store holds there, once per process)."""
    if not is_url(path):
        return path
    import hashlib

    url = path.rstrip("/")
    if url not in _MIRRORS:
        folder = os.path.join(mirror_root(), hashlib.sha1(url.encode()).hexdigest()[:16])
        os.makedirs(folder, exist_ok=True)
        _MIRRORS[url] = (folder, {})
    folder, uploaded = _MIRRORS[url]
    if download and url not in _DOWNLOADED:
        _DOWNLOADED.add(url)
        remote = RemotePath(url)
        try:
            listed = remote.files() if remote.is_dir() else {}
        except FileNotFoundError:
            listed = {}
        for rel in listed:
            if rel.split("/", 1)[0] in _NOT_MIRRORED:
                continue
            target = os.path.join(folder, *rel.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as handle:
                handle.write((remote / rel).read_bytes())
            uploaded[rel] = _stamp(target)
    return folder


def _stamp(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def sync_mirrors() -> list[str]:
    """Upload what changed in every local mirror of this process to its URL. Returns the URLs that could not
    be written (each logged once as a WARNING with the cause; the local copy is kept and retried next time)."""
    import logging

    failed = []
    for url, (folder, uploaded) in list(_MIRRORS.items()):
        try:
            for base, _, names in os.walk(folder):
                for name in names:
                    local = os.path.join(base, name)
                    rel = os.path.relpath(local, folder).replace(os.sep, "/")
                    stamp = _stamp(local)
                    if uploaded.get(rel) != stamp:
                        filesystem(url).put_file(local, f"{url}/{rel}")
                        uploaded[rel] = stamp
        except Exception as exc:
            failed.append(url)
            if url not in _WARNED:
                _WARNED.add(url)
                logging.getLogger(__name__).warning(
                    "Could not upload the run directory's files from %s to %s (%s); they stay on this node and are "
                    "uploaded again at the next checkpoint.",
                    folder,
                    url,
                    describe_error(exc),
                )
    return failed


_WARNED: set[str] = set()
