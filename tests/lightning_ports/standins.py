"""Generated stand-ins for what the ported examples download or import from torchvision.

Same call signatures and shapes as the originals (MNIST images 1x28x28 with 10 classes, WikiText2 token
pairs, ImageFolder images 3xHxW), small sizes, deterministic.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset


class MNIST(Dataset):
    """``torchvision.datasets.MNIST(root, train=True, download=False, transform=None)``: random images."""

    def __init__(self, root: str = "", train: bool = True, download: bool = False, transform: Callable | None = None,
                 size: int | None = None) -> None:
        n = size if size is not None else (96 if train else 32)
        g = torch.Generator().manual_seed(0 if train else 1)
        self.images = torch.rand(n, 1, 28, 28, generator=g)
        self.targets = torch.randint(0, 10, (n,), generator=g)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.images[i]
        return (self.transform(x) if self.transform is not None else x), int(self.targets[i])


class WikiText2(Dataset):
    """``lightning.pytorch.demos.WikiText2``: (input, target) token blocks, target shifted by one."""

    def __init__(self, block_size: int = 16, vocab_size: int = 64, blocks: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab_size, (blocks * block_size + 1,), generator=g)
        self.block_size = block_size
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        return self.data[start:start + self.block_size], self.data[start + 1:start + 1 + self.block_size]


class _Identity:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, x: Any) -> Any:
        return x


class transforms:  # noqa: N801 - torchvision's module name
    """``torchvision.transforms``: the template's transforms as identities (images are already tensors)."""

    Compose = _Identity
    RandomResizedCrop = _Identity
    RandomHorizontalFlip = _Identity
    Resize = _Identity
    CenterCrop = _Identity
    ToTensor = _Identity
    Normalize = _Identity


class _ImageFolder(Dataset):
    def __init__(self, root: str, transform: Callable | None = None, num_classes: int = 1000, size: int = 48) -> None:
        g = torch.Generator().manual_seed(len(root))
        self.images = torch.rand(size, 3, 16, 16, generator=g)
        self.targets = torch.randint(0, num_classes, (size,), generator=g)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[i]), int(self.targets[i])


class datasets:  # noqa: N801
    ImageFolder = _ImageFolder


def get_torchvision_model(arch: str, weights: Any = None) -> nn.Module:
    """``torchvision.models.get_model``: a small CNN with 1000 outputs instead of ``arch``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 1000))


def make_grid(images: torch.Tensor) -> torch.Tensor:
    """``torchvision.utils.make_grid``: images side by side, 3 channels (what add_image expects)."""
    images = images.detach()
    if images.dim() == 3:
        images = images.unsqueeze(1)
    row = torch.cat(list(images), dim=-1)  # C x H x (W * N)
    return row.expand(3, -1, -1) if row.shape[0] == 1 else row


__all__ = ["MNIST", "WikiText2", "datasets", "get_torchvision_model", "make_grid", "math", "transforms"]
