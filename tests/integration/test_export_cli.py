"""``python -m trainer export CKPT OUT``: the package function's export from a shell (trainer/__main__.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from models import Regression, loader, quiet, regression_data

from trainer import Trainer
from trainer.checkpoint.hf import export_weights, open_weights


def test_python_m_trainer_export_equals_the_package_function(tmp_path: Path) -> None:
    trainer = Trainer(**quiet(max_steps=2, enable_checkpointing=True, default_root_dir=str(tmp_path)))
    trainer.fit(Regression(), loader(regression_data(16), batch_size=8))
    ckpt = trainer.checkpoint_callback.last_model_path
    command = [sys.executable, "-m", "trainer", "export", ckpt, str(tmp_path / "cli"), "--dtype", "bfloat16"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    export_weights(ckpt, tmp_path / "function", dtype=torch.bfloat16)
    with open_weights(tmp_path / "cli") as cli, open_weights(tmp_path / "function") as function:
        assert cli.keys() == function.keys() and cli.keys()
        assert all(torch.equal(cli.read(k), function.read(k)) for k in cli.keys())
    bad = subprocess.run(
        [sys.executable, "-m", "trainer", "export", ckpt, str(tmp_path / "x"), "--max-shard-size", "lots"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "'lots' is not a size: give bytes (5000000000) or 5GB, 500MB" in bad.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "trainer", "export", str(tmp_path / "nope.ckpt"), str(tmp_path / "y")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and missing.stderr.startswith("python -m trainer export: ")
