"""Lightning's ``LightningCLI`` on jsonargparse: scripts built on it run under keel after the import rewrite.

``from lightning.pytorch.cli import LightningCLI`` becomes ``from callbacks.lightning.pytorch.cli import LightningCLI``
and the script keeps its command line: the subcommands ``fit`` / ``validate`` / ``test`` / ``predict``, ``--model.*``,
``--data.*``, ``--trainer.*``, ``--config file.yaml``, ``--print_config``, ``--seed_everything``, ``--optimizer`` /
``--lr_scheduler``, and the ``config.yaml`` written into the run directory (docs/cli.md says what differs and why).

The ``--trainer.*`` group is built from keel's :class:`trainer.options.TrainerOptions`, with Lightning's Trainer
keywords that keel lacks accepted at their default (:mod:`callbacks.lightning_cli_options`).

jsonargparse is an optional extra (``pip install keel-trainer[cli]``): this module imports without it, and building
a :class:`LightningCLI` or a :class:`LightningArgumentParser` without it raises ``ImportError`` saying so. Every rank
parses the same arguments; only rank 0 writes ``config.yaml`` (:class:`SaveConfigCallback`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from callbacks.lightning_cli_options import (
    LIGHTNING_TRAINER_DEFAULTS,
    REASONS,
    LRSchedulerCallable,
    LRSchedulerType,
    LRSchedulerTypeTuple,
    LRSchedulerTypeUnion,
    OptimizerCallable,
    ReduceLROnPlateau,
    add_class_path_generator,
    automatic,
    global_add_class_path,
    instantiate_class,
    option_hints,
    trainer_arguments,
    trainer_kwargs,
)
from trainer import __version__
from trainer.callback import Callback
from trainer.lifecycle import seed_everything
from trainer.module import DataModule, TaskModule
from trainer.observability.rank_zero import rank_zero_warn
from trainer.trainer import Trainer

if TYPE_CHECKING:
    from jsonargparse import ActionConfigFile, ArgumentParser, Namespace  # type: ignore[attr-defined]
else:
    try:
        from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
    except ImportError:  # the optional extra is not installed: LightningArgumentParser() raises
        ActionConfigFile = Namespace = None
        ArgumentParser = object

INSTALL_HINT = (
    "LightningCLI needs jsonargparse: pip install keel-trainer[cli] (or pip install 'jsonargparse[signatures]')"
)


def _require_jsonargparse() -> None:
    if ActionConfigFile is None:
        raise ImportError(INSTALL_HINT)


ArgsType = list[str] | dict[str, Any] | Namespace | None


def keep_nulls() -> dict[str, bool]:
    """The keyword of jsonargparse's ``dump`` / ``save`` that keeps ``null`` values (what Lightning saves):
    ``skip_unset`` from jsonargparse 4.49, ``skip_none`` before."""
    from importlib.metadata import version

    major, minor = (int(part) for part in version("jsonargparse").split(".")[:2])
    return {"skip_unset": False} if (major, minor) >= (4, 49) else {"skip_none": False}


def _setup_jsonargparse() -> None:
    """As Lightning does: torch's classes are dumped by the import path users write (``torch.optim.Adam``), and
    config files may be fsspec URLs."""
    from jsonargparse import register_unresolvable_import_paths, set_parsing_settings

    register_unresolvable_import_paths(torch)
    set_parsing_settings(config_read_mode_fsspec_enabled=True)  # --config s3://... (fsspec comes with torch)


# ---------------------------------------------------------------------- the parser


def _builds_trainer(target: Any) -> bool:
    """A Trainer class, or a function annotated to return one (Lightning's ``trainer_class`` may be either)."""
    if not isinstance(target, type) and callable(target):
        target = typing.get_type_hints(target).get("return")
    return isinstance(target, type) and issubclass(target, Trainer)


class LightningArgumentParser(ArgumentParser):
    """Lightning's parser (jsonargparse's ``ArgumentParser``) with ``add_lightning_class_args``,
    ``add_optimizer_args`` and ``add_lr_scheduler_args``; an error names the closest valid option."""

    def __init__(
        self,
        *args: Any,
        description: str = "keel Trainer command line tool (LightningCLI)",
        env_prefix: str = "PL",
        default_env: bool = False,
        **kwargs: Any,
    ) -> None:
        _require_jsonargparse()
        super().__init__(*args, description=description, env_prefix=env_prefix, default_env=default_env, **kwargs)
        self.callback_keys: list[str] = []
        self._optimizers: dict[str, tuple[type | tuple[type, ...], str]] = {}
        self._lr_schedulers: dict[str, tuple[type | tuple[type, ...], str]] = {}
        self._groups: dict[str, list[str]] = {}  # nested key -> its options (for the error's suggestion)

    def add_lightning_class_args(
        self,
        lightning_class: Any,
        nested_key: str,
        subclass_mode: bool = False,
        required: bool = True,
    ) -> list[str]:
        """Add the arguments of a Trainer, TaskModule, DataModule or Callback class (or of a function returning
        one) under ``nested_key``, as Lightning does; the Trainer's come from :func:`trainer_arguments`."""
        from jsonargparse import class_from_function  # type: ignore[attr-defined]

        if _builds_trainer(lightning_class):
            added = self.add_class_arguments(
                trainer_arguments(lightning_class), nested_key, fail_untyped=False, instantiate=False, sub_configs=True
            )
            self._groups[nested_key] = added
            return added
        if callable(lightning_class) and not isinstance(lightning_class, type):
            lightning_class = class_from_function(lightning_class)
        if not (isinstance(lightning_class, type) and issubclass(lightning_class, (TaskModule, DataModule, Callback))):
            raise ValueError(
                f"Cannot add arguments from: {lightning_class}. You should provide either a callable or a subclass of: "
                "Trainer, LightningModule, LightningDataModule, or Callback."
            )
        if issubclass(lightning_class, Callback):
            self.callback_keys.append(nested_key)
        if subclass_mode:
            added = self.add_subclass_arguments(lightning_class, nested_key, fail_untyped=False, required=required)
        else:
            added = self.add_class_arguments(lightning_class, nested_key, fail_untyped=False, sub_configs=True)
        self._groups[nested_key] = list(added or [])
        return added

    def add_optimizer_args(
        self,
        optimizer_class: type[Optimizer] | tuple[type[Optimizer], ...] = (Optimizer,),
        nested_key: str = "optimizer",
        link_to: str = "AUTOMATIC",
    ) -> None:
        """``--optimizer`` (a class, or any subclass of a tuple of them); ``params`` comes from the model."""
        kwargs: dict[str, Any] = {"instantiate": False, "fail_untyped": False, "skip": {"params"}}
        if isinstance(optimizer_class, tuple):
            self.add_subclass_arguments(optimizer_class, nested_key, **kwargs)
        else:
            self.add_class_arguments(optimizer_class, nested_key, sub_configs=True, **kwargs)
        self._optimizers[nested_key] = (optimizer_class, link_to)

    def add_lr_scheduler_args(
        self,
        lr_scheduler_class: Any = LRSchedulerTypeTuple,
        nested_key: str = "lr_scheduler",
        link_to: str = "AUTOMATIC",
    ) -> None:
        """``--lr_scheduler`` (a class, or any subclass of a tuple of them); ``optimizer`` comes from
        ``--optimizer``."""
        kwargs: dict[str, Any] = {"instantiate": False, "fail_untyped": False, "skip": {"optimizer"}}
        if isinstance(lr_scheduler_class, tuple):
            self.add_subclass_arguments(lr_scheduler_class, nested_key, **kwargs)
        else:
            self.add_class_arguments(lr_scheduler_class, nested_key, sub_configs=True, **kwargs)
        self._lr_schedulers[nested_key] = (lr_scheduler_class, link_to)

    def error(self, message: str, ex: Exception | None = None) -> typing.NoReturn:
        """jsonargparse's error, plus keel's hint: the closest valid option, why keel lacks a Lightning one, or
        how to rewrite a ``lightning.*`` class path."""
        super().error(message + "".join(f"\n  {hint}" for hint in option_hints(message, self._groups)), ex)


# ---------------------------------------------------------------------- config.yaml


class SaveConfigCallback(Callback):
    """Writes the parsed config to ``config.yaml`` in the run directory (``trainer.log_dir``) when the first stage
    starts, on rank 0 only; refuses to overwrite an existing file unless ``overwrite=True`` (Lightning's).

    Args:
        parser: The parser that parsed the config.
        config: The parsed config (of the subcommand).
        config_filename: The file's name in the run directory.
        overwrite: Replace an existing file instead of raising.
        multifile: Keep the structure of several ``--config`` files (jsonargparse's ``multifile``).
        save_to_log_dir: False: write nothing yourself, only call :meth:`save_config` (override it).
    """

    def __init__(
        self,
        parser: LightningArgumentParser,
        config: Namespace,
        config_filename: str = "config.yaml",
        overwrite: bool = False,
        multifile: bool = False,
        save_to_log_dir: bool = True,
    ) -> None:
        self.parser, self.config, self.config_filename = parser, config, config_filename
        self.overwrite, self.multifile, self.save_to_log_dir = overwrite, multifile, save_to_log_dir
        self.already_saved = False
        if not save_to_log_dir and type(self).save_config is SaveConfigCallback.save_config:
            raise ValueError(
                "`save_to_log_dir=False` only makes sense when subclassing SaveConfigCallback to implement "
                "`save_config` and it is desired to disable the standard behavior of saving to log_dir."
            )

    def setup(self, trainer: Trainer, pl_module: TaskModule, stage: str) -> None:
        """On every rank (the existence check is broadcast from rank 0, so every rank raises together)."""
        if self.already_saved:
            return
        if self.save_to_log_dir:
            log_dir = trainer.log_dir  # the run directory every rank agreed on
            config_path = os.path.join(log_dir, self.config_filename)
            if not self.overwrite:
                exists = trainer.strategy.broadcast(os.path.isfile(config_path) if trainer.is_global_zero else False)
                if exists:
                    raise RuntimeError(
                        f"{type(self).__name__} expected {config_path} to NOT exist. Aborting to avoid overwriting"
                        " results of a previous run. You can delete the previous config file,"
                        " set `LightningCLI(save_config_callback=None)` to disable config saving,"
                        ' or set `LightningCLI(save_config_kwargs={"overwrite": True})` to overwrite the config file.'
                    )
            if trainer.is_global_zero:
                os.makedirs(log_dir, exist_ok=True)
                self.parser.save(
                    self.config, config_path, overwrite=self.overwrite, multifile=self.multifile, **keep_nulls()
                )
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)

    def save_config(self, trainer: Trainer, pl_module: TaskModule, stage: str) -> None:
        """Override to save the config somewhere else too (a logger, a tracker). Rank 0 only: no collectives."""


