"""How the task is replicated or sharded for training: one small interface, one implementation per case.

The Trainer talks to a :class:`Strategy` and never asks which one it holds (docs/design.md sections 1, 3).
Each method has a fixed signature and a contract:

* **Who calls it**: the fit loop and the optimizer step (``setup``, ``gradient_sync``, ``clip_grad_*``,
  ``raise_explained``), manual optimization (``average_gradients``), every save and restore
  (``save_checkpoint`` / ``load_checkpoint``) and the model and optimizer state objects (the ``*_state_dict``
  methods).
* **When**: ``setup`` once per ``fit``, after the task is on its device and in its dtype and before
  ``configure_optimizers`` (so a sharding strategy can replace parameters before an optimizer holds
  them); ``teardown`` at the end of every stage; the others between the two.
* **On which ranks**: on every rank, in the same order. Methods that communicate say so; nothing else
  blocks on another rank.

Implementations: :class:`SingleDeviceStrategy` (one process, or any launch with world size 1),
:class:`DDPStrategy` (``DistributedDataParallel``) and :class:`~trainer.distributed.fsdp.FSDPStrategy` (FSDP2,
``fully_shard``: parameters, gradients and optimizer state sharded over ranks, in its own module). A new
parallelism (tensor parallel, HSDP) is a new subclass plus one entry in
:data:`trainer.distributed.selection.STRATEGIES`; the loop does not change.

A strategy is configured by its own keyword arguments, not by Trainer options:
``Trainer(strategy=FSDPStrategy(units=["Block"], cpu_offload=True))``; the strings ``"ddp"``, ``"fsdp"`` and
``"auto"`` build the defaults (and Lightning's registered names ``"ddp_find_unused_parameters_true"``,
``"fsdp_cpu_offload"`` their settings). Its settings are checked when it is built; the Trainer then calls
:meth:`Strategy.connect` with the launch, the device and its options, before any process group exists.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import torch
from torch import nn

from trainer.compat import takes_batch_idx
from trainer.distributed import comm
from trainer.distributed.launcher import DistEnv
from trainer.distributed.materialize import check_same_model, has_meta, materialize, shared_rng
from trainer.options import TrainerOptions

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Iterable, Iterator


NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it costs nothing on the hot path


def _without_batch_idx(training_step: Callable[..., Any], batch: Any, batch_idx: int) -> Any:
    return training_step(batch)


class ModelHooks(Protocol):
    """What a strategy calls on a task beyond nn.Module's own methods: building its layers (``configure_model``),
    initialising a module made on the meta device (``init_weights``), and the training step. TaskModule has them;
    the strategy names this protocol instead, so that it never depends on the TaskModule (or on the Trainer
    behind it)."""

    def configure_model(self) -> None: ...
    def init_weights(self, module: nn.Module) -> None: ...
    def training_step(self, *args: Any, **kwargs: Any) -> Any: ...


def hooks_of(task: nn.Module) -> ModelHooks:
    """``task`` (a TaskModule) as the strategy calls it."""
    return cast("ModelHooks", task)


class StepAdapter(nn.Module):
    """What a wrapper such as DDP wraps: its ``forward`` is the task's ``training_step``, so the
    wrapper's gradient hooks see the parameters the step used while the user's ``forward`` stays
    untouched (docs/design.md section 3). ``state_dict`` keys of the task are never prefixed: checkpoints
    read the task itself."""

    run_step: Callable[[Any, int], Any]  # set by bind(), in the instance __dict__

    def __init__(self, task: nn.Module) -> None:
        super().__init__()
        self.task = task  # a registered submodule: the wrapper sees its parameters
        # Lightning calls training_step(batch) when it takes no batch_idx: decided here, once per fit.
        self.with_batch_idx = takes_batch_idx(hooks_of(task).training_step)
        self.bind()

    def bind(self) -> None:
        """Read ``task.training_step`` (again: after something replaced it on the instance, as FSDP's
        ``register_fsdp_forward_method`` does) into ``run_step(batch, batch_idx)``, a plain callable.
        Calling it is calling this adapter; the loop calls it directly when nothing wraps the adapter,
        since reading attributes of an nn.Module (which defines __getattr__) and calling one skip the
        interpreter's fast paths, on every step."""
        step = hooks_of(self.task).training_step
        self.__dict__["run_step"] = step if self.with_batch_idx else partial(_without_batch_idx, step)

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return self.run_step(batch, batch_idx)

    # Nothing registers module hooks on this internal adapter (the task's own modules keep theirs), so
    # calling it skips nn.Module's hook dispatch, about a microsecond of every step. A wrapper around it
    # calls it the same way (DDP calls ``self.module(...)``, torch.compile its ``__call__``).
    __call__ = forward


