"""A fit on streaming data that checkpoints every step and always starts with ckpt_path="last", under any launcher.

--loader picks the stream:
  iterable   a plain DataLoader over a stateful IterableDataset (keel wraps it into a StatefulDataLoader)
  torchdata  the user's own torchdata StatefulDataLoader over the same dataset
  plain      a plain DataLoader over the same dataset without state_dict (keel cannot resume it exactly)
  hf         a Hugging Face streaming dataset over local JSON-lines shards (keel splits it by rank)
  litdata    a LitData StreamingDataLoader over shards written by litdata.optimize
Faults (first attempt only, TORCHELASTIC_RESTART_COUNT == 0 and no --resumed):
  --kill-at S   SIGKILL rank --kill-rank at step S (before that step's checkpoint)
  --crash-at S  raise at step S (after its checkpoint)
Every trained batch is appended to OUT/trained_rank{R}.jsonl as {"attempt", "epoch", "batch_idx", "ids"}, so a test
can rebuild the effective sample sequence (the last attempt's record of each batch); OUT/rank{R}.pt holds the final
weights when the fit completes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer import Callback, TaskModule, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint

N, FEATURES = 96, 6


def table(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    return x, (x.sum(1) > 0).long()


class Numbers(IterableDataset):
    """Samples 0..n-1, shuffled per epoch, sharded by rank (RANK / WORLD_SIZE) and DataLoader worker; its
    position is the next index of this worker's share (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, n: int = N, seed: int = 0, short_rank1: int = 0) -> None:
        self.n, self.seed, self.epoch, self.next, self.short_rank1 = n, seed, 0, 0, short_rank1
        self.resume_at = 0
        self.x, self.y = table(n)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _share(self) -> list[int]:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        share = order.tolist()[rank * workers + worker :: world * workers]
        return share[: len(share) - self.short_rank1] if rank == 1 else share  # --short-rank1: uneven ranks

    def __iter__(self):
        # torchdata's convention: iter() starts the epoch from its beginning unless a state was loaded.
        share, start, self.resume_at = self._share(), self.resume_at, 0
        for k in range(start, len(share)):
            self.next = k + 1
            i = share[k]
            yield self.x[i], self.y[i], i

    def state_dict(self) -> dict:
        return {"next": self.next, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at, self.epoch = state["next"], state["epoch"]


class Unstateful(Numbers):
    state_dict = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]


def hf_shards(folder: Path, shards: int = 4) -> list[str]:
    x, y = table()
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for s in range(shards):
        path = folder / f"part-{s}.jsonl"
        with open(path, "w") as f:
            for i in range(s, N, shards):
                f.write(json.dumps({"x": x[i].tolist(), "y": int(y[i]), "id": i}) + "\n")
        files.append(str(path))
    return files


def litdata_sample(i: int) -> dict:
    x, y = table()
    return {"x": x[i].numpy(), "y": int(y[i]), "id": i}


def prepare(kind: str, work: Path) -> None:
    if kind in ("hf", "hf-split"):
        hf_shards(work / "hf")
    elif kind == "litdata":
        import litdata

        litdata.optimize(
            fn=litdata_sample, inputs=list(range(N)), output_dir=str(work / "litdata"), chunk_size=8, num_workers=1
        )


def hf_collate(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([r["x"] for r in rows]),
        torch.tensor([r["y"] for r in rows]),
        torch.tensor([r["id"] for r in rows]),
    )


def build_loader(kind: str, workers: int, batch: int, work: Path, shuffle_buffer: int = 0, short_rank1: int = 0):
    if kind in ("iterable", "plain"):
        dataset = Numbers(short_rank1=short_rank1) if kind == "iterable" else Unstateful()
        return DataLoader(dataset, batch_size=batch, num_workers=workers)
    if kind == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(Numbers(), batch_size=batch, num_workers=workers)
    if kind in ("hf", "hf-split"):
        from datasets import load_dataset

        files = sorted(str(p) for p in (work / "hf").glob("part-*.jsonl"))
        stream = load_dataset("json", data_files=files, split="train", streaming=True)
        if shuffle_buffer:
            stream = stream.shuffle(seed=0, buffer_size=shuffle_buffer)
        if kind == "hf-split":  # the user split it already
            from datasets.distributed import split_dataset_by_node

            rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
            stream = split_dataset_by_node(stream, rank=rank, world_size=world)
        return DataLoader(stream, batch_size=batch, num_workers=workers, collate_fn=hf_collate)
    if kind == "litdata":
        import litdata

        return litdata.StreamingDataLoader(
            # drop_last explicit: LitData's default (None) turns it on at more than one rank, and a save made with
            # it on does not load at one rank.
            litdata.StreamingDataset(str(work / "litdata"), shuffle=True, seed=0, drop_last=True),
            batch_size=batch,
            num_workers=workers,
        )
    raise SystemExit(f"unknown --loader {kind}")


class Classifier(TaskModule):
    def __init__(self, record: Path) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))
        self.record = record
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, ids = (batch["x"], batch["y"], batch["id"]) if isinstance(batch, dict) else batch  # LitData: dicts
        with open(self.record, "a") as f:
            row = {"attempt": self.attempt, "epoch": self.current_epoch, "batch_idx": batch_idx, "ids": ids.tolist()}
            f.write(json.dumps(row) + "\n")
        loss = F.cross_entropy(self(x.float()), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Faults(Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not args.resumed

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if not (trainer.optimizer_stepped and self.first):
            return
        if trainer.global_step == self.args.kill_at and trainer.global_rank == self.args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.global_step == self.args.crash_at:
            raise RuntimeError(f"simulated crash at step {trainer.global_step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--loader", default="iterable")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--resumed", action="store_true")
    parser.add_argument("--stream-reshard", default="error")
    parser.add_argument("--short-rank1", type=int, default=0, help="iterable: rank 1 gets N samples fewer")
    parser.add_argument("--uneven", default="truncate", help="Trainer(uneven_batches=...)")
    parser.add_argument("--global-batch-size", type=int, default=None, help="Trainer(global_batch_size=...)")
    parser.add_argument("--shuffle-buffer", type=int, default=0, help="hf: shuffle(seed=0, buffer_size=N)")
    parser.add_argument("--prepare", action="store_true", help="write the hf / litdata shards into --data and exit")
    parser.add_argument("--data", default=None, help="where the hf / litdata shards are (default: beside OUT)")
    args = parser.parse_args()
    out = Path(args.out)
    data = Path(args.data) if args.data else out.parent
    if args.prepare:
        prepare(args.loader, data)
        return
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    trainer = Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy="ddp" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        log_every_n_steps=3,
        stream_reshard=args.stream_reshard,
        uneven_batches=args.uneven,
        global_batch_size=args.global_batch_size,
        callbacks=[ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=1, save_top_k=1), Faults(args)],
    )
    task = Classifier(out / f"trained_rank{rank}.jsonl")
    trainer.fit(
        task,
        build_loader(args.loader, args.workers, args.batch, data, args.shuffle_buffer, args.short_rank1),
        ckpt_path="last",
    )
    torch.save({"step": trainer.global_step, "weights": task.state_dict()}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
