"""Precision: autocast, gradient scaling and parameter dtype for the four supported modes.

* ``"32"``: float32, no autocast.
* ``"64"``: the task and floating-point batch tensors in float64 (exact tests).
* ``"bf16-mixed"``: ``torch.autocast(dtype=torch.bfloat16)`` on CPU or CUDA; weights stay float32.
* ``"16-mixed"``: float16 autocast with a ``GradScaler``; CUDA only. Gradients are unscaled before
  clipping and before ``on_before_optimizer_step`` sees them.
"""

from __future__ import annotations

import contextlib
import operator
from contextlib import AbstractContextManager
from typing import Any

import torch

_NO_AUTOCAST = contextlib.nullcontext()  # reusable: "32" and "64" enter it on every step


class Precision:
    """Owns autocast and the GradScaler for one run. Built before any process group exists."""

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision == "16-mixed" and device.type != "cuda":
            raise ValueError(
                f"Trainer option precision='16-mixed' needs CUDA, but the run is on {device.type!r}. "
                "Use precision='bf16-mixed' on CPU, or accelerator='cuda' on a GPU machine."
            )
        self.precision = precision
        self.device = device
        self.param_dtype: torch.dtype | None = torch.float64 if precision == "64" else None
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
        )
        self.autocasts = precision in ("bf16-mixed", "16-mixed")  # autocast() is a real context
        if self.scaler is None:
            # Without a scaler the plugin adds nothing to backward and step: bind torch's own calls, so the
            # step runs no extra Python frame for them (each distinct frame costs a small step,
            # docs/performance.md). ``backward(loss)`` is ``loss.backward()``, ``optimizer_step(o)`` is ``o.step()``.
            self.backward = torch.Tensor.backward  # type: ignore[method-assign]
            self.optimizer_step = operator.methodcaller("step")  # type: ignore[method-assign, assignment]

    def autocast(self) -> AbstractContextManager[Any]:
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        if self.precision == "16-mixed":
            return torch.autocast(self.device.type, dtype=torch.float16)
        return _NO_AUTOCAST

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the gradients of ``optimizer`` true gradients (16-mixed); a no-op otherwise."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            # Skips the step (without a host sync here) when the unscaled gradients hold inf/NaN.
            self.scaler.step(optimizer)
        else:
            optimizer.step()

    def update(self) -> None:
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
