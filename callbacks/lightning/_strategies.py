"""Lightning's strategy classes (``lightning.pytorch.strategies``) as keel's strategies.

``DDPStrategy(find_unused_parameters=True)`` and ``FSDPStrategy(auto_wrap_policy={Block}, cpu_offload=True)`` build
keel's :class:`~trainer.distributed.strategy.DDPStrategy` and :class:`~trainer.distributed.fsdp.FSDPStrategy` with
those settings, so a Lightning program that passes one to its Trainer runs unchanged. ``isinstance(trainer.strategy,
DDPStrategy)`` is True for keel's own DDP strategy too (``strategy="ddp"``). An argument keel has no equivalent for
raises ``TypeError`` naming it and what to do instead: keel never ignores a setting.
"""

from __future__ import annotations

from typing import Any, NoReturn

from trainer.distributed import fsdp as _fsdp
from trainer.distributed import strategy as _strategy

_LAUNCH = "keel reads the devices, the cluster and the backend from torchrun / SLURM"
# Lightning's constructor arguments keel takes only at their defaults, with what to do instead.
_REFUSED = {
    "accelerator": _LAUNCH,
    "parallel_devices": _LAUNCH,
    "cluster_environment": _LAUNCH,
    "checkpoint_io": "keel writes its own checkpoint folders (docs/checkpoints.md)",
    "precision_plugin": "pass Trainer(precision=...)",
    "precision": "pass Trainer(precision=...)",
    "mixed_precision": "pass Trainer(precision='bf16-mixed'): FSDP then gathers and computes in bf16 over fp32 shards",
    "ddp_comm_state": "keel registers no DDP communication hooks",
    "ddp_comm_hook": "keel registers no DDP communication hooks",
    "ddp_comm_wrapper": "keel registers no DDP communication hooks",
    "model_averaging_period": "keel registers no DDP communication hooks",
    "timeout": "pass Trainer(process_group_timeout=seconds)",
    "device_mesh": "not supported yet: keel's FSDP strategy shards over every rank",
}


def _refuse(cls: str, name: str, value: Any, why: str) -> NoReturn:
    raise TypeError(f"{cls}({name}={value!r}): {why}.")


def _check_lightning_arguments(cls: str, given: dict[str, Any]) -> None:
    for name, value in given.items():
        if name == "start_method" and value != "popen":
            _refuse(cls, name, value, "keel does not spawn processes; launch with torchrun or srun")
        elif name == "process_group_backend" and value not in (None, "nccl", "gloo"):
            _refuse(cls, name, value, "keel uses nccl on CUDA and gloo on CPU")
        elif name in _REFUSED and value is not None:
            _refuse(cls, name, value, _REFUSED[name])


def _check_backend(cls: str, backend: str | None, device: Any) -> None:
    expected = "nccl" if device.type == "cuda" else "gloo"
    if backend is not None and backend != expected:
        raise ValueError(
            f"{cls}(process_group_backend={backend!r}) on {device.type}: keel uses {expected!r} there; leave "
            "process_group_backend out."
        )


class _LightningName(type):
    """``isinstance`` / ``issubclass`` against the keel strategy the Lightning name stands for."""

    keel: type

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls.keel)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls.keel)


class DDPStrategy(_strategy.DDPStrategy, metaclass=_LightningName):
    """Lightning's ``DDPStrategy``: keel's DDP with the ``DistributedDataParallel`` keyword arguments Lightning
    passes through (``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``,
    ``broadcast_buffers``)."""

    keel = _strategy.DDPStrategy
    _DDP = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb", "broadcast_buffers")

    def __init__(self, *args: Any, process_group_backend: str | None = None, **kwargs: Any) -> None:
        if args:
            _refuse("DDPStrategy", "accelerator", args[0], _LAUNCH + "; pass the DDP settings as keywords")
        unknown = sorted(set(kwargs) - set(self._DDP) - set(_REFUSED) - {"start_method"})
        if unknown:
            raise TypeError(
                f"DDPStrategy({', '.join(unknown)}=...): keel's DDP takes {', '.join(self._DDP)} (docs/options.md)."
            )
        _check_lightning_arguments("DDPStrategy", {k: v for k, v in kwargs.items() if k not in self._DDP})
        super().__init__(**{k: v for k, v in kwargs.items() if k in self._DDP})
        self.process_group_backend = process_group_backend

    def connect(self, env: Any, device: Any, options: Any) -> None:
        _check_backend(type(self).__name__, self.process_group_backend, device)
        super().connect(env, device, options)


