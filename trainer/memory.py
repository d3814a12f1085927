"""Will it fit, and with what settings? A memory plan before the first step, from fake tensors.

``estimate_memory(CharGPT, batch, strategy="fsdp", world_size=8, precision="bf16-mixed")`` builds the task with the
strategy applied and runs two training steps on fake tensors in a fake process group of that many ranks
(:mod:`trainer.distributed.memory`): nothing is allocated, on any device. It returns the bytes one rank holds at
the peak of a step: parameters, gradients, optimizer state, activations and the rest (temporaries, FSDP's
gathered parameters and communication buffers, DDP's gradient buckets), and what sits in CPU memory under CPU
offload. :func:`plan_memory` estimates DDP, FSDP, FSDP with activation checkpointing and FSDP with CPU offload at
several world sizes and names the cheapest setting that fits a device. ``python -m trainer.memory`` prints the
plan for a task and datamodule named on the command line (see docs/memory.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from trainer.distributed import memory as fake_memory
from trainer.distributed.fsdp import FSDPStrategy
from trainer.distributed.launcher import DistEnv
from trainer.distributed.selection import build_strategy
from trainer.distributed.strategy import DDPStrategy, SingleDeviceStrategy, Strategy
from trainer.doctor import parse_size
from trainer.module import TaskModule
from trainer.step.optim import parse_optimizers
from trainer.step.precision import Precision
from trainer.trainer import Trainer


def format_size(nbytes: int) -> str:
    """``1.5 GiB``, ``148.3 MiB``, ``12.0 KiB``, ``0 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the peak of a training step. ``device`` is what must fit in the accelerator's
    memory; ``host`` what CPU offload keeps in CPU memory instead."""

    setting: str
    world_size: int
    params: int
    grads: int
    optimizer: int
    activations: int
    other: int
    device: int
    host: int

    def fits(self, device_memory: int) -> bool:
        return self.device <= device_memory

    def summary(self) -> str:
        """One line: ``FSDP x8: 31.2 GiB a rank (params 2.1 GiB, grads ..., activations ...)``."""
        parts = ", ".join(
            f"{name} {format_size(getattr(self, name))}"
            for name in ("params", "grads", "optimizer", "activations", "other")
        )
        host = f"; {format_size(self.host)} in CPU memory" if self.host else ""
        return f"{self.setting} x{self.world_size}: {format_size(self.device)} a rank ({parts}){host}"


def estimate_memory(
    task: Callable[[], TaskModule],
    batch: Any,
    *,
    strategy: Any = "auto",
    world_size: int = 1,
    precision: str = "32",
    device: str = "cpu",
) -> MemoryEstimate:
    """The memory one rank needs for a training step of ``task`` on ``batch`` (one micro-batch of one rank).

    Args:
        task: Builds the task (a TaskModule class or a function): it is called on fake tensors, so a model of any
            size costs nothing to build here.
        batch: One micro-batch as the training loader yields it (real tensors; only their shapes and dtypes are
            used).
        strategy: As the Trainer's ``strategy`` option: ``"ddp"``, ``"fsdp"``, or an object with its settings
            (``FSDPStrategy(activation_checkpointing=["Block"], cpu_offload=True)``).
        world_size: Ranks of the run.
        precision: As the Trainer's ``precision`` option.
        device: The device type to estimate for. Fake tensors cost nothing on any device, but kernels differ (on
            CUDA, attention keeps far less than the CPU's math kernel): ``"cuda"`` needs a machine with CUDA.

    Raises:
        RuntimeError: a process group exists already in this process.
    """
    chosen = build_strategy(strategy)
    if getattr(chosen, "tensor_parallel_size", 1) > 1:
        raise NotImplementedError(
            "estimate_memory does not estimate tensor parallelism yet (torch's FSDP cannot combine a 2-D mesh with "
            "fake tensors). An upper bound: FSDPStrategy() at world_size // tensor_parallel_size ranks (as if no "
            "layer were split)."
        )
    if isinstance(chosen, DDPStrategy) and world_size == 1:
        chosen = SingleDeviceStrategy(activation_checkpointing=chosen.activation_checkpointing)
    host = Trainer(  # what the task's hooks may read (self.trainer.max_steps, self.log): never fitted
        precision=precision, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    where = torch.device(device)
    plugin = Precision(precision, where) if precision != "16-mixed" or where.type == "cuda" else None
    env = DistEnv("torchrun", 0, 0, world_size, world_size, 0, "127.0.0.1", 0)
    sharded = isinstance(chosen, FSDPStrategy)

    chosen.connect(env, where, host.options)
    # DDP's reducer cannot run on fake tensors: its rank holds the single-device step plus its gradient buckets.
    applied = SingleDeviceStrategy(activation_checkpointing=chosen.activation_checkpointing) if not sharded else chosen
    applied.connect(env, where, host.options)

    build = partial(_build, task, batch, applied, host, plugin, where)
    prepare = None
    if isinstance(chosen, FSDPStrategy):
        chosen.mesh_2d = False  # torch's FSDP cannot shard over a slice of a 2-D mesh under fake tensors
        prepare = chosen.setup_mesh
    try:
        held = fake_memory.measure_step(build, world_size=world_size, sharded=sharded, prepare=prepare, device=where)
    finally:
        applied.teardown()
        if isinstance(chosen, FSDPStrategy):  # the strategy object may go to a Trainer next: no fake mesh in it
            chosen.device_mesh = None
            del chosen.mesh_2d
    return _estimate(chosen, world_size, held)


def _build(
    task: Callable[[], TaskModule],
    batch: Any,
    strategy: Strategy,
    host: Trainer,
    plugin: Precision | None,
    where: torch.device,
    mode: Any,
) -> tuple[nn.Module, list[torch.optim.Optimizer], Callable[[], None]]:
    """Inside the fake tensor mode: the task with the strategy applied, its optimizers, and one training step."""
    with where:
        module = task()
    module._trainer = host
    if plugin is not None:
        plugin.convert_module(module)
    module.configure_model()  # the layers it builds (self.device_mesh is None here: no plan)
    run = strategy.setup(module, manual=False)
    optimizers, _ = parse_optimizers(module.configure_optimizers())
    fake = tree_map(lambda t: mode.from_tensor(t).to(where) if isinstance(t, torch.Tensor) else t, batch)
    if plugin is not None and plugin.param_dtype is not None:
        fake = tree_map(lambda t: t.to(plugin.param_dtype) if _is_float(t) else t, fake)

    def step() -> None:
        if plugin is not None and plugin.autocasts:
            with plugin.autocast():
                out = run(fake, 0)
        else:
            out = run(fake, 0)
        (out["loss"] if isinstance(out, dict) else out).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return module, optimizers, step


def _estimate(chosen: Strategy, world_size: int, held: dict[str, int]) -> MemoryEstimate:
    offload = isinstance(chosen, FSDPStrategy) and chosen.cpu_offload
    other = (
        held["other"] + held["peak"] - sum(held[k] for k in ("params", "grads", "optimizer", "activations", "other"))
    )
    if isinstance(chosen, DDPStrategy) and not chosen.gradient_as_bucket_view:
        other += held["params"]  # DDP's gradient buckets, made at construction: a gradient's size per parameter
    offloaded = held["params"] + held["grads"] + held["optimizer"] if offload else 0
    if offload:  # the sharded state lives in CPU memory; the gathered units on the device
        setting_device = held["activations"] + other
    else:
        setting_device = held["params"] + held["grads"] + held["optimizer"] + held["activations"] + other
    return MemoryEstimate(
        setting=_describe(chosen),
        world_size=world_size,
        params=held["params"],
        grads=held["grads"],
        optimizer=held["optimizer"],
        activations=held["activations"],
        other=other,
        device=setting_device,
        host=offloaded,
    )


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _describe(strategy: Strategy) -> str:
    name = {"single": "single device", "ddp": "DDP", "fsdp": "FSDP"}.get(strategy.name, strategy.name)
    extras = []
    if strategy.activation_checkpointing:
        extras.append("activation checkpointing")
    if getattr(strategy, "cpu_offload", False):
        extras.append("CPU offload")
    return name + (f" + {' + '.join(extras)}" if extras else "")


def default_recompute_classes(task: nn.Module) -> list[str]:
    """The classes of the modules held in an ``nn.ModuleList`` (the usual blocks): what the plan recomputes."""
    return sorted({type(m).__name__ for holder in task.modules() if isinstance(holder, nn.ModuleList) for m in holder})


def plan_memory(
    task: Callable[[], TaskModule],
    batch: Any,
    *,
    device_memory: int,
    world_sizes: Sequence[int] = (1, 2, 4, 8),
    precision: str = "32",
    recompute: list[str | type[nn.Module]] | None = None,
) -> tuple[list[MemoryEstimate], MemoryEstimate | None]:
    """Estimates of DDP, FSDP, FSDP with activation checkpointing (of ``recompute``, default: the modules held in
    an ``nn.ModuleList``) and FSDP with CPU offload at each world size, cheapest first: fewer ranks first, then
    DDP, FSDP, recompute (a slower step), offload (slower still). Returns ``(all estimates, the first that fits
    device_memory or None)``."""
    if recompute is None:
        with torch.device("meta"):
            recompute = list(default_recompute_classes(task()))
    settings: list[Callable[[], Any]] = [
        lambda: "ddp",
        lambda: FSDPStrategy(),
        lambda: FSDPStrategy(activation_checkpointing=recompute or None),
        lambda: FSDPStrategy(activation_checkpointing=recompute or None, cpu_offload=True),
    ]
    estimates: list[MemoryEstimate] = []
    chosen = None
    for world in world_sizes:
        for make in settings:
            if make is settings[2] and not recompute:
                continue
            estimate = estimate_memory(task, batch, strategy=make(), world_size=world, precision=precision)
            estimates.append(estimate)
            if chosen is None and estimate.fits(device_memory):
                chosen = estimate
    return estimates, chosen


def format_plan(estimates: Sequence[MemoryEstimate], chosen: MemoryEstimate | None, device_memory: int) -> str:
    head = ("setting", "ranks", "params", "grads", "optimizer", "activations", "other", "device", "CPU", "fits")
    rows = [
        (
            e.setting,
            str(e.world_size),
            *(format_size(getattr(e, k)) for k in ("params", "grads", "optimizer", "activations", "other", "device")),
            format_size(e.host) if e.host else "-",
            "yes" if e.fits(device_memory) else "no",
        )
        for e in estimates
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [
        " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [head, *rows]
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    if chosen is None:
        lines.append(
            f"Nothing here fits {format_size(device_memory)} a device: try more ranks (--world-sizes), a smaller "
            "micro-batch, or bf16-mixed."
        )
    else:
        lines.append(f"Cheapest that fits {format_size(device_memory)}: {chosen.summary()}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- python -m trainer.memory


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"trainer.memory: {spec!r} is not module:Name (e.g. recipes.charlm:CharGPT)")
    return getattr(importlib.import_module(module), name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.memory",
        description="A memory plan for a task: the bytes a rank holds at the peak of a training step under DDP, "
        "FSDP, FSDP with activation checkpointing and FSDP with CPU offload, at several world sizes, from fake "
        "tensors (nothing is allocated). The batch is the first of the datamodule's training loader.",
    )
    parser.add_argument("--task", required=True, help="module:Class of the TaskModule (e.g. recipes.charlm:CharGPT)")
    parser.add_argument("--task-args", default="{}", help="JSON keyword arguments of the task")
    parser.add_argument("--data", required=True, help="module:Class of the DataModule (its first training batch)")
    parser.add_argument("--data-args", default="{}", help="JSON keyword arguments of the datamodule")
    parser.add_argument("--device-memory", required=True, type=parse_size, help="per device, e.g. 80GiB")
    parser.add_argument("--world-sizes", default="1,2,4,8", help="comma-separated (default: 1,2,4,8)")
    parser.add_argument("--precision", default="32")
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
    )
    sys.stdout.write(format_plan(estimates, chosen, args.device_memory) + "\n")
    return 0 if chosen is not None else 1


if __name__ == "__main__":
    sys.exit(main())
