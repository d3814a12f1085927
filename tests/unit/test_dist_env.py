"""Tests for trainer.distributed (comm and launcher): launcher detection, host lists, and single-process collectives."""

from __future__ import annotations

import datetime
import shutil
import socket
import subprocess

import pytest
import torch

from trainer.distributed import comm, launcher

TORCHRUN_2x2_RANK3 = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}

# What srun exports to global task 3 of `srun --nodes 2 --ntasks-per-node 2` (trimmed).
SLURM_2x2_RANK3 = {
    "SLURM_JOB_ID": "123456",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- detect_env: single and torchrun -------------------------------------------------


def test_empty_environment_is_single() -> None:
    env = launcher.detect_env({"HOME": "/root", "PATH": "/usr/bin"})
    assert env == launcher.DistEnv("single", 0, 0, 1, 1, 0, None, None)
    assert not env.is_distributed


def test_torchrun_full_environment() -> None:
    env = launcher.detect_env(TORCHRUN_2x2_RANK3)
    assert env.launcher == "torchrun"
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert env.node_rank == 0  # GROUP_RANK absent
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29500)
    assert env.is_distributed


def test_torchrun_group_rank_is_node_rank() -> None:
    env = launcher.detect_env({**TORCHRUN_2x2_RANK3, "GROUP_RANK": "1"})
    assert env.node_rank == 1


def test_torchrun_local_world_size_defaults_to_world_size() -> None:
    environ = {k: v for k, v in TORCHRUN_2x2_RANK3.items() if k != "LOCAL_WORLD_SIZE"}
    assert launcher.detect_env(environ).local_world_size == 4


