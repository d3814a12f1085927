"""Tests for recipes/ and conf/ in one process: every YAML composes and instantiates, the override grammar of
docs/configuration.md works, bad options fail before anything starts, and the saved config reports what a resume
changed. The recipes run end to end (``python -m recipes.train`` launched, with pinned losses) in
tests/integration/test_recipes.py, and on 2 processes in tests/integration/test_recipes_dist.py.
"""

from __future__ import annotations

import logging
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from recipe_paths import COMMAND, REPO_ROOT, _docs_section

pytest.importorskip("sklearn", reason="the digits recipe needs scikit-learn (pip install -e '.[dev]')")

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from callbacks import (
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ProgressBar,
    ThroughputMonitor,
    Timer,
)
from recipes import charlm
from recipes import config_dir as config_dir_mod
from recipes.config_callback import K_CONFIG, SaveConfig, config_diff
from recipes.config_dir import config_dir
from recipes.overrides import check_config_overrides
from recipes.train import build
from recipes.trainer_schema import check_overrides, config_keys, override_args
from trainer import Callback, DataModule, TaskModule, Trainer
from trainer.loggers import Logger

CONF = REPO_ROOT / "conf"
YAML_FILES = sorted(CONF.rglob("*.yaml"))


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


def _callback(trainer: Trainer, cls: type) -> Any:
    found = [cb for cb in trainer.callbacks if isinstance(cb, cls)]
    assert len(found) == 1, [type(cb).__name__ for cb in trainer.callbacks]
    return found[0]


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
    assert {"digits", "charlm"} <= {path.stem for path in (CONF / "experiment").glob("*.yaml")}


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
        assert instantiate(node, _convert_="all") is not None, node._get_full_key(None)
    trainer, task, datamodule = build(cfg)
    assert isinstance(trainer, Trainer) and isinstance(task, TaskModule) and isinstance(datamodule, DataModule)
    assert all(isinstance(cb, Callback) for cb in trainer.callbacks)
    assert all(isinstance(lg, Logger) for lg in trainer.loggers)


# ---------------------------------------------------------------------------------------------- overrides
def test_override_a_trainer_option_and_switch_the_task(tmp_path: Path) -> None:
    trainer, task, datamodule = build(_compose(["trainer.max_epochs=5", f"output_dir={tmp_path}"]))
    assert trainer.max_epochs == 5 and type(task).__name__ == "DigitsCNN"
    cfg = _compose(["task=charlm", "data=charlm", "trainer.precision=bf16-mixed", f"output_dir={tmp_path}"])
    trainer, task, datamodule = build(cfg)
    assert isinstance(task, charlm.CharGPT) and isinstance(datamodule, charlm.CharDataModule)
    assert trainer.precision == "bf16-mixed"


def test_callbacks_are_a_dict_that_overrides_can_edit(tmp_path: Path) -> None:
    trainer, _, _ = build(_compose(["callbacks.checkpoint.save_top_k=3", f"output_dir={tmp_path}"]))
    assert _callback(trainer, ModelCheckpoint).save_top_k == 3
    assert _callback(trainer, ProgressBar).refresh_rate == 5  # conf/callbacks/default.yaml's bar

    cfg = _compose(["~callbacks.progress", "callbacks.checkpoint=null", f"output_dir={tmp_path}"])
    trainer, _, _ = build(cfg)
    # Removed / null entries are skipped; the Trainer then adds its own default bar and checkpoint.
    assert _callback(trainer, ModelCheckpoint).monitor is None
    assert _callback(trainer, ProgressBar).refresh_rate == 1  # the Trainer's default, not the config's

    cfg = _compose(
        ["+callbacks.timer._target_=callbacks.Timer", "+callbacks.timer.duration=00:00:10:00", f"output_dir={tmp_path}"]
    )
    trainer, _, _ = build(cfg)
    assert isinstance(_callback(trainer, Timer), Timer)
    assert [type(cb).__name__ for cb in trainer.callbacks][:3] == ["ModelCheckpoint", "ProgressBar", "Timer"]


def test_groups_can_be_removed(tmp_path: Path) -> None:
    trainer, _, datamodule = build(_compose(["~logger", "~data", f"output_dir={tmp_path}"]))
    assert trainer.loggers == [] and datamodule is None
    assert trainer.log_dir == str(tmp_path / "digits")  # trainer.default_root_dir


