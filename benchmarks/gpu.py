"""keel vs a hand-written loop on one GPU: the char GPT at about 100M parameters in bf16 (one JSON line).

    python benchmarks/gpu.py                  # one CUDA GPU, about 2-3 minutes
    python benchmarks/gpu.py --peak-tflops 989 # MFU against a peak the table below does not know

Four runs, each a fresh ``torchrun --nproc-per-node 1`` process (nccl) on the same model (recipes.charlm
.CharGPT, 12 blocks of width 768 at context 256: ~85M parameters in blocks, ~100M with embeddings
counted once; the head is tied), the same random character batches (pinned, ``non_blocking`` copies),
AdamW (fused), a mean cross-entropy and bf16 autocast with fp32 master weights:

* ``loop_ddp``: a hand-written loop over ``DistributedDataParallel(model)``;
* ``keel_ddp``: ``Trainer(strategy="ddp", precision="bf16-mixed")`` on the same task;
* ``loop_fsdp``: a hand-written loop over ``fully_shard`` (one unit per block, then the root), with
  ``MixedPrecisionPolicy(reduce_dtype=fp32)``, keel's own FSDP mapping of bf16-mixed;
* ``keel_fsdp``: ``Trainer(strategy="fsdp", precision="bf16-mixed")``.

Each times ``--steps`` optimizer steps after ``--warmup`` (``torch.cuda.synchronize()`` at both ends, the
only syncs in the timed window), then the keel runs time one synchronous and one asynchronous checkpoint
save at step boundaries (the loop's blocked time). tokens/s = batch x context x steps / seconds; model
FLOPs per token = 6 x parameters + 12 x layers x context x width (attention scores, PaLM's appendix B),
MFU = FLOPs/s over the GPU's dense bf16 peak (table below, or ``--peak-tflops``). ``batch_copy_overlap``:
a 256 MiB pinned copy queued behind ~50 ms of matmuls, on the compute stream vs keel's copy stream
(trainer.data.transfer.BatchCopier): with overlap the second is close to the compute time alone.

Refuses to run without CUDA, naming why. ``--smoke-on-cpu`` runs a tiny configuration on CPU/gloo, each run one
process with torchrun's variables but no agent (the test suite's check that the script itself works; its numbers
mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Dense bf16 peak TFLOP/s (no sparsity) by device-name substring, from the vendors' data sheets.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "L4": 121.0,
}
FULL = dict(n_layer=12, n_embd=768, n_head=12, block_size=256, batch=32, steps=40, warmup=10)
SMOKE = dict(n_layer=2, n_embd=32, n_head=2, block_size=16, batch=4, steps=3, warmup=2)
RUNS = ("loop_ddp", "keel_ddp", "loop_fsdp", "keel_fsdp")


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from recipes.charlm import CharGPT
    from trainer import Callback, Trainer
    from trainer.checkpoint.model_checkpoint import ModelCheckpoint

    cfg = SMOKE if args.smoke_on_cpu else FULL
    cuda = not args.smoke_on_cpu
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    total = cfg["warmup"] + cfg["steps"] + 3  # + the steps at which the keel runs save
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (total * cfg["batch"], cfg["block_size"] + 1), generator=g)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    loader = DataLoader(data, batch_size=cfg["batch"], pin_memory=cuda)

    class BenchGPT(CharGPT):
        """CharGPT with the loop's loss (mean cross-entropy) and optimizer (fused AdamW, constant lr)."""

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4, fused=cuda or None)

    def task() -> CharGPT:
        torch.manual_seed(0)
        return BenchGPT(
            block_size=cfg["block_size"],
            n_layer=cfg["n_layer"],
            n_head=cfg["n_head"],
            n_embd=cfg["n_embd"],
            total_steps=total,
            sample_chars=0,
        )

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    result: dict = {"run": args.case}
    kind, strategy = args.case.split("_")
    if kind == "loop":
        tdist.init_process_group("nccl" if cuda else "gloo")
        model = task().to(device)
        if strategy == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(device.type, (1,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
            wrapped = fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        optimizer = model.configure_optimizers()
        start = None
        for step, (x, y) in enumerate(loader):
            if step == cfg["warmup"]:
                sync()
                start = time.perf_counter()
            if step == cfg["warmup"] + cfg["steps"]:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = wrapped(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync()
        result["seconds"] = time.perf_counter() - start
        result["params"] = sum(p.numel() for p in model.parameters())
        tdist.destroy_process_group()
    else:

        class Clock(Callback):
            def __init__(self) -> None:
                self.start = self.seconds = None
                self.blocked: dict[str, float] = {}

            def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
                step = trainer.global_step
                if step == cfg["warmup"]:
                    sync()
                    self.start = time.perf_counter()
                elif step == cfg["warmup"] + cfg["steps"]:
                    sync()
                    self.seconds = time.perf_counter() - self.start
                elif step == cfg["warmup"] + cfg["steps"] + 1:
                    begin = time.perf_counter()
                    trainer.save_checkpoint(os.path.join(args.out, f"ck-{strategy}", "sync.ckpt"))
                    self.blocked["sync"] = time.perf_counter() - begin
                elif step == cfg["warmup"] + cfg["steps"] + 2:
                    begin = time.perf_counter()
                    trainer.checkpoint_callback.save(trainer)
                    self.blocked["async"] = time.perf_counter() - begin

        clock = Clock()
        checkpoint = ModelCheckpoint(
            dirpath=os.path.join(args.out, f"ck-{strategy}-async"), async_save=True, save_on_train_epoch_end=False
        )
        trainer = Trainer(
            accelerator="cuda" if cuda else "cpu",
            strategy=strategy,
            precision="bf16-mixed",
            max_steps=total,
            log_every_n_steps=50,
            callbacks=[clock, checkpoint],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=args.out,
        )
        model = task()
        trainer.fit(model, loader)
        result.update(
            seconds=clock.seconds, save_blocked_s=clock.blocked, params=sum(p.numel() for p in model.parameters())
        )
    result.update(tokens=cfg["batch"] * cfg["block_size"] * cfg["steps"], cfg=cfg)
    Path(args.out, f"{args.case}.json").write_text(json.dumps(result))


def copy_overlap(device_index: int = 0) -> dict:
    """Milliseconds for (a ~50 ms matmul chain, then a 256 MiB pinned batch copy) with the copy on the
    compute stream vs keel's BatchCopier side stream: overlap shows as the second close to the larger part."""
    import torch

    from trainer.data.transfer import BatchCopier, move_to_device

    device = torch.device("cuda", device_index)
    a = torch.randn(4096, 4096, device=device)
    batch = [torch.randn(64 * 2**20, pin_memory=True)]  # 256 MiB of float32

    def timed(copy) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        x = a
        for _ in range(40):  # queued; the host goes on to the copy at once
            x = x @ a / 64
        moved = copy(batch)
        (moved[0][:1] + x[0, :1]).sum()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    copier = BatchCopier(device, float_dtype=None, overlap=True)
    same_stream = lambda b: move_to_device(b, device)  # noqa: E731
    for fn in (same_stream, copier):
        timed(fn)  # warm-up
    serial = sorted(timed(same_stream) for _ in range(5))[2]
    overlapped = sorted(timed(copier) for _ in range(5))[2]
    x = a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(40):
        x = x @ a / 64
    torch.cuda.synchronize()
    compute = (time.perf_counter() - start) * 1e3
    return {"compute_ms": compute, "same_stream_ms": serial, "side_stream_ms": overlapped}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of this GPU (TFLOP/s)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run before it is killed")
    parser.add_argument("--smoke-on-cpu", action="store_true", help="tiny CPU/gloo run: checks the script only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    import torch

    if not args.smoke_on_cpu and not torch.cuda.is_available():
        raise SystemExit(
            f"benchmarks/gpu.py needs a CUDA GPU, and torch.cuda.is_available() is False here (torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none, a CPU-only build'}). Run it on a GPU "
            "machine with torch's CUDA build installed first (README 'Quickstart'); for the CPU overhead figures "
            "use benchmarks/overhead.py."
        )
    device_name = "cpu (smoke)" if args.smoke_on_cpu else torch.cuda.get_device_name(0)
    peak = args.peak_tflops
    if peak is None and not args.smoke_on_cpu:
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)
    out = tempfile.mkdtemp(prefix="keel-gpu-bench-")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    commands, envs, ports = {}, {}, set()
    for run in RUNS:
        while (port := _free_port()) in ports:  # the runs may start together: one rendezvous port each
            pass
        ports.add(port)
        worker = [__file__, "--worker", "--case", run, "--out", out]
        if args.smoke_on_cpu:  # the variables torchrun gives one worker, without its agent (the smoke times nothing)
            commands[run] = [sys.executable, *worker, "--smoke-on-cpu"]
            job = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}
            envs[run] = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **job)
            continue
        commands[run] = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--local-addr",
            "127.0.0.1",
            *worker,
        ]
        envs[run] = env
    # On the GPU one run at a time (they are timed); the CPU smoke checks only that each run works: all at once.
    batches = [list(RUNS)] if args.smoke_on_cpu else [[run] for run in RUNS]
    results = {}
    for batch in batches:
        procs = {
            run: subprocess.Popen(
                commands[run], env=envs[run], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for run in batch
        }
        for run, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                for other in procs.values():
                    other.kill()
                raise SystemExit(f"benchmarks/gpu.py: the {run} run took over {args.timeout} s; killed") from None
            if proc.returncode:
                sys.stderr.write(stdout[-4000:] + stderr[-4000:])
                for other in procs.values():
                    other.kill()
                raise SystemExit(f"benchmarks/gpu.py: the {run} run failed (exit {proc.returncode})")
            results[run] = json.loads(Path(out, f"{run}.json").read_text())
    cfg = results["loop_ddp"]["cfg"]
    params = results["loop_ddp"]["params"]
    flops_per_token = 6 * params + 12 * cfg["n_layer"] * cfg["block_size"] * cfg["n_embd"]
    row: dict = {
        "benchmark": "keel-gpu",
        "device": device_name,
        "torch": torch.__version__,
        "params": params,
        "tokens_per_step": cfg["batch"] * cfg["block_size"],
        "steps": cfg["steps"],
        "peak_bf16_tflops": peak,
    }
    for run, r in results.items():
        tps = r["tokens"] / r["seconds"]
        row[run] = {"tokens_per_s": tps, "mfu": tps * flops_per_token / (peak * 1e12) if peak else None}
        if "save_blocked_s" in r:
            row[run]["save_blocked_s"] = r["save_blocked_s"]
    if not args.smoke_on_cpu:
        row["batch_copy_overlap"] = copy_overlap()
    for strategy in ("ddp", "fsdp"):
        row[f"keel_over_loop_{strategy}"] = (
            row[f"keel_{strategy}"]["tokens_per_s"] / row[f"loop_{strategy}"]["tokens_per_s"]
        )
    print(json.dumps(row))


if __name__ == "__main__":
    main()
