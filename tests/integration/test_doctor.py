"""``python -m trainer.doctor`` launched: environment report, checked collectives on one process and on two ranks under
torchrun, bounded failures (a peer that never comes, an unreachable rendezvous). Its parsing, help and checks in
one process: tests/unit/test_doctor_checks.py."""

from __future__ import annotations

import re

import pytest
from launch import free_port, python, torchrun


def test_single_process_prints_environment_and_passes():
    result = python("trainer.doctor", module=True, timeout=60).check()
    out = result.stdout
    assert re.search(r"^launcher\s+single$", out, re.M)
    assert re.search(r"^world\s+1 rank\(s\) on 1 node\(s\)", out, re.M)
    assert re.search(r"^torch\s+\d+\.\d+", out, re.M) and re.search(r"^python\s+3\.", out, re.M)
    assert re.search(r"^gloo\s+available", out, re.M)
    for check in ("rendezvous", "init_process_group", "barrier", "all_reduce", "broadcast", "all_gather"):
        assert re.search(rf"^ok\s+{check}\b", out, re.M), check
    assert out.rstrip().endswith("doctor: all checks passed")


def test_torchrun_two_ranks_pass_and_print_the_table():
    result = torchrun("trainer.doctor", "--iters", "5", nproc=2, timeout=120, module=True).check()
    out = result.stdout
    assert out.count("doctor: all checks passed") == 1  # rank 0 only
    assert out.count("== environment ==") == 1
    assert re.search(r"^launcher\s+torchrun$", out, re.M)
    assert re.search(r"^world\s+2 rank\(s\) on 1 node\(s\), 2 per node", out, re.M)
    assert re.search(r"^\s+0\s+0\s+0\s+\S+\s+\d+\s+cpu$", out, re.M)  # one line per rank
    assert re.search(r"^\s+1\s+1\s+0\s+\S+\s+\d+\s+cpu$", out, re.M)
    assert re.search(r"^\s+MASTER_ADDR=127\.0\.0\.1$", out, re.M)
    assert "reached 127.0.0.1:" in out
    assert "sum of rank+1 over 2 rank(s) = 3" in out and "rank ids [0, 1]" in out
    assert "algbw (GB/s)" in out and "busbw (GB/s)" in out
    rows = re.findall(r"^\s+(\d+ [KM]?i?B)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["4 B", "64 KiB", "1 MiB", "16 MiB"]
    for _, _, micros, algbw, busbw in rows:
        assert float(micros) > 0 and float(busbw) == pytest.approx(float(algbw), abs=1e-3)  # 2(W-1)/W = 1
    assert "FAIL" not in out


def test_rank_whose_peer_never_comes_fails_init_in_bounded_time():
    env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    result = python("trainer.doctor", "--init-timeout", "5", env=env, module=True, timeout=60)
    assert result.returncode != 0, result.tail()
    # Bounded by --init-timeout (named in the message), not torch's 30-minute default; the launch timeout bounds
    # the run.
    assert "FAIL init_process_group: Rank 0 of 2 could not initialise the gloo process group" in result.stdout
    assert "within 0:00:05" in result.stdout, result.tail()
    assert "== environment of rank 0 ==" in result.stdout
    assert "all checks passed" not in result.stdout


def test_unreachable_rendezvous_is_named():
    port = free_port()  # nobody listens there
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    result = python("trainer.doctor", "--init-timeout", "2", env=env, module=True, timeout=60)
    assert result.returncode != 0, result.tail()
    assert f"FAIL rendezvous: cannot reach 127.0.0.1:{port} from rank 1" in result.stdout
    assert "(retried for 2 s)" in result.stdout, result.tail()  # gave up after --init-timeout
    assert "Connection refused" in result.stdout
