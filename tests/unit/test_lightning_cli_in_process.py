"""LightningCLI scripts under keel (callbacks/lightning_cli.py, docs/cli.md), in one process.

tests/harness/scripts/lightning_cli_prog.py is a LightningCLI program written as a Lightning user writes one,
imports rewritten. These tests build its CLI in-process (``cli_main(args=[...])``); the script itself, run once as
``python`` and once under ``torchrun`` with 2 ranks, is tested in tests/integration/test_lightning_cli.py.

The constants marked "Lightning 2.6.6" were measured by running the same program under Lightning 2.6.6 (the import
lines put back to ``lightning``); CI does not install Lightning, so they are written here and in
tests/harness/cli_program.py.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from cli_program import LIGHTNING_CONFIG_PATH, PROG, QUIET, needs_jsonargparse
from launch import REPO_ROOT

from callbacks.lightning import Trainer

LIGHTNING_CONFIG = REPO_ROOT / "tests" / "fixtures" / "cli" / "lightning_fit_config.yaml"

# Lightning 2.6.6: the top-level keys of `prog.py <subcommand> --print_config` (predict's order differs in keel:
# keel's Trainer.predict takes ckpt_path before return_predictions).
LIGHTNING_PRINTED_KEYS = {
    "fit": ["seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path", "weights_only"],
    "validate": [
        "seed_everything",
        "trainer",
        "model",
        "data",
        "optimizer",
        "lr_scheduler",
        "ckpt_path",
        "verbose",
        "weights_only",
    ],
    "predict": [
        "seed_everything",
        "trainer",
        "model",
        "data",
        "optimizer",
        "lr_scheduler",
        "return_predictions",
        "ckpt_path",
        "weights_only",
    ],
}
# Lightning 2.6.6: the config of `run=False` (no subcommand) has these top-level keys.
LIGHTNING_RUN_FALSE_KEYS = {"config", "seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler"}

# Lightning 2.6.6: seed_everything_default=True with PL_GLOBAL_SEED unset seeds 0 and saves `seed_everything: 0`.
LIGHTNING_TRUE_SEED = 0
# Lightning 2.6.6: a second fit into the same log_dir raises RuntimeError starting so.
LIGHTNING_OVERWRITE_MESSAGE = "SaveConfigCallback expected {path} to NOT exist. Aborting to avoid overwriting"


@pytest.fixture(autouse=True)
def _clean_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """sys.argv without pytest's arguments (LightningCLI warns when args and argv are both given), and the seed
    variables seed_everything sets restored after the test."""
    monkeypatch.setattr(sys, "argv", [str(PROG)])
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def prog():
    spec = importlib.util.spec_from_file_location("lightning_cli_prog", PROG)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lightning_cli_prog"] = module  # jsonargparse names the classes by this import path
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("lightning_cli_prog", None)


def run_cli(prog, root: Path, *args: str, cli_class=None, **kwargs):
    """The program's ``cli_main`` in-process (with ``cli_class``, a LightningCLI subclass, in place of
    LightningCLI): ``args`` then the run directory and a quiet model summary."""
    args = list(args)
    if args and args[0] in ("fit", "validate", "test", "predict"):
        args += [f"--trainer.default_root_dir={root}", *QUIET]
    if cli_class is None:
        return prog.cli_main(args=args, **kwargs)
    original = prog.LightningCLI
    prog.LightningCLI = cli_class
    try:
        return prog.cli_main(args=args, **kwargs)
    finally:
        prog.LightningCLI = original


def printed_config(prog, capsys, *args: str, **kwargs) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        prog.cli_main(args=[*args, "--print_config"], **kwargs)
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


# ---------------------------------------------------------------------------- without jsonargparse


def test_the_module_imports_without_jsonargparse_and_the_cli_says_what_to_install(monkeypatch) -> None:
    """A copy of the module loaded while jsonargparse cannot be imported: importing works, building refuses."""
    monkeypatch.setitem(sys.modules, "jsonargparse", None)  # `import jsonargparse` raises ImportError
    spec = importlib.util.spec_from_file_location(
        "_cli_without_jsonargparse", REPO_ROOT / "callbacks" / "lightning_cli.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for build in (module.LightningCLI, module.LightningArgumentParser):
        with pytest.raises(ImportError, match=r"pip install keel-trainer\[cli\]"):
            build()
    del module, build
    gc.collect()  # the copy's Callback subclass leaves Callback.__subclasses__() (jsonargparse searches them)


# ---------------------------------------------------------------------------- fit and the config


@needs_jsonargparse
def test_fit_takes_model_data_and_trainer_options(prog, tmp_path) -> None:
    cli = run_cli(prog, tmp_path, "fit", "--model.hidden=6", "--data.batch_size=8", "--trainer.max_epochs=1")
    assert cli.subcommand == "fit"
    assert isinstance(cli.model, prog.RegressionModel) and cli.model.net[0].out_features == 6
    assert cli.model.hparams == {"hidden": 6, "lr": 0.05}
    assert isinstance(cli.datamodule, prog.RegressionData) and cli.datamodule.batch_size == 8
    assert cli.trainer.max_epochs == 1 and cli.trainer.current_epoch == 1
    assert cli.trainer.global_step == 64 // 8  # one epoch of 64 samples in batches of 8
    assert cli.trainer.options.log_every_n_steps == 1  # trainer_defaults
    # config.yaml lands where Lightning puts it: the run directory of the default logger.
    assert Path(cli.trainer.log_dir) / "config.yaml" == tmp_path / LIGHTNING_CONFIG_PATH
    saved = yaml.safe_load((tmp_path / LIGHTNING_CONFIG_PATH).read_text())
    assert saved["model"] == {"hidden": 6, "lr": 0.05} and saved["data"] == {"batch_size": 8, "num_samples": 64}
    assert saved["trainer"]["max_epochs"] == 1 and saved["seed_everything"] == 1234


@needs_jsonargparse
def test_config_files_in_order_then_the_command_line(prog, tmp_path) -> None:
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("model:\n  hidden: 3\n  lr: 0.1\ntrainer:\n  max_epochs: 1\n  limit_train_batches: 2\n")
    second.write_text("model:\n  hidden: 5\n")
    cli = run_cli(prog, tmp_path, "fit", "--config", str(first), "--config", str(second), "--model.lr=0.2")
    assert cli.model.hparams == {"hidden": 5, "lr": 0.2}
    assert cli.trainer.global_step == 2 and cli.trainer.current_epoch == 1


@needs_jsonargparse
@pytest.mark.parametrize("subcommand", ["fit", "validate", "predict"])
def test_print_config_keys_follow_lightning(prog, capsys, subcommand: str) -> None:
    from callbacks.lightning_cli import LIGHTNING_TRAINER_DEFAULTS

    printed = printed_config(prog, capsys, subcommand)
    assert sorted(printed) == sorted(LIGHTNING_PRINTED_KEYS[subcommand])
    # Every Trainer keyword of Lightning's config is there (keel's own options follow them).
    assert list(printed["trainer"])[: len(LIGHTNING_TRAINER_DEFAULTS)] == list(LIGHTNING_TRAINER_DEFAULTS)
    assert printed["trainer"]["max_epochs"] == 2 and printed["trainer"]["log_every_n_steps"] == 1  # trainer_defaults
    assert printed["seed_everything"] == 1234  # seed_everything_default
    assert printed["model"] == {"hidden": 8, "lr": 0.05} and printed["data"] == {"batch_size": 16, "num_samples": 64}


@needs_jsonargparse
def test_the_lightning_trainer_keywords_are_lightnings() -> None:
    """LIGHTNING_TRAINER_DEFAULTS is what Lightning 2.6.6 printed (the fixture), apart from the program's
    trainer_defaults."""
    from callbacks.lightning_cli import LIGHTNING_TRAINER_DEFAULTS

    trainer = yaml.safe_load(LIGHTNING_CONFIG.read_text())["trainer"]
    assert list(trainer) == list(LIGHTNING_TRAINER_DEFAULTS)
    given = {"max_epochs": 2, "log_every_n_steps": 1, "enable_progress_bar": False}
    assert trainer == {**LIGHTNING_TRAINER_DEFAULTS, **given}


@needs_jsonargparse
def test_print_config_is_the_config_the_run_uses_and_saves(prog, capsys, tmp_path) -> None:
    from callbacks.lightning_cli import keep_nulls

    args = ["fit", "--model.hidden=4", "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path}", *QUIET]
    printed = printed_config(prog, capsys, *args)
    cli = prog.cli_main(args=args)
    parser = cli._subcommand_parsers["fit"]
    assert printed == yaml.safe_load(parser.dump(cli.config.fit, **keep_nulls()))
    assert printed == yaml.safe_load((Path(cli.trainer.log_dir) / "config.yaml").read_text())
    # ... and, as a config file, it is the same config again.
    (tmp_path / "printed.yaml").write_text(yaml.safe_dump(printed))
    again = prog.cli_main(args=["fit", "--config", str(tmp_path / "printed.yaml")], run=True, save_config_callback=None)
    assert yaml.safe_load(again._subcommand_parsers["fit"].dump(again.config.fit, **keep_nulls())) == printed


@needs_jsonargparse
def test_a_config_lightning_printed_runs_under_keel(prog, tmp_path) -> None:
    """Lightning's keywords keel lacks are at Lightning's defaults there, and its nulls mean the defaults."""
    cli = run_cli(prog, tmp_path, "fit", "--config", str(LIGHTNING_CONFIG), "--trainer.max_epochs=1")
    opts = cli.trainer.options
    assert opts.precision == "32" and opts.log_every_n_steps == 1 and opts.num_sanity_val_steps == 2
    assert opts.enable_checkpointing and opts.limit_train_batches == 1.0 and cli.trainer.loggers  # null: defaults
    assert cli.trainer.global_step == 4


@needs_jsonargparse
def test_a_lightning_keyword_keel_lacks_is_refused_with_the_reason(prog, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"--trainer.max_time='00:00:01:00' is a Lightning option keel does not"):
        run_cli(prog, tmp_path, "fit", "--trainer.max_time=00:00:01:00")


# ---------------------------------------------------------------------------- validate / test / predict


class PredictCLI:
    """The program's CLI with its own ``predict`` (a method named like the subcommand runs instead of the
    Trainer's, as in Lightning), keeping the predictions."""

    @staticmethod
    def make(prog):
        class CLI(prog.LightningCLI):
            def predict(self, **kwargs):
                self.predictions = self.trainer.predict(**kwargs)

        return CLI


