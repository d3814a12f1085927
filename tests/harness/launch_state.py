"""What a retried launch starts from: the files its first attempt found.

tests/harness/launch.py runs a launch once more when gloo's known abort (``KNOWN_ABORT``) ends it. The first attempt may
have written before it died: a run that checkpoints and then resumes from ``last`` finds its own final save on
the retry, trains nothing and reports an empty run. So before a launch the state it names is set aside, and a
retry first puts it back as it was:

* local paths: every argument, the value of every ``--opt=value`` or ``key=value`` argument, every value of the
  environment the test gave the launch (split at ``os.pathsep``) and the working directory, where the path is
  absolute and lies in the temporary directory (never the checkout, never the interpreter's prefix). One that
  exists is copied aside (directories whole, symbolic links as links); one that does not exist yet is removed on
  restore.
* remote URLs: what lies under an ``s3://`` URL is read (with the credentials and endpoint of the launch's own
  environment) and, on restore, written back, and objects added since are deleted. A launch that names a URL of
  another scheme, state that cannot be read, or state above :data:`LIMIT_BYTES` is not retried: its first result
  stands, with a line that says why.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # tests/harness/launch_state.py

LIMIT_BYTES = 256 * 2**20  # test-scale state is kilobytes to a few megabytes; more means a path was misnamed

_URL = re.compile(r"([a-z][a-z0-9+.-]*)://[^\s,;=]+")


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _local_paths(words: Iterable[str]) -> list[Path]:
    tmp = Path(tempfile.gettempdir()).resolve()
    keep_out = [REPO_ROOT, Path(sys.prefix).resolve()]
    found: set[Path] = set()
    for word in (w for w in words if "://" not in w):  # a URL is remote state, not a path
        for part in {word, word.rsplit("=", 1)[-1], *word.split(os.pathsep)}:
            if not part.startswith("/"):
                continue
            path = Path(os.path.normpath(part))
            path = path.parent.resolve() / path.name  # the path itself, as named, even where it is a link
            if path == tmp or not _inside(path, tmp):
                continue
            if any(_inside(path, k) or _inside(k, path) for k in keep_out):
                continue
            found.add(path)
    # the outermost only: restoring it restores everything inside
    return sorted(p for p in found if not any(q != p and _inside(p, q) for q in found))


def _size(path: Path, limit: int) -> int:
    """Bytes of the regular files at or under path, counted until past limit."""
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size if path.is_file() and not path.is_symlink() else 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                info = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            total += info.st_size if stat.S_ISREG(info.st_mode) else 0
            if total > limit:
                return total
    return total


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _regular_only(directory: str, names: list[str]) -> list[str]:
    """copytree's ignore: sockets and pipes (a server's) cannot be copied and are no state of a run."""
    skip = []
    for name in names:
        mode = os.lstat(os.path.join(directory, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            skip.append(name)
    return skip


def _s3(url: str, env: Mapping[str, str]) -> tuple[int, Callable[[], None]]:
    """Reads every object under url; returns their bytes and the function that puts the prefix back."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key=env.get("AWS_ACCESS_KEY_ID"),
        secret=env.get("AWS_SECRET_ACCESS_KEY"),
        endpoint_url=env.get("AWS_ENDPOINT_URL"),
        client_kwargs={"region_name": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")},
        skip_instance_cache=True,
    )
    root = url.removeprefix("s3://").rstrip("/")
    saved = {path: fs.cat_file(path) for path in fs.find(root)}

    def put_back() -> None:
        fs.invalidate_cache()
        for path in fs.find(root):
            if path not in saved:
                fs.rm_file(path)
        for path, data in saved.items():
            fs.pipe_file(path, data)

    return sum(map(len, saved.values())), put_back


class Snapshot:
    """The state a launch names, taken before it starts: ``words`` are its arguments, the values of the
    environment the test gave it and its working directory; ``env`` is the environment it runs with.
    :meth:`restore` puts the state back, :meth:`discard` frees the copies."""

    def __init__(self, words: Iterable[str], env: Mapping[str, str], *, limit: int = LIMIT_BYTES) -> None:
        words = [str(w) for w in words]
        self.why_not = ""  # why a retry could not start from this state; "" when it can
        self._paths: list[tuple[Path, Path | None]] = []  # (named path, its copy or None where it did not exist)
        self._remote: list[Callable[[], None]] = []
        self._store: Path | None = None
        total = 0
        for url, scheme in {(m.group(0), m.group(1)) for w in words for m in _URL.finditer(w)}:
            if scheme in ("http", "https", "tcp", "env"):  # endpoints and rendezvous addresses, not stored state
                continue
            if scheme != "s3":
                self.why_not = f"it names {url}, whose state this harness cannot put back"
                return
            try:
                size, put_back = _s3(url, env)
            except Exception as error:
                self.why_not = f"the state under {url} could not be read ({type(error).__name__}: {error})"
                return
            total += size
            self._remote.append(put_back)
        paths = _local_paths(words)
        total += sum(_size(p, limit) for p in paths if p.exists() or p.is_symlink())
        if total > limit:
            self.why_not = f"the state it names holds over {limit} bytes ({', '.join(map(str, paths))})"
            return
        for i, path in enumerate(paths):
            copy = None
            if path.exists() or path.is_symlink():
                if self._store is None:
                    self._store = Path(tempfile.mkdtemp(prefix="keel-launch-state-"))
                copy = self._store / str(i)
                if path.is_dir() and not path.is_symlink():
                    shutil.copytree(path, copy, symlinks=True, ignore=_regular_only)
                else:
                    shutil.copy2(path, copy, follow_symlinks=False)
            self._paths.append((path, copy))

    def restore(self) -> None:
        if self.why_not:
            raise RuntimeError(f"this launch's state cannot be put back: {self.why_not}")
        for path, copy in self._paths:
            _remove(path)
            if copy is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(copy, path)
        for put_back in self._remote:
            put_back()

    def discard(self) -> None:
        if self._store is not None:
            shutil.rmtree(self._store, ignore_errors=True)
            self._store = None