class Strategy:
    """The seam between the loop and the parallelism. See the module docstring for the contract.

    Attributes:
        name: The ``strategy`` option value this class implements.
        env: The launcher's view of this process (rank, world size, ...).
        root_device: This rank's device (Lightning's name).
    """

    name: ClassVar[str] = "single"
    # A process group even in a single process (FSDP needs a device mesh); parameters sharded over ranks.
    needs_process_group: ClassVar[bool] = False
    # gradient_sync() returns a real context (the loop skips the `with` otherwise: a per-step cost).
    has_sync_context: ClassVar[bool] = False

    # The settings a subclass takes as keyword arguments (stored as attributes of the same names), in order:
    # settings() and repr() list them.
    SETTINGS: ClassVar[tuple[str, ...]] = ("activation_checkpointing",)
    # Where the backward launched its last gradient all-reduce (an object with ``at``, set by setup), for the phase
    # clock's sync phase; None: this strategy cannot tell (its sync is not at the end of the backward).
    sync_mark: Any = None
    # Set by connect(), when a Trainer takes the strategy.
    env: DistEnv
    root_device: torch.device
    options: TrainerOptions

    def __init__(self, *, activation_checkpointing: _ModuleClasses | None = None) -> None:
        """
        Args:
            activation_checkpointing: Module classes (names, as in YAML, or classes) whose forward is recomputed
                in backward instead of keeping its activations (``torch.utils.checkpoint``, non-reentrant, RNG
                state preserved: the same gradients). None: keep every activation.

        Raises:
            ValueError: a malformed class list, naming the setting.
        """
        self.activation_checkpointing = _class_list(
            type(self).__name__, "activation_checkpointing", activation_checkpointing
        )
        self._recomputed: list[nn.Module] = []  # the modules whose forward setup() wrapped; restored by teardown()

    def connect(self, env: DistEnv, device: torch.device, options: TrainerOptions) -> None:
        """Called by the Trainer that takes this strategy, before any process group exists: where this process
        sits in the launch, its device and the Trainer's options. A subclass checks its settings against them
        (raising ``ValueError`` naming the setting and the fix)."""
        self.env, self.root_device, self.options = env, device, options

    def settings(self) -> dict[str, Any]:
        """The keyword arguments this strategy was built with, as plain values (classes by name): the
        start-of-run log line and the options a checkpoint records."""
        return {name: _plain_setting(getattr(self, name)) for name in self.SETTINGS}

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

    # Ranks that hold one replica of the model between them (tensor parallelism: they compute the same samples).
    tensor_parallel_size: int = 1

    @property
    def data_parallel_size(self) -> int:
        """How many replicas of the model train on different data: the world size over the tensor-parallel
        size. The samplers shard by it, and the global batch is micro-batch x accumulation x this."""
        return self.env.world_size // self.tensor_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's replica (ranks of one tensor-parallel group share it and read the same batches)."""
        return self.env.rank // self.tensor_parallel_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Lightning's name: how a distributed sampler splits the data (by replica, not by rank)."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def is_global_zero(self) -> bool:
        return self.env.rank == 0

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (a collective; a no-op in one process)."""
        comm.barrier(self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``src``'s picklable object on every rank (a collective)."""
        return comm.broadcast_object(obj, src)

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
            reduce_op.lower() if isinstance(reduce_op, str) else reduce_op
        )
        if op is None:
            raise ValueError(f"Strategy.reduce(reduce_op={reduce_op!r}): expected 'mean', 'sum', 'max' or 'min'.")
        out = tensor.detach().clone() if tensor.is_floating_point() or op != "mean" else tensor.double()
        return comm.all_reduce(out, cast("comm.ReduceOpName", op))  # one of the dict's values above

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
        return torch.stack(comm.all_gather_tensor(tensor))

    # ------------------------------------------------------------------ lifecycle
    def prepare_model(self, task: nn.Module, *, dtype: torch.dtype | None) -> None:
        """Every stage, at the end of its setup (``trainer.lifecycle.setup_stage``), on every rank: run
        ``task.configure_model()`` with rank 0's random state (the layers it builds start equal on every rank),
        give the task ``dtype`` (precision ``"64"``; None: keep it) and put it on :attr:`root_device`. What the task
        built on the meta device is materialised there whole (DDP replicates the model): ``task.init_weights(module)``
        per module, under rank 0's random state, so the weights do not depend on the world size. A collective with
        several ranks. :class:`~trainer.distributed.fsdp.FSDPStrategy` shards before it materialises."""
        with shared_rng(self.root_device):
            hooks_of(task).configure_model()
            check_same_model(
                task, "configured"
            )  # before DDP's construction broadcasts (or materialize fills) the tensors
            if dtype is not None:
                task.to(dtype=dtype)
            if has_meta(task):
                materialize(task, self.root_device, hooks_of(task).init_weights)
        task.to(self.root_device)

    def setup(self, task: nn.Module, *, manual: bool) -> nn.Module:
        """Prepare ``task`` for training; return the module the loop calls as ``model(batch, batch_idx)``
        (it runs ``task.training_step``). ``manual``: the task steps its own optimizers
        (``automatic_optimization = False``). May communicate (every rank calls it)."""
        self.checkpoint_activations(task)
        return StepAdapter(task)

    def teardown(self) -> None:
        """Drop references to wrappers built by :meth:`setup` (end of every stage), and give the modules under
        activation checkpointing their own forward back."""
        for module in self._recomputed:
            module.__dict__.pop("forward", None)
        self._recomputed = []

    def checkpoint_activations(self, task: nn.Module) -> None:
        """Make the outermost modules of the ``activation_checkpointing`` classes recompute their forward in
        backward (called by :meth:`setup` before any wrapper; their parameter names do not change). Outside
        autograd (evaluation, ``no_grad``) they run as they are.

        Raises:
            ValueError: a class that no submodule of the task is, with the task's module classes.
        """
        if self.activation_checkpointing is None:
            return
        found = match_modules(task, self.activation_checkpointing, "the strategy's activation_checkpointing")
        inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
        for module in (m for m in found if id(m) not in inner and "forward" not in m.__dict__):
            module.__dict__["forward"] = partial(_recompute_in_backward, module.forward)
            self._recomputed.append(module)

    # ------------------------------------------------------------------ the step
    def gradient_sync(self, sync: bool) -> AbstractContextManager[Any]:
        """A context for one micro-batch's forward AND backward. ``sync=False`` (all but the last
        micro-batch of an accumulation window) keeps gradients local so that the wrapper reduces them
        once per optimizer step."""
        return NO_CONTEXT

    def scale_gradients(self, params: list[torch.Tensor], factor: torch.Tensor | float) -> None:
        """Multiply the gradients of ``params`` by ``factor`` in place (the token-normalised step's scale: a
        scalar tensor on the device, so no host sync)."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

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

    def eval_context(self, task: nn.Module) -> AbstractContextManager[Any]:
        """Entered by every rank around a whole validation / test / predict loop (inside ``torch.no_grad()``)."""
        return NO_CONTEXT

    def eval_batches(self, batches: Iterable[Any], limit: int | None) -> Iterator[tuple[int, Any]]:
        """``(batch_idx, batch)`` for this rank's batches of one evaluation loader, at most ``limit`` (None: all),
        inside :meth:`eval_context`. Here ranks run different numbers of batches, so nothing the task computes
        in its step may communicate; a sharding strategy whose forward communicates makes the ranks take part in
        every forward (FSDP)."""
        for batch_idx, batch in enumerate(batches):
            if limit is not None and batch_idx >= limit:
                return
            yield batch_idx, batch

    def weights_finite(self, task: nn.Module) -> bool:
        """Whether every weight is finite (before a checkpoint is written), the same answer on every rank:
        one reduction on the device over this rank's parameters (its shards under FSDP), one host read, and
        with several ranks one all-reduce of the verdict."""
        # A DTensor's detach() is a DTensor; torch's stubs type it Tensor (without to_local).
        local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in task.parameters()]  # type: ignore[attr-defined]
        local = [t for t in local if t.numel() and t.is_floating_point()]
        if local:
            norms = torch._foreach_norm(local, ord=math.inf)
            flag = torch.isfinite(torch.stack([n.to(self.root_device) for n in norms])).all().to(torch.float32)
        else:
            flag = torch.ones((), device=self.root_device)
        if self.world_size > 1:
            flag = comm.all_reduce(flag.reshape(1), "min")
        return bool(flag.item() > 0)

    def raise_explained(self, exc: BaseException) -> None:
        """Called with an error raised by the wrapped module's forward. Raises a clearer error (chained
        to ``exc``) when the wrapper knows what it means and how to fix it; returns otherwise, and the
        caller re-raises ``exc`` unchanged."""

    # ------------------------------------------------------------------ manual optimization
    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Manual optimization, on the micro-batch that syncs: make every rank's gradients of
        ``params`` their mean over ranks (a collective in a multi-rank strategy)."""

    # ------------------------------------------------------------------ checkpoints
    # What a strategy varies in a checkpoint: how the model and optimizer state dicts are taken and loaded
    # (trainer/checkpoint/stateful.py calls these; trainer/checkpoint/checkpointer.py saves and loads them).
    def model_state_dict(self, task: nn.Module) -> dict[str, Any]:
        """The task's weights for a checkpoint, keyed as ``task.state_dict()`` (no wrapper prefixes); DTensor
        shards under FSDP (``torch.distributed.checkpoint.state_dict``, the form DCP writes and reshards)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(task)

    def full_model_state_dict(self, task: nn.Module) -> dict[str, Any]:
        """The whole weights as plain CPU tensors on rank 0 (a collective under FSDP): one plain file."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sharded = any(hasattr(p, "device_mesh") for p in task.parameters())
        return get_model_state_dict(task, options=StateDictOptions(full_state_dict=sharded, cpu_offload=True))

    def load_model_state_dict(self, task: nn.Module, state: dict[str, Any], *, strict: bool = True) -> None:
        """Load weights produced by :meth:`model_state_dict` (at any world size), or a plain full state dict
        (a weights file), into ``task``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        sharded_task = any(hasattr(p, "device_mesh") for p in task.parameters())
        full = sharded_task and not any(hasattr(v, "device_mesh") for v in state.values())
        set_model_state_dict(task, state, options=StateDictOptions(full_state_dict=full, strict=strict))

    def optimizer_state_dict(self, task: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state keyed by parameter names (DCP's form), initialised if it has not stepped."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(task, optimizer)

    def load_optimizer_state_dict(
        self, task: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load what :meth:`optimizer_state_dict` produced (parameters by name, at any world size)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(task, optimizer, state)

    def __repr__(self) -> str:
        built = ", ".join(f"{name}={value!r}" for name, value in self.settings().items())
        if not hasattr(self, "env"):
            return f"{type(self).__name__}({built})"
        where = f"world_size={self.world_size}, device={self.root_device}"
        return f"{type(self).__name__}({built + ', ' if built else ''}{where})"


_ModuleClasses = list[str | type[nn.Module]] | str | type[nn.Module]


def _class_list(owner: str, name: str, value: Any) -> list[str | type[nn.Module]] | None:
    """A setting that names module classes: a list of names or classes (one alone is a list of one), or None."""
    if value is None:
        return None
    if isinstance(value, (str, type)):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(u, (str, type)) for u in value):
        raise ValueError(
            f"{owner}({name}={value!r}): expected a non-empty list of module class names (e.g. ['Block']) or "
            "classes, or None."
        )
    return list(value)


def match_modules(task: nn.Module, wanted: list[str | type[nn.Module]], setting: str) -> list[nn.Module]:
    """The submodules of ``task`` (not the task itself) whose class is named (``__name__`` or ``__qualname__``) or
    given in ``wanted``, in ``task.modules()`` order.

    Raises:
        ValueError: a name or class in ``wanted`` that no submodule is, naming ``setting`` and the task's classes.
    """
    names = {w for w in wanted if isinstance(w, str)}
    types = tuple(w for w in wanted if isinstance(w, type))
    found = [
        m for m in task.modules() if m is not task and (_class_names(m) & names or (types and isinstance(m, types)))
    ]
    present = {n for m in found for n in _class_names(m)}
    missing = sorted(n for n in names if n not in present)
    missing += sorted(t.__name__ for t in types if not any(isinstance(m, t) for m in found))
    if missing:
        classes = sorted({type(m).__name__ for m in task.modules() if m is not task})
        raise ValueError(
            f"{setting} names {missing}, which no submodule of {type(task).__name__} is; its module classes: {classes}."
        )
    return found


def _class_names(module: nn.Module) -> set[str]:
    """The names a module's class answers to: its own, and for a class FSDP made for a sharded module
    (``FSDPBlock``, a subclass of ``FSDPModule`` and ``Block``), the user's class it was made from."""
    cls = type(module)
    names = {cls.__name__, cls.__qualname__}
    for base in cls.__bases__:
        if cls.__name__ == "FSDP" + base.__name__:
            names |= {base.__name__, base.__qualname__}
    return names