@needs_jsonargparse
def test_validate_test_and_predict_from_the_fitted_checkpoint(prog, tmp_path) -> None:
    fitted = run_cli(prog, tmp_path / "fit", "fit", "--model.hidden=6", "--trainer.max_epochs=1")
    ckpt = fitted.trainer.checkpoint_callback.best_model_path
    expected = fitted.trainer.validate(fitted.model, datamodule=fitted.datamodule, verbose=False)[0]["val_loss"]
    # Without --model.hidden: the checkpoint's hyperparameters build the model (Lightning 2.6.6 does the same).
    validated = run_cli(prog, tmp_path / "validate", "validate", f"--ckpt_path={ckpt}")
    assert validated.model.hparams["hidden"] == 6 and validated.config.validate.model.hidden == 6
    assert float(validated.trainer.callback_metrics["val_loss"]) == pytest.approx(expected)
    # The same with --model naming the class (model_class=None: any subclass).
    named = ["--model=lightning_cli_prog.RegressionModel", f"--ckpt_path={ckpt}"]
    subclassed = run_cli(prog, tmp_path / "subclass", "validate", *named, model_class=None)
    assert type(subclassed.model) is prog.RegressionModel and subclassed.model.hparams["hidden"] == 6
    tested = run_cli(prog, tmp_path / "test", "test", f"--ckpt_path={ckpt}", "--verbose=false")
    assert float(tested.trainer.callback_metrics["test_loss"]) == pytest.approx(expected)  # the same data
    predicted = run_cli(prog, tmp_path / "predict", "predict", f"--ckpt_path={ckpt}", cli_class=PredictCLI.make(prog))
    weights = {k: v for k, v in fitted.model.state_dict().items()}
    assert all(torch.equal(v, predicted.model.state_dict()[k]) for k, v in weights.items())
    x = torch.cat([x for x, _ in predicted.datamodule.predict_dataloader()])
    assert torch.allclose(torch.cat(predicted.predictions), fitted.model(x).detach())


