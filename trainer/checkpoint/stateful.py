"""What a save holds: objects with ``state_dict()`` / ``load_state_dict()``, one per checkpoint key.

The Trainer's ``Checkpointer`` (trainer/checkpoint/checkpointer.py) builds a dict of these for each save and load;
nothing here reads the Trainer. Model and optimizer states are in
``torch.distributed.checkpoint.state_dict`` form (keyed by parameter names, DTensor shards under FSDP), so
a save loads at any world size and under any strategy. ``classes()`` names what a state needs to load
into (the optimizer and scheduler classes): the reader compares it with the save's before loading anything.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from trainer.checkpoint.files import CheckpointError
from trainer.distributed import comm

if TYPE_CHECKING:  # pragma: no cover
    from trainer.distributed.strategy import Strategy

log = logging.getLogger(__name__)


class ModelState:
    """The task's weights and buffers (written by DCP)."""

    def __init__(self, strategy: Strategy, task: torch.nn.Module, *, strict: bool = True) -> None:
        self.strategy, self.task, self.strict = strategy, task, strict

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.model_state_dict(self.task)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_model_state_dict(self.task, state, strict=self.strict)


class OptimizerStates:
    """Every optimizer's state (written by DCP), in ``configure_optimizers`` order."""

    def __init__(self, strategy: Strategy, task: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        self.strategy, self.task, self.optimizers = strategy, task, optimizers

    def classes(self) -> list[str]:
        return [_class_name(o) for o in self.optimizers]

    def state_dict(self) -> list[dict[str, Any]]:
        return [self.strategy.optimizer_state_dict(self.task, o) for o in self.optimizers]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for optimizer, state in zip(self.optimizers, states):
            self.strategy.load_optimizer_state_dict(self.task, optimizer, state)


class SchedulerStates:
    """The learning-rate schedulers' states, in ``configure_optimizers`` order."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def classes(self) -> list[str]:
        return [_class_name(s) for s in self.schedulers]

    def state_dict(self) -> list[dict[str, Any]]:
        return [s.state_dict() for s in self.schedulers]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for scheduler, state in zip(self.schedulers, states):
            scheduler.load_state_dict(state)


def check_classes(path: str, saved: dict[str, list[str]], state: dict[str, Any]) -> None:
    """Refuse a save whose optimizers or schedulers are not this run's (by class and count), before any
    state is loaded: resuming AdamW's state into SGD fails deep inside torch, or loads a mixed state."""
    for key, obj in state.items():
        if not hasattr(obj, "classes") or key not in saved:
            continue
        mine, theirs = obj.classes(), list(saved[key])
        if mine != theirs:
            raise CheckpointError(
                f"Checkpoint {path!r} holds {key} of classes {theirs}, but configure_optimizers returned {mine}. "
                "Resume with the same optimizers and schedulers, or start a new run from the weights "
                "(TaskModule.load_from_checkpoint, or Trainer.fit(ckpt_path=None) after loading them)."
            )


def _class_name(obj: Any) -> str:
    inner = getattr(obj, "optimizer", None) if type(obj).__name__ == "ManualOptimizer" else None
    kind = type(inner if inner is not None else obj)
    return f"{kind.__module__}.{kind.__qualname__}"


class RNGStates:
    """Every rank's Python, torch, numpy (and CUDA) generator states. ``state_dict()`` is a gather (every
    rank calls it); a rank that did not exist when the save was written is seeded from ``seed``, its rank
    and the step, deterministically."""

    def __init__(self, device: torch.device, rank: int, fallback_seed: Callable[[], int]) -> None:
        self.device, self.rank, self.fallback_seed = device, rank, fallback_seed

    def state_dict(self) -> list[dict[str, Any]]:
        return comm.all_gather_object(_rng_state(self.device))

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if self.rank < len(states or []):
            _set_rng_state(states[self.rank], self.device)
        else:
            seed = self.fallback_seed()
            random.seed(seed)
            torch.manual_seed(seed)


def _rng_state(device: torch.device) -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    try:
        import numpy as np

        # get_state() returns the legacy tuple by default (numpy types it as that tuple or a dict).
        kind, keys, pos, has_gauss, cached = cast("tuple[str, Any, int, int, float]", np.random.get_state())
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
        except ImportError:  # pragma: no cover
            pass
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class KeyedState(Protocol):
    """What a callback's state is saved through (the callback API's ``state_key`` and state methods)."""

    @property
    def state_key(self) -> str: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class CallbackStates:
    """Each callback's ``state_dict()``, under its ``state_key``; a saved state without a matching callback
    in this run is reported and ignored."""

    def __init__(self, callbacks: Sequence[KeyedState]) -> None:
        self.callbacks = callbacks

    def state_dict(self) -> dict[str, Any]:
        return {cb.state_key: state for cb in self.callbacks if (state := cb.state_dict())}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        saved = dict(states or {})
        unmatched = []
        for cb in self.callbacks:
            state = saved.pop(cb.state_key, None)
            if state is not None:
                cb.load_state_dict(state)
            else:
                unmatched.append(cb)
        for cb in unmatched:  # a callback that can tell its state under another key (a moved folder: ModelCheckpoint)
            key = cb.matching_state_key(list(saved)) if hasattr(cb, "matching_state_key") else None
            if key is not None:
                cb.load_state_dict(saved.pop(key))
        if saved:
            log.warning(
                "Checkpoint state for callbacks %s has no matching callback in this run; it is ignored.", sorted(saved)
            )


class Value:
    """A plain value saved as it is (options, hyperparameters) and, on load, handed to ``load`` (if any)."""

    def __init__(self, value: Any, load: Callable[[Any], None] | None = None) -> None:
        self.value, self.load = value, load

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state: Any) -> None:
        if self.load is not None:
            self.load(state)


def plain(value: Any) -> Any:
    """``value`` reduced to types that ``weights_only`` loading accepts (others become their ``str``)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def plain_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters that survive ``weights_only`` loading (containers of str/int/float/bool/None)."""
    out = {}
    for key, value in hparams.items():
        if _is_plain(value):
            out[str(key)] = value
        else:
            log.warning(
                "hparams[%r] (%s) is not a plain value; it is kept in memory but not saved in checkpoints.",
                key,
                type(value).__name__,
            )
    return out


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False