class FSDPStrategy(_fsdp.FSDPStrategy, metaclass=_LightningName):
    """Lightning's ``FSDPStrategy``, as keel's FSDP2 strategy: ``auto_wrap_policy`` (a set or list of module
    classes) becomes ``units``, ``cpu_offload`` (a bool or torch's ``CPUOffload``) ``cpu_offload``, and
    ``sharding_strategy`` ``"FULL_SHARD"`` / ``"SHARD_GRAD_OP"`` ``reshard_after_forward`` True / False, and
    ``"HYBRID_SHARD"`` / ``"_HYBRID_SHARD_ZERO2"`` the same with ``replicate_size="auto"`` (sharded within each
    node, replicated across nodes).
    ``activation_checkpointing_policy`` (a set of module classes; the older ``activation_checkpointing``, a class
    or a list of them) ``activation_checkpointing``. ``state_dict_type`` may be ``"full"`` or ``"sharded"``:
    keel's checkpoint is always a folder that resumes at any world size, and ``export_weights`` writes one plain
    file."""

    keel = _fsdp.FSDPStrategy
    _SHARDING = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "_HYBRID_SHARD_ZERO2": False}

    def __init__(
        self,
        *args: Any,
        auto_wrap_policy: Any = None,
        cpu_offload: Any = None,
        sharding_strategy: Any = "FULL_SHARD",
        state_dict_type: str = "full",
        activation_checkpointing: Any = None,
        activation_checkpointing_policy: Any = None,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        if args:
            _refuse("FSDPStrategy", "accelerator", args[0], _LAUNCH + "; pass the FSDP settings as keywords")
        unknown = sorted(set(kwargs) - set(_REFUSED) - {"start_method"})
        if unknown:
            raise TypeError(
                f"FSDPStrategy({', '.join(unknown)}=...): keel's FSDP takes auto_wrap_policy, cpu_offload, "
                "sharding_strategy, state_dict_type and activation_checkpointing_policy from Lightning's "
                "arguments, or use trainer.FSDPStrategy (docs/fsdp.md)."
            )
        _check_lightning_arguments("FSDPStrategy", kwargs)
        classes = {}
        for name, value in (
            ("auto_wrap_policy", auto_wrap_policy),
            ("activation_checkpointing_policy", activation_checkpointing_policy),
            ("activation_checkpointing", activation_checkpointing),
        ):
            if isinstance(value, type):
                value = [value]
            if value is not None and not (
                isinstance(value, (set, frozenset, list, tuple)) and value and all(isinstance(c, type) for c in value)
            ):
                _refuse("FSDPStrategy", name, value, "keel takes the set of module classes it applies to, e.g. {Block}")
            classes[name] = None if value is None else sorted(value, key=lambda c: c.__qualname__)
        name = getattr(sharding_strategy, "name", sharding_strategy)
        if name not in self._SHARDING:
            _refuse(
                "FSDPStrategy",
                "sharding_strategy",
                sharding_strategy,
                "keel's FSDP2 runs FULL_SHARD (reshard after forward), SHARD_GRAD_OP (keep gathered) and "
                "HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (the same, sharded within each node); for NO_SHARD use "
                "strategy='ddp'",
            )
        if state_dict_type not in ("full", "sharded"):
            _refuse("FSDPStrategy", "state_dict_type", state_dict_type, "expected 'full' or 'sharded'")
        offload = getattr(cpu_offload, "offload_params", cpu_offload)
        super().__init__(
            units=classes["auto_wrap_policy"],
            reshard_after_forward=self._SHARDING[name],
            replicate_size="auto" if "HYBRID" in name else 1,
            cpu_offload=bool(offload),
            activation_checkpointing=classes["activation_checkpointing_policy"] or classes["activation_checkpointing"],
        )
        self.process_group_backend = process_group_backend

    def connect(self, env: Any, device: Any, options: Any) -> None:
        _check_backend(type(self).__name__, self.process_group_backend, device)
        super().connect(env, device, options)


class ModelParallelStrategy(_fsdp.FSDPStrategy):
    """Lightning's ``ModelParallelStrategy(data_parallel_size, tensor_parallel_size)``: keel's FSDP2 strategy on the
    ``("data_parallel", "tensor_parallel")`` mesh. The task's ``configure_model`` reads ``self.device_mesh``, applies
    its tensor-parallel plan and (Lightning's way) calls ``fully_shard`` on the data-parallel dimension itself; keel
    shards nothing twice and shards a root the task left plain. ``"auto"``: the processes of a node form the
    tensor-parallel groups and the nodes the data-parallel dimension, as in Lightning. A checkpoint is a folder that
    resumes at any mesh (``save_distributed_checkpoint=True``, the default; ``export_weights`` writes one file)."""

    def __init__(
        self,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: Any = None,
    ) -> None:
        for name, value in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                _refuse("ModelParallelStrategy", name, value, "expected 'auto' or a whole number >= 1")
        if save_distributed_checkpoint is not True:
            _refuse(
                "ModelParallelStrategy",
                "save_distributed_checkpoint",
                save_distributed_checkpoint,
                "keel's checkpoint is always a folder that resumes at any mesh; write one plain file of the "
                "weights with trainer.checkpoint.export_weights",
            )
        _check_lightning_arguments("ModelParallelStrategy", {"timeout": timeout})
        super().__init__()
        self.wanted = (data_parallel_size, tensor_parallel_size)
        self.process_group_backend = process_group_backend

    def connect(self, env: Any, device: Any, options: Any) -> None:
        _check_backend(type(self).__name__, self.process_group_backend, device)
        want_dp, want_tp = self.wanted
        if isinstance(want_tp, int):
            tp = want_tp
        else:
            tp = env.local_world_size if not isinstance(want_dp, int) else max(1, env.world_size // want_dp)
        dp = want_dp if isinstance(want_dp, int) else max(1, env.world_size // tp)
        if dp * tp != env.world_size:
            raise ValueError(
                f"ModelParallelStrategy(data_parallel_size={self.wanted[0]!r}, tensor_parallel_size={self.wanted[1]!r})"
                f": {dp} x {tp} = {dp * tp} is not the world size {env.world_size}; pick sizes whose product is "
                f"{env.world_size}, or leave them 'auto'."
            )
        self.tensor_parallel_size = tp
        super().connect(env, device, options)


class SingleDeviceStrategy(metaclass=_LightningName):
    """Lightning's ``SingleDeviceStrategy``: keel's, chosen for a one-process launch (strategy='auto')."""

    keel = _strategy.SingleDeviceStrategy

    def __new__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "keel picks the single-device strategy itself for a one-process launch: pass Trainer(strategy='auto') "
            "instead of SingleDeviceStrategy(...) (the device is cuda:LOCAL_RANK or the CPU)."
        )
