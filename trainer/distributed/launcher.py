"""Where this process sits in the job, read from the launcher's environment variables only.

:func:`detect_env` recognises torchrun / TorchElastic, SLURM ``srun`` and a plain single process and
returns a :class:`DistEnv`; :func:`parse_slurm_nodelist_first` expands a compressed SLURM host list.
Nothing here talks to other processes or imports ``torch.distributed``: it runs before any process
group exists, so a bad launch is refused before anything blocks.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger(__name__)

Launcher = Literal["single", "torchrun", "slurm"]

# Variables whose presence means "launched by torchrun"; the rest are read if present.
_TORCHRUN_MARKERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_SLURM_PORT_BASE = 10000
_SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as the launcher described it.

    Attributes:
        launcher: Which launcher started the process.
        rank: Global rank, in ``[0, world_size)``.
        local_rank: Rank on this node; also the CUDA device index.
        world_size: Number of processes in the job.
        local_world_size: Number of processes on this node.
        node_rank: Index of this node.
        master_addr: Host of the rendezvous store (rank 0); None for single.
        master_port: Port of the rendezvous store; None for single.
    """

    launcher: Launcher
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None

    @property
    def is_distributed(self) -> bool:
        """True when a process group must be created.

        torchrun with a single process still gets a group, so that a
        one-process torchrun run takes the same code path as a multi-process one.
        """
        return self.world_size > 1 or self.launcher != "single"


def _single_env() -> DistEnv:
    return DistEnv("single", 0, 0, 1, 1, 0, None, None)


def _parse_int(name: str, value: str, *, minimum: int = 0) -> int:
    """Parses an integer environment variable, naming it on failure."""
    try:
        parsed = int(value.strip())
    except ValueError:
        raise ValueError(f"Environment variable {name}={value!r} is not an integer.") from None
    if parsed < minimum:
        raise ValueError(f"Environment variable {name}={value!r} must be >= {minimum}.")
    return parsed


def _check_ranks(
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    names: tuple[str, str, str, str],
) -> None:
    """Checks rank < world size and local rank < local world size; names the variables."""
    rank_n, world_n, local_n, local_world_n = names
    if rank >= world_size:
        raise ValueError(f"{rank_n}={rank} must be smaller than {world_n}={world_size}.")
    if local_world_size > world_size:
        raise ValueError(f"{local_world_n}={local_world_size} cannot exceed {world_n}={world_size}.")
    if local_rank >= local_world_size:
        raise ValueError(f"{local_n}={local_rank} must be smaller than {local_world_n}={local_world_size}.")


def _parse_port(name: str, value: str) -> int:
    port = _parse_int(name, value, minimum=1)
    if port > 65535:
        raise ValueError(f"Environment variable {name}={value!r} is not a TCP port (1-65535).")
    return port


def _detect_torchrun(environ: Mapping[str, str]) -> DistEnv:
    found = {name: environ[name] for name in _TORCHRUN_VARS if name in environ}
    required = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    if environ.get("WORLD_SIZE", "").strip() != "1":
        required.append("LOCAL_RANK")  # a lone process may omit it: it is then 0
    missing = [name for name in required if name not in environ]
    if missing:
        found_text = ", ".join(f"{k}={v!r}" for k, v in found.items())
        stray = " ".join(k for k in found if k in _TORCHRUN_MARKERS)
        raise ValueError(
            f"Incomplete torchrun environment: found {found_text}; missing {', '.join(missing)}. "
            "Launch with `torchrun --nnodes N --nproc-per-node G script.py ...`, which sets all "
            f"of them, or `unset {stray}` to run as a single process."
        )
    world_size = _parse_int("WORLD_SIZE", environ["WORLD_SIZE"], minimum=1)
    rank = _parse_int("RANK", environ["RANK"])
    local_rank = _parse_int("LOCAL_RANK", environ.get("LOCAL_RANK", "0"))
    local_world_size = _parse_int("LOCAL_WORLD_SIZE", environ.get("LOCAL_WORLD_SIZE", str(world_size)), minimum=1)
    node_rank = _parse_int("GROUP_RANK", environ.get("GROUP_RANK", "0"))
    _check_ranks(
        rank,
        world_size,
        local_rank,
        local_world_size,
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    )
    master_addr = environ["MASTER_ADDR"].strip()
    if not master_addr:
        raise ValueError("Environment variable MASTER_ADDR is empty; set it to rank 0's host.")
    master_port = _parse_port("MASTER_PORT", environ["MASTER_PORT"])
    return DistEnv(
        "torchrun",
        rank,
        local_rank,
        world_size,
        local_world_size,
        node_rank,
        master_addr,
        master_port,
    )


