"""Porting a LightningModule: the checkpoint files a Lightning program reads (L.ModelCheckpoint's paths,
``ckpt_path=best_model_path``) under DDP on 2 ranks. Trainer keywords, the docs' LitAutoEncoder, ReduceLROnPlateau,
hparams and the files on one device, in one process: tests/unit/test_lightning_porting.py."""

from __future__ import annotations

from pathlib import Path

import torch
from launch import spawn_ranks
from lightning_ckpt_files import PORT_DDP, assert_same, check_lightning_checkpoint


# ---------------------------------------------------------------------------- Lightning's checkpoint files
def test_lightning_model_checkpoint_paths_load_with_torch_load_under_ddp(tmp_path: Path) -> None:
    spawn_ranks(PORT_DDP, str(tmp_path), "checkpoint", nproc=2, timeout=300).check()
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["strategy"] == "DDPStrategy"
    assert ranks[0]["best_model_path"] == ranks[1]["best_model_path"]  # every rank reports the same save
    assert_same(ranks[0]["final"], ranks[1]["final"])
    check_lightning_checkpoint(ranks[0], world_size=2)
