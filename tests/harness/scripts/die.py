"""Rank 1 dies (exit code 3) before a collective that rank 0 has entered."""

import datetime
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    if rank == 1:
        sys.stdout.write("rank 1 dying\n")
        sys.stdout.flush()
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)  # never completes normally: rank 1 is gone
    sys.stdout.write(f"rank {rank} UNEXPECTED all_reduce result {t.item()}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
