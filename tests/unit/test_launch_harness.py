"""Parts of the launch harness (tests/harness/launch.py, launch_state.py) that run in one process: free ports, a
launch result's check, and the state a retried launch sets aside. The launches themselves (torchrun, two nodes, dead
and hung ranks, retries, forked launches against fresh ones) are in tests/integration/test_launch.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from launch import LaunchResult, free_port


def test_free_port_and_check():
    port = free_port()
    assert 0 < port < 65536
    LaunchResult(0, "fine", 0.1).check()
    with pytest.raises(AssertionError, match=r"(?s)returncode 2.*line 99\Z") as info:
        LaunchResult(2, "\n".join(f"line {i}" for i in range(100)), 0.1).check()
    assert "line 19" not in str(info.value) and "line 20" in str(info.value)  # last 80 lines only


def test_the_state_of_a_launch_is_what_it_names_in_the_temporary_directory(tmp_path: Path) -> None:
    """Arguments, --opt=value and key=value values, os.pathsep lists; never the checkout or the interpreter."""
    from launch_state import REPO_ROOT, Snapshot, _local_paths

    run, ck, lib = tmp_path / "run", tmp_path / "run" / "ck", tmp_path / "lib"
    words = [sys.executable, str(REPO_ROOT / "tests"), str(ck), f"--dir={run}", f"logger.dir={lib}", f"/nope:{lib}"]
    assert _local_paths(words) == sorted([lib, run])  # ck lies inside run
    (tmp_path / "big").write_bytes(b"x" * 2048)
    assert "holds over 1024 bytes" in Snapshot([str(tmp_path / "big")], {}, limit=1024).why_not
    state = Snapshot([str(tmp_path / "big")], {})
    copies = state._store
    assert copies is not None and (copies / "0").read_bytes() == b"x" * 2048
    state.discard()
    assert not copies.exists()
