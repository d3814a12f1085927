"""The memory a training step holds on one rank, estimated on fake tensors.

:func:`estimate_step` builds the task on the meta device, applies the strategy to it and runs two training steps on
fake tensors in a fake process group (:mod:`trainer.memory.fake`): nothing is allocated, on any device. It returns a
:class:`MemoryEstimate`: the bytes one rank holds at the peak of a step, by category.
:func:`trainer.memory.estimate_memory` is its public face (with ``plan_memory`` and ``python -m trainer.memory``),
:class:`trainer.memory.callback.MemoryPlan` the plan of a run at its first batch. The Trainer that hosts the task's
hooks comes in as an argument (``trainer_class``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from torch.utils._pytree import tree_map

from trainer.distributed import comm
from trainer.distributed.fsdp import FSDPStrategy
from trainer.distributed.launcher import DistEnv
from trainer.distributed.selection import build_strategy
from trainer.distributed.strategy import DDPStrategy, SingleDeviceStrategy, Strategy
from trainer.memory.fake import FakeWorld, measure_step
from trainer.step.optim import parse_optimizers
from trainer.step.precision import Precision

if TYPE_CHECKING:  # pragma: no cover
    from trainer.options import TrainerOptions

log = logging.getLogger(__name__)


def format_size(nbytes: int) -> str:
    """``1.5 GiB``, ``148.3 MiB``, ``12.0 KiB``, ``0 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


PHASES = ("init", "train", "eval", "save", "load")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds. ``device`` is what must fit in the accelerator's memory at the peak of a training step,
    by category (``params`` ... ``other``); ``host`` what CPU offload keeps in CPU memory instead. ``phases`` is the
    device peak of each phase of a run (``PHASES``: initialisation, the training step, an evaluation forward, a
    checkpoint save and a load; docs/memory.md says how each is counted), ``staging`` the CPU memory an asynchronous
    save keeps for its copy of the rank's state. :meth:`fits` compares the largest phase, :attr:`peak`."""

    setting: str
    world_size: int
    params: int
    grads: int
    optimizer: int
    activations: int
    other: int
    device: int
    host: int
    phases: dict[str, int] = dataclasses.field(default_factory=dict)
    staging: int = 0

    @property
    def peak(self) -> int:
        """The largest phase's device bytes (the training step's when no phase was estimated)."""
        return max([self.device, *self.phases.values()])

    @property
    def decides(self) -> str:
        """The phase whose peak is :attr:`peak` (the training step on a tie)."""
        order = sorted(self.phases, key=lambda phase: (-self.phases[phase], phase != "train"))
        return order[0] if order and self.phases[order[0]] > self.device else "train"

    def fits(self, device_memory: int) -> bool:
        return self.peak <= device_memory

    def summary(self) -> str:
        """One line: ``FSDP x8: 31.2 GiB a rank (params 2.1 GiB, grads ..., activations ...); phases: init ...``."""
        parts = ", ".join(
            f"{name} {format_size(getattr(self, name))}"
            for name in ("params", "grads", "optimizer", "activations", "other")
        )
        host = f"; {format_size(self.host)} in CPU memory" if self.host else ""
        line = f"{self.setting} x{self.world_size}: {format_size(self.device)} a rank ({parts}){host}"
        if self.phases:
            each = ", ".join(f"{phase} {format_size(self.phases[phase])}" for phase in PHASES if phase in self.phases)
            line += f"; phases: {each}: {self.decides} decides"
        return line


class Host(Protocol):
    """The Trainer that hosts the task's hooks during the estimate (``self.trainer.max_steps``, ``self.log``)."""

    options: TrainerOptions
    strategy: Strategy


class PlannedTask(Protocol):
    """What the estimate calls on a task beyond nn.Module's methods (a TaskModule has them)."""

    _trainer: Any

    def configure_model(self) -> None: ...
    def configure_optimizers(self) -> Any: ...


