"""Where keel may write: local paths only, for now; a URL is refused when the object that would write to it is built.

keel writes run directories, checkpoints and logs through the local filesystem (a shared one for multi-node
runs: docs/elastic.md). Object storage (``s3://``, ``gs://``, any fsspec URL) has no commit protocol in keel yet, so
a URL is refused with what to do instead; before, ``Trainer(default_root_dir="s3://bucket/run")`` silently wrote a
local folder named ``s3:`` and the checkpoints died with the node. ``file://`` URLs are plain local paths.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlparse

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_path(path: str | os.PathLike[str], what: str) -> str:
    """``path`` as a local filesystem path (``file://`` URLs unwrapped, ``~`` expanded).

    Args:
        path: A path or a URL.
        what: The option or argument it came from, for the error (``"Trainer(default_root_dir=...)"``).

    Raises:
        ValueError: ``path`` is a URL of another scheme, naming it and what to do instead.
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
    raise ValueError(
        f"{what}: {text!r} is a {scheme}:// URL, and keel writes only to filesystem paths (it has no commit "
        "protocol for object storage yet, and would otherwise write a local folder named "
        f"'{scheme}:'). Give a path on a filesystem every node sees (NFS, Lustre, a cloud file service such "
        "as EFS or Filestore; a bucket mounted with FUSE has no atomic rename), or write locally and copy the "
        "committed saves to the bucket."
    )
