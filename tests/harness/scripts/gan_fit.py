"""Fit tests/harness/gan.py's GAN under any launcher; OUT/rank{R}.pt holds the weights and the step count."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from gan import GAN, gan_data
from models import quiet
from torch.utils.data import DataLoader

from trainer import Trainer

out, batch = Path(sys.argv[1]), int(sys.argv[2])
task = GAN()
trainer = Trainer(**quiet(max_epochs=2, precision="64", log_every_n_steps=2))
trainer.fit(task, DataLoader(gan_data(), batch_size=batch))
out.mkdir(parents=True, exist_ok=True)
torch.save(
    {"weights": task.state_dict(), "step": trainer.global_step, "d_loss": trainer.callback_metrics["d_loss"]},
    out / f"rank{trainer.global_rank}.pt",
)
