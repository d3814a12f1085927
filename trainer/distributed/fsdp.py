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
from trainer.distributed.materialize import broadcast_tensors, check_same_model, has_meta, materialize, shared_rng
from trainer.distributed.strategy import (
    NO_CONTEXT,
    StepAdapter,
    Strategy,
    _check_bool,
    _class_list,
    _ModuleClasses,
    _plain_setting,
    hooks_of,
    match_modules,
)
from trainer.options import TrainerOptions

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable, Iterable, Iterator, Sequence

    from torch.distributed.fsdp import FSDPModule


class FSDPStrategy(Strategy):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``): each rank holds 1/world_size of the parameters,
    gradients and optimizer state (DTensors sharded on dim 0); a unit's parameters are all-gathered for
    its forward and backward and its gradients reduce-scattered after backward.

    The task itself is the root unit (``task(x)``, ``validation_step`` and the others run on the sharded
    task), plus one unit per module of ``units`` (default: every module held in an ``nn.ModuleList``,
    the usual transformer blocks); parameters outside every unit belong to the root. The task is sharded in
    every stage's setup (:meth:`prepare_model`), so no stage holds the whole model: a task built on the meta
    device is sharded while empty and then materialised shard by shard, one built eagerly is moved to the device
    a unit at a time. ``training_step`` is registered as an FSDP forward method, so it all-gathers the root's
    parameters like ``forward`` does. Evaluation gathers unit by unit as training does, every rank running the
    same number of forwards (:meth:`eval_batches`). Initial weights do not depend on the world size.
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
        "activation_checkpointing",
        "tensor_parallel_size",
        "replicate_size",
    )
    MESH_DIMS = ("data_parallel", "tensor_parallel")  # Lightning's ModelParallelStrategy names them so too
    HSDP_DIMS = ("replicate", "shard", "tensor_parallel")  # replicate x shard is flattened as "data_parallel"
    REDUCE_GRADS = ("every_micro_batch", "last_micro_batch")

    def __init__(
        self,
        *,
        units: list[str | type[nn.Module]] | str | type[nn.Module] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        reduce_grads: str = "every_micro_batch",
        activation_checkpointing: _ModuleClasses | None = None,
        tensor_parallel_size: int = 1,
        replicate_size: int | str = 1,
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
            activation_checkpointing: Module classes whose forward is recomputed in backward (for example the
                blocks: ``["Block"]``), as for every strategy (:meth:`Strategy.__init__`). None: off.
            tensor_parallel_size: Ranks that split each layer between them (tensor parallelism). With T > 1 the
                ranks form a ``(world_size // T, T)`` mesh named ``("data_parallel", "tensor_parallel")``, which the
                task reads as ``self.device_mesh`` in ``configure_model`` to apply its plan
                (``parallelize_module(self, self.device_mesh["tensor_parallel"], plan)``); the parameters are
                then sharded over the data-parallel dimension, and the data is split by data-parallel rank.
            replicate_size: Hybrid sharding (HSDP): R groups of ranks each hold a whole sharded copy of the model,
                sharded within the group and replicated across groups, so the parameter all-gathers stay inside a
                group (a node) and only the gradient all-reduce crosses groups. ``"auto"``: the number of nodes
                (world size / processes per node). The mesh is ``(R, world_size // (R x T), T)`` named
                ``("replicate", "shard", "tensor_parallel")``, with ``"data_parallel"`` the flattened first two.
                1: every rank shards the model (FSDP).

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
        if (
            isinstance(tensor_parallel_size, bool)
            or not isinstance(tensor_parallel_size, int)
            or tensor_parallel_size < 1
        ):
            raise ValueError(f"{owner}(tensor_parallel_size={tensor_parallel_size!r}): expected a whole number >= 1.")
        self.tensor_parallel_size = tensor_parallel_size
        if replicate_size != "auto" and (
            isinstance(replicate_size, bool) or not isinstance(replicate_size, int) or replicate_size < 1
        ):
            raise ValueError(
                f"{owner}(replicate_size={replicate_size!r}): expected a whole number >= 1 (the groups of ranks that "
                "each hold a sharded copy of the model) or 'auto' (one group per node)."
            )
        self.replicate_size = replicate_size  # as given ("auto" stays "auto": the next run may have other nodes)
        self.replicas = 1  # the replica groups of this run, resolved when connected
        self.task: nn.Module | None = None
        self._sync: bool | None = None  # the requires_gradient_sync flag last set on the units
        self.device_mesh: Any = None  # the DeviceMesh the parameters are sharded over (setup_mesh)
        self._eval_forward: list[tuple[Any, bool]] = []  # the units the last evaluation forward gathered (eval_batches)
        self._recording: list[tuple[Any, bool]] | None = None  # the forward being recorded (_EvalForwards)

    def settings(self) -> dict[str, Any]:
        return {
            "units": _plain_setting(self.units_wanted),
            **{k: _plain_setting(getattr(self, k)) for k in self.SETTINGS[1:]},
        }

    def connect(self, env: DistEnv, device: torch.device, options: TrainerOptions) -> None:
        tp, owner = self.tensor_parallel_size, type(self).__name__
        if env.world_size % tp:
            raise ValueError(
                f"{owner}(tensor_parallel_size={tp}) does not divide the world size {env.world_size}: "
                f"launch a multiple of {tp} processes, or pick a tensor-parallel size that divides {env.world_size} "
                "(usually the GPUs of one node)."
            )
        nodes = max(1, env.world_size // max(1, env.local_world_size))
        replicas = nodes if self.replicate_size == "auto" else int(self.replicate_size)
        if (env.world_size // tp) % replicas:
            raise ValueError(
                f"{owner}(replicate_size={self.replicate_size!r}) gives {replicas} replica groups, which do not divide "
                f"the {env.world_size // tp} data-parallel ranks (world size {env.world_size}, tensor-parallel size "
                f"{tp}): pick a replicate size that divides them (usually the number of nodes, 'auto')."
            )
        self.replicas = replicas
        super().connect(env, device, options)

    def mesh_layout(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The shape and dimension names of the run's mesh: ``(data_parallel, tensor_parallel)``, or with hybrid
        sharding ``(replicate, shard, tensor_parallel)``."""
        replicas, tp, dp = self.replicas, self.tensor_parallel_size, self.data_parallel_size
        if replicas == 1:
            return (dp, tp), self.MESH_DIMS
        return (replicas, dp // replicas, tp), self.HSDP_DIMS

    def build_mesh(self, make: Callable[[tuple[int, ...], tuple[str, ...]], Any]) -> Any:
        """``make(shape, names)`` of :meth:`mesh_layout` (a ``DeviceMesh``); under hybrid sharding its replicate and
        shard dimensions are also named ``"data_parallel"`` together (the task's ``self.device_mesh`` has the same
        names with and without it)."""
        shape, names = self.mesh_layout()
        mesh = make(shape, names)
        if names == self.HSDP_DIMS:
            mesh["replicate", "shard"]._flatten("data_parallel")
        return mesh

    def prepare_model(self, task: nn.Module, *, dtype: torch.dtype | None) -> None:
        """Every stage: the task sharded, on its device, every weight real, with the same initial weights at every
        world size (a collective; docs/fsdp.md, "What a rank holds").

        1. Tensors the task built eagerly get rank 0's values (one broadcast per tensor, through the device).
        2. ``task.configure_model()`` runs with rank 0's random state (restored after it on the other ranks): the
           layers it builds and the tensor-parallel plan it applies start as rank 0's.
        3. The task takes ``dtype`` (precision ``"64"``) and is sharded (:meth:`shard`): ``fully_shard`` moves each
           unit's tensors to the device and keeps this rank's shard, so the device never holds the whole model.
        4. What is still on the meta device is materialised shard by shard (:func:`materialize`): each module's
           parameters at full size, ``task.init_weights(module)`` under rank 0's random state, this rank's slice
           kept. The peak beyond the shards is one module's full parameters.

        A task an earlier stage sharded only runs ``configure_model`` again (it should build only what is missing).
        An eager task under tensor parallelism moves to the device whole before its plan splits it (the plan
        splits full tensors); build it on the meta device to avoid that.
        """
        self.setup_mesh()
        if any(_is_dtensor(p) for p in task.parameters()):  # sharded by an earlier stage
            with shared_rng(self.root_device):
                hooks_of(task).configure_model()
            return
        check_same_model(task, "built")  # before the first broadcast of its tensors
        broadcast_tensors(task, self.root_device)
        if self.tensor_parallel_size > 1 and not has_meta(task):
            task.to(self.root_device)  # the plan's distribute_tensor splits full tensors already on the device
        with shared_rng(self.root_device):
            hooks_of(task).configure_model()
        check_same_model(task, "configured")  # what configure_model built, before sharding splits it
        if dtype is not None:
            task.to(dtype=dtype)
        self.shard(task)
        with shared_rng(self.root_device):
            materialize(task, self.root_device, hooks_of(task).init_weights)
        task.to(self.root_device)  # buffers outside every unit, and a task without parameters

    def shard(self, task: nn.Module) -> None:
        """``fully_shard`` each unit (:meth:`units`) and then the task as root, over :meth:`shard_mesh`, with the
        precision and offload policies of the run. A task whose ``configure_model`` called ``fully_shard`` itself
        keeps its units (only a root it left plain is sharded). BatchNorm is refused without ``sync_batchnorm``.

        Under ``bf16-mixed`` the arithmetic is autocast's, as without FSDP, and no bf16 copy of the blocks' weights
        outlives their backward: a unit gathers bf16 parameters (``param_dtype``, the values autocast's cast would
        give) and reduces gradients in fp32, over fp32 sharded master weights; its embeddings and normalisation
        layers (:func:`full_precision_modules`) are nested units gathered in fp32, since autocast leaves them in
        fp32; the root gathers fp32 and autocast casts its weights as it would without FSDP. The units neither cast
        their inputs nor their outputs, so the residual stream keeps the dtype autocast gives it.
        """
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        self._check_batchnorm(task)
        if self.options.sync_batchnorm:
            converted = nn.SyncBatchNorm.convert_sync_batchnorm(task)
            if converted is not task:
                raise TypeError("sync_batchnorm: the task itself must not be a BatchNorm layer.")
        self._check_tensor_parallel(task)
        full = mp = MixedPrecisionPolicy()
        if self.options.precision == "bf16-mixed":
            mp = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.float32,
                cast_forward_inputs=False,
            )
        offload = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda") if self.cpu_offload else OffloadPolicy()
        kwargs: dict[str, Any] = dict(
            mesh=self.shard_mesh(),
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=mp,
            offload_policy=offload,
        )
        if not any(isinstance(m, FSDPModule) for m in task.modules()):
            for unit in self.units(task):
                kept = full_precision_modules(unit) if mp is not full else []
                for module in kept:
                    if module is not unit:  # its own small unit (torch's memory tracker refuses grouped units)
                        fully_shard(module, **{**kwargs, "mp_policy": full})
                fully_shard(unit, **{**kwargs, "mp_policy": full if kept == [unit] else mp})
            if mp is not full:
                _autocast_outside_the_loop(task, self.root_device.type)
        if not isinstance(task, FSDPModule):
            # The root: every parameter left outside the units. It keeps them gathered from forward to backward,
            # which needs them first (FSDP2's own choice for a root: one all-gather a step fewer).
            fully_shard(task, **{**kwargs, "mp_policy": full, "reshard_after_forward": False})

    def setup(self, task: nn.Module, *, manual: bool) -> nn.Module:
        from torch.distributed.fsdp import register_fsdp_forward_method

        if not any(p.requires_grad for p in task.parameters()):
            raise ValueError(f"{type(task).__name__} has no trainable parameters; FSDP has nothing to shard.")
        # The forward of the activation-checkpointing classes recomputes in backward; FSDP's hooks on the units
        # gather around it (its pre-backward hook unshards a unit before its recomputed forward runs).
        self.checkpoint_activations(task)
        adapter = StepAdapter(task)  # before registration: it reads training_step's own signature
        for method in self.STEP_METHODS:
            if callable(getattr(task, method, None)):
                register_fsdp_forward_method(task, method)
        adapter.bind()  # the registered training_step, which unshards around the step
        self.task, self._sync = task, None
        return adapter

    def setup_mesh(self) -> Any:
        """The ``DeviceMesh`` over every rank (:meth:`mesh_layout`; the tensor-parallel size is 1 without tensor
        parallelism; a tensor-parallel group is ``tensor_parallel_size`` consecutive ranks, a replica group
        consecutive blocks of ranks: a node), made on the first call (a collective: the process group must exist) and
        kept for the strategy's life."""
        if self.device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self.device_mesh = self.build_mesh(
                lambda shape, names: init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)
            )
        return self.device_mesh

    def shard_mesh(self) -> Any:
        """The mesh the parameters are sharded over: the data-parallel dimension, or under hybrid sharding the 2-D
        ``(replicate, shard)`` mesh (FSDP2 shards over the second and replicates over the first)."""
        mesh = self.setup_mesh()
        return mesh["replicate", "shard"] if self.replicas > 1 else mesh["data_parallel"]

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
            return NO_CONTEXT
        if sync != self._sync:
            cast("FSDPModule", self.task).set_requires_gradient_sync(sync)  # fully_shard made the task one
            self._sync = sync
        return NO_CONTEXT

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
        return _EvalForwards(self, task)

    def eval_batches(self, batches: Iterable[Any], limit: int | None) -> Iterator[tuple[int, Any]]:
        """This rank's evaluation batches, then as many forwards without a batch as the ranks with the most
        batches still run, so that every rank takes part in every all-gather (:class:`_EvalForwards`). The number
        is agreed before the first batch when the loader has a length (one all-gather), else one small all-reduce
        per batch.

        Raises:
            RuntimeError: on every rank, when some rank has no batch to take part with and has never run an
                evaluation forward (fewer samples than data-parallel ranks), naming the fix.
        """
        if self.world_size == 1:
            yield from super().eval_batches(batches, limit)
            return
        known = _length(batches)
        if known is not None:
            mine = known if limit is None else min(known, limit)
            rows = comm.all_gather_tensor(torch.tensor([mine, int(bool(self._eval_forward))], device=self.root_device))
            counts = [(int(r[0]), bool(r[1])) for r in rows]
            most = max(n for n, _ in counts)
            self._refuse_if_unrecorded([r for r, (n, recorded) in enumerate(counts) if n == 0 < most and not recorded])
            for batch_idx, batch in enumerate(batches):
                if batch_idx >= mine:
                    break
                yield from self._recorded(batch_idx, batch)
            for _ in range(most - mine):
                self._replay()
            return
        iterator, batch_idx = iter(batches), 0
        while True:
            batch = next(iterator, _END) if limit is None or batch_idx < limit else _END
            here = batch is not _END
            flags = comm.all_reduce(
                torch.tensor([float(here), -float(here or bool(self._eval_forward))], device=self.root_device), "max"
            )
            if flags[0] == 0:
                return
            if -flags[1] == 0:
                self._refuse_if_unrecorded(None)
            if here:
                yield from self._recorded(batch_idx, batch)
                batch_idx += 1
            else:
                self._replay()

    def _recorded(self, batch_idx: int, batch: Any) -> Iterator[tuple[int, Any]]:
        forward: list[tuple[Any, bool]] = []
        self._recording = forward
        try:
            yield batch_idx, batch
        finally:
            self._recording = None
        if forward:
            self._eval_forward = forward

    def _replay(self) -> None:
        """The collectives of one evaluation forward without running it: each unit the last recorded forward
        gathered, all-gathered and freed again in the same order (FSDP's ``unshard`` / ``reshard``)."""
        for unit, resharded in self._eval_forward:
            unit.unshard()
            if resharded:
                unit.reshard()

    def _refuse_if_unrecorded(self, ranks: list[int] | None) -> None:
        if ranks == []:
            return
        which = f"rank(s) {ranks}" if ranks else "a rank"
        raise RuntimeError(
            f"FSDP evaluation: {which} of {self.data_parallel_size} data-parallel ranks got no batch of this loader, "
            "and every rank must run the same number of forwards (each one all-gathers parameters from every rank). "
            f"Give the loader at least {self.data_parallel_size} samples (one per data-parallel rank), or evaluate "
            "on fewer ranks."
        )


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


_END = object()


def _length(batches: Any) -> int | None:
    try:
        return len(batches)
    except TypeError:
        return None


class _EvalForwards:
    """Around an FSDP evaluation loop: records, for each forward, which units it gathered and whether each was
    freed after its forward (hooks on every unit), so that a rank out of batches can take part in the other ranks'
    forwards (:meth:`FSDPStrategy.eval_batches`). On exit every unit is resharded: nothing stays gathered."""

    def __init__(self, strategy: FSDPStrategy, task: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.strategy = strategy
        self.units = [m for m in task.modules() if isinstance(m, FSDPModule)]
        self.handles: list[Any] = []

    def __enter__(self) -> None:
        strategy = self.strategy
        strategy._recording = None
        open_units: list[int] = []  # indices into the recording of the units whose forward is running
        for unit in self.units:
            owner, name = _managed_parameter(unit, self.units)

            def before(module: nn.Module, args: Any) -> None:
                if strategy._recording is not None:
                    open_units.append(len(strategy._recording))
                    strategy._recording.append((module, False))

            def after(module: nn.Module, args: Any, output: Any, owner: Any = owner, name: str = name) -> None:
                if strategy._recording is not None and open_units:
                    # FSDP frees a unit's gathered parameters by registering its shards (DTensors) again.
                    freed = owner is not None and _is_dtensor(owner._parameters.get(name))
                    strategy._recording[open_units.pop()] = (module, freed)

            # Registered after FSDP's own hooks: `after` sees the unit once FSDP has freed (or kept) its parameters.
            self.handles += [unit.register_forward_pre_hook(before), unit.register_forward_hook(after)]

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.strategy._recording = None
        for unit in self.units:
            cast("FSDPModule", unit).reshard()


def _managed_parameter(unit: nn.Module, units: Sequence[nn.Module]) -> tuple[nn.Module | None, str]:
    """One parameter ``unit`` gathers itself (its nearest enclosing unit is ``unit``), as (owning module, name);
    ``(None, "")`` when every parameter below it belongs to a nested unit."""
    nested = {id(m) for m in units if m is not unit}

    def search(module: nn.Module) -> tuple[nn.Module | None, str]:
        for name, param in module._parameters.items():
            if param is not None:
                return module, name
        for child in module.children():
            if id(child) not in nested:
                found = search(child)
                if found[0] is not None:
                    return found
        return None, ""

    return search(unit)


_FULL_PRECISION = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.modules.batchnorm._NormBase,
)


def full_precision_modules(unit: nn.Module) -> list[nn.Module]:
    """The modules of ``unit`` (itself included) that keep fp32 parameters under ``bf16-mixed``, outermost first:
    embeddings and normalisation layers (torch's classes and any class whose name ends in ``Norm``, such as a
    hand-written RMSNorm), those with parameters. Autocast computes none of them in bf16: an embedding returns its
    weight's dtype, so a bf16 weight would make the residual stream bf16, and a norm runs in fp32."""
    found = [
        m
        for m in unit.modules()
        if (isinstance(m, _FULL_PRECISION) or type(m).__name__.endswith("Norm")) and any(True for _ in m.parameters())
    ]
    inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inner]


def _autocast_outside_the_loop(task: nn.Module, device_type: str) -> None:
    """A task whose units gather bf16 weights computes under bf16 autocast wherever it is called: the Trainer's
    stages already run in autocast; a call outside them (``task(x)`` after ``fit``, sampling in ``on_fit_end``)
    enters it for that forward, since an fp32 activation cannot meet a unit's bf16 weight (under DDP the same call
    computes in fp32)."""
    entered: list[AbstractContextManager[Any] | None] = []

    def enter(module: nn.Module, args: Any) -> None:
        context = None if torch.is_autocast_enabled(device_type) else torch.autocast(device_type, torch.bfloat16)
        if context is not None:
            context.__enter__()
        entered.append(context)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        context = entered.pop()
        if context is not None:
            context.__exit__(None, None, None)

    task.register_forward_pre_hook(enter, prepend=True)
    task.register_forward_hook(leave, always_call=True)