def _recompute_in_backward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _plain_setting(value: Any) -> Any:
    if isinstance(value, type):
        return value.__qualname__
    if isinstance(value, (list, tuple)):
        return [_plain_setting(v) for v in value]
    return value


def _check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}({name}={value!r}): expected True or False.")
    return value


class SingleDeviceStrategy(Strategy):
    """One process, or a launch whose world size is 1: the task runs as it is, nothing is reduced."""

    name = "single"


_DDP_BUFFER_SYNC_ARG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


class _SyncMark:
    """When the backward finished computing gradients (``time.perf_counter``), i.e. after it launched its last
    gradient all-reduce: the phase clock splits the backward there into computing and waiting for the sync
    (trainer/observability/phases.py). On CUDA ``event`` is a timing event recorded on the compute stream at that
    point, which splits the device's backward the same way (the phase clock swaps in a fresh one after each
    backward). ``stamp`` runs as an autograd engine callback queued at the start of each backward (:class:`_Carry`):
    the engine runs it when the graph is done, before DDP's own callback, which waits for the all-reduces."""

    __slots__ = ("at", "carrier", "event", "flags")

    def __init__(self, device: torch.device) -> None:
        self.at = 0.0
        self.event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        self.flags: Any = None  # the loop's CarriedFlags: the preemption flags ride on the gradients (_Carry)
        self.carrier: nn.Parameter | None = None  # the parameter whose gradient carries them

    def stamp(self) -> None:
        self.at = time.perf_counter()
        if self.event is not None:
            self.event.record()


