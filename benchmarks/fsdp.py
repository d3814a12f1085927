"""DDP vs FSDP on 2 ranks (gloo, CPU), side by side in one run: memory per rank, step time, save blocking.

    python benchmarks/fsdp.py                  # ~100M parameters, AdamW; a few minutes on 2 cores
    python benchmarks/fsdp.py --width 512 --layers 4 --steps 6   # smoke run (seconds)

One model (a ModuleList of ``--layers`` Linear(width, width) blocks: the default FSDP units) is trained
under ``strategy="ddp"`` and then ``strategy="fsdp"``, each under ``torchrun --nproc-per-node 2`` on
127.0.0.1. Measured per rank, inside the run:

* bytes of parameters + gradients + optimizer state this rank holds (DTensors count their local shard),
  read in ``on_before_optimizer_step`` (gradients exist, Adam state after the first step);
* median wall time per optimizer step (``on_train_batch_end`` to ``on_train_batch_end``, after warm-up);
* the time the loop is blocked by one checkpoint save, synchronous (``Trainer.save_checkpoint``: a folder to
  which every rank writes its part, its shards under FSDP) and asynchronous (``ModelCheckpoint(async_save=
  True)``: the state is staged to CPU memory and written in the background; blocked = until ``save``
  returns), each the median of ``--saves`` saves at step boundaries (the JSON also lists each save: the
  first async save allocates the CPU buffers that the later ones reuse).

Output: a table and one JSON line. This is a report, not a test: exit status 0 unless a run failed.
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

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from trainer import Callback, TaskModule, Trainer
    from trainer.checkpoint.model_checkpoint import ModelCheckpoint

    class Stack(TaskModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList([nn.Linear(args.width, args.width) for _ in range(args.layers)])

        def training_step(self, batch, batch_idx):
            h = batch[0]
            for block in self.blocks:
                h = torch.relu(block(h))
            return h.pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def local_bytes(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.nelement() * t.element_size()

    class Probe(Callback):
        def __init__(self) -> None:
            self.memory: dict[str, int] = {}
            self.times: list[float] = []
            self.sync: list[float] = []
            self.async_: list[float] = []
            self._last = None

        def on_before_optimizer_step(self, trainer, task, optimizer) -> None:
            if trainer.global_step == 1:  # Adam state exists from the first step on
                self.memory = {
                    "params": sum(local_bytes(p) for p in task.parameters()),
                    "grads": sum(local_bytes(p.grad) for p in task.parameters() if p.grad is not None),
                    "optimizer": sum(
                        local_bytes(v)
                        for s in optimizer.state.values()
                        for v in s.values()
                        if isinstance(v, torch.Tensor)
                    ),
                }

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            step = trainer.global_step
            if self._last is not None and 2 <= step <= args.steps:
                self.times.append(now - self._last)
            if step > args.steps and step <= args.steps + 2 * args.saves:
                directory = os.path.join(args.out, f"ck-{trainer.strategy.name}")
                start = time.perf_counter()
                if (step - args.steps) % 2:  # odd: synchronous, even: asynchronous
                    trainer.save_checkpoint(os.path.join(directory, f"sync-{step}.ckpt"))
                    self.sync.append(time.perf_counter() - start)
                else:
                    cb = trainer.checkpoint_callback
                    cb.save(trainer)
                    self.async_.append(time.perf_counter() - start)
            self._last = time.perf_counter()

    probe = Probe()
    directory = os.path.join(args.out, f"ck-{args.strategy}")
    checkpoint = ModelCheckpoint(dirpath=directory, save_top_k=1, async_save=True, save_on_train_epoch_end=False)
    total = args.steps + 2 * args.saves + 1
    data = TensorDataset(torch.randn(total * 2 * args.batch, args.width))
    trainer = Trainer(
        max_steps=total,
        strategy=args.strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[probe, checkpoint],
        log_every_n_steps=10_000,
    )
    trainer.fit(Stack(), DataLoader(data, batch_size=args.batch))
    result = {
        "strategy": args.strategy,
        "rank": trainer.global_rank,
        "memory": probe.memory,
        "step_s": statistics.median(probe.times) if probe.times else None,
        "save_sync_s": statistics.median(probe.sync) if probe.sync else None,
        "save_async_blocked_s": statistics.median(probe.async_) if probe.async_ else None,
        "save_async_each_s": probe.async_,
        "save_sync_each_s": probe.sync,
        "params": sum(p.numel() for p in trainer.task.parameters()),
    }
    Path(args.out, f"{args.strategy}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    out = tempfile.mkdtemp(prefix="keel-fsdp-bench-")
    results = {}
    for strategy in ("ddp", "fsdp"):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--local-addr",
            "127.0.0.1",
            __file__,
            "--worker",
            "--strategy",
            strategy,
            "--out",
            out,
            "--width",
            str(args.width),
            "--layers",
            str(args.layers),
            "--batch",
            str(args.batch),
            "--steps",
            str(args.steps),
            "--saves",
            str(args.saves),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
        done = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
            raise SystemExit(f"{strategy} run failed (exit {done.returncode})")
        results[strategy] = [json.loads(Path(out, f"{strategy}-rank{r}.json").read_text()) for r in (0, 1)]
    ddp, fsdp = results["ddp"][0], results["fsdp"][0]
    held = {s: sum(results[s][0]["memory"].values()) for s in results}
    row = {
        "params": ddp["params"],
        "bytes_per_rank": {s: results[s][0]["memory"] for s in results},
        "fsdp_over_ddp_bytes": held["fsdp"] / held["ddp"],
        "step_s": {"ddp": ddp["step_s"], "fsdp": fsdp["step_s"]},
        "fsdp_over_ddp_step": fsdp["step_s"] / ddp["step_s"],
        "save_blocked_s": {
            s: {
                "sync": max(r["save_sync_s"] for r in results[s]),
                "async": max(r["save_async_blocked_s"] for r in results[s]),
                # per save, slowest rank; the first async save also allocates its CPU buffers
                "async_each": [max(v) for v in zip(*(r["save_async_each_s"] for r in results[s]))],
                "sync_each": [max(v) for v in zip(*(r["save_sync_each_s"] for r in results[s]))],
            }
            for s in results
        },
    }
    for s in results:
        blocked = row["save_blocked_s"][s]
        blocked["async_over_sync"] = blocked["async"] / blocked["sync"]
    print(
        f"{'':8} {'params+grads+optim per rank':>28} {'step (s)':>10} {'save sync (s)':>14} "
        f"{'save async blocked (s)':>24}"
    )
    for s in results:
        b = row["save_blocked_s"][s]
        print(
            f"{s:8} {held[s] / 2**20:>24.1f} MiB {row['step_s'][s]:>10.3f} {b['sync']:>14.3f} "
            f"{b['async']:>14.3f} ({100 * b['async_over_sync']:.1f}%)"
        )
    print(json.dumps(row))


if __name__ == "__main__":
    main()