def test_experiment_charlm_matches_the_recipe_defaults(tmp_path: Path) -> None:
    """conf/experiment/charlm.yaml spells out recipes.charlm's defaults; they must not drift apart."""
    composed = _compose(["+experiment=charlm", f"output_dir={tmp_path}"])
    cfg = {key: OmegaConf.to_container(composed[key], resolve=True) for key in ("data", "task", "trainer", "callbacks")}
    defaults = charlm.default_hparams()
    assert {k: cfg["data"][k] for k in defaults["data"]} == defaults["data"]
    assert {k: cfg["task"][k] for k in defaults["task"]} == defaults["task"]
    assert {k: cfg["trainer"][k] for k in charlm.default_trainer_options()} == charlm.default_trainer_options()
    max_steps = charlm.default_trainer_options()["max_steps"]
    assert instantiate(composed.callbacks.accumulation.scheduling) == charlm.default_accumulation(max_steps)
    shorter = _compose(["+experiment=charlm", "trainer.max_steps=200", f"output_dir={tmp_path}"])
    assert instantiate(shorter.callbacks.accumulation.scheduling) == charlm.default_accumulation(200)

    trainer, task, datamodule = build(_compose(["+experiment=charlm", f"output_dir={tmp_path}"]))
    assert (trainer.precision, trainer.options.gradient_clip_val) == ("bf16-mixed", 1.0)
    for cls in (GradientAccumulationScheduler, ThroughputMonitor, LearningRateMonitor):
        _callback(trainer, cls)
    assert _callback(trainer, ModelCheckpoint).monitor == "val/loss"


def _docs_commands(heading: str) -> list[list[str]]:
    """The ``python -m recipes.train ...`` command lines of the first bash block of docs/configuration.md's
    ``## heading``."""
    section = _docs_section("configuration.md", heading)
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, heading
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True)[3:] for line in lines if line.startswith("python -m recipes.train")]


def test_docs_override_examples_compose_and_build(tmp_path: Path) -> None:
    commands = _docs_commands("Overrides")
    assert len(commands) >= 10
    for args in commands:
        assert check_overrides(args) is None, args
        assert check_config_overrides(override_args(args)) is None, args
        if "-m" in args:  # a sweep: compose its first job
            args = [re.sub(r"=([^,]*),.*$", r"=\1", arg) for arg in args if arg != "-m"]
        cfg = _compose([*args, f"output_dir={tmp_path}"])
        trainer, task, _ = build(cfg)
        assert isinstance(task, TaskModule), args


# ---------------------------------------------------------------------------------------------- schema
def test_trainer_schema_rejects_a_bad_value_at_compose_time(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="trainer.max_epochs"):
        _compose(["trainer.max_epochs=oops", f"output_dir={tmp_path}"])
    with pytest.raises(Exception, match="trainer.max_epoch"):  # a typo: not a TrainerOptions key
        _compose(["trainer.max_epoch=3", f"output_dir={tmp_path}"])


def test_check_overrides_names_the_key_and_the_valid_keys() -> None:
    typo = check_overrides(["trainer.max_epoch=3"])
    assert typo is not None and "'trainer.max_epoch'" in typo and "Did you mean trainer.max_epochs?" in typo
    assert all(key in typo for key in config_keys())
    wrong = check_overrides(["-m", "trainer.precision=32,bf16-mixed", "trainer.max_steps=5,x"])
    assert wrong is not None and "trainer.max_steps" in wrong and "'x'" in wrong
    assert check_overrides(["+trainer.nope=1"]) is not None
    for fine in (
        ["trainer.max_epochs=5", "trainer.seed=null"],
        ["-m", "trainer.precision=32,bf16-mixed"],
        ["--config-name", "train", "task=charlm"],
        ["trainer.limit_val_batches=0.5"],
    ):
        assert check_overrides(fine) is None, fine


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "ckpt_pth=last",
            "Unknown config key 'ckpt_pth' in override 'ckpt_pth=last'. Did you mean ckpt_path? Valid top-level keys: "
            "callbacks, ckpt_path, data, logger, name, output_dir, task, test, trainer. To add a new key on purpose, "
            "write +ckpt_pth=last.",
        ),
        (
            "task.dropot=0.1",
            "Unknown config key 'task.dropot' in override 'task.dropot=0.1'. Did you mean task.dropout?",
        ),
        (
            "logger=tensorbord",
            "Unknown choice 'tensorbord' for the config group logger in override 'logger=tensorbord'. Did you mean "
            "tensorboard? Choices (logger/*.yaml): csv, mlflow, tensorboard, wandb.",
        ),
        ("trainer/strategy=fsdb", "Did you mean fsdp? Choices (strategy/*.yaml): ddp, fsdp."),
        (
            "data.batch_size=abc",
            "Invalid value 'abc' for data.batch_size in override 'data.batch_size=abc': it takes a number (it is 64 "
            "now).",
        ),
        ("test=maybe", "Invalid value 'maybe' for test in override 'test=maybe': it takes true or false"),
        ("data.batch_size=16,abc", "Invalid value 'abc' for data.batch_size"),  # a sweep, value by value
    ],
)
def test_a_wrong_override_is_one_line_naming_the_fix(override: str, message: str) -> None:
    """Hydra would say "use +ckpt_pth=last" (a key nothing reads), print its search path, or accept the word and
    fail in a DataLoader with a traceback."""
    error = check_config_overrides([override])
    assert error is not None and message in error and "\n" not in error, error