class _Carry(torch.autograd.Function):
    """The identity on the loss, whose backward gives DDP's one-element-pair ``carrier`` parameter this rank's
    preemption flags as its gradient, so that DDP's own bucketed all-reduce (no Python communication hook, whose
    result would come back through a Python callback on the communication thread) averages them with the gradients;
    and queues the sync mark's stamp for the end of the graph. On a micro-batch that does not sync (``no_sync``)
    the carrier's gradient is zero."""

    @staticmethod
    def forward(ctx, loss, carrier, mark, syncing):  # type: ignore[no-untyped-def]
        ctx.mark, ctx.syncing, ctx.carrier = mark, syncing, carrier
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        mark = ctx.mark
        torch.autograd.Variable._execution_engine.queue_callback(mark.stamp)  # after the last gradient
        flags = mark.flags
        if flags is None or not ctx.syncing:  # zeros: the carrier takes part in every backward (static graphs)
            return grad, torch.zeros_like(ctx.carrier), None, None
        # DDP averages: the flags times the world size come back as their sum over ranks.
        _, sent = flags.pack(ctx.carrier)
        return grad, sent * comm.get_world_size(), None, None


class _CarryingAdapter(StepAdapter):
    """The :class:`StepAdapter` DDP wraps: the training step's loss goes through :class:`_Carry`, so the
    preemption flags and the sync mark ride on DDP's own all-reduce."""

    def __init__(self, task: nn.Module, mark: _SyncMark) -> None:
        super().__init__(task)
        first = next(task.parameters())  # its dtype: the carrier joins a bucket of the task's own
        self.carrier = nn.Parameter(
            torch.zeros(2, device=first.device, dtype=first.dtype if first.is_floating_point() else torch.float32)
        )
        self.mark = mark
        mark.carrier = self.carrier
        self.__dict__["_wrapper"] = lambda: None  # the DDP around it (attach): a weak reference, not a submodule

    def attach(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Remember the DDP that wraps this adapter, weakly: a module attribute would register it as a submodule,
        a cycle that leaves DDP's reducer (and its process group's threads) to the garbage collector, which can run
        it at interpreter exit while a communication thread waits for the GIL (a hang)."""
        self.__dict__["_wrapper"] = weakref.ref(ddp)

    def forward(self, batch: Any, batch_idx: int) -> Any:
        output = self.run_step(batch, batch_idx)
        ddp = self.__dict__["_wrapper"]()
        syncing = ddp is None or ddp.require_backward_grad_sync
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return _Carry.apply(output, self.carrier, self.mark, syncing)
        if isinstance(output, dict) and isinstance(loss := output.get("loss"), torch.Tensor) and loss.requires_grad:
            return {**output, "loss": _Carry.apply(loss, self.carrier, self.mark, syncing)}
        return output  # no loss to carry the flags: DDP reports the carrier unused, as it would any parameter

    __call__ = forward


class DDPStrategy(Strategy):
    """``DistributedDataParallel`` over the :class:`StepAdapter`: every rank holds the whole task, and
    gradients are averaged over ranks by DDP's bucketed all-reduce during the backward of the
    micro-batch that syncs (docs/design.md section 5)."""

    name = "ddp"
    has_sync_context = True
    SETTINGS = (
        "find_unused_parameters",
        "static_graph",
        "gradient_as_bucket_view",
        "bucket_cap_mb",
        "broadcast_buffers",
        "activation_checkpointing",
    )

    def __init__(
        self,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        activation_checkpointing: _ModuleClasses | None = None,
    ) -> None:
        """The arguments are ``DistributedDataParallel``'s of the same names (``bucket_cap_mb=None``: DDP's
        default), and ``activation_checkpointing`` as for every strategy (:meth:`Strategy.__init__`).

        Raises:
            ValueError: a setting of the wrong type or out of range, naming it.
        """
        super().__init__(activation_checkpointing=activation_checkpointing)
        owner = type(self).__name__
        self.find_unused_parameters = _check_bool(owner, "find_unused_parameters", find_unused_parameters)
        self.static_graph = _check_bool(owner, "static_graph", static_graph)
        self.gradient_as_bucket_view = _check_bool(owner, "gradient_as_bucket_view", gradient_as_bucket_view)
        self.broadcast_buffers = _check_bool(owner, "broadcast_buffers", broadcast_buffers)
        if bucket_cap_mb is not None and (
            isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0
        ):
            raise ValueError(f"{owner}(bucket_cap_mb={bucket_cap_mb!r}): expected a number of megabytes > 0, or None.")
        self.bucket_cap_mb = bucket_cap_mb
        self.ddp: nn.parallel.DistributedDataParallel | None = None

    def setup(self, task: nn.Module, *, manual: bool) -> nn.Module:
        opts = self.options
        if opts.sync_batchnorm:
            converted = nn.SyncBatchNorm.convert_sync_batchnorm(task)
            if converted is not task:  # the task itself is never a BatchNorm layer
                raise TypeError("sync_batchnorm: the task itself must not be a BatchNorm layer.")
        self.checkpoint_activations(task)
        if manual:
            adapter = StepAdapter(task)
            # Manual optimization syncs gradients in manual_backward (average_gradients); start every
            # rank from rank 0's state. One broadcast per tensor, at setup only.
            for tensor in task.state_dict().values():
                comm.broadcast(tensor, 0)
            self.ddp = None
            return adapter
        if not any(p.requires_grad for p in task.parameters()):
            raise ValueError(f"{type(task).__name__} has no trainable parameters; DDP has nothing to synchronise.")
        kwargs: dict[str, Any] = dict(
            device_ids=[device.index] if (device := self.root_device).type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )
        # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (same meaning for True; False
        # still syncs once at construction, which keel wants anyway).
        kwargs[_DDP_BUFFER_SYNC_ARG] = self.broadcast_buffers
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        # Construction broadcasts rank 0's parameters and buffers: every rank starts equal. DDP reduces with its
        # own all-reduce; the sync mark and the preemption flags ride on it through the carrying adapter.
        self.sync_mark = mark = _SyncMark(self.root_device)
        carrying = _CarryingAdapter(task, mark)
        self.ddp = nn.parallel.DistributedDataParallel(carrying, **kwargs)
        carrying.attach(self.ddp)
        return self.ddp

    def teardown(self) -> None:
        super().teardown()
        self.ddp = self.sync_mark = None

    def gradient_sync(self, sync: bool) -> AbstractContextManager[Any]:
        # no_sync must cover forward AND backward: DDP decides at forward time whether the backward
        # all-reduces. Gradients then accumulate locally until the window's last micro-batch.
        if sync or self.ddp is None:
            return NO_CONTEXT
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
            "Trainer(strategy=DDPStrategy(find_unused_parameters=True)) (or static_graph=True when the unused set "
            "never changes)."
        ) from exc

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        # One all-reduce of all current gradients (flattened). Re-reducing a gradient that an earlier
        # manual_backward of this step already averaged is harmless: it is identical on every rank.
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        comm.all_reduce(flat, "mean")
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)
