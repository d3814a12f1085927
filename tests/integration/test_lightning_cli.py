"""LightningCLI scripts under keel (callbacks/lightning_cli.py, docs/cli.md), launched.

tests/harness/scripts/lightning_cli_prog.py is a LightningCLI program written as a Lightning user writes one,
imports rewritten. These tests run the script itself, once as ``python`` and once under ``torchrun`` with 2 ranks;
the tests that build its CLI in-process (``cli_main(args=[...])``) are in tests/unit/test_lightning_cli_in_process.py.
"""

from __future__ import annotations

import yaml
from cli_program import LIGHTNING_CONFIG_PATH, PROG, QUIET, needs_jsonargparse
from launch import python, torchrun

# ---------------------------------------------------------------------------- the script itself


@needs_jsonargparse
def test_the_script_prints_its_config_and_fits(tmp_path) -> None:
    printed = python(PROG, "fit", "--print_config", "--model.hidden=3", cwd=tmp_path, timeout=180).check()
    config = yaml.safe_load(printed.stdout[printed.stdout.index("# keel-trainer==") :])  # stderr is merged in
    assert config["model"] == {"hidden": 3, "lr": 0.05} and config["seed_everything"] == 1234
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    python(PROG, "fit", "--config=config.yaml", "--trainer.max_epochs=1", *QUIET, cwd=tmp_path, timeout=180).check()
    assert yaml.safe_load((tmp_path / LIGHTNING_CONFIG_PATH).read_text()) == {
        **config,
        "trainer": {**config["trainer"], "max_epochs": 1, "enable_model_summary": False},
    }


@needs_jsonargparse
def test_torchrun_two_ranks_train_and_rank_zero_alone_writes_config_yaml(tmp_path) -> None:
    result = torchrun(
        PROG, "fit", "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path}", *QUIET, nproc=2, timeout=300
    ).check()
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("config.yaml"))
    assert written == [LIGHTNING_CONFIG_PATH], result.tail()
    saved = yaml.safe_load((tmp_path / LIGHTNING_CONFIG_PATH).read_text())
    assert saved["trainer"]["max_epochs"] == 1 and saved["seed_everything"] == 1234
    # Both ranks trained: 64 samples, 2 ranks, batches of 16 -> 2 steps; the checkpoint says step 2.
    assert [p.name for p in (tmp_path / LIGHTNING_CONFIG_PATH).parent.glob("checkpoints/epoch=0-step=2*")], (
        result.tail()
    )
