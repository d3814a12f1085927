"""The ``strategy`` option to a strategy object: the strings (Lightning's registered names among them) build their
strategy with its settings, an object is taken as it is, anything else is refused naming the alternatives. Apart
from :mod:`~trainer.distributed.strategy` and :mod:`~trainer.distributed.fsdp` so that neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from trainer.distributed.fsdp import FSDPStrategy
from trainer.distributed.launcher import DistEnv
from trainer.distributed.strategy import DDPStrategy, SingleDeviceStrategy, Strategy
from trainer.options import TrainerOptions

# The strategy option's strings: what each builds (Lightning's registered names included).
STRATEGIES: dict[str | None, Callable[[], Strategy]] = {
    "auto": DDPStrategy,
    None: DDPStrategy,
    "ddp": DDPStrategy,
    "ddp_find_unused_parameters_true": partial(DDPStrategy, find_unused_parameters=True),
    "ddp_find_unused_parameters_false": DDPStrategy,
    "fsdp": FSDPStrategy,
    "fsdp_cpu_offload": partial(FSDPStrategy, cpu_offload=True),
}


def build_strategy(value: Any) -> Strategy:
    """The strategy object for the ``strategy`` option: a :class:`Strategy` as it is, a string of
    :data:`STRATEGIES` built with its settings.

    Raises:
        ValueError: any other value, naming it and the alternatives.
    """
    if isinstance(value, Strategy):
        return value
    if isinstance(value, str | None) and value in STRATEGIES:
        return STRATEGIES[value]()
    if isinstance(value, str) and value in ("ddp_spawn", "ddp_fork", "ddp_notebook", "spawn"):
        hint = "keel does not spawn processes; launch with `torchrun --nproc-per-node G your_script.py`"
    elif isinstance(value, str):
        hint = "keel runs DistributedDataParallel and FSDP2; no DeepSpeed or DataParallel"
    else:
        hint = "a strategy object is a trainer.DDPStrategy or trainer.FSDPStrategy (or a subclass of Strategy)"
    shown = value if isinstance(value, str) else type(value).__name__
    raise ValueError(
        f"Trainer option strategy={shown!r} is not valid: expected 'auto', 'ddp', 'fsdp' (or Lightning's "
        f"'ddp_find_unused_parameters_true', 'fsdp_cpu_offload'), None, or a strategy object such as "
        f"DDPStrategy(find_unused_parameters=True) or FSDPStrategy(units=['Block']); {hint}."
    )


def select_strategy(options: TrainerOptions, env: DistEnv, device: torch.device) -> Strategy:
    """The strategy for this run, from the ``strategy`` option and the launcher's world size, connected to
    the launch.

    ``"auto"`` / ``"ddp"`` / None / a :class:`DDPStrategy`: DDP when the job has more than one process, else a
    single device. ``"fsdp"`` / a :class:`~trainer.distributed.fsdp.FSDPStrategy`: FSDP2 at any world size (1
    included: a one-rank group is created). Called in ``Trainer.__init__``, before any process group exists
    (nothing here communicates).
    """
    strategy = build_strategy(options.strategy)
    if isinstance(strategy, DDPStrategy) and env.world_size == 1:
        strategy = SingleDeviceStrategy(activation_checkpointing=strategy.activation_checkpointing)
    strategy.connect(env, device, options)
    return strategy
