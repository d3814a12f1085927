"""Lightning idioms keel honours without knowing the Trainer or the TaskModule: small functions of callables.

* how a step method is called (:func:`takes_batch_idx`: ``training_step(self, batch)`` without ``batch_idx`` is
  decided once per stage, never per step), and which TaskModule hooks keep keel's default (:func:`keel_default` /
  :func:`is_keel_default`);
* ``trainer.fit(torch.compile(task))``: :func:`unwrap_compiled` and :func:`compile_step`.

The Trainer's Lightning-named attributes are in :mod:`trainer.attributes`; the checks of hook signatures and the
hooks keel never calls in :mod:`trainer.hooks`; the loop's own decisions (when to validate, when to stop) in
:mod:`trainer.trainer`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch


# ---------------------------------------------------------------------- step methods and default hooks
def takes_batch_idx(step: Callable[..., Any], *, extra: int = 0) -> bool:
    """Whether ``step`` (a bound ``*_step`` method) takes ``batch_idx`` after ``batch``: Lightning calls
    ``training_step(batch)`` when the method has a single parameter. Read once per stage by the caller.

    ``extra`` counts further positional arguments the caller passes after ``batch_idx``
    (``dataloader_idx``: 1); only their absence changes the call, never their presence.
    """
    try:
        params = list(inspect.signature(step).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: assume Lightning's full signature
        return True
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2


def keel_default(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a TaskModule hook whose default the loop replaces with its own behaviour unless overridden
    (``on_validation_model_train``: the loop restores each submodule's training mode itself)."""
    fn._keel_default = True  # type: ignore[attr-defined]
    return fn


def is_keel_default(bound: Callable[..., Any]) -> bool:
    """True when ``bound`` (a bound hook) is keel's own default, not a user's override."""
    return bool(getattr(bound, "_keel_default", False))


# ---------------------------------------------------------------------- torch.compile
def unwrap_compiled(model: Any) -> tuple[Any, Any | None]:
    """``(task, dynamo context)`` for ``torch.compile(task)``, ``(model, None)`` for anything else.

    Lightning's idiom ``trainer.fit(torch.compile(model))``: keel trains the task itself (so
    checkpoints hold its plain ``state_dict`` keys, hooks and ``self.log`` see the task) and compiles the
    training step with the same settings (:func:`compile_step`).
    """
    # A compiled model means torch.compile imported dynamo. ``torch._dynamo`` here would import it (1.3 s on a
    # 2-core CPU) into a process that compiles nothing: a fit pays that anyway (torch's Optimizer constructor
    # imports it), validate / test / predict from a fresh process no longer do.
    optimized = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    if optimized is not None and isinstance(model, optimized):
        return model._orig_mod, model.dynamo_ctx
    return model, None


def compile_step(model: torch.nn.Module, dynamo_ctx: Any | None) -> torch.nn.Module:
    """The module the loop calls for ``training_step``, compiled with the user's ``torch.compile``
    settings (its backend and mode) when the task came compiled; unchanged otherwise. Like Lightning,
    the compiled region is the wrapped training step (after DDP's wrapping, so DDP's optimizer splits
    the graph at bucket boundaries)."""
    if dynamo_ctx is None:
        return model
    return torch._dynamo.eval_frame.OptimizedModule(model, dynamo_ctx)