def estimate_step(
    task: Callable[[], nn.Module],
    batch: Any,
    *,
    trainer_class: Callable[..., Host],
    strategy: Any = "auto",
    world_size: int = 1,
    precision: str = "32",
    device: str = "cpu",
) -> MemoryEstimate:
    """The memory one rank needs for a training step of ``task`` on ``batch`` (one micro-batch of one rank):
    :func:`trainer.memory.estimate_memory`, whose arguments, returns and errors these are, and ``trainer_class``
    (the ``Trainer`` class: the task's hooks read a Trainer built of it, never fitted)."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "Planning for CUDA needs torch with CUDA here: even fake CUDA tensors copy through CUDA's device guard, "
            "which torch's CPU build lacks. Plan with device='cpu' (the same model, state and gradients; kernels "
            "differ mostly in attention, where the CPU's math kernel keeps more), or run the plan on a GPU machine."
        )
    chosen = build_strategy(strategy)
    if isinstance(chosen, DDPStrategy) and world_size == 1:
        chosen = SingleDeviceStrategy(activation_checkpointing=chosen.activation_checkpointing)
    sharded = isinstance(chosen, FSDPStrategy)
    host = trainer_class(  # what the task's hooks may read (self.trainer.max_steps, self.log): never fitted
        precision=precision,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        memory_plan=False,
    )
    where = torch.device(device)
    plugin = Precision(precision, where) if precision != "16-mixed" or where.type == "cuda" else None
    rank = comm.get_rank()  # inside a run (the plan logged at fit start), each rank estimates its own part
    env = DistEnv("torchrun", rank, rank, world_size, world_size, 0, "127.0.0.1", 0)

    chosen.connect(env, where, host.options)
    if sharded:
        host.strategy = chosen  # the task's self.device_mesh in configure_model: the run's mesh, on the fake group
    # DDP's reducer cannot run on fake tensors: its rank holds the single-device step plus its gradient buckets.
    applied = SingleDeviceStrategy(activation_checkpointing=chosen.activation_checkpointing) if not sharded else chosen
    applied.connect(env, where, host.options)

    sizes: dict[str, int] = {}
    build = partial(_build, _on_meta(task), batch, applied, host, plugin, where, sizes)
    prepare: Callable[[FakeWorld], None] | None = None
    if isinstance(chosen, FSDPStrategy):  # the run's mesh (hybrid sharding's included), of fake groups

        def prepare(world: FakeWorld) -> None:
            chosen.device_mesh = chosen.build_mesh(lambda shape, names: world.device_mesh(where.type, shape, names))

    try:
        held = measure_step(build, world_size=world_size, sharded=sharded, prepare=prepare, device=where)
    finally:
        applied.teardown()
        if isinstance(chosen, FSDPStrategy):  # the strategy object may go to a Trainer next: no fake mesh in it
            chosen.device_mesh = None
    return _estimate(chosen, world_size, held, sizes)


def _on_meta(task: Callable[[], nn.Module]) -> nn.Module:
    """The task built on the meta device: its structure, no storage; ``__init__`` may move or convert it
    (``.to(torch.float64)``, which fake tensors cannot do: their ``module.to`` swap fails)."""
    with torch.device("meta"):
        return task()


def _build(
    built: nn.Module,
    batch: Any,
    strategy: Strategy,
    host: Host,
    plugin: Precision | None,
    where: torch.device,
    sizes: dict[str, int],
    mode: Any,
) -> tuple[nn.Module, list[torch.optim.Optimizer], Callable[[], None], Callable[[], None]]:
    """Inside the fake tensor mode: the task with the strategy applied, its optimizers, one training step and one
    evaluation forward (the step's forward under ``no_grad``, in eval mode). ``sizes["module"]`` gets the largest
    module's own parameter bytes at full size (what materialising it holds)."""
    dtype = plugin.param_dtype if plugin is not None else None  # the plugin's module.to(dtype)
    replace_tensors(  # fake tensors on the device, in the run's dtype
        built, lambda t: torch.empty_like(t, device=where, dtype=dtype if dtype and t.is_floating_point() else None)
    )
    module, planned = built, cast("PlannedTask", built)
    planned._trainer = host
    with where:  # the layers it builds, and its tensor-parallel plan on self.device_mesh (FSDP)
        planned.configure_model()
    sizes["module"] = max((_nbytes(m.parameters(recurse=False)) for m in module.modules()), default=0)
    if isinstance(strategy, FSDPStrategy):
        strategy.shard(module)  # a run shards in the stage setup (FSDPStrategy.prepare_model)
    run = strategy.setup(module, manual=False)
    optimizers, _ = parse_optimizers(planned.configure_optimizers())
    fake = tree_map(lambda t: mode.from_tensor(t).to(where) if isinstance(t, torch.Tensor) else t, batch)
    if plugin is not None and plugin.param_dtype is not None:
        fake = tree_map(lambda t: t.to(plugin.param_dtype) if _is_float(t) else t, fake)

    def step() -> None:
        with plugin.autocast() if plugin is not None else nullcontext():
            out = run(fake, 0)
        (out["loss"] if isinstance(out, dict) else out).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def evaluate() -> None:
        module.eval()
        try:
            with torch.no_grad(), plugin.autocast() if plugin is not None else nullcontext():
                run(fake, 0)
        finally:
            module.train()

    return module, optimizers, step, evaluate


def _nbytes(tensors: Iterator[torch.Tensor]) -> int:
    """Full-size bytes (a DTensor counts its global shape)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _estimate(chosen: Strategy, world_size: int, held: dict[str, int], sizes: dict[str, int]) -> MemoryEstimate:
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
    state = held["params"] + held["optimizer"]  # what stays between steps (gradients are freed by zero_grad)
    resident = 0 if offload else state
    if isinstance(chosen, FSDPStrategy):  # sharded while empty, then one module at a time at full size
        init = sizes.get("module", 0) + (0 if offload else held["params"])
    else:
        init = held["params"]  # the whole model (DDP replicates it)
    phases = {"init": init, "train": setting_device, "save": resident, "load": resident}
    if held.get("eval_peak"):
        phases["eval"] = held["eval_peak"]
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
        phases=phases,
        staging=state,
    )


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _describe(strategy: Strategy) -> str:
    name = {"single": "single device", "ddp": "DDP", "fsdp": "FSDP"}.get(strategy.name, strategy.name)
    extras = []
    if getattr(strategy, "replicas", 1) > 1:
        extras.append(f"HSDP {strategy.replicas} replicas")  # type: ignore[attr-defined]
    if getattr(strategy, "tensor_parallel_size", 1) > 1:
        extras.append(f"TP {strategy.tensor_parallel_size}")
    if strategy.activation_checkpointing:
        extras.append("activation checkpointing")
    if getattr(strategy, "cpu_offload", False):
        extras.append("CPU offload")
    return name + (f" + {' + '.join(extras)}" if extras else "")


def meta_copy(task: nn.Module) -> nn.Module:
    """A deep copy of ``task`` whose parameters and buffers are on the meta device (no storage), without the
    Trainer it points to; everything else is copied as ``copy.deepcopy`` copies it (so the estimate's steps
    change nothing of the real task)."""
    memo: dict[int, Any] = {}
    for _, _, tensor in _tensor_slots(task):
        if id(tensor) not in memo:
            memo[id(tensor)] = _remade(tensor, lambda t: torch.empty_like(t, device="meta"))
    trainer = getattr(task, "_trainer", None)
    if trainer is not None:
        memo[id(trainer)] = None
    return copy.deepcopy(task, memo)


def replace_tensors(module: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """Replace each parameter and buffer ``t`` of ``module`` by ``make(t)`` (a parameter stays a parameter with
    its ``requires_grad``; shared ones stay shared). Works on fake tensors, where ``module.to`` cannot swap."""
    made: dict[int, torch.Tensor] = {}
    for table, name, tensor in list(_tensor_slots(module)):
        if id(tensor) not in made:
            made[id(tensor)] = _remade(tensor, make)
        table[name] = made[id(tensor)]
    return module


def _tensor_slots(module: nn.Module) -> Iterator[tuple[dict[str, Any], str, torch.Tensor]]:
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    yield table, name, tensor


def _remade(tensor: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    new = make(tensor.detach())
    return nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
