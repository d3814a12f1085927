"""Token batches of the char GPT that the memory plan's tests estimate (tests/unit/test_memory_plan.py and
tests/integration/test_memory.py)."""

from __future__ import annotations

import torch


def tokens(batch: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 128, (batch, block), generator=torch.Generator().manual_seed(0))
    return x, x
