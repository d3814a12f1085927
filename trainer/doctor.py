"""``python -m trainer.doctor``: is this machine (or cluster) ready for a keel run?

Run it the way the job will run, on every node::

    python -m trainer.doctor                                   # one process
    torchrun --nproc-per-node 8 -m trainer.doctor              # one node
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m trainer.doctor           # on each node
    srun python -m trainer.doctor                              # SLURM

``python -m trainer.doctor goodput RUN_DIR`` instead prints a job's goodput across its restarts (the share of
its wall time that produced kept training progress), from the run directory (docs/slow-runs.md).

In order, it

1. detects the launcher and this rank's place in the job (:func:`trainer.distributed.launcher.detect_env`)
   and the device, as the Trainer would;
2. checks that the rendezvous store ``MASTER_ADDR:MASTER_PORT`` answers a TCP connect
   (from every rank but the store's host; retried until ``--init-timeout``);
3. creates the process group with ``--init-timeout`` (:func:`trainer.distributed.comm.init_process_group`);
4. gathers every rank's environment (host, versions, devices, ``NCCL_*``/``GLOO_*``/...
   variables) and prints it on rank 0;
5. runs barrier, all_reduce, broadcast and all_gather with their results checked, and
   times all_reduce per message size (algorithm and bus bandwidth, as nccl-tests does).

Exit status: 0 and ``doctor: all checks passed`` on rank 0; 1 with one
``FAIL <check>: <why>`` line per failure; 2 for bad arguments. Every wait is bounded
by ``--init-timeout``, and a hang watchdog dumps stacks and exits if a step stalls.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from trainer.distributed import comm, launcher
from trainer.distributed.watchdog import Watchdog

logger = logging.getLogger(__name__)
T = TypeVar("T")

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DEFAULT_SIZES = "4,64K,1M,16M"
BROADCAST_NUMEL = 1 << 16
BROADCAST_SEED = 1234
_WATCHDOG_MARGIN_S = 30.0
_MAX_RANKS_SHOWN = 8  # per-rank details in a check line

# Environment variables shown in the report: these names, and every name with these prefixes.
_ENV_NAMES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
)
_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_FR_")
_VERSION_KEYS = ("python", "torch", "cuda", "nccl")
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


@dataclass
class RankReport:
    """What one rank found; gathered to rank 0 (plain data, so it pickles)."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    device: str
    versions: dict[str, str]
    cuda_devices: list[str]
    env_vars: dict[str, str]
    results: dict[str, str] = field(default_factory=dict)  # check -> detail, when it passed
    failures: list[tuple[str, str]] = field(default_factory=list)  # (check, why)
    timings: dict[int, float] = field(default_factory=dict)  # all_reduce bytes -> seconds per op


class CollectiveError(Exception):
    """A collective raised (timeout, peer gone): the group is unusable, stop here."""

    def __init__(self, check: str, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.check = check


def _say(text: str) -> None:
    """One write per message, so lines from different ranks do not interleave."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------- sizes and formats


def parse_size(text: str) -> int:
    """Parses ``"4"``, ``"64K"``, ``"1MiB"``, ``"16 MB"`` (powers of 1024) into bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _SIZE_UNITS or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad message size {text!r}: expected e.g. 4, 64K, 1M, 16MiB")
    return int(match.group(1)) * _SIZE_UNITS[unit]


def _parse_sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


# ---------------------------------------------------------------------------- environment


def _versions() -> dict[str, str]:
    nccl = "not built"
    if "nccl" in comm.available_backends():
        try:
            nccl = ".".join(str(p) for p in torch.cuda.nccl.version())
        except Exception as exc:  # a driver problem must not stop the report
            nccl = f"unknown ({type(exc).__name__})"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none (CPU build)",
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
        "nccl": nccl,
        "gloo": "available" if "gloo" in comm.available_backends() else "not built",
    }


def _cuda_devices() -> list[str]:
    if not torch.cuda.is_available():
        return []
    names = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        memory = props.total_memory / (1 << 30)
        names.append(f"{index}: {props.name}, {memory:.0f} GiB, sm_{props.major}{props.minor}")
    return names


