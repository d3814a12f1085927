"""Start-up: seconds from launching the command to the end of the first optimizer step, keel against a hand-written
loop doing the same work in the same process layout (1 process; 2 ranks under torchrun, gloo).

    python benchmarks/startup.py                 # 1 process and 2 ranks, 5 repeats each
    python benchmarks/startup.py --repeats 3 --layouts 1

The work: README's classifier (16 -> 64 -> 4, SGD), 1024 random samples in a TensorDataset, batch 32, one
optimizer step. The hand loop imports torch, (on 2 ranks) creates the gloo process group, wraps the model in
DistributedDataParallel and reads a DistributedSampler. keel runs ``Trainer(default_root_dir=tmp).fit(...)`` as a
user's script does, every default on (TensorBoard logger, ModelCheckpoint, progress bar, model summary), and
``keel quiet`` the same with the logger, checkpointing, the bar and the summary off. Each child writes, per rank,
the seconds since the parent started it at each milestone and exits at the end of the first step (no teardown is
timed); a launch's time is its slowest rank's. Cases alternate in order within a repeat; the table gives medians.

Bytecode: every child reads and writes its compiled modules under one cache folder (``PYTHONPYCACHEPREFIX``), and
each case runs once untimed first, so no run pays for compiling Python files (a machine with
``PYTHONDONTWRITEBYTECODE`` set would otherwise compile keel's modules in every process). Targets: keel's extra
start-up over the loop at most 0.5 s in one process and 1 s on 2 ranks. A report, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
CASES = ("loop", "keel", "keel quiet")
TARGET_S = {1: 0.5, 2: 1.0}


# ---------------------------------------------------------------------- the children
def _mark(name: str, marks: dict[str, float]) -> None:
    marks[name] = time.time() - float(os.environ["STARTUP_T0"])


def _write(marks: dict[str, float]) -> None:
    rank = os.environ.get("RANK", "0")
    Path(os.environ["STARTUP_OUT"], f"rank{rank}.json").write_text(json.dumps(marks))
    sys.stdout.flush()
    os._exit(0)  # the first step is done: no teardown is timed


def _data():  # type: ignore[no-untyped-def]
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(1024, 16, generator=g), torch.randint(0, 4, (1024,), generator=g))


def child_loop(marks: dict[str, float]) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    _mark("imported", marks)
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    net: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    sampler = None
    if world > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        net = DistributedDataParallel(net)
        sampler = DistributedSampler(_data(), shuffle=True, seed=0)
    loader = DataLoader(_data(), batch_size=32, shuffle=sampler is None, sampler=sampler)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    _mark("built", marks)
    x, y = next(iter(loader))
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _mark("first step", marks)
    _write(marks)


def child_keel(marks: dict[str, float], *, quiet: bool) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from trainer import Callback, TaskModule, Trainer

    _mark("imported", marks)

    class Classifier(TaskModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Milestones(Callback):
        def on_fit_start(self, trainer, task):  # type: ignore[no-untyped-def]
            _mark("fit set up", marks)

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            _mark("first step", marks)
            _write(marks)

    options = {"max_steps": 1, "default_root_dir": os.environ["STARTUP_OUT"], "callbacks": [Milestones()]}
    if quiet:
        options.update(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = Trainer(**options)
    _mark("built", marks)
    trainer.fit(Classifier(), DataLoader(_data(), batch_size=32, shuffle=True))


# ---------------------------------------------------------------------- the parent
def launch(case: str, ranks: int, cache: str, timeout: float) -> dict[str, float]:
    """One run of ``case``: each milestone's time, the slowest rank's."""
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env.update(
            STARTUP_OUT=out,
            PYTHONPYCACHEPREFIX=cache,
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            OMP_NUM_THREADS="1",
        )
        script = [str(HERE), "--child", case]
        if ranks == 1:
            cmd = [sys.executable, *script]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *script]
        env["STARTUP_T0"] = repr(time.time())
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=out)
        files = sorted(Path(out).glob("rank*.json"))
        if done.returncode != 0 or len(files) != ranks:
            raise RuntimeError(f"{case} on {ranks} rank(s) failed ({done.returncode}):\n{done.stderr[-3000:]}")
        marks = [json.loads(f.read_text()) for f in files]
        return {name: max(m[name] for m in marks) for name in marks[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layouts", type=int, nargs="+", default=[1, 2], help="ranks per case (1, 2)")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    if args.child:
        marks: dict[str, float] = {}
        if args.child == "loop":
            child_loop(marks)
        else:
            child_keel(marks, quiet=args.child == "keel quiet")
        return
    import torch

    cache = tempfile.mkdtemp(prefix="keel-startup-pycache-")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for ranks in args.layouts:
        for case in CASES:  # untimed: compile and cache every module the case imports
            launch(case, ranks, cache, args.timeout)
        runs: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}
        for repeat in range(args.repeats):
            for case in CASES if repeat % 2 == 0 else reversed(CASES):
                runs[case].append(launch(case, ranks, cache, args.timeout))
        results[str(ranks)] = {
            case: {name: statistics.median(r[name] for r in rs) for name in rs[0]} for case, rs in runs.items()
        }
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.repeats} repeats, medians in seconds")
    print("| ranks | case | imported | built | fit set up | first step | extra over loop | target |")
    print("|---|---|---|---|---|---|---|---|")
    for ranks, cases in results.items():
        loop = cases["loop"]["first step"]
        for case, m in cases.items():
            extra = m["first step"] - loop
            target = TARGET_S[int(ranks)] if case == "keel" else None
            verdict = "" if target is None else f"<= {target} {'PASS' if extra <= target else 'MISS'}"
            cells = [f"{m[k]:.2f}" if k in m else "-" for k in ("imported", "built", "fit set up", "first step")]
            print(f"| {ranks} | {case} | {' | '.join(cells)} | {extra:+.2f} | {verdict} |")
    print(json.dumps({"startup": results}))


if __name__ == "__main__":
    main()