@needs_jsonargparse
def test_weights_only_false_is_refused(prog, tmp_path) -> None:
    with pytest.raises(ValueError, match="keel always loads checkpoints with weights_only=True"):
        run_cli(prog, tmp_path, "validate", "--weights_only=false")


# ---------------------------------------------------------------------------- seeds and defaults


@needs_jsonargparse
@pytest.mark.parametrize(
    "given, seed",
    [({}, 1234), ({"seed_everything_default": True}, LIGHTNING_TRUE_SEED), ({"seed_everything_default": 7}, 7)],
)
def test_seed_everything_seeds_and_is_saved(prog, tmp_path, given: dict, seed: int) -> None:
    cli = run_cli(prog, tmp_path, "fit", "--trainer.max_epochs=1", **given)
    assert cli.config.fit.seed_everything == seed and os.environ["PL_GLOBAL_SEED"] == str(seed)
    assert cli.trainer.options.seed == seed  # keel's Trainer seeds every stage with it
    assert yaml.safe_load((Path(cli.trainer.log_dir) / "config.yaml").read_text())["seed_everything"] == seed


@needs_jsonargparse
def test_seed_everything_false_seeds_nothing_and_the_command_line_wins(prog, tmp_path) -> None:
    cli = run_cli(prog, tmp_path / "a", "fit", "--trainer.max_epochs=1", seed_everything_default=False)
    assert cli.config.fit.seed_everything is False and cli.trainer.options.seed is None
    assert "PL_GLOBAL_SEED" not in os.environ
    cli = run_cli(prog, tmp_path / "b", "fit", "--trainer.max_epochs=1", "--seed_everything=5", "--trainer.seed=9")
    assert cli.config.fit.seed_everything == 5 and cli.trainer.options.seed == 9


