"""How the task is replicated or sharded for training: one small interface, one implementation per case.

The Trainer talks to a :class:`Strategy` and never asks which one it holds (DESIGN.md sections 1, 3).
Each method has a fixed signature and a contract:

* **Who calls it**: the fit loop and the optimizer step (``setup``, ``gradient_sync``, ``clip_grad_*``,
  ``raise_explained``), manual optimization (``average_gradients``) and the checkpoint code (the
  ``*_state_dict`` methods).
* **When**: ``setup`` once per ``fit``, after the task is on its device and in its dtype and before
  ``configure_optimizers`` (so a sharding strategy can replace parameters before an optimizer holds
  them); ``teardown`` at the end of every stage; the others between the two.
* **On which ranks**: on every rank, in the same order. Methods that communicate say so; nothing else
  blocks on another rank.

Implementations: :class:`SingleDeviceStrategy` (one process, or any launch with world size 1) and
:class:`DDPStrategy` (``DistributedDataParallel``). A new parallelism (FSDP, tensor parallel, HSDP) is a
new subclass plus one line in :func:`select_strategy`; the loop does not change.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from typing import Any, ClassVar, ContextManager

import torch
from torch import nn

from trainer import dist
from trainer.compat import takes_batch_idx
from trainer.launcher import DistEnv
from trainer.options import TrainerOptions

_NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it costs nothing on the hot path


class StepAdapter(nn.Module):
    """What a wrapper such as DDP wraps: its ``forward`` is the task's ``training_step``, so the
    wrapper's gradient hooks see the parameters the step used while the user's ``forward`` stays
    untouched (DESIGN.md section 3). ``state_dict`` keys of the task are never prefixed: checkpoints
    read the task itself."""

    def __init__(self, task: nn.Module) -> None:
        super().__init__()
        self.task = task
        # Lightning calls training_step(batch) when it takes no batch_idx: decided here, once per fit.
        self.with_batch_idx = takes_batch_idx(task.training_step)

    def forward(self, batch: Any, batch_idx: int) -> Any:
        if self.with_batch_idx:
            return self.task.training_step(batch, batch_idx)
        return self.task.training_step(batch)


class Strategy:
    """The seam between the loop and the parallelism. See the module docstring for the contract.

    Attributes:
        name: The ``strategy`` option value this class implements.
        env: The launcher's view of this process (rank, world size, ...).
        root_device: This rank's device (Lightning's name).
    """

    name: ClassVar[str] = "single"

    def __init__(self, env: DistEnv, device: torch.device, options: TrainerOptions) -> None:
        self.env = env
        self.root_device = device
        self.options = options

    # ------------------------------------------------------------------ Lightning-style queries
    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def global_rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def is_global_zero(self) -> bool:
        return self.env.rank == 0

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (a collective; a no-op in one process)."""
        dist.barrier(self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``src``'s picklable object on every rank (a collective)."""
        return dist.broadcast_object(obj, src)

    @property
    def num_processes(self) -> int:
        """Processes on this node (Lightning's name; keel runs one device per process)."""
        return self.env.local_world_size

    @property
    def num_nodes(self) -> int:
        return max(1, self.env.world_size // max(1, self.env.local_world_size))

    @property
    def node_rank(self) -> int:
        return self.env.node_rank

    def reduce(self, tensor: Any, group: Any = None, reduce_op: str | None = "mean") -> Any:
        """``tensor`` reduced over ranks (a collective; Lightning's default op is the mean). Non-tensors and
        a single process return ``tensor`` unchanged. ``group`` must be None (keel uses one group)."""
        if group is not None:
            raise ValueError("Strategy.reduce(group=...): keel reduces over the default process group only.")
        if not isinstance(tensor, torch.Tensor) or self.world_size == 1:
            return tensor
        op = {None: "mean", "mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}.get(
            reduce_op.lower() if isinstance(reduce_op, str) else reduce_op)
        if op is None:
            raise ValueError(f"Strategy.reduce(reduce_op={reduce_op!r}): expected 'mean', 'sum', 'max' or 'min'.")
        out = tensor.detach().clone() if tensor.is_floating_point() or op != "mean" else tensor.double()
        return dist.all_reduce(out, op)  # type: ignore[arg-type]

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` stacked on a new first dimension of size world size (a collective); in a
        single process ``tensor`` itself, as in Lightning. ``sync_grads=True`` keeps the autograd graph."""
        if group is not None:
            raise ValueError("Strategy.all_gather(group=...): keel gathers over the default process group only.")
        if self.world_size == 1:
            return tensor
        if sync_grads:
            from torch.distributed.nn.functional import all_gather as differentiable_all_gather

            return torch.stack(differentiable_all_gather(tensor.contiguous()))
        return torch.stack(dist.all_gather_tensor(tensor))

    # ------------------------------------------------------------------ lifecycle
    def setup(self, task: nn.Module, *, manual: bool) -> nn.Module:
        """Prepare ``task`` for training; return the module the loop calls as ``model(batch, batch_idx)``
        (it runs ``task.training_step``). ``manual``: the task steps its own optimizers
        (``automatic_optimization = False``). May communicate (every rank calls it)."""
        return StepAdapter(task)

    def teardown(self) -> None:
        """Drop references to wrappers built by :meth:`setup` (end of every stage)."""

    # ------------------------------------------------------------------ the step
    def gradient_sync(self, sync: bool) -> ContextManager[Any]:
        """A context for one micro-batch's forward AND backward. ``sync=False`` (all but the last
        micro-batch of an accumulation window) keeps gradients local so that the wrapper reduces them
        once per optimizer step."""
        return _NO_CONTEXT

    def clip_gradients(self, params: list[torch.Tensor], clip_val: float | None, algorithm: str) -> None:
        """``gradient_clip_val`` / ``gradient_clip_algorithm``: by norm or by value; None does nothing."""
        if clip_val is None:
            return
        if algorithm == "norm":
            self.clip_grad_norm(params, clip_val)
        else:
            self.clip_grad_value(params, clip_val)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> None:
        """Scale the gradients of ``params`` so that their global 2-norm is at most ``max_norm``.
        Foreach kernels; the norm stays on the device (no host sync)."""
        nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def clip_grad_value(self, params: list[torch.Tensor], clip_value: float) -> None:
        """Clamp every gradient element of ``params`` to ``[-clip_value, clip_value]``."""
        nn.utils.clip_grad_value_(params, clip_value, foreach=True)

    def raise_explained(self, exc: BaseException) -> None:
        """Called with an error raised by the wrapped module's forward. Raises a clearer error (chained
        to ``exc``) when the wrapper knows what it means and how to fix it; returns otherwise, and the
        caller re-raises ``exc`` unchanged."""

    # ------------------------------------------------------------------ manual optimization
    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Manual optimization, on the micro-batch that syncs: make every rank's gradients of
        ``params`` their mean over ranks (a collective in a multi-rank strategy)."""

    # ------------------------------------------------------------------ checkpoint state
    def model_state_dict(self, task: nn.Module) -> dict[str, Any]:
        """The task's weights for a checkpoint, keyed as ``task.state_dict()`` (no wrapper prefixes)."""
        return task.state_dict()

    def load_model_state_dict(self, task: nn.Module, state: dict[str, Any], *, strict: bool = True) -> None:
        """Load weights produced by :meth:`model_state_dict` (at any world size) into ``task``."""
        task.load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, device={self.root_device})"


class SingleDeviceStrategy(Strategy):
    """One process, or a launch whose world size is 1: the task runs as it is, nothing is reduced."""

    name = "single"


_DDP_BUFFER_SYNC_ARG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


class DDPStrategy(Strategy):
    """``DistributedDataParallel`` over the :class:`StepAdapter`: every rank holds the whole task, and
    gradients are averaged over ranks by DDP's bucketed all-reduce during the backward of the
    micro-batch that syncs (DESIGN.md section 5)."""

    name = "ddp"

    def __init__(self, env: DistEnv, device: torch.device, options: TrainerOptions) -> None:
        super().__init__(env, device, options)
        self.ddp: nn.parallel.DistributedDataParallel | None = None

    def setup(self, task: nn.Module, *, manual: bool) -> nn.Module:
        opts = self.options
        if opts.sync_batchnorm:
            converted = nn.SyncBatchNorm.convert_sync_batchnorm(task)
            if converted is not task:  # the task itself is never a BatchNorm layer
                raise TypeError("sync_batchnorm: the task itself must not be a BatchNorm layer.")
        adapter = StepAdapter(task)
        if manual:
            # Manual optimization syncs gradients in manual_backward (average_gradients); start every
            # rank from rank 0's state. One broadcast per tensor, at setup only.
            for tensor in task.state_dict().values():
                dist.broadcast(tensor, 0)
            self.ddp = None
            return adapter
        if not any(p.requires_grad for p in task.parameters()):
            raise ValueError(f"{type(task).__name__} has no trainable parameters; DDP has nothing to synchronise.")
        kwargs: dict[str, Any] = dict(
            device_ids=[device.index] if (device := self.root_device).type == "cuda" else None,
            find_unused_parameters=opts.find_unused_parameters,
            static_graph=opts.static_graph,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
        )
        # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (same meaning for True; False
        # still syncs once at construction, which keel wants anyway).
        kwargs[_DDP_BUFFER_SYNC_ARG] = opts.broadcast_buffers
        if opts.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = opts.bucket_cap_mb
        # Construction broadcasts rank 0's parameters and buffers: every rank starts equal.
        self.ddp = nn.parallel.DistributedDataParallel(adapter, **kwargs)
        return self.ddp

    def teardown(self) -> None:
        self.ddp = None

    def gradient_sync(self, sync: bool) -> ContextManager[Any]:
        # no_sync must cover forward AND backward: DDP decides at forward time whether the backward
        # all-reduces. Gradients then accumulate locally until the window's last micro-batch.
        if sync or self.ddp is None:
            return _NO_CONTEXT
        return self.ddp.no_sync()

    def raise_explained(self, exc: BaseException) -> None:
        """DDP's unused-parameter error, re-raised with the parameter names and the option that fixes it."""
        text = str(exc)
        if self.ddp is None or "Expected to have finished reduction in the prior iteration" not in text:
            return
        names = [name.removeprefix("module.task.") for name, p in self.ddp.named_parameters() if p.requires_grad]
        match = _UNUSED_INDICES.search(text)
        unused = [names[int(i)] for i in match.group(2).split()] if match else []
        listed = ", ".join(unused) if unused else "(run with TORCH_DISTRIBUTED_DEBUG=INFO to list them)"
        raise RuntimeError(
            f"DDP: some parameters got no gradient in the previous step: {listed}. Make every parameter take "
            "part in the loss, freeze unused ones (requires_grad=False), or pass "
            "Trainer(find_unused_parameters=True) (or static_graph=True when the unused set never changes)."
        ) from exc

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        # One all-reduce of all current gradients (flattened). Re-reducing a gradient that an earlier
        # manual_backward of this step already averaged is harmless: it is identical on every rank.
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, "mean")
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)


STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy}


def select_strategy(options: TrainerOptions, env: DistEnv, device: torch.device) -> Strategy:
    """The strategy for this run, from the ``strategy`` option and the launcher's world size.

    ``"auto"`` / ``"ddp"`` / None: DDP when the job has more than one process, else a single device.
    Called in ``Trainer.__init__``, before any process group exists (nothing here communicates).
    """
    if env.world_size == 1:
        return SingleDeviceStrategy(env, device, options)
    return STRATEGIES["ddp"](env, device, options)