def test_torchrun_single_process_is_still_distributed() -> None:
    environ = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    env = launcher.detect_env(environ)
    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("torchrun", 0, 0, 1)
    assert env.is_distributed


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"LOCAL_RANK": "0"}, "RANK"),
        ({k: v for k, v in TORCHRUN_2x2_RANK3.items() if k != "MASTER_PORT"}, "MASTER_PORT"),
        ({k: v for k, v in TORCHRUN_2x2_RANK3.items() if k != "LOCAL_RANK"}, "LOCAL_RANK"),
        ({**TORCHRUN_2x2_RANK3, "RANK": "4"}, "RANK=4"),
        ({**TORCHRUN_2x2_RANK3, "RANK": "zero"}, "RANK='zero'"),
        ({**TORCHRUN_2x2_RANK3, "RANK": "-1"}, "RANK='-1'"),
        ({**TORCHRUN_2x2_RANK3, "WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({**TORCHRUN_2x2_RANK3, "LOCAL_RANK": "2"}, "LOCAL_RANK=2"),
        ({**TORCHRUN_2x2_RANK3, "GROUP_RANK": "x"}, "GROUP_RANK='x'"),
        ({**TORCHRUN_2x2_RANK3, "MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
        ({**TORCHRUN_2x2_RANK3, "MASTER_ADDR": ""}, "MASTER_ADDR"),
    ],
)
def test_partial_or_inconsistent_torchrun_raises(environ: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        launcher.detect_env(environ)


def test_partial_torchrun_message_lists_found_missing_and_fix() -> None:
    with pytest.raises(ValueError) as info:
        launcher.detect_env({"RANK": "1", "MASTER_ADDR": "h"})
    message = str(info.value)
    assert "RANK='1'" in message and "MASTER_ADDR='h'" in message  # found, with values
    assert "missing WORLD_SIZE, MASTER_PORT, LOCAL_RANK" in message
    assert "torchrun" in message and "unset RANK" in message


# --- detect_env: SLURM ----------------------------------------------------------------


def test_slurm_srun_two_nodes_two_tasks() -> None:
    env = launcher.detect_env(SLURM_2x2_RANK3)
    assert env.launcher == "slurm"
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert env.node_rank == 1
    assert env.master_addr == "gpu07"
    assert env.master_port == 10000 + 123456 % 20000
    assert env.is_distributed


def test_slurm_master_variables_override_nodelist_and_job_id() -> None:
    env = launcher.detect_env({**SLURM_2x2_RANK3, "MASTER_ADDR": "head", "MASTER_PORT": "23456"})
    assert (env.master_addr, env.master_port) == ("head", 23456)


def test_slurm_job_nodelist_used_without_step_nodelist() -> None:
    environ = {k: v for k, v in SLURM_2x2_RANK3.items() if k != "SLURM_STEP_NODELIST"}
    environ["SLURM_JOB_NODELIST"] = "node[001-004,007]"
    assert launcher.detect_env(environ).master_addr == "node001"


def test_slurm_ntasks_per_node_and_heterogeneous_layout() -> None:
    assert launcher.detect_env({**SLURM_2x2_RANK3, "SLURM_NTASKS_PER_NODE": "2"}).local_world_size == 2
    hetero = {
        **SLURM_2x2_RANK3,
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "2,1",
    }
    env = launcher.detect_env(hetero)
    assert (env.rank, env.world_size, env.node_rank, env.local_world_size) == (2, 3, 1, 1)


def test_slurm_localid_beyond_tasks_per_node_raises() -> None:
    with pytest.raises(ValueError, match="SLURM_LOCALID=2"):
        launcher.detect_env({**SLURM_2x2_RANK3, "SLURM_LOCALID": "2"})


def test_slurm_single_task_is_single() -> None:
    environ = {**SLURM_2x2_RANK3, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    environ.update(SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1")
    assert launcher.detect_env(environ).launcher == "single"


def test_slurm_batch_script_without_srun_is_single() -> None:
    # sbatch --ntasks=1 running python directly: no step variables at all.
    environ = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}
    assert launcher.detect_env(environ).launcher == "single"


def test_slurm_step_num_tasks_preferred_over_ntasks() -> None:
    # An srun step of one task inside a four-task allocation runs alone.
    environ = {**SLURM_2x2_RANK3, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    environ["SLURM_STEP_NUM_TASKS"] = "1"
    assert launcher.detect_env(environ).launcher == "single"


def test_torchrun_takes_precedence_over_slurm() -> None:
    env = launcher.detect_env({**SLURM_2x2_RANK3, **TORCHRUN_2x2_RANK3, "GROUP_RANK": "1"})
    assert env.launcher == "torchrun"
    assert (env.master_addr, env.master_port, env.node_rank) == ("10.0.0.1", 29500, 1)


# --- Slurm host lists -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node001", "node001"),
        ("node[001-004,007]", "node001"),
        ("gpu-a[3,5-6],gpu-b1", "gpu-a3"),
        ("n[09-11]", "n09"),
        ("a1,b2", "a1"),
        ("rack[1-2]-node[3-4]", "rack1-node3"),
        ("node[7]", "node7"),
        (" host.example.com ", "host.example.com"),
        # Multi-node forms as SLURM writes them into SLURM_JOB_NODELIST (cf. `scontrol show hostnames`).
        ("node[01-04,07]", "node01"),
        ("gpu-a[1,3]-[2-3]", "gpu-a1-2"),
        ("node[07,01-04]", "node07"),  # SLURM keeps the order it was given
        ("c[0-1]n[10-11]", "c0n10"),
        ("node[1-3]x[4-5]", "node1x4"),
        ("n[009-011]", "n009"),
        ("x[10,2]", "x10"),
        ("dgx-[001-016],login[1-2]", "dgx-001"),
        ("a100-node[3]", "a100-node3"),
    ],
)
def test_parse_slurm_nodelist_first(nodelist: str, first: str) -> None:
    assert launcher.parse_slurm_nodelist_first(nodelist) == first


MULTI_NODE_LISTS = [
    "node[01-04,07]",
    "gpu-a[1,3]-[2-3]",
    "node[07,01-04]",
    "rack[1-2]-node[3-4]",
    "c[0-1]n[10-11]",
    "n[009-011]",
    "x[10,2]",
    "dgx-[001-016],login[1-2]",
    "a1,b2",
    "ab[3]",
]


@pytest.mark.slurm
@pytest.mark.parametrize("nodelist", MULTI_NODE_LISTS)
def test_first_host_matches_scontrol_show_hostnames(nodelist: str, tmp_path) -> None:
    """SLURM's own expansion agrees (needs only the scontrol binary, not a running cluster)."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed (tests/harness/slurm/start.sh installs SLURM)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=keel\nSlurmctldHost=localhost\n")  # read, never contacted
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "SLURM_CONF": str(conf)}
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, env=env, check=True
    ).stdout.split()
    assert launcher.parse_slurm_nodelist_first(nodelist) == hosts[0]
    environ = {**SLURM_2x2_RANK3, "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist}
    assert launcher.detect_env(environ).master_addr == hosts[0]  # every task computes the same master


@pytest.mark.parametrize("nodelist", ["", "node[1-2", "node1]", "node[]", ",a1"])
def test_parse_slurm_nodelist_first_rejects_malformed(nodelist: str) -> None:
    with pytest.raises(ValueError):
        launcher.parse_slurm_nodelist_first(nodelist)


# --- single-process behaviour ------------------------------------------------------------


def test_single_process_collectives_are_no_ops() -> None:
    assert not comm.is_initialized()
    assert (comm.get_rank(), comm.get_world_size(), comm.is_rank_zero()) == (0, 1, True)
    for op in ("sum", "mean", "max", "min"):
        tensor = torch.tensor([1.0, -2.0, 3.5])
        assert comm.all_reduce(tensor, op) is tensor
        assert tensor.tolist() == [1.0, -2.0, 3.5]
    obj = {"a": [1, 2]}
    assert comm.all_gather_object(obj) == [obj]
    assert comm.broadcast_object(obj) is obj
    comm.barrier()
    comm.barrier(torch.device("cpu"))
    comm.destroy_process_group()  # no group: no-op, no error


def test_collective_argument_errors_are_raised_in_a_single_process_too() -> None:
    with pytest.raises(ValueError, match="reduce op"):
        comm.all_reduce(torch.zeros(1), "avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="floating"):
        comm.all_reduce(torch.zeros(1, dtype=torch.int64), "mean")
    with pytest.raises(ValueError, match="src=1"):
        comm.broadcast_object("x", src=1)


def test_init_process_group_single_env_returns_false() -> None:
    env = launcher.detect_env({})
    assert not comm.init_process_group(env, backend="gloo", timeout=datetime.timedelta(seconds=5))
    assert not comm.is_initialized()


def test_select_device_and_backend() -> None:
    single = launcher.detect_env({})
    assert comm.select_device("cpu", single) == torch.device("cpu")
    assert comm.backend_for(torch.device("cpu")) == "gloo"
    assert comm.backend_for(torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ValueError, match="accelerator"):
        comm.select_device("tpu", single)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        assert comm.select_device("auto", single) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_select_device_cuda_without_cuda_raises() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        comm.select_device("cuda", launcher.detect_env({}))


# --- a real process group of one ------------------------------------------------------------


def _torchrun_env_of_one(monkeypatch: pytest.MonkeyPatch) -> launcher.DistEnv:
    """Sets torchrun's variables for a one-process group on a free port and detects them."""
    values = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    env = launcher.detect_env()
    assert env.launcher == "torchrun" and env.world_size == 1
    return env


def test_gloo_group_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _torchrun_env_of_one(monkeypatch)
    timeout = datetime.timedelta(seconds=30)
    try:
        assert comm.init_process_group(env, backend="gloo", timeout=timeout)
        assert comm.is_initialized()
        assert (comm.get_rank(), comm.get_world_size(), comm.is_rank_zero()) == (0, 1, True)
        tensor = torch.tensor([2.0, 4.0])
        assert comm.all_reduce(tensor, "mean") is tensor
        assert tensor.tolist() == [2.0, 4.0]
        assert comm.all_reduce(torch.tensor([3]), "max").tolist() == [3]
        assert comm.all_gather_object({"step": 7}) == [{"step": 7}]
        assert comm.broadcast_object("run-42") == "run-42"
        comm.barrier()
        # A second init with the same environment reuses the group ...
        assert not comm.init_process_group(env, backend="gloo", timeout=timeout)
        # ... and one that disagrees with it is refused.
        other = launcher.DistEnv("torchrun", 1, 0, 2, 2, 0, "127.0.0.1", env.master_port)
        with pytest.raises(ValueError, match="rank 0 of 1"):
            comm.init_process_group(other, backend="gloo", timeout=timeout)
    finally:
        comm.destroy_process_group()
    assert not comm.is_initialized()
    comm.destroy_process_group()  # idempotent


def test_init_failure_names_rank_address_and_causes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 of 2 with no rank 1: the rendezvous times out quickly.
    env = launcher.DistEnv("torchrun", 0, 0, 2, 2, 0, "127.0.0.1", _free_port())
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.setenv(name, "0")  # restored by monkeypatch after init exports env
    try:
        with pytest.raises(RuntimeError) as info:
            comm.init_process_group(env, backend="gloo", timeout=datetime.timedelta(seconds=2))
    finally:
        comm.destroy_process_group()
    message = str(info.value)
    assert "Rank 0 of 2" in message and f"127.0.0.1:{env.master_port}" in message
    assert "gloo" in message and "0:00:02" in message and "WORLD_SIZE" in message
    assert info.value.__cause__ is not None
    assert not comm.is_initialized()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_group_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _torchrun_env_of_one(monkeypatch)
    device = comm.select_device("cuda", env)
    assert device == torch.device("cuda", 0)
    assert comm.backend_for(device) == "nccl"
    try:
        assert comm.init_process_group(env, backend="nccl", timeout=datetime.timedelta(seconds=60), device=device)
        tensor = torch.tensor([1.0, 3.0], device=device)
        comm.all_reduce(tensor, "mean")
        assert tensor.tolist() == [1.0, 3.0]
        assert comm.all_gather_object(5) == [5]
        comm.barrier(device)
    finally:
        comm.destroy_process_group()
    assert not comm.is_initialized()
