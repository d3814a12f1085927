"""Whether the S3 server of the tests can start here (tests/harness/s3server.py's ``unavailable_reason``): the
reason a test is skipped names what is missing. The server itself, started, is tested in
tests/integration/test_s3server.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import s3server


def test_unavailable_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert s3server.unavailable_reason() is None or "not installed" in str(s3server.unavailable_reason())
    monkeypatch.setattr(s3server.shutil, "which", lambda name: None)
    monkeypatch.setattr(s3server.sys, "executable", str(tmp_path / "python"))
    assert s3server.weed_binary() is None
    assert "no `weed` on PATH" in str(s3server.unavailable_reason())
