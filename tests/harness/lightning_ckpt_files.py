"""What a Lightning program reads from the checkpoint files of tests/harness/scripts/lightning_port_ddp.py, checked on
one device (tests/unit/test_lightning_porting.py) and under DDP (tests/integration/test_lightning_port.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from launch import REPO_ROOT

PORT_DDP = REPO_ROOT / "tests" / "harness" / "scripts" / "lightning_port_ddp.py"
LIGHTNING_KEYS = {"state_dict", "epoch", "global_step", "hyper_parameters"}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def check_lightning_checkpoint(result: dict, world_size: int) -> None:
    """What a Lightning program reads from L.ModelCheckpoint's paths, and ckpt_path=best_model_path."""
    assert result["world_size"] == world_size
    best, last = Path(result["best_model_path"]), Path(result["last_model_path"])
    assert best != last  # val/loss is best after epoch 0: the best save is not the newest
    for path in (best, last):  # one plain file with Lightning's keys, inside a committed save folder
        assert path.is_file() and path.name == "lightning.pt" and (path.parent / "keel.json").is_file(), path
    loaded = torch.load(best, weights_only=True)
    assert LIGHTNING_KEYS <= loaded.keys(), sorted(loaded)
    epoch, weights = result["saved"][loaded["global_step"]]  # the task's weights when that save was made
    assert loaded["epoch"] == epoch and loaded["hyper_parameters"] == result["hparams"] == {
        "lr": 0.05,
        "note": "ported",
    }
    assert_same(loaded["state_dict"], weights)
    for path in (last, Path(result["dirpath"]) / "last.ckpt"):  # save_last=True: Lightning's last.ckpt too
        loaded = torch.load(path, weights_only=True)
        assert LIGHTNING_KEYS <= loaded.keys() and loaded["hyper_parameters"] == result["hparams"], path
        assert (loaded["global_step"], loaded["epoch"]) == (result["global_step"], 1), path  # epoch 1 of 0, 1
        assert_same(loaded["state_dict"], result["final"])  # the trained task's weights
    # test(ckpt_path=best_model_path) tests those weights (not the untrained task it was given) ...
    assert result["tested_best"] == result["tested_by_hand"] != result["tested_untrained"]
    # ... and fit(ckpt_path=...) resumes from the save folder (the Lightning file alone holds no optimizer
    # or loop state): only the remaining steps, to the weights of the uninterrupted fit, bit for bit.
    per_epoch = result["reference_steps"] // 3
    best_step = torch.load(best, weights_only=True)["global_step"]
    assert result["from_best_steps"] == result["reference_steps"] - best_step < result["reference_steps"]
    assert result["from_last_steps"] == per_epoch and result["global_step"] == 2 * per_epoch
    assert_same(result["from_best"], result["reference"])
    assert_same(result["from_last"], result["reference"])
