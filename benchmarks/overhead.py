"""Per-step overhead of ``Trainer.fit`` over a hand-written PyTorch loop (docs/design.md section 11).

    python benchmarks/overhead.py                       # 1 process, 2-process DDP and 2-process FSDP (gloo)
    python benchmarks/overhead.py --quick --single-only # smoke run
    python benchmarks/overhead.py --fsdp-only           # the FSDP case alone

The same MLP, data (in-memory TensorDataset, batch 64), SGD and cross-entropy run under a hand-written
loop and under the Trainer (logger, checkpointing, progress bar and sanity check off, the default
log_every_n_steps=50, max_steps), alternating in one process: loop, trainer, trainer+self.log, then the
reverse order on the next repeat, so machine noise hits all three. "trainer+self.log" is the same
Trainer run with ``self.log("train/loss", loss)`` in every training_step.

Only training steps are timed: from the end of the ``--warmup``-th step to the end of the last one
(``on_train_batch_end`` of a callback for the Trainer, the same point of the hand loop), so process-group
init, DDP construction, loader rebuilding and teardown are excluded. Each case runs in a child process with
OMP_NUM_THREADS=1 and ``torch.set_num_threads(1)``; DDP cases run under ``python -m torch.distributed.run``
on 127.0.0.1 with gloo: the hand loop wraps the model in DistributedDataParallel and reads a
DistributedSampler(shuffle=False); the Trainer gets a plain DataLoader and shards it itself.

The FSDP case (``blocks4m``: a linear layer in, four 1024-wide Linear+ReLU blocks held in an nn.ModuleList, a
linear head; 4.5M parameters) runs 2 ranks: the hand loop applies FSDP2's
``fully_shard`` to each block and then to the whole net, as the FSDP2 docs do, with a DistributedSampler; the
Trainer runs ``strategy="fsdp"``, whose default units are the same blocks. Both broadcast nothing inside the
timed window; keel's broadcast of rank 0's initial weights happens at setup, before it. The 2-D case
(``blocks4m_tp``, the same net) runs the same ranks as a (data_parallel, tensor_parallel) mesh of shape
(ranks / 2, 2): the hand loop splits the blocks' Linear layers in column / row pairs with ``parallelize_module``
on the mesh's tensor-parallel dimension and then shards as above over its data-parallel one, as torchtitan does,
with a DistributedSampler over the data-parallel ranks; the Trainer runs ``FSDPStrategy(tensor_parallel_size=2)``
and the task applies the same plan in ``configure_model``.

Output: a table ``case | loop steps/s | trainer steps/s | ratio | cpu ratio | target`` and one JSON line.
ratio = trainer / loop wall time, paired within each repeat, median over repeats; cpu ratio is the same
with process CPU time, which ignores time spent descheduled (steadier on a busy machine). self.log cost =
(trainer+self.log - trainer) / steps. Targets: ratio <= 1.05 (tiny), <= 1.03 (mlp1m), self.log < 50 us.
PASS/MISS is a report, not a test: the exit status is 0 unless a run failed or timed out (--timeout).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import gc
import json
import logging
import os
import platform
import pstats
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python benchmarks/overhead.py` from a plain checkout
    sys.path.insert(0, str(REPO_ROOT))

from trainer import Callback, FSDPStrategy, TaskModule, Trainer  # noqa: E402

BATCH_SIZE = 64
LR = 0.01
LOG_EVERY_N_STEPS = 50  # the Trainer's default: some timed steps are logging steps
MODELS = {  # name -> layer widths of an MLP with ReLU between layers
    "tiny": (32, 96, 64, 10),  # 10,026 parameters
    "mlp1m": (256, 1024, 704, 10),  # 991,818 parameters
    "blocks4m": (256, 1024, 1024, 1024, 1024, 1024, 10),  # 4,471,818 parameters; the blocks are FSDP units
    "blocks4m_tp": (256, 1024, 1024, 1024, 1024, 1024, 10),  # the same net, its blocks split by tensor parallelism
}
FSDP_MODELS = ("blocks4m", "blocks4m_tp")  # run in the FSDP case only
TP_MODELS = ("blocks4m_tp",)  # FSDP x TP on a (world // 2, 2) mesh
TENSOR_PARALLEL = 2
STEPS = {"tiny": 500, "mlp1m": 100, "blocks4m": 40, "blocks4m_tp": 40}  # timed steps per repeat (after the warm-up)
QUICK_STEPS = {"tiny": 30, "mlp1m": 10, "blocks4m": 4, "blocks4m_tp": 4}
# trainer_time / loop_time (tiny: issue 17; FSDP and FSDP x TP: issue 26)
TARGETS = {"tiny": 1.05, "mlp1m": 1.03, "blocks4m": 1.05, "blocks4m_tp": 1.05}
SELF_LOG_TARGET_US = 50.0
WHOLE_TARGET_US = 10.0  # keel's extra time per step over the hand loop, whole run and fixed costs included
RUNNERS = ("loop", "trainer", "trainer_log")
_MARKER = "KEEL_BENCH_LAUNCH_ID"  # inherited by every process of a launch, so all can be found and killed
_LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
)  # not inherited from a caller that runs under torchrun


# --------------------------------------------------------------------------- the measured code (child processes)


class Clock:
    """Wall time and process CPU time at the end of each step. CPU time (all threads of the process,
    gloo's included) leaves out time spent descheduled, so it is steadier on a shared machine."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.began = (time.perf_counter(), time.process_time())  # the whole run: from building it to its end

    def tick(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def window(self, warmup: int) -> tuple[float, float]:
        """(wall, cpu) seconds from the end of step ``warmup`` to the end of the last step."""
        return self.wall[-1] - self.wall[warmup - 1], self.cpu[-1] - self.cpu[warmup - 1]

    def whole(self) -> tuple[float, float]:
        """(wall, cpu) seconds from the clock's creation (before the run is built) to now (after it returned)."""
        return time.perf_counter() - self.began[0], time.process_time() - self.began[1]


class BlockMLP(nn.Module):
    """In, a ModuleList of Linear+ReLU blocks (FSDP's units), head: the FSDP case's net."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.inp = nn.Linear(widths[0], widths[1])
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths[1:-2], widths[2:-1])
        )
        self.head = nn.Linear(widths[-2], widths[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_net(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    widths = MODELS[name]
    if name in FSDP_MODELS:
        return BlockMLP(widths)
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(fan_in, fan_out)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def fully_shard_blocks(net: nn.Module, tensor_parallel: bool) -> nn.Module:
    """FSDP2 as its docs apply it: each block a unit, then the root. ``tensor_parallel``: as torchtitan does, a
    ``(data_parallel, tensor_parallel)`` mesh, the plan applied on its second dimension, then FSDP over the first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if tensor_parallel:
        world = tdist.get_world_size()
        mesh_2d = init_device_mesh(
            "cpu", (world // TENSOR_PARALLEL, TENSOR_PARALLEL), mesh_dim_names=("data_parallel", "tensor_parallel")
        )
        split_blocks(net, mesh_2d["tensor_parallel"])
        mesh = mesh_2d["data_parallel"]
    else:
        mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def split_blocks(net: nn.Module, tp_mesh) -> None:
    """The tensor-parallel plan of the 2-D case: the blocks' Linear layers in column / row pairs (Megatron's MLP
    split: one all-reduce per pair in forward)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for i, block in enumerate(net.blocks):
        parallelize_module(block[0], tp_mesh, ColwiseParallel() if i % 2 == 0 else RowwiseParallel())


def make_data(name: str, num_samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_samples, MODELS[name][0], generator=g)
    y = torch.randint(0, MODELS[name][-1], (num_samples,), generator=g)
    return TensorDataset(x, y)


def hand_loop(name: str, dataset, total_steps: int, warmup: int, ddp: bool) -> tuple[float, ...]:
    """The baseline: plain PyTorch (plus DDP, or FSDP2 for the FSDP models, and a DistributedSampler when ``ddp``).
    Returns (wall, cpu) s of the timed steps, then of the whole run (building it included)."""
    clock = Clock()
    net = make_net(name)
    if ddp and name in FSDP_MODELS:
        model = net = fully_shard_blocks(net, tensor_parallel=name in TP_MODELS)
    else:
        model = torch.nn.parallel.DistributedDataParallel(net) if ddp else net
    replicas, replica = tdist.get_world_size() if ddp else 1, tdist.get_rank() if ddp else 0
    if name in TP_MODELS:  # the ranks of a tensor-parallel group read the same batches
        replicas, replica = replicas // TENSOR_PARALLEL, replica // TENSOR_PARALLEL
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=replica, shuffle=False) if ddp else None
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()  # the same point as the Trainer's on_train_batch_end
        if len(clock.wall) == total_steps:
            break
    assert len(clock.wall) == total_steps, f"hand loop ran {len(clock.wall)} of {total_steps} steps"
    return (*clock.window(warmup), *clock.whole())


def run_trainer(name: str, dataset, total_steps: int, warmup: int, log_every_step: bool) -> tuple[float, ...]:
    """``Trainer.fit`` on the same net, data and optimizer. Returns (wall, cpu) seconds of the timed steps, then of
    the whole run (``Trainer(...)``, building the task and ``fit`` included)."""

    class BenchTask(TaskModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net(name)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            if log_every_step:
                self.log("train/loss", loss)
            return loss

        def configure_model(self) -> None:
            if name in TP_MODELS and not hasattr(self.net.blocks[0][0].weight, "device_mesh"):
                split_blocks(self.net, self.device_mesh["tensor_parallel"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=LR)

    class StepClock(Callback):
        def __init__(self) -> None:
            self.clock = Clock()

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
            self.clock.tick()

    stepclock = StepClock()
    trainer = Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        log_every_n_steps=LOG_EVERY_N_STEPS,
        max_steps=total_steps,
        callbacks=[stepclock],
        strategy=FSDPStrategy(tensor_parallel_size=TENSOR_PARALLEL if name in TP_MODELS else 1)
        if name in FSDP_MODELS
        else "auto",
    )
    trainer.fit(BenchTask(), train_dataloaders=DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=False))
    clock = stepclock.clock
    assert trainer.global_step == total_steps == len(clock.wall), (trainer.global_step, len(clock.wall))
    return (*clock.window(warmup), *clock.whole())


def measure(name: str, steps: int, warmup: int, repeats: int) -> dict:
    """All repeats of one model; in DDP every rank calls it and rank 0's dict is the result."""
    ddp = tdist.is_initialized()
    world = tdist.get_world_size() if ddp else 1
    total = warmup + steps
    replicas = world // TENSOR_PARALLEL if name in TP_MODELS else world
    dataset = make_data(name, total * BATCH_SIZE * replicas)  # exactly one epoch of `total` steps per rank
    wall: dict[str, list[float]] = {r: [] for r in RUNNERS}
    cpu: dict[str, list[float]] = {r: [] for r in RUNNERS}
    whole: dict[str, list[float]] = {r: [] for r in RUNNERS}  # the whole run, building it and fixed costs included
    whole_cpu: dict[str, list[float]] = {r: [] for r in RUNNERS}
    # One short untimed run of each first: what only a process's first run pays (lazy imports and inits) would
    # otherwise land on whichever runner comes first, in the whole-run times.
    hand_loop(name, dataset, warmup + 1, warmup, ddp)
    for log_every_step in (False, True):
        run_trainer(name, dataset, warmup + 1, warmup, log_every_step=log_every_step)
    for rep in range(repeats):
        for runner in RUNNERS if rep % 2 == 0 else RUNNERS[::-1]:  # cancel order effects
            gc.collect()
            if ddp:
                tdist.barrier()
            if runner == "loop":
                seconds = hand_loop(name, dataset, total, warmup, ddp)
            else:
                seconds = run_trainer(name, dataset, total, warmup, log_every_step=runner == "trainer_log")
            if ddp:  # the slowest rank's times (ranks are in lock-step through the all-reduce anyway)
                t = torch.tensor(seconds, dtype=torch.float64)
                tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
                seconds = tuple(t.tolist())
            wall[runner].append(seconds[0])
            cpu[runner].append(seconds[1])
            whole[runner].append(seconds[2])
            whole_cpu[runner].append(seconds[3])
    med = statistics.median

    def paired(times: dict[str, list[float]], a: str, b: str, per_step_us: bool = False, over: int = steps) -> float:
        """Median over repeats of a/b (or (a-b)/over steps in us) within each repeat: drift cancels."""
        return med((x - y) / over * 1e6 if per_step_us else x / y for x, y in zip(times[a], times[b]))

    return {
        "model": name,
        "params": sum(p.numel() for p in make_net(name).parameters()),
        "procs": world,
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "batch_size": BATCH_SIZE,
        "target": TARGETS[name],
        **{f"{r}_steps_per_s": steps / med(wall[r]) for r in RUNNERS},
        "ratio": paired(wall, "trainer", "loop"),
        "ratio_log": paired(wall, "trainer_log", "loop"),
        "self_log_us": paired(wall, "trainer_log", "trainer", per_step_us=True),
        "cpu_ratio": paired(cpu, "trainer", "loop"),
        "cpu_ratio_log": paired(cpu, "trainer_log", "loop"),
        "self_log_cpu_us": paired(cpu, "trainer_log", "trainer", per_step_us=True),
        # The whole run, fixed costs included: keel's extra time per step over the hand loop (all `total` steps).
        "whole_ratio": paired(whole, "trainer", "loop"),
        "whole_extra_us": paired(whole, "trainer", "loop", per_step_us=True, over=total),
        "whole_extra_cpu_us": paired(whole_cpu, "trainer", "loop", per_step_us=True, over=total),
        "whole_s": whole,
        "wall_s": wall,
        "cpu_s": cpu,
    }


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    logging.disable(logging.INFO)  # the Trainer's start-of-run lines, once per Trainer()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))  # env:// from torchrun
    results = [measure(m, args.steps[m], args.warmup, args.repeats) for m in args.models]
    if not tdist.is_initialized() or tdist.get_rank() == 0:
        Path(args._result).write_text(json.dumps(results))
    if tdist.is_initialized():
        tdist.destroy_process_group()


def profile(args: argparse.Namespace) -> None:
    """cProfile of one Trainer run per model (1 process), the top functions by own time."""
    torch.set_num_threads(1)
    logging.disable(logging.INFO)
    for name in args.models:
        total = args.warmup + args.steps[name]
        dataset = make_data(name, total * BATCH_SIZE)
        run_trainer(name, dataset, total, args.warmup, log_every_step=False)  # warm caches and imports
        prof = cProfile.Profile()
        prof.enable()
        run_trainer(name, dataset, total, args.warmup, log_every_step=False)
        prof.disable()
        stats = pstats.Stats(prof).sort_stats("tottime")
        print(f"\n=== cProfile: Trainer.fit, {name}, {total} steps, by own time ===")
        stats.print_stats(args.profile_top)
        print("\n=== the same, keel's own code only (trainer/, callbacks/) ===")
        stats.print_stats(r"keel|/(trainer|callbacks)/", args.profile_top)


# --------------------------------------------------------------------------- launching and reporting (parent)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_launch(proc: subprocess.Popen, marker: str) -> None:
    """SIGTERM, then SIGKILL after 5 s, the launcher and every process carrying ``marker`` in its environment
    (torchrun starts its workers in sessions of their own, so a process-group kill would miss them)."""
    needle = f"{_MARKER}={marker}".encode()

    def marked() -> list[int]:
        pids = []
        for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
            try:
                if entry.isdigit() and needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    pids.append(int(entry))
            except OSError:  # gone, or not ours to read
                continue
        return pids

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [proc.pid] + marked():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
            if not marked():
                return


def launch(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run ``cmd`` with OMP_NUM_THREADS=1 and return (exit status, output); 124 when it timed out,
    after killing it and every process it started."""
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{_MARKER: marker})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_launch(proc, marker)
            rc = 124
        except BaseException:  # Ctrl-C: never leave ranks behind
            _kill_launch(proc, marker)
            raise
        out.seek(0)
        text = out.read().decode("utf-8", errors="replace")
    if rc == 124:
        text += f"\n[overhead.py] timed out after {timeout:g}s; killed every process of the launch\n"
    return rc, text


def run_case(procs: int, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        child = [
            str(Path(__file__).resolve()),
            "--_worker",
            "--_result",
            result,
            "--warmup",
            str(args.warmup),
            "--repeats",
            str(args.repeats),
            "--models",
            ",".join(args.models),
            "--steps",
            ",".join(f"{m}={args.steps[m]}" for m in args.models),
            "--timeout",
            str(args.timeout),
        ]
        if procs == 1:
            cmd = [sys.executable] + child
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1",
                "--nproc-per-node",
                str(procs),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{free_port()}",
                "--local-addr",
                "127.0.0.1",
                "--max-restarts",
                "0",
                "--monitor-interval",
                "0.5",
            ] + child
        rc, output = launch(cmd, args.timeout)
        if rc != 0 or not os.path.exists(result):
            tail = "\n".join(output.splitlines()[-60:])
            raise RuntimeError(f"{procs}-process run failed (exit {rc}): {' '.join(cmd)}\n{tail}")
        return json.loads(Path(result).read_text())


def report(results: list[dict]) -> None:
    head = ("case", "loop steps/s", "trainer steps/s", "ratio", "cpu ratio", "target (on ratio)")
    rows = []
    for r in results:
        kind = "FSDP" if r["model"] in FSDP_MODELS else "DDP"
        if r["model"] in TP_MODELS:
            kind = f"FSDP x TP ({r['procs'] // TENSOR_PARALLEL}, {TENSOR_PARALLEL})"
        case = f"{r['model']} ({r['params']:,} params), {r['procs']} proc" + ("" if r["procs"] == 1 else f"s {kind}")
        verdict = "PASS" if r["ratio"] <= r["target"] else "MISS"
        rows.append(
            (
                case,
                f"{r['loop_steps_per_s']:.1f}",
                f"{r['trainer_steps_per_s']:.1f}",
                f"{r['ratio']:.3f}",
                f"{r['cpu_ratio']:.3f}",
                f"<= {r['target']:.2f} {verdict}",
            )
        )
        verdict = "PASS" if r["whole_extra_us"] <= WHOLE_TARGET_US else "MISS"
        rows.append(
            (
                "  the whole run (building it, fit, fixed costs)",
                "",
                "",
                f"{r['whole_ratio']:.3f}",
                "",
                f"keel's extra {r['whole_extra_us']:+.1f} us/step (cpu {r['whole_extra_cpu_us']:+.1f}; "
                f"<= {WHOLE_TARGET_US:.0f}) {verdict}",
            )
        )
        verdict = "PASS" if r["self_log_us"] < SELF_LOG_TARGET_US else "MISS"
        rows.append(
            (
                "  trainer + self.log every step",
                f"{r['loop_steps_per_s']:.1f}",
                f"{r['trainer_log_steps_per_s']:.1f}",
                f"{r['ratio_log']:.3f}",
                f"{r['cpu_ratio_log']:.3f}",
                f"self.log {r['self_log_us']:+.1f} us/call (cpu {r['self_log_cpu_us']:+.1f}; "
                f"< {SELF_LOG_TARGET_US:.0f}) {verdict}",
            )
        )
    widths = [max(len(row[i]) for row in rows + [head]) for i in range(len(head))]
    for row in [head, tuple("-" * w for w in widths)] + rows:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row[:-1], widths))]
        print(" | ".join(cells + [row[-1]]))
    r0 = results[0]
    print(
        f"\nratio: median over {r0['repeats']} paired repeats of trainer/loop wall time of the timed steps "
        f"({r0['warmup']} warm-up steps excluded); cpu ratio: the same with process CPU time. See --help."
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="short smoke run: few steps, 2 repeats, 3 warm-up steps (the timings are noise)",
    )
    p.add_argument("--single-only", action="store_true", help="skip the DDP and FSDP cases")
    p.add_argument("--ddp-only", action="store_true", help="skip the single-process and FSDP cases")
    p.add_argument("--fsdp-only", action="store_true", help="only the 2-process FSDP and FSDP x TP cases")
    p.add_argument(
        "--models",
        default=None,
        help="comma-separated subset of "
        + ", ".join(f"{m} (MLP {'-'.join(map(str, w))})" for m, w in MODELS.items())
        + f" (default: all; {', '.join(FSDP_MODELS)} run in the FSDP case only)",
    )
    p.add_argument(
        "--steps", help=f"timed steps per run: one int, or model=int pairs (default: {STEPS}; --quick: {QUICK_STEPS})"
    )
    p.add_argument("--warmup", type=int, help="untimed steps at the start of each run (default: 10; --quick: 3)")
    p.add_argument("--repeats", type=int, help="repeats of (loop, trainer, trainer+self.log) (default: 9; --quick: 2)")
    p.add_argument("--nproc", type=int, default=2, help="processes of the DDP and FSDP cases (default: 2)")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds before a child launch is killed with all its ranks (default: 600)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of the benchmark: cProfile one Trainer run per "
        "model in this process (1 process) and print the top functions by own time",
    )
    p.add_argument("--profile-top", type=int, default=30, help="rows printed by --profile (default: 30)")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = [m for m in (args.models or ",".join(MODELS)).split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    steps = dict(QUICK_STEPS if args.quick else STEPS)
    if args.steps:
        for item in args.steps.split(","):
            name, _, value = item.rpartition("=")
            if name and name not in MODELS:
                p.error(f"--steps: unknown model {name!r}")
            for m in [name] if name else list(steps):
                steps[m] = int(value)
    args.steps = steps
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 9)  # odd: a true median
    if args.warmup < 1 or args.repeats < 1 or min(steps.values()) < 1:
        p.error("--warmup, --repeats and --steps must be >= 1")
    if sum((args.single_only, args.ddp_only, args.fsdp_only)) > 1:
        p.error("--single-only, --ddp-only and --fsdp-only exclude each other")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        worker(args)
        return 0
    if args.profile:
        profile(args)
        return 0
    started, results, failed = time.monotonic(), [], False
    plain = [m for m in args.models if m not in FSDP_MODELS]
    sharded = [m for m in args.models if m in FSDP_MODELS]
    cases = [] if args.ddp_only or args.fsdp_only else [(1, plain)]
    cases += [] if args.single_only or args.fsdp_only else [(args.nproc, plain)]
    cases += [] if args.single_only or args.ddp_only else [(args.nproc, sharded)]
    for procs, models in cases:
        if not models:
            continue
        try:
            results += run_case(procs, argparse.Namespace(**{**vars(args), "models": models}))
        except RuntimeError as exc:  # report what was measured, then fail
            print(exc, file=sys.stderr)
            failed = True
    if results:
        report(results)
        line = json.dumps(
            {
                "benchmark": "keel-overhead",
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "quick": args.quick,
                "wall_s": round(time.monotonic() - started, 1),
                "cases": results,
            }
        )
        print(line)
        if args.json:
            Path(args.json).write_text(line + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
