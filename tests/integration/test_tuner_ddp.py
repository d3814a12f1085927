"""``Tuner.lr_find`` under DDP on 2 ranks finds what one process finds with the global batch; ``scale_batch_size``
refuses a distributed run, as Lightning's does.

Every rank records the loss averaged over the ranks (Lightning records rank 0's own), so with each rank's batch
half the global one the search sees the global batch's loss, step for step. Tolerance: the ranks' float32 losses
and gradients are summed in another order than one process sums them (rounding differences of ~1e-7 relative),
which the search's rising learning rate amplifies towards its end (1e-6 at the last step here), so rel=1e-5; the
suggestion, the step where the search stops and the learning rates are exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import REPO_ROOT, spawn_ranks

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "tuner_ddp.py"


def load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tuner_ddp", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lr_find_on_two_ranks_equals_one_process_with_the_global_batch(tmp_path: Path) -> None:
    spawn_ranks(SCRIPT, str(tmp_path / "ddp"), "8", nproc=2, timeout=300).check()
    ranks = [json.loads((tmp_path / "ddp" / f"rank{r}.json").read_text()) for r in (0, 1)]
    one = load_script().main(tmp_path / "one", 16)
    assert [r["world_size"] for r in ranks] == [2, 2] and ranks[0]["strategy"] == "ddp" and one["world_size"] == 1
    assert ranks[0] == ranks[1]  # every rank found the same, and trained the same afterwards
    ddp = ranks[0]
    assert ddp["global_step"] == one["global_step"] == 0  # the step clock put back after the search
    assert ddp["lrs"] == one["lrs"] and len(ddp["losses"]) == len(one["losses"]) < 100  # stopped early, same step
    assert (ddp["index"], ddp["suggestion"], ddp["model_lr"]) == (one["index"], one["suggestion"], one["model_lr"])
    assert ddp["losses"] == pytest.approx(one["losses"], rel=1e-5)
    for ddp_weights, one_weights in zip(ddp["weights"], one["weights"], strict=True):
        assert ddp_weights == pytest.approx(one_weights, rel=1e-5, abs=1e-7)
    assert "Tuning the batch size is not supported with distributed strategies" in ddp["refusal"]
    assert "refusal" not in one
