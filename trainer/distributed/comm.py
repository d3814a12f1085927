"""The process group and the collectives keel uses, in one small module.

Every other keel module reaches other processes through these functions; only the strategies
(:mod:`trainer.distributed.strategy`, which wrap the task in DDP or FSDP2) and the checkpoints
(:mod:`trainer.checkpoint.store` and :mod:`~trainer.checkpoint.reader`, DCP) use ``torch.distributed``
directly. It holds:

* launcher detection (:func:`~trainer.distributed.launcher.detect_env`, in its own module): torchrun /
  TorchElastic, SLURM ``srun``, or a plain single process, read from environment variables only;
* process-group setup and teardown (:func:`init_process_group`,
  :func:`destroy_process_group`) and device selection (:func:`select_device`,
  :func:`backend_for`);
* the handful of collectives the Trainer needs (:func:`barrier`,
  :func:`all_reduce`, :func:`all_gather_object`, :func:`broadcast_object`).

Every query and collective is a no-op (or trivially correct) when no process group
is initialised, so single-process code paths need no ``if distributed`` branches.
Collectives must be called by every rank, in the same order; they are the only
functions here that block on other ranks.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from trainer.distributed.launcher import DistEnv

logger = logging.getLogger(__name__)

Backend = Literal["nccl", "gloo"]
ReduceOpName = Literal["sum", "mean", "max", "min"]
Accelerator = Literal["auto", "cpu", "cuda"]
T = TypeVar("T")  # an object collective's payload: every rank passes (and gets back) the same kind


def _export_env(env: DistEnv) -> None:
    """Writes ``env`` into ``os.environ`` so ``init_method="env://"`` (and libraries that
    read torchrun's variables) see it; for torchrun these are the values already there."""
    values = {
        "MASTER_ADDR": str(env.master_addr),
        "MASTER_PORT": str(env.master_port),
        "RANK": str(env.rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank),
    }
    for name, value in values.items():
        if os.environ.get(name) != value:
            logger.debug("Exporting %s=%s for env:// rendezvous", name, value)
            os.environ[name] = value


def init_process_group(
    env: DistEnv,
    *,
    backend: Backend,
    timeout: datetime.timedelta,
    device: torch.device | None = None,
    init_timeout: datetime.timedelta | None = None,
) -> bool:
    """Creates the default process group from the launcher's environment (``env://`` semantics).

    For SLURM the environment's rank, world size and rendezvous address are first
    exported to ``os.environ`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``). Blocks until
    all ``env.world_size`` ranks have joined or ``timeout`` passes.

    Args:
        env: The environment from :func:`detect_env`.
        backend: ``"nccl"`` for CUDA devices, ``"gloo"`` for CPU (see :func:`backend_for`).
        timeout: Limit for every collective of the group.
        init_timeout: Limit for joining: connecting to the rendezvous store and waiting for every rank
            (default: ``timeout``). An unreachable MASTER_ADDR or a rank that never starts fails after
            this long instead of after the collective timeout.
        device: This rank's device; for nccl it is bound to the group (``device_id``),
            which must match the device set by :func:`select_device`.

    Returns:
        True if this call created the group (the caller then owns destroying it);
        False if a group already existed or ``env`` is a single process.

    Raises:
        ValueError: A group already exists whose rank or world size differs from ``env``.
        RuntimeError: The rendezvous or backend failed; the message names rank, world
            size, address, backend, timeout and likely causes. The original is chained.
    """
    if is_initialized():
        group_rank, group_world = dist.get_rank(), dist.get_world_size()
        if (group_rank, group_world) != (env.rank, env.world_size):
            raise ValueError(
                f"A process group already exists with rank {group_rank} of {group_world}, but "
                f"the {env.launcher} environment says rank {env.rank} of {env.world_size}. Either "
                "let keel create the group, or set RANK/WORLD_SIZE/LOCAL_RANK to match it."
            )
        logger.debug("Reusing the existing process group (rank %d of %d)", group_rank, group_world)
        return False
    if env.launcher == "single":
        return False
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build.")
    _export_env(env)
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # device_id binds the communicator to this GPU eagerly (torch >= 2.3).
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = torch.device("cuda", index)
    logger.info(
        "Initialising process group: backend=%s rank=%d world_size=%d master=%s:%s timeout=%s",
        backend,
        env.rank,
        env.world_size,
        env.master_addr,
        env.master_port,
        timeout,
    )
    join_timeout = init_timeout or timeout
    try:
        kwargs["store"] = _rendezvous_store(env, join_timeout)
        dist.init_process_group(backend=backend, timeout=timeout, rank=env.rank, world_size=env.world_size, **kwargs)
    except (RuntimeError, TimeoutError) as exc:  # DistNetworkError/DistStoreError are RuntimeErrors
        raise RuntimeError(
            f"Rank {env.rank} of {env.world_size} could not initialise the {backend} process "
            f"group at {env.master_addr}:{env.master_port} within {join_timeout} "
            f"({type(exc).__name__}: {exc}). Likely causes: MASTER_ADDR is not reachable from "
            "this node (wrong host or a firewall on MASTER_PORT), the port is in use, a rank did "
            "not start or crashed, or WORLD_SIZE does not match the number of processes launched."
        ) from exc
    return True


def ensure_process_group(
    env: DistEnv,
    *,
    device: torch.device,
    timeout: datetime.timedelta,
    init_timeout: datetime.timedelta,
    backend_env: Mapping[str, str] | None = None,
    single_process: bool = False,
) -> bool:
    """The Trainer's entry: create the default group for a distributed launch unless one exists.

    A group created here is destroyed at interpreter exit (an atexit handler), not when a loop raises:
    re-creating the default group in one process races with the old group's rendezvous keys.

    Args:
        env: The launcher's environment.
        device: This rank's device; picks the backend (nccl on CUDA, gloo otherwise).
        timeout: Limit for every collective of the group.
        init_timeout: Limit for joining the group.
        backend_env: Variables set (if unset) before an nccl group is created (the flight recorder).
        single_process: Also create a one-rank group for a plain single process (FSDP needs a device mesh).

    Returns:
        True if this call created the group.

    Raises:
        RuntimeError: An existing group's world size differs from the launcher's, or init failed.
    """
    if is_initialized() or not (env.is_distributed or single_process):
        if is_initialized() and get_world_size() != env.world_size:
            raise RuntimeError("A process group exists whose world size does not match the launcher's.")
        return False
    backend = backend_for(device)
    if not env.is_distributed:  # one rank, no launcher: an in-memory store, nothing to rendezvous with
        kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)
        _destroy_at_exit()
        logger.info("Process group: backend=%s world_size=1 (a single process; the strategy needs a group).", backend)
        return True
    if backend == "nccl":
        for key, value in (backend_env or {}).items():
            os.environ.setdefault(key, value)
    created = init_process_group(env, backend=backend, timeout=timeout, device=device, init_timeout=init_timeout)
    if created:
        _destroy_at_exit()
    logger.info(
        "Process group: backend=%s world_size=%d (launcher %s, %d node(s)).",
        backend,
        env.world_size,
        env.launcher,
        max(1, env.world_size // max(1, env.local_world_size)),
    )
    return created


_EXIT_HOOK_REGISTERED = False


def _destroy_at_exit() -> None:
    global _EXIT_HOOK_REGISTERED
    if not _EXIT_HOOK_REGISTERED:
        atexit.register(_exit_teardown)
        _EXIT_HOOK_REGISTERED = True


def _exit_teardown() -> None:
    """Destroy the group while the interpreter is fully alive, then collect the objects that still hold
    it (DDP reducers, pending work), so no backend thread outlives them into interpreter shutdown."""
    destroy_process_group()
    gc.collect()


def _rendezvous_store(env: DistEnv, timeout: datetime.timedelta) -> dist.Store:
    """The store the default group rendezvous through, joined within ``timeout``.

    Under torchrun the agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``) and it outlives a worker
    restart. The default group's keys (each rank's gloo address) are the same in every attempt, so a
    restarted rank could read the address of a peer that was just killed and fail with
    "connectFullMesh ... Connection refused": a prefix per ``TORCHELASTIC_RESTART_COUNT`` keeps each
    attempt's keys apart. Otherwise (SLURM, a hand-set environment) rank 0 hosts the store and waits for
    every rank, like ``env://`` does, but with ``timeout`` instead of the collective timeout.
    """
    host, port = env.master_addr or "127.0.0.1", int(env.master_port or 0)
    if env.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(host_name=host, port=port, world_size=env.world_size, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"keel/attempt_{attempt}", store)
    return dist.TCPStore(
        host_name=host,
        port=port,
        world_size=env.world_size,
        is_master=env.rank == 0,
        timeout=timeout,
        wait_for_workers=True,
    )


_CHECKPOINT_GROUP: dist.ProcessGroup | None = None


def checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group of all ranks for background checkpoint traffic (created on first use: a collective,
    so every rank must call it at the same point). Asynchronous sharded saves run their collectives on it
    while training uses the default group: a background thread's collectives on the training group interleave
    with the loop's and abort or hang. None without a process group."""
    global _CHECKPOINT_GROUP
    if not is_initialized():
        return None
    if _CHECKPOINT_GROUP is None:
        _CHECKPOINT_GROUP = dist.new_group(backend="gloo")
    return _CHECKPOINT_GROUP


def destroy_process_group() -> None:
    """Destroys the default process group; a no-op if none exists. Never raises."""
    global _CHECKPOINT_GROUP
    if not is_initialized():
        return
    _CHECKPOINT_GROUP = None  # destroyed with the default group
    try:
        dist.destroy_process_group()
    except Exception as exc:  # teardown runs on error paths; do not mask the original error
        logger.warning("Destroying the process group failed: %s: %s", type(exc).__name__, exc)


def is_initialized() -> bool:
    """Returns True when the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Returns the global rank from the process group, or 0 without one.

    Before the group exists every process answers 0; use :func:`detect_env` for the
    launcher's rank at that point.
    """
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    """Returns the number of ranks in the process group, or 1 without one."""
    return dist.get_world_size() if is_initialized() else 1


def is_rank_zero() -> bool:
    """Returns True on global rank 0 (and in a single process)."""
    return get_rank() == 0


def barrier(device: torch.device | None = None) -> None:
    """Blocks until every rank reaches this call; a no-op without a process group.

    Args:
        device: This rank's device. With nccl and a CUDA device, the barrier runs on
            it, avoiding nccl's guess of a device from the rank.
    """
    if not is_initialized():
        return
    if device is not None and device.type == "cuda" and dist.get_backend() == "nccl":
        index = device.index if device.index is not None else torch.cuda.current_device()
        dist.barrier(device_ids=[index])
    else:
        dist.barrier()


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def all_reduce(tensor: torch.Tensor, op: ReduceOpName = "sum") -> torch.Tensor:
    """Reduces ``tensor`` across ranks in place (a collective: every rank must call it).

    ``"mean"`` is a sum divided by the world size, so it works on gloo, which has no
    AVG. The tensor must be contiguous and on the group's device type.

    Args:
        tensor: The local value; overwritten with the reduced value.
        op: One of ``"sum"``, ``"mean"``, ``"max"``, ``"min"``.

    Returns:
        ``tensor`` itself, for chaining. Unchanged without a process group.

    Raises:
        ValueError: Unknown ``op``, or ``"mean"`` of a non-floating tensor (checked in
            a single process too, so code fails the same way on one rank and on many).
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"Unknown reduce op {op!r}; expected one of {sorted(_REDUCE_OPS)}.")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"all_reduce 'mean' needs a floating tensor, got {tensor.dtype}.")
    if not is_initialized():
        return tensor
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, _REDUCE_OPS[op]))
    if op == "mean":
        tensor.div_(dist.get_world_size())
    return tensor


def all_reduce_future(tensor: torch.Tensor) -> torch.futures.Future[Any]:
    """Sum ``tensor`` across ranks in place, asynchronously: the future of the default group's all-reduce (for
    communication hooks, which return futures)."""
    work = dist.all_reduce(tensor, async_op=True)
    assert work is not None
    return work.get_future()


def all_gather_object(obj: T, group: dist.ProcessGroup | None = None) -> list[T]:
    """Gathers a picklable object from every rank (a collective of ``group``, default: the default group).

    With nccl the objects travel through the current CUDA device, so
    :func:`select_device` must have run first.

    Args:
        obj: This rank's object.

    Returns:
        One object per rank, indexed by rank; ``[obj]`` without a process group.
    """
    if not is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def gather_object(obj: T, dst: int = 0) -> list[T] | None:
    """Gathers a picklable object from every rank to ``dst`` only (a collective of the default group): one object
    per rank, indexed by rank, on ``dst``; None on the other ranks; ``[obj]`` without a process group. With nccl
    the objects travel through the current CUDA device, as in :func:`all_gather_object`."""
    if not is_initialized():
        return [obj]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst)
    return gathered


def broadcast_object(obj: T, src: int = 0) -> T:
    """Sends ``src``'s picklable object to every rank (a collective).

    Args:
        obj: The object to send on ``src``; ignored on other ranks.
        src: The sending global rank.

    Returns:
        ``src``'s object; ``obj`` itself without a process group.

    Raises:
        ValueError: ``src`` is not a rank of the group.
    """
    world_size = get_world_size()
    if not 0 <= src < world_size:
        raise ValueError(f"broadcast_object src={src} is not a rank of a group of {world_size}.")
    if not is_initialized():
        return obj
    payload: list[Any] = [obj]
    dist.broadcast_object_list(payload, src=src)
    return payload[0]


def select_device(accelerator: Accelerator, env: DistEnv) -> torch.device:
    """Chooses this rank's device and, for CUDA, makes it current.

    Call it before :func:`init_process_group`: nccl and the object collectives use
    the current CUDA device.

    Args:
        accelerator: ``"cpu"``, ``"cuda"``, or ``"auto"`` (CUDA when available).
        env: The environment; ``env.local_rank`` picks the GPU.

    Returns:
        ``cpu``, or ``cuda:<local_rank>``.

    Raises:
        ValueError: Unknown accelerator, CUDA requested but unavailable, or fewer
            visible GPUs than local ranks.
    """
    if accelerator not in ("auto", "cpu", "cuda"):
        raise ValueError(f"Unknown accelerator {accelerator!r}; expected 'auto', 'cpu' or 'cuda'.")
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            "accelerator='cuda' but CUDA is not available (no GPU visible, or a CPU-only "
            "PyTorch build). Use accelerator='cpu' or 'auto'."
        )
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env.local_rank >= count:
        raise ValueError(
            f"Local rank {env.local_rank} needs GPU {env.local_rank}, but only {count} GPU(s) are "
            f"visible on this node (CUDA_VISIBLE_DEVICES={visible!r}). "
            f"Start at most {count} process(es) per node (torchrun --nproc-per-node {count}, or "
            "srun --ntasks-per-node)."
        )
    device = torch.device("cuda", env.local_rank)
    torch.cuda.set_device(device)
    return device


def backend_for(device: torch.device) -> Backend:
    """Returns the collective backend for a device: nccl for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


