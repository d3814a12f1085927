"""``python -m trainer.doctor`` in one process (``doctor.main``): sizes parsed and printed, the options its help
documents, the launch variables it reports, and a wrong collective result named. The launched doctor (one process,
two ranks under torchrun, a peer that never comes, an unreachable rendezvous) is in tests/integration/test_doctor.py."""

from __future__ import annotations

import argparse

import pytest

import trainer.distributed.comm
from trainer import doctor

_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID",
)


@pytest.fixture
def single_process_env(monkeypatch):
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def test_parse_and_format_sizes():
    assert [doctor.parse_size(s) for s in ("4", "64K", "1M", "16MiB", "2 GB", "8b")] == [
        4,
        65536,
        1 << 20,
        16 << 20,
        2 << 30,
        8,
    ]
    for bad in ("", "0", "-1", "1T", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            doctor.parse_size(bad)
    assert [doctor.format_size(n) for n in (4, 65536, 1 << 20, 3000)] == ["4 B", "64 KiB", "1 MiB", "3000 B"]


def test_help_documents_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        doctor.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--init-timeout", "--sizes", "--iters", "--accelerator", "--run-dir"):
        assert option in text
    assert "all checks passed" in text and "FAIL" in text  # exit status documented
    assert "python -m trainer.doctor goodput RUN_DIR" in " ".join(text.split())  # every command is listed


def test_relevant_env_vars():
    environ = {
        "NCCL_DEBUG": "INFO",
        "GLOO_SOCKET_IFNAME": "lo",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "MASTER_ADDR": "h",
        "OMP_NUM_THREADS": "4",
        "HOME": "/root",
        "NCCLX": "no",
    }
    assert doctor.relevant_env_vars(environ) == {
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "h",
        "NCCL_DEBUG": "INFO",
        "OMP_NUM_THREADS": "4",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }


def test_wrong_collective_result_is_named(single_process_env, monkeypatch, capsys):
    real = trainer.distributed.comm.all_reduce

    def off_by_one(tensor, op="sum"):
        return real(tensor, op).add_(1)

    monkeypatch.setattr(trainer.distributed.comm, "all_reduce", off_by_one)
    assert doctor.main(["--init-timeout", "5"]) == doctor.EXIT_FAIL
    out = capsys.readouterr().out
    assert "FAIL all_reduce: rank 0 got 2.0, expected 1.0" in out
    assert "doctor: 1 check(s) failed" in out and "all checks passed" not in out
