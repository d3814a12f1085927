"""Token-weighted loss with variable-length, padded sequences; dumps the first step's gradients and the
final weights. Usage: token_accum.py OUT --batch B --accumulate K [--steps S] (any launcher)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from models import quiet
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer import Callback, TaskModule, Trainer

VOCAB, LENGTH, PAD = 11, 12, -100


def sequences(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)  # 2..12 real tokens, the rest is padding
    targets = tokens.roll(-1, dims=1)
    targets[torch.arange(LENGTH)[None, :] >= lengths[:, None] - 1] = PAD
    return TensorDataset(tokens, targets)


class TinyLM(TaskModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens)))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self(tokens)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD, reduction="sum")
        return {"loss": loss_sum, "num_items": (targets != PAD).sum()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class FirstGrads(Callback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer, task, optimizer) -> None:
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in task.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--accumulate", type=int, required=True)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    grads = FirstGrads()
    task = TinyLM()
    trainer = Trainer(
        **quiet(
            max_steps=args.steps,
            precision="64",
            accumulate_grad_batches=args.accumulate,
            log_every_n_steps=1,
            callbacks=[grads],
        )
    )
    trainer.fit(task, DataLoader(sequences(), batch_size=args.batch))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "grads": grads.grads,
            "weights": task.state_dict(),
            "loss": trainer.progress_bar_metrics["loss"],
            "steps": trainer.global_step,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
