"""Will it fit, and with what settings? A memory plan before the first step, from fake tensors.

``estimate_memory(CharGPT, batch, strategy="fsdp", world_size=8, precision="bf16-mixed")`` builds the task with the
strategy applied and runs two training steps on fake tensors in a fake process group of that many ranks
(:mod:`trainer.memory.estimate`, :mod:`trainer.memory.fake`): nothing is allocated, on any device. It returns the
bytes one rank holds at the peak of a step: parameters, gradients, optimizer state, activations and the rest
(temporaries, FSDP's gathered parameters and communication buffers, DDP's gradient buckets), and what sits in CPU
memory under CPU offload. :func:`plan_memory` estimates DDP, FSDP, FSDP with activation checkpointing, FSDP with
tensor parallelism (``FSDPStrategy(tensor_parallel_size=T)``: the task's ``configure_model`` applies its plan on the
run's 2-D mesh) and FSDP with CPU offload at several world sizes and names the cheapest setting that fits a device.
``python -m trainer.memory`` prints the plan for a task and datamodule named on the command line (see
docs/memory.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.distributed.fsdp import FSDPStrategy
from trainer.memory.estimate import MemoryEstimate, estimate_step, format_size
from trainer.trainer import Trainer

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule

__all__ = ["MemoryEstimate", "estimate_memory", "format_plan", "format_size", "plan_memory"]


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
        task: Builds the task (a TaskModule class or a function): it is called on the meta device, so a model of
            any size costs nothing to build here.
        batch: One micro-batch as the training loader yields it (real tensors; only their shapes and dtypes are
            used).
        strategy: As the Trainer's ``strategy`` option: ``"ddp"``, ``"fsdp"``, or an object with its settings
            (``FSDPStrategy(activation_checkpointing=["Block"], cpu_offload=True)``,
            ``FSDPStrategy(tensor_parallel_size=2)``: the task's ``configure_model`` applies its plan on
            ``self.device_mesh`` as in a run).
        world_size: Ranks of the run.
        precision: As the Trainer's ``precision`` option.
        device: The device type to estimate for. Fake tensors cost nothing on any device, but kernels differ (on
            CUDA, attention keeps far less than the CPU's math kernel): ``"cuda"`` needs a machine with CUDA.

    Raises:
        RuntimeError: this process belongs to a process group of another world size, or the step reads a
            tensor's value on the host (fake tensors have none).
    """
    return estimate_step(
        task,
        batch,
        trainer_class=Trainer,
        strategy=strategy,
        world_size=world_size,
        precision=precision,
        device=device,
    )


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
    tensor_parallel_sizes: Sequence[int] = (),
    node_size: int | None = None,
    device: str = "cpu",
) -> tuple[list[MemoryEstimate], MemoryEstimate | None]:
    """Estimates of DDP, FSDP, FSDP with activation checkpointing (of ``recompute``, default: the modules held in
    an ``nn.ModuleList``), FSDP with tensor parallelism at each of ``tensor_parallel_sizes`` that divides the world
    size (without and with recompute; the task's ``configure_model`` applies its plan on ``self.device_mesh``), and
    FSDP with CPU offload, at each world size, cheapest first: fewer ranks first, then DDP, FSDP, recompute (a
    slower step), tensor parallelism (a collective in every split layer), offload (slowest: the state crosses PCIe
    every step). With ``node_size`` (devices per node), a world of several nodes also gets hybrid sharding
    (``FSDPStrategy(replicate_size=world // node_size)``: sharded within a node, its all-gathers never cross nodes),
    ahead of FSDP over every rank, with and without recompute. A setting fits when the largest phase of its run
    (initialisation, step, evaluation, save, load) fits. Returns ``(all estimates, the first that fits
    device_memory or None)``."""
    if recompute is None:
        with torch.device("meta"):
            recompute = list(default_recompute_classes(task()))
    checkpointed = recompute or None
    estimates: list[MemoryEstimate] = []
    chosen = None
    for world in world_sizes:
        settings: list[Any] = ["ddp"]
        if node_size and world > node_size and world % node_size == 0:
            nodes = world // node_size
            settings.append(FSDPStrategy(replicate_size=nodes))
            settings += (
                [FSDPStrategy(replicate_size=nodes, activation_checkpointing=checkpointed)] if checkpointed else []
            )
        settings.append(FSDPStrategy())
        settings += [FSDPStrategy(activation_checkpointing=checkpointed)] if checkpointed else []
        for tp in (t for t in tensor_parallel_sizes if t > 1 and world % t == 0):
            settings.append(FSDPStrategy(tensor_parallel_size=tp))
            settings += (
                [FSDPStrategy(tensor_parallel_size=tp, activation_checkpointing=checkpointed)] if checkpointed else []
            )
        settings.append(FSDPStrategy(activation_checkpointing=checkpointed, cpu_offload=True))
        for setting in settings:
            estimate = estimate_memory(
                task, batch, strategy=setting, world_size=world, precision=precision, device=device
            )
            estimates.append(estimate)
            if chosen is None and estimate.fits(device_memory):
                chosen = estimate
    return estimates, chosen


def format_plan(estimates: Sequence[MemoryEstimate], chosen: MemoryEstimate | None, device_memory: int) -> str:
    head = ("setting", "ranks", "params", "grads", "optimizer", "activations", "other", "step", "peak", "CPU", "fits")
    rows = [
        (
            e.setting,
            str(e.world_size),
            *(format_size(getattr(e, k)) for k in ("params", "grads", "optimizer", "activations", "other", "device")),
            f"{format_size(e.peak)} ({e.decides})",
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