@needs_jsonargparse
def test_trainer_defaults_the_command_line_overrides_and_callbacks_always_added(prog, tmp_path) -> None:
    from callbacks.lightning import LearningRateMonitor

    monitor = LearningRateMonitor()
    defaults = {"max_epochs": 1, "limit_train_batches": 3, "callbacks": [monitor]}
    cli = run_cli(prog, tmp_path, "fit", "--trainer.limit_train_batches=2", trainer_defaults=defaults)
    assert cli.trainer.options.max_epochs == 1 and cli.trainer.global_step == 2
    assert monitor in cli.trainer.callbacks
    with pytest.raises(ValueError, match=r"'max_epoch' is not a Trainer option; did you mean 'max_epochs'\?"):
        run_cli(prog, tmp_path, "fit", trainer_defaults={"max_epoch": 1})


@needs_jsonargparse
def test_trainer_class_a_subclass_with_its_own_keyword_or_a_function(prog, tmp_path) -> None:
    class NotedTrainer(Trainer):
        def __init__(self, note: str = "none", **options) -> None:
            super().__init__(**options)
            self.note = note

    def make_trainer(max_epochs: int = 1, **options) -> Trainer:
        return Trainer(max_epochs=max_epochs, **options)

    cli = run_cli(
        prog, tmp_path / "a", "fit", "--trainer.note=hi", "--trainer.max_epochs=1", trainer_class=NotedTrainer
    )
    assert type(cli.trainer) is NotedTrainer and cli.trainer.note == "hi" and cli.trainer.global_step == 4
    cli = run_cli(
        prog,
        tmp_path / "b",
        "fit",
        "--trainer.limit_train_batches=1",
        trainer_class=make_trainer,
        trainer_defaults={},
    )
    assert cli.trainer.max_epochs == 1 and cli.trainer.global_step == 1


@needs_jsonargparse
@needs_jsonargparse
def test_a_strategy_object_with_its_settings_from_the_command_line(prog, tmp_path) -> None:
    """``--trainer.strategy`` takes the strings and a strategy class with its settings (jsonargparse's class
    path), as Lightning's CLI does."""
    base = ["--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path}"]
    given = ["--trainer.strategy=trainer.FSDPStrategy", "--trainer.strategy.units=[Block]"]
    cli = prog.cli_main(args=[*base, *given, "--trainer.strategy.cpu_offload=true"], run=False)
    assert cli.trainer.strategy.name == "fsdp"
    assert cli.trainer.strategy.settings()["units"] == ["Block"] and cli.trainer.strategy.cpu_offload is True
    assert prog.cli_main(args=[*base, "--trainer.strategy=fsdp"], run=False).trainer.strategy.name == "fsdp"


def test_run_false_builds_without_running(prog, tmp_path) -> None:
    cli = prog.cli_main(
        args=["--model.hidden=5", "--trainer.max_epochs=3", f"--trainer.default_root_dir={tmp_path}"], run=False
    )
    assert cli.subcommand is None and set(cli.config.as_dict()) == LIGHTNING_RUN_FALSE_KEYS
    assert cli.model.hparams["hidden"] == 5 and cli.trainer.max_epochs == 3 and cli.trainer.global_step == 0
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


# ---------------------------------------------------------------------------- config.yaml