# --------------------------------------------------------------------------- diagnostics
# Used by ``python -m trainer.doctor`` and the hang watchdog (trainer/distributed/watchdog.py).


def available_backends() -> list[Backend]:
    """Returns the collective backends compiled into this PyTorch build (``gloo``, ``nccl``)."""
    if not dist.is_available():
        return []
    found: list[Backend] = []
    if dist.is_gloo_available():
        found.append("gloo")
    if dist.is_nccl_available():
        found.append("nccl")
    return found


def get_backend() -> str | None:
    """Returns the default group's backend name, or None without a process group."""
    return str(dist.get_backend()) if is_initialized() else None


def monitored_barrier(timeout: datetime.timedelta, device: torch.device | None = None) -> None:
    """A barrier that names the ranks that did not arrive (a collective).

    On gloo this is ``torch.distributed.monitored_barrier(wait_all_ranks=True)``: rank 0
    raises an error listing every rank that missed ``timeout``. Other backends (nccl)
    have no monitored barrier; they get :func:`barrier`, bounded by the group's timeout.

    Args:
        timeout: How long rank 0 waits for the others.
        device: This rank's device, for the nccl fallback.
    """
    if not is_initialized():
        return
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
    else:
        barrier(device)


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrites ``tensor`` on every rank with ``src``'s (a collective, in place).

    Args:
        tensor: The tensor to send on ``src``, to receive into elsewhere; same shape,
            dtype and device type on every rank.
        src: The sending global rank.

    Returns:
        ``tensor`` itself. Unchanged without a process group.
    """
    world_size = get_world_size()
    if not 0 <= src < world_size:
        raise ValueError(f"broadcast src={src} is not a rank of a group of {world_size}.")
    if is_initialized():
        dist.broadcast(tensor, src=src)
    return tensor


def all_gather_tensor(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Gathers a same-shaped tensor from every rank (a collective).

    Returns:
        One tensor per rank, indexed by rank; ``[tensor]`` without a process group.
    """
    if not is_initialized():
        return [tensor]
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return gathered


