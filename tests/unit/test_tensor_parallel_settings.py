"""Tensor parallelism's settings (FSDPStrategy(tensor_parallel_size=...), Lightning's ModelParallelStrategy) are
checked before any process group: against the world size and the node's processes, in one process on a stood-in
launch environment. The 2-D meshes of real gloo ranks: tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from trainer.distributed.fsdp import FSDPStrategy
from trainer.distributed.launcher import DistEnv
from trainer.options import TrainerOptions


def _connect(strategy: FSDPStrategy, world_size: int, local_world_size: int | None = None) -> None:
    local = world_size if local_world_size is None else local_world_size
    env = DistEnv(
        launcher="torchrun",
        rank=0,
        local_rank=0,
        world_size=world_size,
        local_world_size=local,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
    )
    strategy.connect(env, torch.device("cpu"), TrainerOptions())


def test_tensor_parallel_settings_are_checked_before_any_process_group() -> None:
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            FSDPStrategy(tensor_parallel_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        _connect(FSDPStrategy(tensor_parallel_size=4), 6)
    strategy = FSDPStrategy(tensor_parallel_size=2)
    _connect(strategy, 8)
    assert (strategy.data_parallel_size, strategy.data_parallel_rank) == (4, 0)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 0}
    assert strategy.settings()["tensor_parallel_size"] == 2

    from callbacks.lightning.pytorch.strategies import ModelParallelStrategy

    auto = ModelParallelStrategy()  # Lightning's "auto": a node's processes split each layer, nodes replicate
    _connect(auto, 8, local_world_size=4)
    assert (auto.data_parallel_size, auto.tensor_parallel_size) == (2, 4)
    with pytest.raises(ValueError, match=r"3 x 2 = 6 is not the world size 8"):
        _connect(ModelParallelStrategy(data_parallel_size=3, tensor_parallel_size=2), 8)
    with pytest.raises(TypeError, match="save_distributed_checkpoint"):
        ModelParallelStrategy(save_distributed_checkpoint=False)
