"""The one-node SLURM cluster of tests/harness/slurm/start.sh, as the SLURM tests use it.

:func:`connect` finds the cluster (or starts it, as root, when the packages are installed) and returns a
:class:`Cluster`, or the reason it cannot. Every client command has a timeout; every job a test submits
is cancelled when the test leaves it (:meth:`Cluster.job`), and processes of the job that are still alive
are killed, so that no job or rank outlives its test. Like tests/harness/launch.py, this module does not import
the ``trainer`` package.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import launch

START = Path(__file__).resolve().parent / "start.sh"
DIR = Path(os.environ.get("KEEL_SLURM_DIR", "/tmp/keel-slurm"))
CONF = DIR / "slurm.conf"
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def client_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for SLURM clients: the test cluster's config, no SLURM_* of a job
    pytest itself may run in (srun would otherwise join that job), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(CONF)
    env.update(extra or {})
    return env


def _client(args: Sequence[str], *, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, env=client_env(), stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
    return proc


def _start_script(action: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(START), action, "--no-install"],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@dataclass
class Job:
    """A submitted batch job."""

    job_id: str
    log: Path
    marker: str

    def info(self) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...); {} once the job is forgotten."""
        proc = _client(["scontrol", "show", "job", "-o", self.job_id], check=False)
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}

    def state(self) -> str:
        return self.info().get("JobState", "UNKNOWN")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, until, *, timeout: float, what: str) -> None:
        """Polls ``until(job)`` every 0.25 s; AssertionError with the job's state and log after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not until(self):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {self.job_id}: {what} did not happen within {timeout:g}s "
                    f"(state {self.info()})\n--- job log ---\n{launch._tail(self.output())}"
                )
            time.sleep(0.25)

    def wait_done(self, *, timeout: float) -> str:
        """Waits until the job reached a final state (a requeue passes through PENDING first); returns it."""
        self.wait(lambda job: job.state() in TERMINAL, timeout=timeout, what="the end of the job")
        return self.state()


@dataclass
class Cluster:
    """A running test cluster; ``started`` when this session started it (and must stop it)."""

    started: bool
    cpus: int
    jobs: list[Job] = field(default_factory=list)

    @contextlib.contextmanager
    def job(
        self, script: str, *args: str, options: Sequence[str] = (), log: Path, env: dict[str, str] | None = None
    ) -> Iterator[Job]:
        """Submits ``script`` (the text of a batch file) with ``sbatch [options] FILE args``, the output
        in ``log``; on leaving, cancels the job if it still runs and kills its leftover processes."""
        launch.require_multiprocess_marker("sbatch")
        log.parent.mkdir(parents=True, exist_ok=True)
        path = log.with_suffix(".sbatch")
        path.write_text(script)
        marker = uuid.uuid4().hex
        # The launch harness's variables (PYTHONPATH, OMP_NUM_THREADS=1, gloo on loopback) and its marker,
        # so that every process of the job can be found and killed.
        job_env = launch._make_env(env, marker)
        job_env = client_env({k: v for k, v in job_env.items() if not k.startswith("SLURM_")})
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--output={log}", *options, str(path), *args],
            capture_output=True,
            text=True,
            timeout=30,
            env=job_env,
            cwd=launch.REPO_ROOT,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise AssertionError(f"sbatch failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        job = Job(proc.stdout.strip().split(";")[0], log, marker)
        try:
            yield job
        finally:
            self.cancel(job)

    def cancel(self, job: Job) -> None:
        """Cancels ``job`` unless it ended, waits for it to end, kills whatever of it is still alive."""
        if job.state() not in TERMINAL | {"UNKNOWN"}:
            _client(["scancel", job.job_id], check=False)
            with contextlib.suppress(AssertionError):
                job.wait(lambda j: j.state() in TERMINAL | {"UNKNOWN"}, timeout=30, what="cancel")
        for pid in launch._marked_pids(job.marker):
            launch._signal_pid(pid, signal.SIGKILL)

    def srun(
        self, *args: str, timeout: float, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None
    ) -> launch.LaunchResult:
        """``srun args...`` through the launch harness: ends within ``timeout``, leaves no process
        (the tasks inherit the harness's marker), retried once on the known gloo abort at exit, from the files
        it found (tests/harness/launch_state.py)."""
        run = lambda: [self.command("srun", *args, timeout=timeout, env=env, cwd=cwd)]  # noqa: E731
        return launch._retry_known_abort(run, args, env, cwd)[0]

    def command(
        self, *cmd: str, timeout: float, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None
    ) -> launch.LaunchResult:
        """``cmd`` (a SLURM client, or a program that calls them) through the launch harness, talking to
        this cluster: the SLURM_* variables of a job pytest may run in are removed, SLURM_CONF is set."""
        clear = [f"--unset={name}" for name in os.environ if name.startswith("SLURM_")]
        full = ["env", *clear, f"SLURM_CONF={CONF}", *cmd]
        return launch._run([full], what=cmd[0], timeout=timeout, env=env, cwd=cwd, fail_fast=False)[0]

    def cancel_by_name(self, name: str) -> None:
        """Cancels every job called ``name`` (jobs that a program, such as submitit, submitted)."""
        _client(["scancel", f"--name={name}"], check=False)

    def close(self) -> None:
        if self.started:
            _start_script("stop", 90)


def connect() -> tuple[Cluster | None, str]:
    """The running test cluster, or one started now (root, packages installed); else None and why not."""
    if not START.is_file():
        return None, f"{START} is missing"
    try:
        started = False
        if _start_script("status", 30).returncode != 0:
            if os.geteuid() != 0:
                return None, (
                    "no SLURM test cluster is running and starting one needs root: "
                    f"sudo {START.relative_to(launch.REPO_ROOT)}"
                )
            proc = _start_script("start", 120)
            if proc.returncode != 0:
                return None, f"the SLURM test cluster could not start ({START.name}): " + launch._tail(
                    proc.stdout + proc.stderr, 8
                )
            started = True
        cpus = int(_client(["sinfo", "-h", "-N", "-o", "%c"]).stdout.split()[0])
    except (OSError, subprocess.TimeoutExpired, AssertionError, ValueError, IndexError) as exc:
        return None, f"the SLURM test cluster does not answer: {type(exc).__name__}: {exc}"
    return Cluster(started=started, cpus=cpus), ""
