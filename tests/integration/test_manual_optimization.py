"""Manual optimization (automatic_optimization = False) with two optimizers: equals a hand-written loop in
one process, and 2-rank DDP equals one process with the global batch."""

from __future__ import annotations

from pathlib import Path

import torch
from gan import GAN, gan_data, hand_written_gan
from launch import REPO_ROOT, python, spawn_ranks
from models import quiet
from torch.utils.data import DataLoader

from trainer import Trainer

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "gan_fit.py"


def test_gan_under_manual_optimization_equals_hand_written_loop() -> None:
    expected = hand_written_gan(batch_size=16, epochs=2)
    task = GAN()
    trainer = Trainer(**quiet(max_epochs=2, precision="64"))
    trainer.fit(task, DataLoader(gan_data(), batch_size=16))
    assert trainer.global_step == 8  # one step per training iteration, not per optimizer call
    got = task.state_dict()
    for name, value in expected.items():
        assert torch.allclose(got[name], value, atol=1e-12, rtol=0), name
    assert trainer.lr_scheduler_configs == [] and task.lr_schedulers() is None


def test_manual_optimizers_and_toggle() -> None:
    task = GAN()
    Trainer(**quiet(max_steps=1, precision="64")).fit(task, DataLoader(gan_data(), batch_size=16))
    opt_g, opt_d = task.optimizers()
    assert opt_g.optimizer is task.trainer.optimizers[0]
    task.toggle_optimizer(opt_d)
    assert not any(p.requires_grad for p in task.gen.parameters()) and all(
        p.requires_grad for p in task.disc.parameters()
    )
    task.untoggle_optimizer(opt_d)
    assert all(p.requires_grad for p in task.parameters())


def test_gan_two_ranks_equal_one_process_with_global_batch(tmp_path: Path) -> None:
    python(SCRIPT, str(tmp_path / "one"), "16", timeout=120).check()
    spawn_ranks(SCRIPT, str(tmp_path / "two"), "8", nproc=2, timeout=180).check()
    one = torch.load(tmp_path / "one" / "rank0.pt", weights_only=False)
    ranks = [torch.load(tmp_path / "two" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for rank in ranks:
        assert rank["step"] == one["step"] == 8
        for name, value in one["weights"].items():
            assert torch.allclose(rank["weights"][name], value, atol=1e-10, rtol=0), name
    for name in ranks[0]["weights"]:
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