def test_overrides_that_are_right_pass_the_check() -> None:
    for fine in (
        ["data.batch_size=32", "test=false", "ckpt_path=null", "name=x", "logger=csv"],
        ["+experiment=charlm", "data.block_size=16"],  # a key the experiment's data node has
        ["~logger", "+callbacks.extra={_target_: trainer.Callback}", "task.lr=1e-3"],
        ["logger=null", "hydra.job.chdir=false", "trainer.max_epochs=2"],
    ):
        assert check_config_overrides(fine) is None, fine


def test_a_strategy_object_and_its_settings_from_the_config_group(tmp_path: Path) -> None:
    from trainer import DDPStrategy, FSDPStrategy

    args = ["trainer/strategy=fsdp", "trainer.strategy.units=[Block]", "trainer.strategy.reduce_grads=last_micro_batch"]
    assert check_overrides(args) is None
    trainer, _, _ = build(_compose([*args, f"output_dir={tmp_path}"]))
    assert isinstance(trainer.strategy, FSDPStrategy) and trainer.strategy.settings()["units"] == ["Block"]
    assert trainer.strategy.reduce_grads == "last_micro_batch"
    # One process: DDP settings build the DDP strategy object, which runs as the single-device one.
    cfg = _compose(["trainer/strategy=ddp", "trainer.strategy.static_graph=true", f"output_dir={tmp_path}"])
    assert isinstance(instantiate(cfg.trainer.strategy), DDPStrategy) and build(cfg)[0].strategy.name == "single"
    moved = check_overrides(["trainer.fsdp_units=[Block]"])
    assert moved is not None and "trainer/strategy=fsdp trainer.strategy.units=..." in moved, moved


def test_values_the_schema_cannot_type_are_refused_by_the_trainer(tmp_path: Path) -> None:
    # limit_*_batches is int | float, typed Any in the schema (OmegaConf 2.3 has no unions).
    cfg = _compose(["trainer.limit_val_batches=oops", f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="limit_val_batches"):
        build(cfg)


# ---------------------------------------------------------------------------------------------- saved config
def test_config_diff_lists_changed_added_and_removed_keys() -> None:
    old = {"trainer": {"max_steps": 3, "seed": 0}, "callbacks": {"killer": {"_target_": "x.K"}}, "name": "a"}
    new = {"trainer": {"max_steps": 5, "seed": 0}, "callbacks": {}, "name": "a", "test": False}
    assert config_diff(old, new) == [
        ("callbacks", "<absent>", {}),
        ("callbacks.killer._target_", "x.K", "<absent>"),
        ("test", "<absent>", False),
        ("trainer.max_steps", 3, 5),
    ]


def test_save_config_warns_key_by_key_when_a_resume_changes_the_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = Trainer(
        logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=str(tmp_path)
    )
    saver = SaveConfig(OmegaConf.create({"trainer": {"max_steps": 5}, "task": {"lr": 0.1}}), "cmd")
    checkpoint: dict[str, Any] = {}
    SaveConfig({"trainer": {"max_steps": 3}, "task": {"lr": 0.1}}, "cmd").on_save_checkpoint(trainer, None, checkpoint)
    assert checkpoint[K_CONFIG] == {"trainer": {"max_steps": 3}, "task": {"lr": 0.1}}
    saver.setup(trainer, None, "fit")  # type: ignore[arg-type]
    assert (tmp_path / "config.yaml").read_text().startswith("# cmd\n")
    with caplog.at_level(logging.WARNING, logger="recipes.config_callback"):
        saver.on_load_checkpoint(trainer, None, checkpoint)  # type: ignore[arg-type]
    assert "trainer.max_steps: 3 -> 5" in caplog.text and "current config wins" in caplog.text
    assert "task.lr" not in caplog.text


def test_an_object_store_output_dir_is_the_run_directory_never_a_local_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _compose(["output_dir=memory://keel-recipes/runs"])
    assert cfg.hydra.sweep.dir.startswith("outputs/memory/keel-recipes/runs/digits/multirun/")  # Hydra's own: local
    stream = _compose(["output_dir=memory://keel-recipes/runs", "+experiment=charlm", "data=charlm_stream"])
    assert stream.data.shards_dir == "outputs/memory/keel-recipes/runs/charlm_shards"  # written with open(): local
    trainer, _, _ = build(cfg)
    trainer.loggers[0].resolve_version()
    assert trainer.log_dir == "memory://keel-recipes/runs/digits/version_0"
    assert trainer.checkpoint_callback is not None
    from hydra.errors import InstantiationException

    with pytest.raises(
        (ValueError, InstantiationException), match=r"'nosuchscheme://bucket/runs' is a nosuchscheme://"
    ):
        build(_compose(["output_dir=nosuchscheme://bucket/runs"]))  # no filesystem for it: refused when built
    assert not any(":" in p.name for p in tmp_path.rglob("*"))