def _parse_slurm_tasks_per_node(name: str, value: str) -> list[int]:
    """Expands ``"4(x2)"`` to ``[4, 4]`` and ``"2(x3),1"`` to ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"Cannot parse {name}={value!r} (expected e.g. '4(x2)' or '2,1').")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _slurm_local_world_size(environ: Mapping[str, str], node_rank: int) -> tuple[int, str]:
    """Returns this node's task count and the variable it came from."""
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "").strip()
    if per_node.isdigit():
        return _parse_int("SLURM_NTASKS_PER_NODE", per_node, minimum=1), "SLURM_NTASKS_PER_NODE"
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in environ:
            counts = _parse_slurm_tasks_per_node(name, environ[name])
            # Heterogeneous layouts ("2,1") differ per node; uniform ones are one count.
            return (counts[node_rank] if node_rank < len(counts) else counts[0]), name
    raise ValueError(
        "SLURM environment has no task layout: none of SLURM_NTASKS_PER_NODE, "
        "SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE is set. Launch the tasks with `srun`."
    )


def _detect_slurm(environ: Mapping[str, str], ntasks: int, ntasks_name: str) -> DistEnv:
    rank = _parse_int("SLURM_PROCID", environ["SLURM_PROCID"])
    local_rank = _parse_int("SLURM_LOCALID", environ["SLURM_LOCALID"])
    node_rank = _parse_int("SLURM_NODEID", environ.get("SLURM_NODEID", "0"))
    local_world_size, local_world_name = _slurm_local_world_size(environ, node_rank)
    _check_ranks(
        rank,
        ntasks,
        local_rank,
        local_world_size,
        ("SLURM_PROCID", ntasks_name, "SLURM_LOCALID", local_world_name),
    )
    if environ.get("MASTER_ADDR", "").strip():
        master_addr = environ["MASTER_ADDR"].strip()
    else:
        names = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        nodelist = next((environ[n] for n in names if environ.get(n, "").strip()), None)
        if nodelist is None:
            raise ValueError(
                "SLURM environment has no node list (SLURM_STEP_NODELIST / SLURM_JOB_NODELIST) "
                "and MASTER_ADDR is not set; export MASTER_ADDR to the first node's host name."
            )
        master_addr = parse_slurm_nodelist_first(nodelist)
    if "MASTER_PORT" in environ:
        master_port = _parse_port("MASTER_PORT", environ["MASTER_PORT"])
    else:
        job_id_name = "SLURM_JOB_ID" if "SLURM_JOB_ID" in environ else "SLURM_JOBID"
        if job_id_name not in environ:
            raise ValueError(
                "SLURM environment has no SLURM_JOB_ID and MASTER_PORT is not set; "
                "export MASTER_PORT to a free port on the first node."
            )
        # Derived from the job id alone, so every task of the job computes the same port.
        job_id = _parse_int(job_id_name, environ[job_id_name])
        master_port = _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN
    return DistEnv("slurm", rank, local_rank, ntasks, local_world_size, node_rank, master_addr, master_port)


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Works out how this process was launched, from environment variables only.

    Rules, in order:

    1. torchrun / TorchElastic: any of ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` is set.
       ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` are required, and
       ``LOCAL_RANK`` too unless ``WORLD_SIZE`` is 1 (it is then 0).
       ``LOCAL_WORLD_SIZE`` defaults to ``WORLD_SIZE``; ``GROUP_RANK`` (the node rank)
       defaults to 0. torchrun variables win over SLURM ones (torchrun under SLURM).
    2. SLURM ``srun``: ``SLURM_PROCID``, ``SLURM_LOCALID`` and a task count
       (``SLURM_STEP_NUM_TASKS``, preferred, else ``SLURM_NTASKS``) are set and the
       count is > 1. rank = ``SLURM_PROCID``, local rank = ``SLURM_LOCALID``,
       node rank = ``SLURM_NODEID`` (default 0), local world size =
       ``SLURM_NTASKS_PER_NODE`` when it is a plain integer, else this node's entry of
       ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` (``"4(x2)"``,
       ``"2,1"``). ``MASTER_ADDR`` defaults to the first host of
       ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST`` (parsed here, no
       ``scontrol``); ``MASTER_PORT`` defaults to ``10000 + SLURM_JOB_ID % 20000``,
       which every task of the job computes identically. A SLURM job with one task
       (``python train.py`` inside ``sbatch``, no ``srun``) is a single process.
    3. Otherwise a single process: rank 0, world size 1.

    Args:
        environ: The variables to read; ``os.environ`` when None.

    Returns:
        The detected environment.

    Raises:
        ValueError: The variables are partial or inconsistent (a torchrun variable
            without the others, a non-integer or negative value, rank >= world size,
            local rank >= local world size). The message names the variables, their
            values and the fix.
    """
    env = os.environ if environ is None else environ
    if any(name in env for name in _TORCHRUN_MARKERS):
        return _detect_torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_LOCALID" in env:
        ntasks_name = next((n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if n in env), None)
        if ntasks_name is not None:
            ntasks = _parse_int(ntasks_name, env[ntasks_name], minimum=1)
            if ntasks > 1:
                if ntasks_name == "SLURM_NTASKS":
                    # srun always sets SLURM_STEP_NUM_TASKS; its absence hints at a batch
                    # script running python directly, where the other tasks never start.
                    logger.warning(
                        "SLURM_NTASKS=%d but SLURM_STEP_NUM_TASKS is unset: assuming %d tasks "
                        "were started by srun. If you ran python directly in an sbatch script, "
                        "launch it with `srun` (or use --ntasks=1), or init will time out.",
                        ntasks,
                        ntasks,
                    )
                return _detect_slurm(env, ntasks, ntasks_name)
    return _single_env()


def parse_slurm_nodelist_first(nodelist: str) -> str:
    """Returns the first host name of a (possibly compressed) Slurm host list.

    Examples: ``"node[001-004,007]"`` -> ``"node001"``, ``"n[09-11]"`` -> ``"n09"``
    (zero padding kept), ``"gpu-a[3,5-6],gpu-b1"`` -> ``"gpu-a3"``,
    ``"rack[1-2]-node[3-4]"`` -> ``"rack1-node3"``.

    Args:
        nodelist: The value of ``SLURM_JOB_NODELIST`` or ``SLURM_STEP_NODELIST``.

    Returns:
        The first host, as ``scontrol show hostnames`` would print it first.

    Raises:
        ValueError: The list is empty or malformed (unbalanced or empty brackets).
    """
    text = nodelist.strip()
    host: list[str] = []
    i = 0
    while i < len(text) and text[i] != ",":  # a top-level comma ends the first host pattern
        if text[i] == "[":
            end = text.find("]", i)
            if end == -1:
                raise ValueError(f"Malformed Slurm node list {nodelist!r}: '[' without ']'.")
            # The first item's lower bound, kept as written so "09-11" gives "09".
            first = text[i + 1 : end].split(",")[0].split("-")[0].strip()
            if not first.isdigit():
                raise ValueError(f"Malformed Slurm node list {nodelist!r}: bad range {text[i : end + 1]!r}.")
            host.append(first)
            i = end + 1
        elif text[i] == "]":
            raise ValueError(f"Malformed Slurm node list {nodelist!r}: ']' without '['.")
        else:
            host.append(text[i])
            i += 1
    result = "".join(host).strip()
    if not result:
        raise ValueError(f"Empty Slurm node list {nodelist!r}.")
    return result


def run_identity() -> str | None:
    """What stays the same across restarts of one job: torchrun's run id, else SLURM's job id.

    A job of Hydra's ``submitit_local`` launcher is named by submitit's local job id (its controller's
    pid): that launcher runs a sweep's jobs at the same time, so each needs a run directory of its own.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    if run_id == "none":  # torchrun without --rdzv-id: its agent (our parent) lives across restarts
        agent = _agent_identity()
        if agent is not None:
            return f"torchrun-agent:{agent}"
    local_job = os.environ.get("SUBMITIT_LOCAL_JOB_ID")
    if local_job:  # before SLURM's: submitit_local jobs started inside an allocation share its job id
        return f"submitit-local:{socket.gethostname()}:{local_job}"
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    if not job_id:
        return None
    # The step id tells apart two srun steps in one allocation; a requeued job starts again at step 0.
    return f"slurm:{job_id}.{os.environ.get('SLURM_STEP_ID', os.environ.get('SLURM_STEPID', 'batch'))}"


def _agent_identity() -> str | None:
    """Host, pid and start time of the parent process (the torchrun agent), stable across restarts."""
    agent = os.getppid()
    try:
        with open(f"/proc/{agent}/stat") as handle:
            start_time = handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return f"{socket.gethostname()}:{agent}:{start_time}"


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (Linux), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def this_process() -> dict[str, Any]:
    """This process as a record another process can check: host, pid and the pid's start time (so that a
    recycled pid is not mistaken for it)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _start_time(pid)}


def is_this_process(record: dict[str, Any]) -> bool:
    me = this_process()
    return all(record.get(k) == me[k] for k in ("host", "pid", "started"))


def process_alive(record: dict[str, Any]) -> bool | None:
    """Whether the process a record names still runs: True or False on this host, None on another (it cannot be
    told from here). This process counts as not alive: a record it wrote is its own."""
    if record.get("host") != socket.gethostname():
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    started = _start_time(pid)
    return started is not None and started == record.get("started")
