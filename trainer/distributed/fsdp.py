"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the strategy that shards parameters, gradients and optimizer
state over the ranks. See :mod:`trainer.distributed.strategy` for the contract every strategy keeps, and docs/fsdp.md.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from trainer.distributed import comm
from trainer.distributed.launcher import DistEnv
from trainer.distributed.strategy import (
    _NO_CONTEXT,
    StepAdapter,
    Strategy,
    _check_bool,
    _class_list,
    _ModuleClasses,
    _plain_setting,
    match_modules,
)
from trainer.options import TrainerOptions

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.fsdp import FSDPModule

    from trainer.module import TaskModule


class FSDPStrategy(Strategy):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``): each rank holds 1/world_size of the parameters,
    gradients and optimizer state (DTensors sharded on dim 0); a unit's parameters are all-gathered for
    its forward and backward and its gradients reduce-scattered after backward.

    The task itself is the root unit (``task(x)``, ``validation_step`` and the others run on the sharded
    task), plus one unit per module of ``units`` (default: every module held in an ``nn.ModuleList``,
    the usual transformer blocks); parameters outside every unit belong to the root. ``training_step`` is
    registered as an FSDP forward method, so it all-gathers the root's parameters like ``forward`` does;
    the evaluation loops run inside :meth:`eval_context`, with every unit gathered once for the whole loop
    (registering the evaluation steps too would reshard after each nested ``self(x)`` and all-gather per
    batch, which hangs when ranks run different numbers of batches).
    Initial weights are rank 0's, broadcast before sharding, so they are the same at every world size.
    Checkpoints are the same folders as under DDP (each rank writes its shards). See docs/fsdp.md.
    """

    name = "fsdp"
    has_sync_context = True
    needs_process_group = True
    STEP_METHODS = ("training_step",)
    SETTINGS = (
        "units",
        "reshard_after_forward",
        "cpu_offload",
        "reduce_grads",
        "bf16_params",
        "activation_checkpointing",
        "tensor_parallel_size",
    )
    MESH_DIMS = ("data_parallel", "tensor_parallel")  # Lightning's ModelParallelStrategy names them so too
    REDUCE_GRADS = ("every_micro_batch", "last_micro_batch")

    def __init__(
        self,
        *,
        units: list[str | type[nn.Module]] | str | type[nn.Module] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        reduce_grads: str = "every_micro_batch",
        bf16_params: bool = False,
        activation_checkpointing: _ModuleClasses | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        """
        Args:
            units: Which submodules become FSDP units, as class names (YAML) or classes. None: every module held
                in an ``nn.ModuleList``. The task itself is always the root unit.
            reshard_after_forward: Free a unit's gathered parameters after its forward (and all-gather them
                again in backward): less memory, more traffic. The root (the task) keeps its own parameters
                gathered until backward either way, as FSDP2 does by default: backward needs them first.
            cpu_offload: Keep the sharded parameters, gradients and optimizer state in CPU memory (the optimizer
                step runs on the CPU).
            reduce_grads: Under accumulation, reduce-scatter gradients after ``"every_micro_batch"`` (less
                memory) or after the ``"last_micro_batch"`` of each window (less traffic). Same maths either way.
            bf16_params: With ``precision="bf16-mixed"`` only: all-gather and compute with bf16 parameters (half
                the traffic and unsharded memory, but bf16 numerics).
            activation_checkpointing: Module classes whose forward is recomputed in backward (for example the
                blocks: ``["Block"]``), as for every strategy (:meth:`Strategy.__init__`). None: off.
            tensor_parallel_size: Ranks that split each layer between them (tensor parallelism). With T > 1 the
                ranks form a ``(world_size // T, T)`` mesh named ``("data_parallel", "tensor_parallel")``, which the
                task reads as ``self.device_mesh`` in ``configure_model`` to apply its plan
                (``parallelize_module(self, self.device_mesh["tensor_parallel"], plan)``); the parameters are
                then sharded over the data-parallel dimension, and the data is split by data-parallel rank.

        Raises:
            ValueError: a setting of the wrong type or value, naming it and what is expected.
        """
        super().__init__(activation_checkpointing=activation_checkpointing)
        owner = type(self).__name__
        if reduce_grads not in self.REDUCE_GRADS:
            raise ValueError(
                f"{owner}(reduce_grads={reduce_grads!r}): expected 'every_micro_batch' (reduce-scatter each "
                "backward: sharded gradients, less memory, more traffic) or 'last_micro_batch' (once per "
                "accumulation window, like DDP's no_sync)."
            )
        self.units_wanted = _class_list(owner, "units", units)  # None: every module held in an nn.ModuleList
        self.reshard_after_forward = _check_bool(owner, "reshard_after_forward", reshard_after_forward)
        self.cpu_offload = _check_bool(owner, "cpu_offload", cpu_offload)
        self.reduce_grads = reduce_grads
        self.bf16_params = _check_bool(owner, "bf16_params", bf16_params)
        if (
            isinstance(tensor_parallel_size, bool)
            or not isinstance(tensor_parallel_size, int)
            or tensor_parallel_size < 1
        ):
            raise ValueError(f"{owner}(tensor_parallel_size={tensor_parallel_size!r}): expected a whole number >= 1.")
        self.tensor_parallel_size = tensor_parallel_size
        self.task: nn.Module | None = None
        self._sync: bool | None = None  # the requires_gradient_sync flag last set on the units
        self.device_mesh: Any = None  # the DeviceMesh the parameters are sharded over (setup_mesh)

    def settings(self) -> dict[str, Any]:
        return {
            "units": _plain_setting(self.units_wanted),
            **{k: _plain_setting(getattr(self, k)) for k in self.SETTINGS[1:]},
        }

    def connect(self, env: DistEnv, device: torch.device, options: TrainerOptions) -> None:
        if self.bf16_params and options.precision != "bf16-mixed":
            raise ValueError(
                f"{type(self).__name__}(bf16_params=True) needs Trainer(precision='bf16-mixed') "
                f"(precision={options.precision!r}): pass bf16_params=False or precision='bf16-mixed'."
            )
        tp = self.tensor_parallel_size
        if env.world_size % tp:
            raise ValueError(
                f"{type(self).__name__}(tensor_parallel_size={tp}) does not divide the world size {env.world_size}: "
                f"launch a multiple of {tp} processes, or pick a tensor-parallel size that divides {env.world_size} "
                "(usually the GPUs of one node)."
            )
        super().connect(env, device, options)

    def configure_model(self, task: TaskModule) -> None:
        """Make the mesh (``task.device_mesh``), then run ``task.configure_model()`` so that every rank builds
        rank 0's weights: an unsharded task first gets rank 0's weights and buffers (one broadcast per tensor), and
        ``configure_model`` runs with rank 0's random state (restored after it on the other ranks). So the
        initial weights do not depend on the world size, whether ``configure_model`` builds layers, applies a
        tensor-parallel plan (which splits full tensors) or calls ``fully_shard`` itself. The task moves to its
        device first, so a plan splits tensors already there (and NCCL broadcasts device tensors). Collective."""
        self.setup_mesh()
        task.to(self.root_device)
        if self.world_size == 1:
            task.configure_model()
            return
        if not any(_is_dtensor(p) for p in task.parameters()):  # not sharded by an earlier stage
            for tensor in task.state_dict().values():
                comm.broadcast(tensor, 0)
        devices = [self.root_device] if self.root_device.type == "cuda" else []
        states = comm.broadcast_object(_rng_states(devices), 0)
        if self.global_rank == 0:
            task.configure_model()
            return
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(states[0])
            if devices:
                torch.cuda.set_rng_state(states[1], devices[0])
            task.configure_model()

    def setup(self, task: TaskModule, *, manual: bool) -> nn.Module:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        opts = self.options
        self._check_batchnorm(task)
        if opts.sync_batchnorm:
            converted = nn.SyncBatchNorm.convert_sync_batchnorm(task)
            if converted is not task:
                raise TypeError("sync_batchnorm: the task itself must not be a BatchNorm layer.")
        if not any(p.requires_grad for p in task.parameters()):
            raise ValueError(f"{type(task).__name__} has no trainable parameters; FSDP has nothing to shard.")
        # Every rank holds rank 0's weights here (configure_model saw to it).
        mesh = self.shard_mesh()
        self._check_tensor_parallel(task)
        # bf16-mixed: fp32 sharded master weights and fp32 gradient reduction; compute in bf16 through the
        # precision plugin's autocast (the numerics of DDP's bf16-mixed, and Lightning's FSDP mapping).
        # bf16_params also gathers and computes with bf16 parameters: half the all-gather traffic and
        # unsharded-parameter memory, at a measured cost in accuracy (benchmarks/results/charlm.md).
        mp = (
            MixedPrecisionPolicy(reduce_dtype=torch.float32)
            if opts.precision == "bf16-mixed"
            else MixedPrecisionPolicy()
        )
        if self.bf16_params:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda") if self.cpu_offload else OffloadPolicy()
        kwargs: dict[str, Any] = dict(
            mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp, offload_policy=offload
        )
        self.checkpoint_activations(task)  # inside the units: FSDP's hooks gather around the recomputed forward
        from torch.distributed.fsdp import FSDPModule

        # A task whose configure_model called fully_shard itself (Lightning's ModelParallelStrategy) chose its units:
        # nothing is sharded twice, and only a root it left plain is sharded here.
        if not any(isinstance(m, FSDPModule) for m in task.modules()):
            for unit in self.units(task):
                fully_shard(unit, **kwargs)
        if not isinstance(task, FSDPModule):
            # The root: every parameter left outside the units. It keeps them gathered from forward to backward,
            # which needs them first (FSDP2's own choice for a root: one all-gather a step fewer).
            fully_shard(task, **{**kwargs, "reshard_after_forward": False})
        adapter = StepAdapter(task)  # before registration: it reads training_step's own signature
        for method in self.STEP_METHODS:
            if callable(getattr(task, method, None)):
                register_fsdp_forward_method(task, method)
        adapter.bind()  # the registered training_step, which unshards around the step
        self.task, self._sync = task, None
        return adapter

    def setup_mesh(self) -> Any:
        """The ``(data_parallel, tensor_parallel)`` ``DeviceMesh`` over every rank (the tensor-parallel size is 1
        without tensor parallelism; a tensor-parallel group is ``tensor_parallel_size`` consecutive ranks), made on
        the first call (a collective: the process group must exist) and kept for the strategy's life."""
        if self.device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            shape = (self.data_parallel_size, self.tensor_parallel_size)
            self.device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=self.MESH_DIMS)
        return self.device_mesh

    def shard_mesh(self) -> Any:
        """The mesh the parameters are sharded over: the data-parallel dimension."""
        return self.setup_mesh()["data_parallel"]

    def _check_tensor_parallel(self, task: nn.Module) -> None:
        if self.tensor_parallel_size == 1:
            return
        split = [p for p in task.parameters() if "tensor_parallel" in _mesh_dims(p)]
        if not split:
            raise ValueError(
                f"{type(self).__name__}(tensor_parallel_size={self.tensor_parallel_size}): {type(task).__name__}."
                "configure_model applied no tensor-parallel plan, so every tensor-parallel rank would compute the "
                "same thing. Apply one there (parallelize_module(self, self.device_mesh['tensor_parallel'], plan)), "
                "or pass tensor_parallel_size=1."
            )

    def units(self, task: nn.Module) -> list[nn.Module]:
        """The modules that become FSDP units (besides the root), outermost first, none inside another.

        Raises:
            ValueError: ``units`` names a class that no submodule of the task has.
        """
        wanted = self.units_wanted
        if wanted is None:
            found = [m for holder in task.modules() if isinstance(holder, nn.ModuleList) for m in holder]
        else:
            found = match_modules(task, wanted, f"{type(self).__name__}(units=...)")
        inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
        units = [m for m in found if id(m) not in inner and any(True for _ in m.parameters())]
        return units

    def _check_batchnorm(self, task: nn.Module) -> None:
        if self.options.sync_batchnorm:
            return
        bn = [
            name
            for name, m in task.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
        ]
        if bn:
            raise ValueError(
                f"strategy='fsdp': {type(task).__name__} has BatchNorm layers ({', '.join(bn[:5])}), whose running "
                "statistics FSDP does not synchronise (each rank would drift, and a checkpoint keeps one rank's). "
                "Pass sync_batchnorm=True (SyncBatchNorm: statistics over the global batch) or use LayerNorm/GroupNorm."
            )

    def teardown(self) -> None:
        super().teardown()
        self._sync = None  # the mesh stays: tensor-parallel parameters hold it, and the next stage uses it

    def gradient_sync(self, sync: bool) -> AbstractContextManager[Any]:
        # 'last_micro_batch': reduce-scatter once per window (full-size unsharded gradients are held
        # until then, like DDP's no_sync). 'every_micro_batch': every backward reduce-scatters, so
        # gradients stay sharded (less memory, more traffic); the maths is the same.
        if self.reduce_grads == "every_micro_batch" or self.task is None:
            return _NO_CONTEXT
        if sync != self._sync:
            cast("FSDPModule", self.task).set_requires_gradient_sync(sync)  # fully_shard made the task one
            self._sync = sync
        return _NO_CONTEXT

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> None:
        # Every gradient is a DTensor (all parameters are in a unit): its norm is over the whole tensor. With
        # tensor parallelism, split layers live on the 2-D mesh and the others on its data-parallel dimension;
        # torch cannot stack norms of two meshes, so the norm is taken per mesh and combined (one 2-norm).
        by_mesh = _by_mesh(params)
        if len(by_mesh) <= 1:
            nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
            return
        norms = [nn.utils.get_total_norm([p.grad for p in group], foreach=True) for group in by_mesh]
        total = torch.linalg.vector_norm(torch.stack([_full(n) for n in norms]))
        for group in by_mesh:
            nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)

    def scale_gradients(self, params: list[torch.Tensor], factor: torch.Tensor | float) -> None:
        for group in _by_mesh(params):  # one foreach kernel per mesh (torch's foreach ops take one mesh)
            torch._foreach_mul_([p.grad for p in group], factor)

    def clip_grad_value(self, params: list[torch.Tensor], clip_value: float) -> None:
        for group in _by_mesh(params):
            nn.utils.clip_grad_value_(group, clip_value, foreach=True)

    def eval_context(self, task: nn.Module) -> AbstractContextManager[Any]:
        return _Unsharded(task, reshard_after_forward=self.reshard_after_forward)


