"""The S3 server of the tests (tests/harness/s3server.py, the ``s3_server`` fixture of tests/conftest.py): it serves
S3 through s3fs, refuses other credentials, reaches a child process through the standard AWS variables, and
its faults (pause, kill) look to a client the way keel's tests rely on. Why it cannot start somewhere:
tests/unit/test_s3server_availability.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import s3server
from s3server import S3Server

pytest.importorskip("s3fs")

import botocore.exceptions  # s3fs brings botocore


@pytest.fixture
def own_server(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A server of this test alone, for the faults that would break the session's server."""
    reason = s3server.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    server = S3Server.start(tmp_path / "weed")
    yield server
    server.kill()


def test_put_get_list_delete(s3_server: S3Server) -> None:
    fs = s3_server.filesystem()
    bucket = s3_server.bucket()
    fs.pipe_file(f"{bucket}/ckpt/step-1/model.pt", b"weights")
    fs.pipe_file(f"{bucket}/ckpt/step-1/meta.json", b"{}")
    fs.pipe_file(f"{bucket}/top.txt", b"x")
    assert fs.cat_file(f"{bucket}/ckpt/step-1/model.pt") == b"weights"
    with fs.open(s3_server.url(bucket, "ckpt", "step-1", "model.pt"), "rb") as f:  # an s3:// URL works too
        assert f.read() == b"weights"
    # ls lists the common prefixes as directories, and the objects at that level
    listing = {entry["name"]: entry["type"] for entry in fs.ls(bucket, detail=True)}
    assert listing == {f"{bucket}/ckpt": "directory", f"{bucket}/top.txt": "file"}
    assert sorted(fs.find(bucket)) == [
        f"{bucket}/ckpt/step-1/meta.json",
        f"{bucket}/ckpt/step-1/model.pt",
        f"{bucket}/top.txt",
    ]
    fs.rm(f"{bucket}/ckpt")  # without recursive=True: removes nothing, and says nothing
    fs.invalidate_cache()
    assert len(fs.find(f"{bucket}/ckpt")) == 2
    fs.rm(f"{bucket}/ckpt", recursive=True)
    fs.rm_file(f"{bucket}/top.txt")
    fs.invalidate_cache()
    assert fs.find(bucket) == []
    assert not fs.exists(f"{bucket}/top.txt")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{bucket}/top.txt")


def test_a_retried_launch_finds_the_objects_its_first_attempt_found(s3_server: S3Server) -> None:
    """tests/harness/launch_state.py: what lies under a launch's s3:// URL is put back before a retry (changed objects
    rewritten, deleted ones restored, new ones removed); objects beside the URL are left as they are."""
    from launch_state import Snapshot

    fs, bucket = s3_server.filesystem(), s3_server.bucket()
    fs.pipe_file(f"{bucket}/ck/last", b"step=2")
    fs.pipe_file(f"{bucket}/ck/step=2/keel.json", b"{}")
    state = Snapshot(["--ckpt-dir", s3_server.url(bucket, "ck"), s3_server.endpoint], s3_server.env())
    assert state.why_not == ""
    fs.pipe_file(f"{bucket}/ck/last", b"step=4")
    fs.rm_file(f"{bucket}/ck/step=2/keel.json")
    fs.pipe_file(f"{bucket}/ck/step=4/keel.json", b"{}")
    fs.pipe_file(f"{bucket}/beside", b"kept")
    state.restore()
    fs.invalidate_cache()
    assert sorted(fs.find(bucket)) == [f"{bucket}/beside", f"{bucket}/ck/last", f"{bucket}/ck/step=2/keel.json"]
    assert fs.cat_file(f"{bucket}/ck/last") == b"step=2"


def test_a_missing_bucket_is_not_created_on_write(s3_server: S3Server) -> None:
    fs = s3_server.filesystem()
    with pytest.raises(FileNotFoundError, match="bucket does not exist"):
        fs.pipe_file("keel-no-such-bucket/x", b"1")
    with pytest.raises(FileNotFoundError, match="bucket does not exist"):
        fs.ls("keel-no-such-bucket")


def test_wrong_credentials_are_refused(s3_server: S3Server) -> None:
    import s3fs

    bucket = s3_server.bucket()
    options = s3_server.storage_options()
    wrong_secret = s3fs.S3FileSystem(**{**options, "secret": "not-" + s3_server.secret_key}, skip_instance_cache=True)
    with pytest.raises(PermissionError, match="signature we calculated does not match"):
        wrong_secret.pipe_file(f"{bucket}/x", b"1")
    with pytest.raises(PermissionError, match="signature we calculated does not match"):
        wrong_secret.ls(bucket)
    wrong_key = s3fs.S3FileSystem(**{**options, "key": "NOT" + s3_server.access_key}, skip_instance_cache=True)
    with pytest.raises(PermissionError, match="access key ID you provided does not exist"):
        wrong_key.ls(bucket)
    anonymous = s3fs.S3FileSystem(anon=True, endpoint_url=s3_server.endpoint, skip_instance_cache=True)
    with pytest.raises(PermissionError, match="Access Denied"):
        anonymous.pipe_file(f"{bucket}/x", b"1")


