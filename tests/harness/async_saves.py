"""What the async checkpoint tests read from a save folder (tests/unit/test_async_checkpoint_saves.py and
tests/integration/test_async_checkpoint.py): the files of a one-process save, its weights and loop state, and the
hidden (temporary) entries of a checkpoint folder."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainer.checkpoint.reader import load_weights

SAVE_FILES = [".metadata", "__0_0.distcp", "keel.json", "keel.pt"]  # one process, lightning_file=False


def weights_of(save: Path) -> dict[str, torch.Tensor]:
    return load_weights(save)["state_dict"]


def loop_of(save: Path) -> dict:
    return torch.load(save / "keel.pt", weights_only=True)["loop"]


def hidden(folder: Path) -> list[str]:
    return [name for name in os.listdir(folder) if name.startswith(".")]