def _is_dtensor(tensor: Any) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local")


def _mesh_dims(tensor: Any) -> tuple[str, ...]:
    mesh = getattr(tensor, "device_mesh", None)
    return tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()


def _full(tensor: Any) -> torch.Tensor:
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def _by_mesh(params: list[Any]) -> list[list[Any]]:
    """The ``params`` that have a gradient, grouped by the device mesh it lives on (plain tensors together), in
    first-seen order."""
    groups: dict[Any, list[Any]] = {}
    for param in params:
        if param.grad is not None:
            groups.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    return list(groups.values())


def _rng_states(devices: list[torch.device]) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]


class _Unsharded:
    """FSDP evaluation: all-gather every unit once on entry (collectives, every rank in the same order)
    and keep the parameters unsharded until exit, so per-batch forwards never communicate while ranks
    run different numbers of batches. Costs the full parameters' memory for the loop's duration."""

    def __init__(self, task: nn.Module, *, reshard_after_forward: bool) -> None:
        units = [m for m in task.modules() if hasattr(m, "unshard") and hasattr(m, "set_reshard_after_forward")]
        self.modules = cast("list[FSDPModule]", units)  # the FSDP units (fully_shard made them FSDPModules)
        self.root, self.reshard_after_forward = task, reshard_after_forward

    def __enter__(self) -> None:
        for m in self.modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()

    def __exit__(self, *exc: object) -> None:
        for m in self.modules:
            m.reshard()
            root = m is cast("FSDPModule", self.root)
            m.set_reshard_after_forward(self.reshard_after_forward and not root, recurse=False)
