"""``python -m trainer.memory``: the memory plan of a task and datamodule named on the command line (docs/memory.md)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from trainer.doctor import parse_size
from trainer.memory.plan import format_plan, plan_memory


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"trainer.memory: {spec!r} is not module:Name (e.g. recipes.charlm:CharGPT)")
    return getattr(importlib.import_module(module), name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.memory",
        description="A memory plan for a task: the bytes a rank holds at the peak of a training step under DDP, "
        "FSDP, FSDP with activation checkpointing, FSDP with tensor parallelism and FSDP with CPU offload, at "
        "several world sizes, from fake tensors (nothing is allocated). The batch is the first of the datamodule's "
        "training loader.",
    )
    parser.add_argument("--task", required=True, help="module:Class of the TaskModule (e.g. recipes.charlm:CharGPT)")
    parser.add_argument("--task-args", default="{}", help="JSON keyword arguments of the task")
    parser.add_argument("--data", required=True, help="module:Class of the DataModule (its first training batch)")
    parser.add_argument("--data-args", default="{}", help="JSON keyword arguments of the datamodule")
    parser.add_argument("--device-memory", required=True, type=parse_size, help="per device, e.g. 80GiB")
    parser.add_argument("--world-sizes", default="1,2,4,8", help="comma-separated (default: 1,2,4,8)")
    parser.add_argument("--precision", default="32")
    parser.add_argument(
        "--node-size", type=int, default=None, help="devices per node: plans hybrid sharding (HSDP) across nodes too"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="the device type to plan for; 'cuda' needs torch built with CUDA",
    )
    parser.add_argument(
        "--tensor-parallel-sizes",
        default="",
        help="comma-separated tensor-parallel sizes to plan too (e.g. 2,4); the task's configure_model must apply "
        "its plan on self.device_mesh['tensor_parallel']",
    )
    args = parser.parse_args(argv)
    task_cls, data_cls = _load(args.task), _load(args.data)
    task_kwargs, data_kwargs = json.loads(args.task_args), json.loads(args.data_args)
    data = data_cls(**data_kwargs)
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    estimates, chosen = plan_memory(
        lambda: task_cls(**task_kwargs),
        batch,
        device_memory=args.device_memory,
        world_sizes=[int(w) for w in args.world_sizes.split(",")],
        precision=args.precision,
        tensor_parallel_sizes=[int(t) for t in args.tensor_parallel_sizes.split(",") if t],
        node_size=args.node_size,
        device=args.device,
    )
    sys.stdout.write(format_plan(estimates, chosen, args.device_memory) + "\n")
    return 0 if chosen is not None else 1


if __name__ == "__main__":
    sys.exit(main())
