"""Fails (exit 1) on the first attempt; on a torchelastic restart, all_reduces and succeeds."""

import os
import sys

attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
rank = os.environ.get("RANK", "?")
if attempt == "0":
    sys.stdout.write(f"rank {rank} attempt 0 failing on purpose\n")
    sys.stdout.flush()
    sys.exit(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1], dtype=torch.int64)
dist.all_reduce(t)
sys.stdout.write(f"rank {dist.get_rank()} attempt {attempt} sum {int(t.item())}\n")
sys.stdout.flush()
dist.destroy_process_group()