def test_a_fresh_bucket_per_call(s3_server: S3Server) -> None:
    first, second = s3_server.bucket(), s3_server.bucket("ckpt")
    assert first != second and first.startswith("t-") and second.startswith("ckpt-")
    for name in (first, second):
        assert 3 <= len(name) <= 63 and name == name.lower()
    fs = s3_server.filesystem()
    assert fs.ls(first) == [] and fs.ls(second) == []
    assert s3_server.url(first, "a/", "b.pt") == f"s3://{first}/a/b.pt"
    with pytest.raises(ValueError, match="not a valid S3 bucket name"):
        s3_server.bucket("x" * 60)


def test_it_listens_on_loopback_only(s3_server: S3Server) -> None:
    assert s3_server.proc is not None
    pid = s3_server.proc.pid
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # an fd closed meanwhile
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    listening = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if inode in inodes and (state == "0A" or table.startswith("udp")):  # 0A: LISTEN
                    listening.append((table, local))
    ports = {int(local.rsplit(":", 1)[1], 16) for _, local in listening}
    assert ports == set(s3_server.ports.values()), listening  # no listener but the ports it was given
    assert all(local.split(":")[0] == "0100007F" for _, local in listening), listening  # 127.0.0.1


def test_the_standard_aws_variables_reach_it(s3_server: S3Server, tmp_path: Path) -> None:
    """A plain ``s3fs.S3FileSystem()`` in a child with only PATH, a HOME without ~/.aws, and ``env()``."""
    bucket = s3_server.bucket()
    s3_server.filesystem().pipe_file(f"{bucket}/hello", b"from the parent")
    code = f"import s3fs; print(s3fs.S3FileSystem().cat_file({f'{bucket}/hello'!r}).decode())"
    bare = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**bare, **s3_server.env()}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "from the parent", done.stderr
    # without the variables (and no ~/.aws): botocore's own error, not an OSError
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**bare, "AWS_ENDPOINT_URL": s3_server.endpoint, "AWS_EC2_METADATA_DISABLED": "true"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "NoCredentialsError: Unable to locate credentials" in done.stderr, done.stderr


@pytest.mark.slow  # tests/integration/test_s3.py pauses its own server in the hanging-store test
def test_a_paused_server_hangs_until_resumed(own_server: S3Server) -> None:
    bucket = own_server.bucket()
    own_server.filesystem().pipe_file(f"{bucket}/x", b"1")
    patient, impatient = own_server.filesystem(read_timeout=60), own_server.impatient_filesystem(timeout=1)
    own_server.pause()
    t0 = time.monotonic()
    with pytest.raises(botocore.exceptions.ReadTimeoutError, match="Read timeout on endpoint URL"):
        impatient.cat_file(f"{bucket}/x")
    assert time.monotonic() - t0 < 5
    results: dict[str, object] = {}
    reader = threading.Thread(target=lambda: results.update(read=patient.cat_file(f"{bucket}/x")), daemon=True)
    # an upload is not bounded by the read timeout: it waits for the server's "100 Continue"
    writer = threading.Thread(
        target=lambda: results.update(write=impatient.pipe_file(f"{bucket}/y", b"2")), daemon=True
    )
    reader.start()
    writer.start()
    reader.join(1.5)  # past the impatient client's 1 s read timeout
    assert reader.is_alive() and writer.is_alive() and results == {}
    own_server.resume()
    reader.join(30)
    writer.join(30)
    assert not reader.is_alive() and not writer.is_alive()
    assert results["read"] == b"1"
    assert own_server.filesystem().cat_file(f"{bucket}/y") == b"2"


@pytest.mark.slow  # tests/integration/test_s3.py kills and restarts its own server in the store-dying tests
def test_a_killed_server_refuses_connections_and_a_restart_brings_the_store_back(own_server: S3Server) -> None:
    bucket = own_server.bucket()
    fs = own_server.impatient_filesystem(timeout=1)
    fs.pipe_file(f"{bucket}/x", b"1")
    pid = own_server.proc.pid if own_server.proc else -1
    own_server.kill()
    assert not own_server.running
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole group is gone
    assert not Path(f"/tmp/seaweedfs-s3-grpc-{own_server.ports['s3.port.grpc']}.sock").exists()  # cleaned up
    t0 = time.monotonic()
    with pytest.raises(botocore.exceptions.EndpointConnectionError, match="Could not connect to the endpoint URL"):
        fs.cat_file(f"{bucket}/x")
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        fs.pipe_file(f"{bucket}/y", b"2")
    assert time.monotonic() - t0 < 5
    own_server.stop()  # stopping a dead server is a no-op
    # The same directory gives the same store back, at the same endpoint with the same keys: the old client works.
    restarted = S3Server.start(own_server.data_dir)
    try:
        assert (restarted.endpoint, restarted.secret_key) == (own_server.endpoint, own_server.secret_key)
        assert fs.cat_file(f"{bucket}/x") == b"1"
    finally:
        restarted.kill()
