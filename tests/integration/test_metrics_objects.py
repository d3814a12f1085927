"""Lightning-style ``self.log`` on 2 real ranks (``tests/harness/scripts/lightning_port_ddp.py``): reduce_fx,
rank_zero_only and metric objects (duck-typed and torchmetrics) give every rank the same values, and a metric that
all-reduces itself is not reduced again. The same rules in one process, on a simulated world:
tests/unit/test_metric_collector.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import REPO_ROOT, spawn_ranks

DDP_SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "lightning_port_ddp.py"


def test_two_ranks_reduce_fx_rank_zero_only_and_metric_objects(tmp_path: Path) -> None:
    spawn_ranks(DDP_SCRIPT, str(tmp_path), nproc=2, timeout=180).check()
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == 2
    for key in ("steps", "epochs", "validations", "validated"):
        assert r0[key] == r1[key], key  # every rank sees the same reduced values
    hand = r0["hand"]
    # 32 samples, 4 per rank per step: 4 steps per epoch, batch_idx 0..3 on both ranks.
    assert len(r0["steps"]) == 8
    for i, step in enumerate(r0["steps"]):
        b = i % 4
        assert step["s_sum"] == 3.0  # 1 + 2
        assert step["s_max"] == 10.0 + b and step["s_min"] == float(b) and step["s_mean"] == 5.0 + b
        assert step["r0"] == 100.0  # rank 0's value, not the mean 100.5
    last_step = r0["steps"][3]
    assert last_step["train_mean_step"] == pytest.approx(hand["train_mean"], rel=1e-12)  # running, all ranks
    for epoch in r0["epochs"]:
        assert epoch["e_sum"] == 12.0 and epoch["e_max"] == 13.0 and epoch["e_min"] == 0.0
        assert epoch["r0_epoch"] == 100.0
        assert epoch["train_mean_epoch"] == pytest.approx(hand["train_mean"], rel=1e-12)
    # The duck metrics all-reduce themselves in compute(): keel must not reduce again (37, not 74).
    for values in r0["validations"]:
        assert values["val_count"] == hand["val_count"] == 37
        assert values["val_mean"] == pytest.approx(hand["val_mean"], rel=1e-12)
    assert r0["val_mean_calls"] == [3, 3]  # 2 epochs + validate(): one compute and one reset each
    assert r0["train_mean_calls"] == [4 * 2 + 2, 2]
    if r0["has_torchmetrics"]:
        assert r0["validated"]["val_acc"] == pytest.approx(hand["val_acc"], abs=1e-6)
    # devices=2, num_nodes=1, strategy="ddp" matched the launch; devices=4 names the command to use.
    assert "torchrun --nnodes 1 --nproc-per-node 4 your_script.py" in r0["mismatch"]