# ---------------------------------------------------------------------- the CLI


class LightningCLI:
    """Lightning's ``LightningCLI``: parse the command line (and config files) into a model, a datamodule and a
    Trainer, then run the subcommand. The arguments are Lightning's (docs/cli.md).

    Args:
        model_class: A TaskModule class or a function returning one; None: any subclass, ``--model=Name``.
        datamodule_class: A DataModule class or a function returning one; None: optional, any subclass.
        save_config_callback: The callback that writes ``config.yaml`` (None: write nothing).
        save_config_kwargs: Its keyword arguments (``{"overwrite": True}``).
        trainer_class: The Trainer class, or a function returning a Trainer; None: ``callbacks.lightning``'s.
        trainer_defaults: Defaults of ``--trainer.*``; its ``callbacks`` are always added, not configurable.
        seed_everything_default: ``--seed_everything``'s default: an int, True (seed from ``PL_GLOBAL_SEED``,
            else 0) or False (no seeding).
        parser_kwargs: Keyword arguments of every parser, or per subcommand (``{"fit": {...}}``).
        parser_class: The parser class.
        subclass_mode_model: Accept any subclass of ``model_class`` (``--model.class_path``).
        subclass_mode_data: Accept any subclass of ``datamodule_class``.
        args: The arguments to parse instead of ``sys.argv[1:]``: a list of strings, or a dict / Namespace.
        run: Add the subcommands and run the chosen one; False: only build the model, data and Trainer.
        auto_configure_optimizers: Add ``--optimizer`` / ``--lr_scheduler``; given, they replace the model's
            ``configure_optimizers``.
        load_from_checkpoint_support: Accepted for Lightning's signature; keel's ``save_hyperparameters`` always
            records the values ``__init__`` received (docs/cli.md).
    """

    def __init__(
        self,
        model_class: type[TaskModule] | Callable[..., TaskModule] | None = None,
        datamodule_class: type[DataModule] | Callable[..., DataModule] | None = None,
        save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
        save_config_kwargs: dict[str, Any] | None = None,
        trainer_class: type[Trainer] | Callable[..., Trainer] | None = None,
        trainer_defaults: dict[str, Any] | None = None,
        seed_everything_default: bool | int = True,
        parser_kwargs: dict[str, Any] | None = None,
        parser_class: type[LightningArgumentParser] = LightningArgumentParser,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: ArgsType = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
        load_from_checkpoint_support: bool = True,
    ) -> None:
        _require_jsonargparse()
        _setup_jsonargparse()
        if trainer_class is None:
            # Lightning's Trainer name (imported here: callbacks.lightning re-exports this module).
            trainer_class = importlib.import_module("callbacks.lightning").Trainer
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = save_config_kwargs or {}
        self.trainer_class = trainer_class
        self.trainer_defaults = trainer_defaults or {}
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs = parser_kwargs or {}
        self.parser_class = parser_class
        self.auto_configure_optimizers = auto_configure_optimizers
        self.model_class = model_class
        self._model_class = model_class or TaskModule
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.datamodule_class = datamodule_class
        self._datamodule_class = datamodule_class or DataModule
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data

        main_kwargs, subparser_kwargs = self._setup_parser_kwargs(self.parser_kwargs)
        self.setup_parser(run, main_kwargs, subparser_kwargs)
        self.parse_arguments(self.parser, args)
        self._parse_ckpt_path()
        self.subcommand: str | None = self.config["subcommand"] if run else None
        self._set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # ------------------------------------------------------------------ the parser
    def _setup_parser_kwargs(self, parser_kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        names = self.subcommands().keys()
        return (
            {k: v for k, v in parser_kwargs.items() if k not in names},
            {k: v for k, v in parser_kwargs.items() if k in names},
        )

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """The parser with ``-c/--config`` (and jsonargparse's ``--print_config``)."""
        kwargs.setdefault("dump_header", [f"keel-trainer=={__version__}"])
        parser = self.parser_class(**kwargs)
        parser.add_argument(
            "-c", "--config", action=ActionConfigFile, help="Path to a configuration file in json or yaml format."
        )
        return parser

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        """The main parser, and one parser per subcommand (``run=True``)."""
        self.parser = self.init_parser(**main_kwargs)
        if add_subcommands:
            self._subcommand_method_arguments: dict[str, list[str]] = {}
            self._add_subcommands(self.parser, **subparser_kwargs)
        else:
            self._add_arguments(self.parser)

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--seed_everything``."""
        parser.add_argument(
            "--seed_everything",
            type=bool | int,
            default=self.seed_everything_default,
            help=(
                "Set to an int to run seed_everything with this value before classes instantiation."
                "Set to True to use a random seed."
            ),
        )

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--trainer.*`` (with ``trainer_defaults``), ``--model.*`` and ``--data.*``."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        defaults = {k: v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        options = [key.split(".", 1)[1] for key in parser._groups["trainer"]]
        for name in defaults:
            if name not in options:
                close = difflib.get_close_matches(name, options, n=1)
                raise ValueError(
                    f"LightningCLI(trainer_defaults={{{name!r}: ...}}): {name!r} is not a Trainer option"
                    + (f": {REASONS[name]}" if name in REASONS else f"; did you mean {close[0]!r}?" if close else ".")
                )
        parser.set_defaults({f"trainer.{k}": v for k, v in defaults.items()})
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(
            self._datamodule_class,
            "data",
            subclass_mode=self.subclass_mode_data,
            required=self.datamodule_class is not None,
        )

    def _add_arguments(self, parser: LightningArgumentParser) -> None:
        self.add_default_arguments_to_parser(parser)
        self.add_core_arguments_to_parser(parser)
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            if not parser._optimizers:  # the user's add_arguments_to_parser may have added them
                parser.add_optimizer_args((Optimizer,))
            if not parser._lr_schedulers:
                parser.add_lr_scheduler_args(LRSchedulerTypeTuple)
        self.link_optimizers_and_lr_schedulers(parser)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Override to add arguments or links (``parser.link_arguments``)."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The subcommands, each with the Trainer method's parameters the CLI fills itself."""
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
            "test": {"model", "dataloaders", "datamodule"},
            "predict": {"model", "dataloaders", "datamodule"},
        }

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        self._subcommand_parsers: dict[str, LightningArgumentParser] = {}
        parser_subcommands = parser.add_subcommands()
        trainer_class = self.trainer_class if isinstance(self.trainer_class, type) else Trainer
        for subcommand in self.subcommands():
            doc = inspect.getdoc(getattr(trainer_class, subcommand)) or ""
            description = doc.split("\n\n")[0].replace("\n", " ") or None
            subparser_kwargs = dict(kwargs.get(subcommand, {}))
            subparser_kwargs.setdefault("description", description)
            subcommand_parser = self._prepare_subcommand_parser(trainer_class, subcommand, **subparser_kwargs)
            self._subcommand_parsers[subcommand] = subcommand_parser
            parser_subcommands.add_subcommand(subcommand, subcommand_parser, help=description)
            parser._groups.update(subcommand_parser._groups)  # the main parser's errors name their options too

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        parser = self.init_parser(**kwargs)
        self._add_arguments(parser)
        skip: set[str | int] = set(self.subcommands()[subcommand])
        self._subcommand_method_arguments[subcommand] = parser.add_method_arguments(klass, subcommand, skip=skip)
        if "weights_only" not in self._subcommand_method_arguments[subcommand]:
            parser.add_argument(
                "--weights_only",
                type=bool | None,
                default=None,
                help="Lightning's torch.load flag: keel always loads checkpoints with weights_only=True.",
            )
        return parser

    @staticmethod
    def link_optimizers_and_lr_schedulers(parser: LightningArgumentParser) -> None:
        """Links for the optimizers and schedulers added with a ``link_to`` other than ``"AUTOMATIC"``."""
        for key, (class_type, link_to) in {**parser._optimizers, **parser._lr_schedulers}.items():
            if link_to == "AUTOMATIC":
                continue
            if isinstance(class_type, tuple):
                parser.link_arguments(key, link_to)
            else:
                parser.link_arguments(key, link_to, compute_fn=add_class_path_generator(class_type))

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse ``args`` (or ``sys.argv[1:]``) into ``self.config``."""
        if args is not None and len(sys.argv) > 1:
            rank_zero_warn(
                "LightningCLI's args parameter is intended to run from within Python like if it were from the command "
                "line. To prevent mistakes it is not recommended to provide both args and command line arguments, got: "
                f"sys.argv[1:]={sys.argv[1:]}, args={args}."
            )
        if isinstance(args, (dict, Namespace)):
            self.config = parser.parse_object(args)
        else:
            self.config = parser.parse_args(args)

    def _parse_ckpt_path(self) -> None:
        """``--ckpt_path`` of an existing checkpoint: its saved hyperparameters become the model's arguments
        (they win over the command line, as in Lightning)."""
        if not self.config.get("subcommand"):
            return
        ckpt_path = self.config[self.config.subcommand].get("ckpt_path")
        if not ckpt_path or not Path(ckpt_path).exists():
            return  # also "last" / "best": the Trainer resolves those
        from trainer.checkpoint.files import K_HPARAMS
        from trainer.checkpoint.reader import load_weights

        hparams: dict[str, Any] = dict(load_weights(ckpt_path).get(K_HPARAMS) or {})
        if not hparams:
            return
        given = self.config[self.config.subcommand].get("model")
        if self.subclass_mode_model and given is not None and given.get("class_path"):
            # keel's hyperparameters hold no class path (Lightning's hold `_class_path`): --model names the class.
            hparams = {"class_path": given.class_path, "init_args": hparams}
        try:
            self.config = self.parser.parse_object({self.config.subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    # ------------------------------------------------------------------ instantiation
    def before_instantiate_classes(self) -> None:
        """Override to run code before the classes are instantiated."""

    def instantiate_classes(self) -> None:
        """Build the model, the datamodule and the Trainer from the config (``self.config_init``)."""
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes  # 4.49 renamed it
        self.config_init = instantiate(self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        self._add_configure_optimizers_method_to_model(self.subcommand)
        self.trainer = self.instantiate_trainer()

    def after_instantiate_classes(self) -> None:
        """Override to run code after the classes are instantiated."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer, from ``--trainer.*`` updated with ``kwargs``; its callbacks are the configured ones, the
        extra callback groups, ``trainer_defaults["callbacks"]`` and the config-saving callback."""
        extra_callbacks = [self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys]
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        return self._instantiate_trainer(trainer_config, extra_callbacks)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        config = trainer_kwargs(config)
        if "seed" in config and config["seed"] is None:
            # The seed seed_everything used (keel's Trainer seeds every stage); None without seed_everything.
            config["seed"] = self._seed
        if "callbacks" not in config:
            rank_zero_warn(
                f"The `{getattr(self.trainer_class, '__qualname__', self.trainer_class)}` class does not expose the "
                "`callbacks` argument so they will not be included."
            )
            return self.trainer_class(**config)
        value = config["callbacks"]
        config["callbacks"] = [] if value is None else list(value) if isinstance(value, list) else [value]
        config["callbacks"].extend(callbacks)
        if "callbacks" in self.trainer_defaults:
            value = self.trainer_defaults["callbacks"]
            config["callbacks"] += value if isinstance(value, list) else [value]
        if self.save_config_callback and not config.get("fast_dev_run", False):
            config["callbacks"].append(
                self.save_config_callback(
                    self._parser(self.subcommand),
                    self.config.get(str(self.subcommand), self.config),
                    **self.save_config_kwargs,
                )
            )
        return self.trainer_class(**config)

    def _parser(self, subcommand: str | None) -> LightningArgumentParser:
        return self.parser if subcommand is None else self._subcommand_parsers[subcommand]

    def _set_seed(self) -> None:
        """``seed_everything`` before anything is built; the seed used goes into the config (and config.yaml)."""
        self._seed: int | None = None
        config_seed = self._get(self.config, "seed_everything")
        if config_seed is False:
            return
        self._seed = seed_everything(None if config_seed is True else config_seed, workers=True)
        (self.config[self.subcommand] if self.subcommand else self.config)["seed_everything"] = self._seed

    def _get(self, config: Namespace, key: str, default: Any = None) -> Any:
        """A config value, inside the subcommand's namespace when there is one."""
        return config.get(str(self.subcommand), config).get(key, default)

    # ------------------------------------------------------------------ optimizers
    @staticmethod
    def configure_optimizers(
        lightning_module: TaskModule, optimizer: Optimizer, lr_scheduler: LRSchedulerTypeUnion | None = None
    ) -> Any:
        """What the model's ``configure_optimizers`` returns when ``--optimizer`` is given; override to change it."""
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": lr_scheduler, "monitor": lr_scheduler.monitor},
            }
        return [optimizer], [lr_scheduler]

    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        """With one ``"AUTOMATIC"`` optimizer given (and at most one scheduler), the model's ``configure_optimizers``
        builds them from the config when the Trainer calls it (over the parameters that exist then)."""
        if not self.auto_configure_optimizers:
            return
        parser = self._parser(subcommand)
        optimizers = automatic(Optimizer, parser._optimizers)
        lr_schedulers = automatic(LRSchedulerTypeTuple, parser._lr_schedulers)
        if not optimizers:
            return
        if len(optimizers) > 1 or len(lr_schedulers) > 1:
            raise ValueError(
                f"`{type(self).__name__}.add_configure_optimizers_method_to_model` expects at most one optimizer "
                f"and one lr_scheduler to be 'AUTOMATIC', but found {optimizers + lr_schedulers}. In this case the "
                "user is expected to link the argument groups and implement `configure_optimizers` (docs/cli.md)."
            )
        optimizer_class = parser._optimizers[optimizers[0]][0]
        optimizer_init = self._get(self.config_init, optimizers[0])
        if not isinstance(optimizer_class, tuple):
            optimizer_init = global_add_class_path(optimizer_class, optimizer_init)
        if not optimizer_init:
            return  # registered, not given: the model's own configure_optimizers runs
        lr_scheduler_init = None
        if lr_schedulers:
            lr_scheduler_class = parser._lr_schedulers[lr_schedulers[0]][0]
            lr_scheduler_init = self._get(self.config_init, lr_schedulers[0])
            if not isinstance(lr_scheduler_class, tuple):
                lr_scheduler_init = global_add_class_path(lr_scheduler_class, lr_scheduler_init)
        if type(self.model).configure_optimizers is not TaskModule.configure_optimizers:
            rank_zero_warn(
                f"`{type(self.model).__name__}.configure_optimizers` will be overridden by "
                f"`{type(self).__name__}.configure_optimizers`."
            )
        cli = self

        def configure_optimizers(model: TaskModule) -> Any:
            optimizer = instantiate_class(model.parameters(), optimizer_init)
            lr_scheduler = instantiate_class(optimizer, lr_scheduler_init) if lr_scheduler_init else None
            return cli.configure_optimizers(model, optimizer, lr_scheduler)

        self.model.configure_optimizers = MethodType(configure_optimizers, self.model)

    # ------------------------------------------------------------------ running
    def _run_subcommand(self, subcommand: str) -> None:
        """``before_<subcommand>``, the Trainer's method (or the CLI's own of that name), ``after_<subcommand>``."""
        before_fn = getattr(self, f"before_{subcommand}", None)
        if callable(before_fn):
            before_fn()
        fn = getattr(self, subcommand, getattr(self.trainer, subcommand))
        fn(**self._prepare_subcommand_kwargs(subcommand))
        after_fn = getattr(self, f"after_{subcommand}", None)
        if callable(after_fn):
            after_fn()

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        given = self.config_init[subcommand]
        fn_kwargs = {k: v for k, v in given.items() if k in self._subcommand_method_arguments[subcommand]}
        if given.get("weights_only") is False:
            raise ValueError(
                "--weights_only=false: keel always loads checkpoints with weights_only=True (nothing in a checkpoint "
                "can run code); leave the option out."
            )
        fn_kwargs["model"] = self.model
        if self.datamodule is not None:
            fn_kwargs["datamodule"] = self.datamodule
        return fn_kwargs


__all__ = [
    "ArgsType",
    "LIGHTNING_TRAINER_DEFAULTS",
    "LRSchedulerCallable",
    "LRSchedulerType",
    "LRSchedulerTypeTuple",
    "LRSchedulerTypeUnion",
    "LightningArgumentParser",
    "LightningCLI",
    "OptimizerCallable",
    "ReduceLROnPlateau",
    "SaveConfigCallback",
    "instantiate_class",
    "trainer_arguments",
]