def flight_recorder_dump() -> bytes | None:
    """Returns this process's c10d Flight Recorder buffer as pickled bytes, or None.

    The Flight Recorder (torch >= 2.5) keeps the last ``TORCH_FR_BUFFER_SIZE``
    collectives of every group with their sequence numbers and states, so a dump
    from each rank shows which collective a hung job is stuck in
    (``python -m torch.distributed.flight_recorder.fr_trace``). Not a collective;
    safe to call from another thread while the main thread is blocked in one.
    None without a process group, or when this build has no dump entry point.
    """
    if not is_initialized():
        return None
    import torch._C._distributed_c10d as c10d  # private, but the documented dump hook

    # nccl records into its own (CUDA-event) recorder; gloo and others into the generic one.
    name = "_dump_nccl_trace" if dist.get_backend() == "nccl" else "_dump_fr_trace"
    dump = getattr(c10d, name, None)
    if dump is None:
        return None
    try:
        return bytes(dump())
    except Exception as exc:  # never let a diagnostic mask the failure being diagnosed
        logger.debug("%s failed: %s: %s", name, type(exc).__name__, exc)
        return None


def record(fn: Callable[..., T]) -> Callable[..., T | None]:
    """TorchElastic's error recorder: decorate your ``main`` so that torchrun's failure summary shows the
    root-cause traceback of the rank that failed first (``torch.distributed.elastic...errors.record``)."""
    from torch.distributed.elastic.multiprocessing.errors import record as elastic_record

    return elastic_record(fn)


# ---------------------------------------------------------------------- sharded tensors (FSDP's DTensors)
def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter or state entry of an FSDP / tensor-parallel model)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def sharded_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard) as a DTensor with ``like``'s mesh, placements, shape and stride, on ``like``'s
    device; no communication."""
    from torch.distributed.tensor import DTensor

    assert isinstance(like, DTensor)
    return DTensor.from_local(
        local.to(like.to_local().device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def shard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor split over ``like``'s mesh as ``like`` is (every rank passes the same ``whole``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    assert isinstance(like, DTensor)
    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements)
