"""Tests for recipes/ and conf/: every YAML composes and instantiates; the digits recipe runs end to end.

The end-to-end tests launch ``python -m recipes.train`` in a subprocess, exactly as a user would, with
the run directory in a temporary folder.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sklearn", reason="the digits recipe needs scikit-learn (pip install -e '.[dev]')")

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import DictConfig, ListConfig, OmegaConf  # noqa: E402

from recipes import config_dir as config_dir_mod  # noqa: E402
from recipes.config_dir import config_dir  # noqa: E402
from recipes.train import build  # noqa: E402  (also registers trainer/options_schema)
from trainer import Callback, DataModule, TaskModule, Trainer  # noqa: E402
from trainer.loggers import Logger  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF = REPO_ROOT / "conf"
YAML_FILES = sorted(CONF.rglob("*.yaml"))
COMMAND = ["python", "-m", "recipes.train"]

# The digits recipe after 5 optimizer steps with trainer.seed=0 and data.split_seed=0 (see
# test_digits_recipe_end_to_end). Observed on CPU with torch 2.13; identical with 1 or 2 threads.
PINNED_TRAIN_LOSS = 2.293416  # train/loss of step 5 (log_every_n_steps=1)
PINNED_VAL_LOSS = 2.278098  # val/loss over the first 2 validation batches after step 5


def _command_line(path: Path) -> list[str]:
    """The command in the file's first comment line (after Hydra's ``# @package`` header, if any)."""
    for line in path.read_text().splitlines():
        if re.match(r"^\s*#\s*@", line):
            continue  # Hydra header directives must precede every other comment
        assert line.startswith("# "), f"{path.relative_to(REPO_ROOT)} must open with '# <command that uses it>'"
        return shlex.split(line[2:])
    raise AssertionError(f"{path} is empty")


def _compose(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides, return_hydra_config=True)


def _targets(node: Any) -> list[DictConfig]:
    """Every sub-config with a ``_target_``, outermost first (nested targets are built by their parent)."""
    if isinstance(node, DictConfig):
        if "_target_" in node:
            return [node]
        return [found for key in node for found in _targets(node._get_node(key))]
    if isinstance(node, ListConfig):
        return [found for item in node for found in _targets(item)]
    return []


# ---------------------------------------------------------------------------------------------- config
def test_config_dir_is_the_checkout_conf_without_a_packaged_copy() -> None:
    assert Path(config_dir()) == CONF


def test_config_dir_prefers_the_packaged_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "recipes" / "conf").mkdir(parents=True)
    monkeypatch.setattr(config_dir_mod, "_PACKAGE_DIR", tmp_path / "recipes")
    assert config_dir() == str(tmp_path / "recipes" / "conf")
    (tmp_path / "recipes" / "conf").rmdir()
    with pytest.raises(FileNotFoundError, match="conf"):
        config_dir()


def test_conf_has_every_group() -> None:
    groups = {path.parent.name for path in YAML_FILES if path.parent != CONF}
    assert {"trainer", "task", "data", "callbacks", "logger", "experiment"} <= groups
    assert CONF / "train.yaml" in YAML_FILES


@pytest.mark.parametrize("path", YAML_FILES, ids=[str(p.relative_to(CONF)) for p in YAML_FILES])
def test_yaml_composes_with_its_command_and_instantiates(path: Path, tmp_path: Path) -> None:
    command = _command_line(path)
    assert command[:3] == COMMAND, f"{path.name}: the first comment must be a `python -m recipes.train ...` command"
    overrides = command[3:]
    cfg = _compose(overrides + [f"output_dir={tmp_path}"])
    if path.parent != CONF:  # a group option: the command must select this very file
        group, option = path.parent.relative_to(CONF).as_posix(), path.stem
        assert cfg.hydra.runtime.choices.get(group) == option, f"`{shlex.join(command)}` does not select {path}"
    for node in _targets(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])):
        assert instantiate(node) is not None, node._get_full_key(None)
    trainer, task, datamodule = build(cfg)
    assert isinstance(trainer, Trainer) and isinstance(task, TaskModule) and isinstance(datamodule, DataModule)
    assert all(isinstance(cb, Callback) for cb in trainer.callbacks)
    assert all(isinstance(lg, Logger) for lg in trainer.loggers)


