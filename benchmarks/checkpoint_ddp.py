"""How long a DDP save blocks each rank: this checkout vs another one (the previous release), side by side.

    git worktree add /tmp/keel-before <commit>          # e.g. the last release that wrote one file per save
    python benchmarks/checkpoint_ddp.py --before /tmp/keel-before [--params-millions 100] [--repeats 3]

Each variant is a ``torchrun --nproc-per-node 2`` job (gloo on CPU) that trains a ~100M-parameter stack of
Linear layers with AdamW for two steps (so the optimizer state is full size) and then calls
``Trainer.save_checkpoint`` ``--repeats`` times into ``--dir``. Blocked time of a save = the slowest rank's
time inside ``save_checkpoint`` (every rank is blocked until the save is committed). The variants alternate,
so both see the same disk and page cache. A third variant runs this checkout with the CRC32 of the written
bytes replaced by a no-op: the difference is what the checksums cost.

Before: rank 0 wrote the whole one-file checkpoint while rank 1 waited at a barrier. Now: every rank writes
its share of the tensors (DCP spreads the replicated ones), then rank 0 commits the folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, os.environ["KEEL_ROOT"])
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from trainer import TaskModule, Trainer
    from trainer.distributed import comm

    if args.no_crc:
        import trainer.checkpoint.files as files

        class _NoCrc:
            @staticmethod
            def crc32(data: object, value: int = 0) -> int:
                return 0

        files.zlib = _NoCrc  # type: ignore[assignment]

    width, depth = 2048, max(1, round(args.params_millions * 1e6 / (2048 * 2049)))

    class Big(TaskModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    data = DataLoader(TensorDataset(torch.randn(8, width)), batch_size=2)
    trainer = Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0
    )
    task = Big()
    trainer.fit(task, data)
    times = []
    for i in range(args.repeats):
        path = os.path.join(args.dir, f"{args.label}-{i}.ckpt")
        comm.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        times.append(time.perf_counter() - start)
        comm.barrier()
        if trainer.is_global_zero:
            (shutil.rmtree if os.path.isdir(path) else os.remove)(path)
        comm.barrier()
    slowest = [max(t) for t in zip(*comm.all_gather_object(times))]
    if trainer.is_global_zero:
        params = sum(p.numel() for p in task.parameters())
        print("RESULT " + json.dumps({"label": args.label, "params": params, "blocked_s": slowest}), flush=True)


def run(label: str, root: str, args: argparse.Namespace, *extra: str) -> dict:
    env = dict(os.environ, KEEL_ROOT=root, PYTHONPATH=root, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(args.port), __file__, "--worker", "--label", label, "--dir", args.dir]
    cmd += ["--repeats", "1", "--params-millions", str(args.params_millions), *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{label} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="a checkout of the release to compare with")
    parser.add_argument("--params-millions", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--label", default="now")
    parser.add_argument("--no-crc", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    args.dir = args.dir or tempfile.mkdtemp(prefix="keel-ddp-save-")
    variants = [("now", str(HERE), ()), ("now-no-crc", str(HERE), ("--no-crc",))]
    if args.before:
        variants.insert(0, ("before", str(Path(args.before).resolve()), ()))
    results: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    params = 0
    for _ in range(args.repeats):  # alternate the variants: the same disk and page-cache conditions
        for label, root, extra in variants:
            result = run(label, root, args, *extra)
            results[label] += result["blocked_s"]
            params = result["params"]
    print(f"{params / 1e6:.1f}M parameters + AdamW, 2 ranks (gloo, CPU), {args.repeats} saves each, into {args.dir}")
    print("| variant | blocked per save, median (s) | each (s) |")
    print("|---|---|---|")
    for label, times in results.items():
        print(f"| {label} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |")
    if args.before:
        print(f"now / before: {statistics.median(results['now']) / statistics.median(results['before']):.2f}")
    crc = statistics.median(results["now"]) / statistics.median(results["now-no-crc"]) - 1
    print(f"checksum cost: {100 * crc:+.1f}% of the save time")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