@needs_jsonargparse
def test_config_yaml_is_not_overwritten_unless_asked(prog, tmp_path) -> None:
    args = ["fit", "--trainer.max_epochs=1", "--trainer.logger=false"]  # no logger: log_dir is default_root_dir
    run_cli(prog, tmp_path, *args)
    path = tmp_path / "config.yaml"
    assert path.is_file()
    with pytest.raises(RuntimeError, match=LIGHTNING_OVERWRITE_MESSAGE.format(path=path)):
        run_cli(prog, tmp_path, *args, "--model.hidden=3")
    run_cli(prog, tmp_path, *args, "--model.hidden=3", save_config_kwargs={"overwrite": True})
    assert yaml.safe_load(path.read_text())["model"]["hidden"] == 3
    path.unlink()
    run_cli(prog, tmp_path, *args, save_config_callback=None)
    assert not path.exists()


@needs_jsonargparse
def test_only_rank_zero_writes_config_yaml(tmp_path) -> None:
    from jsonargparse import Namespace

    from callbacks.lightning_cli import SaveConfigCallback

    class Strategy:
        def broadcast(self, obj, src=0):
            return obj

    class Parser:
        saved: list[str] = []

        def save(self, config, path, **kwargs):
            self.saved.append(path)

    class Rank:
        def __init__(self, rank: int) -> None:
            self.is_global_zero, self.log_dir, self.strategy = rank == 0, str(tmp_path), Strategy()

    parser = Parser()
    SaveConfigCallback(parser, Namespace()).setup(Rank(1), None, "fit")
    assert parser.saved == []
    SaveConfigCallback(parser, Namespace()).setup(Rank(0), None, "fit")
    assert parser.saved == [str(tmp_path / "config.yaml")]


# ---------------------------------------------------------------------------- errors