def test_callbacks_are_a_dict_that_overrides_can_edit(tmp_path: Path) -> None:
    cfg = _compose(["~callbacks.progress", "callbacks.checkpoint=null", f"output_dir={tmp_path}"])
    trainer, _, _ = build(cfg)
    names = [type(cb).__name__ for cb in trainer.callbacks]
    # Removed / null entries are skipped; the Trainer then adds its own default bar and checkpoint.
    assert names.count("ModelCheckpoint") == 1 and trainer.checkpoint_callback.monitor is None
    assert names.count("ProgressBar") == 1


def test_trainer_schema_rejects_a_bad_value_at_compose_time(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="trainer.max_epochs"):
        _compose(["trainer.max_epochs=oops", f"output_dir={tmp_path}"])
    with pytest.raises(Exception, match="trainer.max_epoch"):  # a typo: not a TrainerOptions key
        _compose(["trainer.max_epoch=3", f"output_dir={tmp_path}"])


def test_values_the_schema_cannot_type_are_refused_by_the_trainer(tmp_path: Path) -> None:
    # limit_*_batches is int | float, typed Any in the schema (OmegaConf 2.3 has no unions).
    cfg = _compose(["trainer.limit_val_batches=oops", f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="limit_val_batches"):
        build(cfg)


# ---------------------------------------------------------------------------------------------- end to end
def _run(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "recipes.train", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def _summary(stdout: str) -> tuple[dict[str, str], dict[str, float]]:
    """``(fields, metrics)`` parsed from the summary block that recipes.train prints."""
    block = stdout[stdout.index("keel run summary"):]
    fields = dict(re.findall(r"^(run dir|tensorboard|best checkpoint|last checkpoint)\s+(\S+)", block, re.M))
    metrics = {name: float(value) for name, value in re.findall(r"^  (\S+)\s+(-?[0-9.]+(?:e-?\d+)?)$", block, re.M)}
    return fields, metrics


E2E_ARGS = ["trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "trainer.log_every_n_steps=1"]


def test_digits_recipe_end_to_end(tmp_path: Path) -> None:
    proc = _run(["trainer.max_steps=5", *E2E_ARGS, f"output_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fields, metrics = _summary(proc.stdout)
    assert metrics["train/loss"] == pytest.approx(PINNED_TRAIN_LOSS, abs=1e-4), proc.stdout
    assert metrics["val/loss"] == pytest.approx(PINNED_VAL_LOSS, abs=1e-4), proc.stdout
    assert {"val/acc", "test/acc", "test/loss"} <= set(metrics)
    run_dir = tmp_path / "digits" / "version_0"
    assert Path(fields["run dir"]) == run_dir
    assert Path(fields["tensorboard"]) == run_dir
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir))
    for key in ("best checkpoint", "last checkpoint"):
        ckpt = Path(fields[key])
        assert ckpt.is_file() and ckpt.parent == run_dir / "checkpoints", fields
    config = (run_dir / "config.yaml").read_text()
    assert config.startswith("# python -m recipes.train trainer.max_steps=5")
    # Hydra wrote nothing of its own and stayed in the launch directory.
    assert sorted(os.listdir(tmp_path)) == ["digits"]


def test_digits_recipe_resumes_exactly_in_its_run_dir(tmp_path: Path) -> None:
    """ckpt_path=last (the default) + a pinned run dir: 3 steps, then 2 more, equal 5 steps in one go."""
    common = [*E2E_ARGS, "logger.version=0", "test=false", f"output_dir={tmp_path}"]
    first = _run(["trainer.max_steps=3", *common], cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    second = _run(["trainer.max_steps=5", *common], cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Resumed at global step 3" in second.stderr
    fields, metrics = _summary(second.stdout)
    assert Path(fields["run dir"]) == tmp_path / "digits" / "version_0"
    assert metrics["train/loss"] == pytest.approx(PINNED_TRAIN_LOSS, abs=1e-4), second.stdout
    assert metrics["val/loss"] == pytest.approx(PINNED_VAL_LOSS, abs=1e-4), second.stdout


def test_bad_option_fails_naming_the_key(tmp_path: Path) -> None:
    proc = _run(["trainer.max_epochs=oops", f"output_dir={tmp_path}"], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "trainer.max_epochs" in proc.stderr + proc.stdout
    assert not (tmp_path / "digits").exists()