def relevant_env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that shape rendezvous and collectives (see ``_ENV_NAMES`` / ``_ENV_PREFIXES``)."""
    environ = os.environ if environ is None else environ
    return {
        name: value for name, value in sorted(environ.items()) if name in _ENV_NAMES or name.startswith(_ENV_PREFIXES)
    }


def _local_report(env: launcher.DistEnv, device: torch.device) -> RankReport:
    device_text = str(device)
    if device.type == "cuda":
        device_text += f" ({torch.cuda.get_device_name(device)})"
    return RankReport(
        rank=env.rank,
        local_rank=env.local_rank,
        node_rank=env.node_rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=device_text,
        versions=_versions(),
        cuda_devices=_cuda_devices(),
        env_vars=relevant_env_vars(),
    )


def _format_environment(env: launcher.DistEnv, backend: str, reports: Sequence[RankReport]) -> str:
    first = reports[0]
    nodes = len({r.node_rank for r in reports})
    store = "the torchrun agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
    lines = [
        "== environment ==",
        f"launcher      {env.launcher}",
        f"world         {env.world_size} rank(s) on {nodes} node(s), {env.local_world_size} per node",
        f"backend       {backend}",
    ]
    if env.master_addr is not None:
        lines.append(f"rendezvous    {env.master_addr}:{env.master_port} (store hosted by {store})")
    for key in first.versions:
        values: set[str | None] | list[str | None] = {r.versions.get(key) for r in reports}
        note = "" if len(values) == 1 else "   (differs across ranks, see FAIL versions)"
        lines.append(f"{key:<13} {first.versions[key]}{note}")
    seen_hosts: set[str] = set()
    for r in reports:
        if r.host not in seen_hosts:
            seen_hosts.add(r.host)
            gpus = f"{len(r.cuda_devices)} CUDA device(s)" if r.cuda_devices else "no CUDA device"
            lines.append(f"host {r.host}: {gpus}" + "".join(f"\n    {d}" for d in r.cuda_devices))
    lines.append(f"{'rank':>4} {'local':>5} {'node':>4}  {'host':<24} {'pid':>8}  device")
    for r in reports:
        lines.append(f"{r.rank:>4} {r.local_rank:>5} {r.node_rank:>4}  {r.host:<24} {r.pid:>8}  {r.device}")
    names = sorted({name for r in reports for name in r.env_vars})
    none_set = ": none of MASTER_*, NCCL_*, GLOO_*, TORCH_NCCL_* set"
    lines.append("environment variables" + ("" if names else none_set))
    for name in names:
        values = [r.env_vars.get(name) for r in reports]
        if len(set(values)) == 1:
            lines.append(f"  {name}={values[0]}")
        else:
            per_rank = ", ".join(f"rank {r.rank}: {v if v is not None else '<unset>'}" for r, v in zip(reports, values))
            lines.append(f"  {name}: {per_rank}   (differs across ranks)")
    return "\n".join(lines)


def _version_failures(reports: Sequence[RankReport]) -> list[tuple[str, str]]:
    """Ranks that disagree on python / torch / CUDA / NCCL versions (a classic cause of hangs)."""
    failures = []
    for key in _VERSION_KEYS:
        values = {r.versions.get(key) for r in reports}
        if len(values) > 1:
            per_rank = ", ".join(f"{r.versions.get(key)} on rank {r.rank} ({r.host})" for r in reports)
            failures.append(("versions", f"{key} differs across ranks: {per_rank}"))
    return failures


# ---------------------------------------------------------------------------- rendezvous


def check_rendezvous(env: launcher.DistEnv, timeout: float) -> tuple[str, str | None]:
    """TCP-connects to ``MASTER_ADDR:MASTER_PORT``, retrying until ``timeout``.

    The store host does not probe itself: with ``env://`` that is rank 0, which opens
    the store only inside ``init_process_group``; under torchrun
    (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent hosts it, so every rank probes.
    Other ranks retry because rank 0 may simply not have started yet (srun).

    Returns:
        ``(detail, None)`` when reachable or skipped, ``("", why)`` otherwise.
    """
    if env.master_addr is None or env.master_port is None:
        return "skipped: single process, no rendezvous", None
    addr, port = env.master_addr, env.master_port
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return "", (
            f"MASTER_ADDR={addr} does not resolve on rank {env.rank} ({socket.gethostname()}): {exc.strerror or exc}"
        )
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if env.rank == 0 and not agent_store:
        return f"rank 0 hosts the store on {addr}:{port}", None
    start = time.monotonic()
    deadline = start + timeout
    while True:
        attempt = time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, max(0.1, deadline - attempt))):
                return f"reached {addr}:{port} in {(time.monotonic() - attempt) * 1e3:.1f} ms", None
        except OSError as exc:  # refused, unreachable, timed out
            error = exc.strerror or str(exc) or type(exc).__name__
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "", (
                f"cannot reach {addr}:{port} from rank {env.rank} ({socket.gethostname()}): {error} "
                f"(retried for {time.monotonic() - start:.0f} s). Check that rank 0 / the torchrun agent "
                f"on {addr} is running, that MASTER_ADDR names it, and that no firewall blocks port {port}."
            )
        time.sleep(min(0.5, remaining))


# ---------------------------------------------------------------------------- checks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _collective(check: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # DistBackendError / timeouts are RuntimeErrors
        raise CollectiveError(check, exc) from exc


def run_checks(
    report: RankReport, device: torch.device, world: int, timeout: float, beat: Callable[[str], None]
) -> None:
    """Barrier, all_reduce, broadcast and all_gather on every rank, results checked locally.

    Each rank records its own failures in ``report``; rank 0 reports them all after the gather.

    Raises:
        CollectiveError: A collective raised; the group cannot be trusted any more.
    """
    rank = report.rank
    beat("barrier")
    start = time.perf_counter()
    _collective("barrier", comm.monitored_barrier, datetime.timedelta(seconds=timeout), device)
    report.results["barrier"] = f"{(time.perf_counter() - start) * 1e3:.2f} ms"

    beat("all_reduce")
    value = _collective("all_reduce", comm.all_reduce, torch.tensor([rank + 1.0], device=device))
    got, expected = float(value.item()), world * (world + 1) / 2
    if got != expected:
        report.failures.append(("all_reduce", f"rank {rank} got {got}, expected {expected} (sum of rank+1)"))
    report.results["all_reduce"] = f"sum of rank+1 over {world} rank(s) = {got:g}"

    beat("broadcast")
    expected_t = torch.randn(BROADCAST_NUMEL, generator=torch.Generator().manual_seed(BROADCAST_SEED))
    tensor = expected_t.to(device) if rank == 0 else torch.zeros(BROADCAST_NUMEL, device=device)
    received = _collective("broadcast", comm.broadcast, tensor, 0).cpu()
    wrong = int((received != expected_t).sum())
    if wrong:
        diff = float((received - expected_t).abs().max())
        report.failures.append(
            (
                "broadcast",
                f"rank {rank} got {wrong} of {BROADCAST_NUMEL} elements different from rank 0's "
                f"(max abs diff {diff:g})",
            )
        )
    report.results["broadcast"] = f"rank 0's random tensor ({BROADCAST_NUMEL} floats) identical on all ranks"

    beat("all_gather")
    mine = torch.tensor([rank], dtype=torch.int64, device=device)
    gathered = _collective("all_gather", comm.all_gather_tensor, mine)
    ids = [int(t.item()) for t in gathered]
    if ids != list(range(world)):
        report.failures.append(("all_gather", f"rank {rank} got {ids}, expected {list(range(world))}"))
    report.results["all_gather"] = f"rank ids {ids}" if world <= 16 else f"rank ids 0..{world - 1}"


def measure_bandwidth(
    report: RankReport,
    device: torch.device,
    sizes: Sequence[int],
    iters: int,
    warmup: int,
    beat: Callable[[str], None],
) -> None:
    """Seconds per all_reduce (float32, sum) per message size, this rank's view, into ``report``."""
    for nbytes in sizes:
        beat(f"all_reduce bandwidth {format_size(nbytes)}")
        tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        for _ in range(warmup):
            _collective("bandwidth", comm.all_reduce, tensor)
        _sync(device)
        _collective("bandwidth", comm.barrier, device)
        start = time.perf_counter()
        for _ in range(iters):
            _collective("bandwidth", comm.all_reduce, tensor)
        _sync(device)  # nccl returns before the kernel ends
        report.timings[tensor.numel() * 4] = (time.perf_counter() - start) / iters


def format_bandwidth(reports: Sequence[RankReport], backend: str, iters: int) -> str:
    """nccl-tests' figures: algbw = bytes / time, busbw = algbw * 2(W-1)/W; time = slowest rank."""
    world = len(reports)
    lines = [
        f"== all_reduce bandwidth ({backend}, {world} ranks, float32 sum, mean of {iters} iterations, slowest rank) ==",
        f"{'size':>10} {'elements':>10} {'time (us)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}",
    ]
    for nbytes in reports[0].timings:
        seconds = max(r.timings[nbytes] for r in reports)
        algbw = nbytes / seconds / 1e9
        busbw = algbw * 2 * (world - 1) / world
        lines.append(
            f"{format_size(nbytes):>10} {nbytes // 4:>10} {seconds * 1e6:>11.1f} {algbw:>13.3f} {busbw:>13.3f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.doctor",
        description=(
            "Check a keel launch environment: print the launcher, ranks, devices, versions and "
            "NCCL/GLOO/TORCH_NCCL variables of every rank; check that the rendezvous store is "
            "reachable and the process group initialises; run barrier, all_reduce, broadcast and "
            "all_gather with their results checked; time all_reduce per message size. Run it under "
            "the same launcher as the job (torchrun on every node, srun, or plain python)."
        ),
        epilog=(
            "Commands: python -m trainer.doctor [options] checks the launch (above); python -m trainer.doctor "
            "goodput RUN_DIR [--json] prints a job's goodput across its restarts (see its --help). "
            "Examples: python -m trainer.doctor | torchrun --nproc-per-node 8 -m trainer.doctor | "
            "srun python -m trainer.doctor --sizes 1M,256M. Exit status: 0 and 'doctor: all checks "
            "passed' (rank 0); 1 with a 'FAIL <check>: <why>' line per failure; 2 for bad arguments."
        ),
    )
    parser.add_argument(
        "--init-timeout",
        type=_positive_float,
        default=60.0,
        metavar="SECONDS",
        help="limit for the rendezvous probe, process-group creation and every collective (default 60)",
    )
    parser.add_argument(
        "--sizes",
        type=_parse_sizes,
        default=_parse_sizes(DEFAULT_SIZES),
        metavar="LIST",
        help=f"comma-separated all_reduce message sizes, K/M/G = KiB/MiB/GiB (default {DEFAULT_SIZES})",
    )
    parser.add_argument("--iters", type=int, default=10, help="timed all_reduce iterations per size (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed all_reduce iterations per size (default 2)")
    parser.add_argument(
        "--accelerator",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="device as the Trainer picks it; cuda uses nccl, cpu uses gloo (default auto)",
    )
    parser.add_argument(
        "--run-dir",
        default=os.path.join(tempfile.gettempdir(), "keel-doctor"),
        help="where a stalled rank writes its stacks (default: %(default)s)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages (process-group setup)")
    return parser


def goodput_main(argv: Sequence[str]) -> int:
    """``python -m trainer.doctor goodput RUN_DIR``: the goodput of the job whose run directory that is."""
    from trainer.observability import goodput

    parser = argparse.ArgumentParser(
        prog="python -m trainer.doctor goodput",
        description="Goodput of a finished or running job across its restarts, from <run dir>/goodput.jsonl.",
    )
    parser.add_argument("run_dir", help="the run directory (trainer.log_dir: the folder of metrics.csv or events)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    try:
        figures = goodput.account(goodput.read(args.run_dir))
    except (OSError, ValueError) as exc:
        _say(f"doctor goodput: {exc}")
        return EXIT_USAGE
    _say(json.dumps(figures) if args.json else goodput.report(figures))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["goodput"]:
        return goodput_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        _say("doctor: --iters must be >= 1 and --warmup >= 0")
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        env = launcher.detect_env()
    except ValueError as exc:
        _say(f"FAIL environment: {exc}")
        return EXIT_FAIL
    try:
        device = comm.select_device(args.accelerator, env)
    except ValueError as exc:
        _say(f"FAIL device: rank {env.rank}: {exc}")
        return EXIT_FAIL
    backend = comm.backend_for(device)
    report = _local_report(env, device)

    def hang_exit() -> None:  # the watchdog already logged the phase and the stacks file
        _say(f"FAIL hang: rank {env.rank} stopped making progress; stacks in {watchdog.dump_path}")
        os._exit(EXIT_FAIL)

    # Every wait below is bounded by --init-timeout; the watchdog catches whatever is not.
    watchdog = Watchdog(args.init_timeout + _WATCHDOG_MARGIN_S, run_dir=args.run_dir, rank=env.rank, on_fire=hang_exit)
    watchdog.start()
    try:
        return _run(args, env, device, backend, report, watchdog)
    finally:
        watchdog.stop()


def _fail_alone(env: launcher.DistEnv, backend: str, report: RankReport, check: str, why: str) -> int:
    """Fails before a group exists: this rank prints its own environment and the reason."""
    text = _format_environment(env, backend, [report])
    _say(text.replace("== environment ==", f"== environment of rank {env.rank} =="))
    _say(f"FAIL {check}: {why}")
    return EXIT_FAIL


def _run(
    args: argparse.Namespace,
    env: launcher.DistEnv,
    device: torch.device,
    backend: comm.Backend,
    report: RankReport,
    watchdog: Watchdog,
) -> int:
    def beat(phase: str) -> None:
        watchdog.beat(phase, 0)

    beat("rendezvous")
    detail, why = check_rendezvous(env, args.init_timeout)
    if why is not None:
        return _fail_alone(env, backend, report, "rendezvous", why)
    report.results["rendezvous"] = detail

    beat("init_process_group")
    start = time.monotonic()
    try:
        owns_group = comm.init_process_group(
            env, backend=backend, timeout=datetime.timedelta(seconds=args.init_timeout), device=device
        )
    except (RuntimeError, ValueError) as exc:
        return _fail_alone(env, backend, report, "init_process_group", str(exc))
    if owns_group:
        report.results["init_process_group"] = f"{backend}, {time.monotonic() - start:.2f} s"
    elif comm.is_initialized():
        report.results["init_process_group"] = f"reused the existing {comm.get_backend()} group"
    else:
        report.results["init_process_group"] = "skipped: world of 1, no process group"
    world = comm.get_world_size()
    try:
        run_checks(report, device, world, args.init_timeout, beat)
        if comm.is_initialized():
            measure_bandwidth(report, device, args.sizes, args.iters, args.warmup, beat)
        beat("gather reports")
        reports: list[RankReport] = _collective("gather reports", comm.all_gather_object, report)
    except CollectiveError as exc:
        # Peers may be stuck in the collective; do not tear the group down (that can hang too).
        _say(f"FAIL {exc.check}: rank {env.rank}: {exc}")
        sys.stderr.flush()
        os._exit(EXIT_FAIL)

    failures = [f for r in reports for f in r.failures] + _version_failures(reports)
    if env.rank == 0:
        lines = ["keel doctor", _format_environment(env, backend, reports), "== checks =="]
        failed_checks = {check for check, _ in failures}
        for check in report.results:
            status = "FAIL" if check in failed_checks else "ok  "
            details = [r.results.get(check, "") for r in reports]
            detail = (
                details[0]
                if len(set(details)) == 1
                else "; ".join(f"rank {r.rank}: {d}" for r, d in list(zip(reports, details))[:_MAX_RANKS_SHOWN])
                + ("" if len(reports) <= _MAX_RANKS_SHOWN else f"; ... ({len(reports)} ranks)")
            )
            lines.append(f"{status} {check:<20} {detail}")
        if reports[0].timings:
            lines.append(format_bandwidth(reports, backend, args.iters))
        else:
            lines.append("== all_reduce bandwidth: skipped (single process, no process group) ==")
        lines += [f"FAIL {check}: {why}" for check, why in failures]
        lines.append(f"doctor: {len(failures)} check(s) failed" if failures else "doctor: all checks passed")
        _say("\n".join(lines))
    if owns_group:
        comm.destroy_process_group()
    return EXIT_FAIL if failures else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
