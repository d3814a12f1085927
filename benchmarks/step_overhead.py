"""keel's extra time per training step over a hand-written loop, measured step by step in one run.

    python benchmarks/step_overhead.py                  # tiny MLP, 6,000 steps: 1 process and 2-rank DDP
    python benchmarks/step_overhead.py --single-only --repeats 3
    python benchmarks/step_overhead.py --quick          # smoke run (the timings are noise)

``benchmarks/overhead.py`` runs the hand loop and the Trainer one after the other; on a shared 2-core machine their
runs drift apart by tens of microseconds a step, more than the difference being measured. Here the two run side by
side at the finest grain: one ``Trainer.fit`` of N steps and, after each of its steps (in ``on_train_batch_end`` of
a callback), one step of each hand-written loop, each of them first every other step. Each hand loop is a generator
resumed once per keel step, so its own ``for`` loop, its loader and its step all count, as they would in a script.
Noise then falls on all of them within microseconds of each other.

Two hand loops run beside keel, with the same net, data (batch 64), SGD and cross-entropy as ``overhead.py``:

- ``hand loop``: plain PyTorch, ``loss = F.cross_entropy(net(x), y)``;
- ``hand loop + task``: the same loop calling ``training_step(batch, i)`` of a second instance of the benchmark's
  task. A task's own structure (a method call; ``self.net`` found by ``nn.Module.__getattr__``) costs the same in
  any loop; against this loop keel's extra is what keel's loop adds.

keel's step is the time from the end of one callback call to the start of the next: its loop, the step, its
bookkeeping and its hook dispatch. The extra a step is the mean over the timed steps (after ``--warmup``) of keel's
step less the hand loop's. The whole run adds every fixed cost: from ``Trainer(...)`` to the end of ``fit``, less the
hand loops' time inside it, against the hand loop's whole run (building its net, optimizer and loader, and all of its
steps); divided by the steps. The median over ``--repeats`` fits is reported. Under DDP (torchrun, gloo on
127.0.0.1) each hand loop wraps its net in ``DistributedDataParallel`` and reads a ``DistributedSampler``; the
slowest rank's times are reported. ratio = keel's whole run / the hand loop's whole run.

The target (issue 58): keel's extra at most 10 us a step, fixed costs included. PASS/MISS is a report; the exit
status is 0 unless a run failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as tdist
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))  # overhead.py: the same nets, data and launcher
from overhead import BATCH_SIZE, LR, REPO_ROOT, free_port, launch, make_data, make_net

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from trainer import Callback, TaskModule, Trainer

TARGET_US = 10.0
HANDS = ("hand", "hand_task")  # the plain loop, and the loop calling the task's training_step
_now = time.perf_counter


class BenchTask(TaskModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.net = make_net(name)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=LR)


class TaskStep(torch.nn.Module):
    """What DDP wraps in the ``hand loop + task`` case: its forward is the task's training_step (as in keel)."""

    def __init__(self, task: BenchTask) -> None:
        super().__init__()
        self.task = task

    def forward(self, batch, batch_idx):
        return self.task.training_step(batch, batch_idx)


def hand_loop(name: str, dataset, ddp: bool, task: bool) -> Iterator[None]:
    """A hand-written loop, one step per ``next``; the first ``next`` builds it."""
    sampler = DistributedSampler(dataset, shuffle=False) if ddp else None
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)
    if task:
        bench = BenchTask(name)
        step = torch.nn.parallel.DistributedDataParallel(TaskStep(bench)) if ddp else bench.training_step
        optimizer = torch.optim.SGD(bench.parameters(), lr=LR)
        for i, batch in enumerate(loader):
            loss = step(batch, i)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            yield
        return
    net = make_net(name)
    model = torch.nn.parallel.DistributedDataParallel(net) if ddp else net
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        yield


class SideBySide(Callback):
    """After each keel step, one step of each hand loop; the intervals of all three."""

    def __init__(self, name: str, dataset, ddp: bool) -> None:
        self.name, self.dataset, self.ddp = name, dataset, ddp
        self.keel: list[float] = []
        self.hands: dict[str, list[float]] = {h: [] for h in HANDS}
        self.inside = 0.0  # seconds of hand-loop work inside the fit (to take out of keel's whole run)
        self.last: float | None = None
        self.loops: dict[str, Iterator[None]] = {}

    def on_train_start(self, trainer, task) -> None:
        began = _now()
        self.loops = {h: hand_loop(self.name, self.dataset, self.ddp, task=h == "hand_task") for h in HANDS}
        self.inside += _now() - began

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        began = _now()
        if self.last is not None:
            self.keel.append(began - self.last)
        at = began
        for h in HANDS if batch_idx % 2 == 0 else HANDS[::-1]:  # each hand loop comes first every other step
            next(self.loops[h])
            end = _now()
            self.hands[h].append(end - at)
            at = end
        self.inside += at - began
        self.last = at


