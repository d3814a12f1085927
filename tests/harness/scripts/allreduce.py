"""all_reduce(rank + 1) over gloo; prints one line per rank.

Launched by torchrun (env:// init).  Output: "rank R sum S group G world W".
"""

import os
import sys

import torch
import torch.distributed as dist


def say(msg: str) -> None:
    sys.stdout.write(msg + "\n")  # one write(): lines of different ranks do not interleave
    sys.stdout.flush()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(t)
    say(f"rank {rank} sum {int(t.item())} group {os.environ.get('GROUP_RANK', '?')} world {world}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