@needs_jsonargparse
@pytest.mark.parametrize(
    "option, says",
    [
        ("--trainer.max_epochz=1", ["did you mean --trainer.max_epochs?"]),
        ("--model.hiden=3", ["did you mean --model.hidden?"]),
        ("--trainer.gpus=1", ["--trainer.gpus is a Lightning option keel does not support: use accelerator='cuda'"]),
    ],
)
def test_a_bad_option_fails_naming_it_and_the_closest(prog, capsys, tmp_path, option: str, says: list[str]) -> None:
    """jsonargparse's error (exit status 2) naming the option, then keel's hint."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli(prog, tmp_path, "fit", option)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {option}" in err.lower() and all(text in err for text in says), err


@needs_jsonargparse
def test_a_bad_key_in_a_config_file_names_the_closest(prog, capsys, tmp_path) -> None:
    (tmp_path / "bad.yaml").write_text("trainer:\n  max_epochz: 1\n")
    with pytest.raises(SystemExit):
        run_cli(prog, tmp_path, "fit", "--config", str(tmp_path / "bad.yaml"))
    err = capsys.readouterr().err
    assert "'trainer.max_epochz'" in err and "did you mean --trainer.max_epochs?" in err, err


@needs_jsonargparse
def test_callbacks_and_logger_as_class_paths(prog, capsys, tmp_path) -> None:
    from callbacks.lightning import CSVLogger, EarlyStopping, ModelCheckpoint

    config = tmp_path / "callbacks.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: EarlyStopping\n      init_args: {monitor: val_loss, patience: 3}\n"
        "    - class_path: callbacks.lightning.ModelCheckpoint\n      init_args: {monitor: val_loss}\n"
        f"  logger:\n    class_path: callbacks.lightning.CSVLogger\n    init_args: {{save_dir: {tmp_path / 'csv'}}}\n"
    )
    cli = run_cli(prog, tmp_path, "fit", "--config", str(config), "--trainer.max_epochs=1")
    (stopping,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, EarlyStopping)]
    assert stopping.patience == 3 and type(cli.trainer.checkpoint_callback) is ModelCheckpoint
    assert isinstance(cli.trainer.logger, CSVLogger) and (Path(cli.trainer.log_dir) / "config.yaml").is_file()
    # Lightning's class paths are rewritten like its imports; the bare ModelCheckpoint is ambiguous in keel.
    for class_path, says in [
        ("lightning.pytorch.callbacks.EarlyStopping", "as `callbacks.lightning.Name`"),
        ("ModelCheckpoint", "Lightning's ModelCheckpoint is `callbacks.lightning.ModelCheckpoint`"),
    ]:
        with pytest.raises(SystemExit):
            run_cli(prog, tmp_path, "fit", f"--trainer.callbacks={class_path}")
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the loggers likewise: the Lightning layer's write under lightning_logs/
        run_cli(prog, tmp_path, "fit", "--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={tmp_path}")
    assert "Lightning's CSVLogger is `callbacks.lightning.CSVLogger`" in capsys.readouterr().err


# ---------------------------------------------------------------------------- optimizers and hooks


@needs_jsonargparse
def test_optimizer_and_lr_scheduler_from_the_command_line(prog, tmp_path) -> None:
    cli = run_cli(
        prog,
        tmp_path,
        "fit",
        "--optimizer=Adam",
        "--optimizer.lr=0.01",
        "--lr_scheduler=StepLR",
        "--lr_scheduler.step_size=1",
        "--trainer.max_epochs=2",
        model_class=prog.PlainModel,
    )
    (optimizer,) = cli.trainer.optimizers
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["lr"] == 0.01
    scheduler = cli.trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and scheduler.last_epoch == 2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.1**2)
    with pytest.warns(UserWarning, match="configure_optimizers` will be overridden"):
        run_cli(prog, tmp_path / "b", "fit", "--optimizer=SGD", "--optimizer.lr=0.1", "--trainer.max_epochs=1")


@needs_jsonargparse
def test_an_optimizer_group_linked_to_the_model(prog, tmp_path) -> None:
    from callbacks.lightning_cli import instantiate_class

    class LinkedModel(prog.PlainModel):
        def __init__(self, hidden: int = 8, optimizer_init: dict | None = None) -> None:
            super().__init__(hidden)
            self.optimizer_init = optimizer_init

        def configure_optimizers(self):
            return instantiate_class(self.parameters(), self.optimizer_init)

    class CLI(prog.LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_optimizer_args(torch.optim.Adam, link_to="model.optimizer_init")

    cli = run_cli(
        prog, tmp_path, "fit", "--optimizer.lr=0.02", "--trainer.max_epochs=1", cli_class=CLI, model_class=LinkedModel
    )
    (optimizer,) = cli.trainer.optimizers
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["lr"] == 0.02


@needs_jsonargparse
def test_reduce_lr_on_plateau_with_its_monitor(prog, tmp_path) -> None:
    from callbacks.lightning_cli import ReduceLROnPlateau

    cli = run_cli(
        prog,
        tmp_path,
        "fit",
        "--optimizer=SGD",
        "--optimizer.lr=0.1",
        "--lr_scheduler=ReduceLROnPlateau",
        "--lr_scheduler.monitor=val_loss",
        "--lr_scheduler.patience=0",
        "--trainer.max_epochs=1",
        model_class=prog.PlainModel,
    )
    (config,) = cli.trainer.lr_scheduler_configs
    assert isinstance(config.scheduler, ReduceLROnPlateau) and config.monitor == "val_loss"


@needs_jsonargparse
def test_an_extra_callback_group_and_an_fsspec_config(prog, tmp_path) -> None:
    import fsspec

    from callbacks.lightning import EarlyStopping

    class CLI(prog.LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_lightning_class_args(EarlyStopping, "early_stopping")

    with fsspec.open("memory://keel-cli/extra.yaml", "w") as handle:
        handle.write("early_stopping:\n  monitor: val_loss\n  patience: 2\n")
    cli = run_cli(
        prog, tmp_path, "fit", "--config=memory://keel-cli/extra.yaml", "--trainer.max_epochs=1", cli_class=CLI
    )
    (stopping,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, EarlyStopping)]
    assert stopping.monitor == "val_loss" and stopping.patience == 2


@needs_jsonargparse
def test_the_overridable_hooks_run_in_lightnings_order(prog, tmp_path) -> None:
    calls = []

    class CLI(prog.LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.link_arguments("data.batch_size", "model.hidden")
            calls.append("add_arguments_to_parser")

        def before_instantiate_classes(self):
            calls.append("before_instantiate_classes")

        def after_instantiate_classes(self):
            calls.append(f"after_instantiate_classes hidden={self.model.hparams.hidden}")

        def before_fit(self):
            calls.append(f"before_fit step={self.trainer.global_step}")

        def after_fit(self):
            calls.append(f"after_fit step={self.trainer.global_step}")

    run_cli(prog, tmp_path, "fit", "--data.batch_size=32", "--trainer.max_epochs=1", cli_class=CLI)
    assert calls[-4:] == [
        "before_instantiate_classes",
        "after_instantiate_classes hidden=32",
        "before_fit step=0",
        "after_fit step=2",
    ]
    assert set(calls[:-4]) == {"add_arguments_to_parser"}  # once per subcommand parser