def one_fit(name: str, dataset, steps: int, warmup: int, ddp: bool) -> dict[str, float]:
    """One fit of ``steps`` steps side by side with the hand loops: us a step of each, and the whole-run extras."""
    began = _now()
    side = SideBySide(name, dataset, ddp)
    trainer = Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        max_steps=steps,
        callbacks=[side],
    )
    trainer.fit(BenchTask(name), train_dataloaders=DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=False))
    keel_whole = _now() - began - side.inside
    assert trainer.global_step == steps == len(side.keel) + 1, (trainer.global_step, len(side.keel))
    # Each hand loop's whole run: a fresh build (what its first next() paid inside the fit is in its first step).
    out: dict[str, float] = {}
    timed = slice(warmup, None)
    keel = side.keel[warmup - 1 :]  # keel's step i: from the end of callback i-1 to the start of callback i
    for h in HANDS:
        hand = side.hands[h][timed]
        n = min(len(keel), len(hand))
        out[f"{h}_us"] = sum(hand[:n]) / n * 1e6
        out[f"{h}_extra_us"] = (sum(keel[:n]) - sum(hand[:n])) / n * 1e6
        hand_whole = sum(side.hands[h])
        out[f"{h}_whole_extra_us"] = (keel_whole - hand_whole) / steps * 1e6
        out[f"{h}_whole_ratio"] = keel_whole / hand_whole
    out["keel_us"] = sum(keel) / len(keel) * 1e6
    return out


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    logging.disable(logging.INFO)
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if ddp:
        tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    world = tdist.get_world_size() if ddp else 1
    dataset = make_data(args.model, (args.steps + 1) * BATCH_SIZE * world)
    one_fit(args.model, dataset, min(args.steps, 50), min(args.warmup, 10), ddp)  # untimed: lazy imports and inits
    runs = [one_fit(args.model, dataset, args.steps, args.warmup, ddp) for _ in range(args.repeats)]
    if ddp:  # the slowest rank's figures
        keys = sorted(runs[0])
        t = torch.tensor([[r[k] for k in keys] for r in runs], dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        runs = [dict(zip(keys, row)) for row in t.tolist()]
    if not ddp or tdist.get_rank() == 0:
        Path(args._result).write_text(json.dumps(runs))
    if ddp:
        tdist.destroy_process_group()


def run_case(procs: int, args: argparse.Namespace) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        child = [str(Path(__file__).resolve()), "--_worker", "--_result", result, "--model", args.model]
        child += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
        child += ["--timeout", str(args.timeout)]
        cmd = [sys.executable, *child]
        if procs > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(procs)]
            cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
            cmd += ["--local-addr", "127.0.0.1", "--max-restarts", "0", "--monitor-interval", "0.5", *child]
        rc, output = launch(cmd, args.timeout)
        if rc != 0 or not os.path.exists(result):
            tail = "\n".join(output.splitlines()[-60:])
            raise RuntimeError(f"{procs}-process run failed (exit {rc}): {' '.join(cmd)}\n{tail}")
        return json.loads(Path(result).read_text())


def summarise(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def report(cases: list[tuple[int, dict[str, float], list[dict[str, float]]]], args: argparse.Namespace) -> None:
    head = ("case", "against", "hand us/step", "keel us/step", "extra us/step", "whole run: extra", "ratio", "target")
    rows = []
    for procs, med, _ in cases:
        case = f"{args.model}, {procs} proc" + ("" if procs == 1 else "s DDP")
        for h, label in (("hand", "hand loop"), ("hand_task", "hand loop + task")):
            whole = med[f"{h}_whole_extra_us"]
            verdict = "PASS" if whole <= TARGET_US else "MISS"
            rows.append(
                (
                    case,
                    label,
                    f"{med[f'{h}_us']:.1f}",
                    f"{med['keel_us']:.1f}",
                    f"{med[f'{h}_extra_us']:+.1f}",
                    f"{whole:+.1f}",
                    f"{med[f'{h}_whole_ratio']:.3f}",
                    f"<= {TARGET_US:.0f} us {verdict}",
                )
            )
            case = ""
    widths = [max(len(row[i]) for row in rows + [head]) for i in range(len(head))]
    for row in [head, tuple("-" * w for w in widths)] + rows:
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row[:-1], widths))]
        print(" | ".join(cells + [row[-1]]))
    print(
        f"\n{args.steps} steps a fit ({args.warmup} warm-up steps left out of the per-step columns), median over "
        f"{args.repeats} fits; the whole run includes every fixed cost. See --help."
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 200 steps, 1 repeat")
    p.add_argument("--single-only", action="store_true", help="skip the DDP case")
    p.add_argument("--ddp-only", action="store_true", help="skip the 1-process case")
    p.add_argument("--model", default="tiny", choices=["tiny", "mlp1m"], help="the MLP (default: tiny)")
    p.add_argument("--steps", type=int, help="steps a fit (default: 6000; --quick: 200)")
    p.add_argument("--warmup", type=int, default=100, help="steps left out of the per-step columns (default: 100)")
    p.add_argument("--repeats", type=int, help="fits, each with all three loops (default: 5; --quick: 1)")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the DDP case (default: 2)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a launch is killed (default: 900)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.steps = args.steps or (200 if args.quick else 6000)
    args.repeats = args.repeats or (1 if args.quick else 5)
    if args.quick:
        args.warmup = min(args.warmup, 20)
    if args.warmup < 1 or args.steps <= args.warmup or args.repeats < 1:
        p.error("need --warmup >= 1, --steps > --warmup and --repeats >= 1")
    if args.single_only and args.ddp_only:
        p.error("--single-only and --ddp-only exclude each other")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        worker(args)
        return 0
    started, cases, failed = time.monotonic(), [], False
    for procs in ([] if args.ddp_only else [1]) + ([] if args.single_only else [args.nproc]):
        try:
            runs = run_case(procs, args)
        except RuntimeError as exc:  # report what was measured, then fail
            print(exc, file=sys.stderr)
            failed = True
            continue
        cases.append((procs, summarise(runs), runs))
    if cases:
        report(cases, args)
        line = json.dumps(
            {
                "benchmark": "keel-step-overhead",
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "model": args.model,
                "steps": args.steps,
                "quick": args.quick,
                "wall_s": round(time.monotonic() - started, 1),
                "cases": [{"procs": p, "median": m, "runs": r} for p, m, r in cases],
            }
        )
        print(line)
        if args.json:
            Path(args.json).write_text(line + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
