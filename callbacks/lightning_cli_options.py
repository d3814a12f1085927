"""What :mod:`callbacks.lightning_cli` builds its parser from, without jsonargparse: the Trainer's keywords as a
signature, and Lightning's optimizer and scheduler helpers.

keel's ``Trainer(**options)`` has no signature for jsonargparse to read, so :func:`trainer_arguments` builds one from
:class:`trainer.options.TrainerOptions` (its fields, types and docstring), in Lightning's order. Lightning's Trainer
keywords that keel lacks (``max_time``, ``inference_mode``, ...) are in it at Lightning's default value, so that a
config written by Lightning's ``--print_config`` loads; :func:`trainer_kwargs` drops them at that value and refuses
any other with the reason. ``null`` for an option whose Lightning default is ``None`` means keel's default, as it
means Lightning's in Lightning (docs/cli.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import typing
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from trainer.callback import Callback
from trainer.distributed.strategy import Strategy
from trainer.loggers.logger import Logger
from trainer.observability.profiler import Profiler
from trainer.options import LIGHTNING_UNSUPPORTED, TrainerOptions
from trainer.trainer import Trainer


class ReduceLROnPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """Lightning's CLI scheduler: torch's ``ReduceLROnPlateau`` plus the ``monitor`` it reads (``--lr_scheduler
    ReduceLROnPlateau --lr_scheduler.monitor val_loss``)."""

    def __init__(self, optimizer: Optimizer, monitor: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **kwargs)
        self.monitor = monitor


LRSchedulerTypeTuple = (LRScheduler, ReduceLROnPlateau)
LRSchedulerTypeUnion = LRScheduler | ReduceLROnPlateau
LRSchedulerType = type[LRScheduler] | type[ReduceLROnPlateau]
# Lightning's aliases for dependency injection: `optimizer: OptimizerCallable = torch.optim.Adam` in a model's __init__.
OptimizerCallable = Callable[[Iterable], Optimizer]
LRSchedulerCallable = Callable[[Optimizer], LRScheduler | ReduceLROnPlateau]

# ---------------------------------------------------------------------- the --trainer.* group

# Lightning 2.6's Trainer keywords, in its order, with its defaults: a config written by Lightning's --print_config
# holds every one of them.
LIGHTNING_TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "auto",
    "strategy": "auto",
    "devices": "auto",
    "num_nodes": 1,
    "precision": None,
    "logger": None,
    "callbacks": None,
    "fast_dev_run": False,
    "max_epochs": None,
    "min_epochs": None,
    "max_steps": -1,
    "min_steps": None,
    "max_time": None,
    "limit_train_batches": None,
    "limit_val_batches": None,
    "limit_test_batches": None,
    "limit_predict_batches": None,
    "overfit_batches": 0.0,
    "val_check_interval": None,
    "check_val_every_n_epoch": 1,
    "num_sanity_val_steps": None,
    "log_every_n_steps": None,
    "enable_checkpointing": None,
    "enable_progress_bar": None,
    "enable_model_summary": None,
    "accumulate_grad_batches": 1,
    "gradient_clip_val": None,
    "gradient_clip_algorithm": None,
    "deterministic": None,
    "benchmark": None,
    "inference_mode": True,
    "use_distributed_sampler": True,
    "profiler": None,
    "detect_anomaly": False,
    "barebones": False,
    "plugins": None,
    "sync_batchnorm": False,
    "reload_dataloaders_every_n_epochs": 0,
    "default_root_dir": None,
    "enable_autolog_hparams": True,
    "model_registry": None,
}
_OPTION_FIELDS = {f.name: f for f in dataclasses.fields(TrainerOptions)}
# Lightning keywords keel lacks: accepted at Lightning's default only (then dropped), refused otherwise.
LIGHTNING_ONLY = {name: value for name, value in LIGHTNING_TRAINER_DEFAULTS.items() if name not in _OPTION_FIELDS}
REASONS = {
    **LIGHTNING_UNSUPPORTED,
    "enable_autolog_hparams": "keel logs the saved hyperparameters at the start of fit; pass "
    "save_hyperparameters(logger=False) to keep them out of the loggers.",
}
# Options whose Lightning default is None ("the default") and keel's is a value: null means keel's default
# (callbacks: null is no callbacks in both).
NONE_MEANS_DEFAULT = (
    frozenset(name for name, value in LIGHTNING_TRAINER_DEFAULTS.items() if value is None and name in _OPTION_FIELDS)
    - {name for name, f in _OPTION_FIELDS.items() if f.default is None}
    - {"callbacks"}
)
_LIGHTNING_ONLY_TYPES: dict[str, Any] = {
    "max_time": str | dict[str, int] | None,
    "overfit_batches": int | float,
    "plugins": Any | None,
    "reload_dataloaders_every_n_epochs": int,
    "model_registry": str | None,
}
# CLI types wider than the dataclass's where keel's own check gives the better message (a list of devices) or where
# jsonargparse must build objects (callbacks, loggers, profilers, strategies).
_CLI_TYPES: dict[str, Any] = {
    "precision": str | int | None,
    "callbacks": list[Callback] | Callback | None,
    "logger": Logger | list[Logger] | bool | None,
    "profiler": Profiler | str | None,
    "devices": int | str | list[int],
    "deterministic": bool | str | None,
    "strategy": Strategy | str | None,  # --trainer.strategy=fsdp, or class_path / init_args of a strategy
    "seed": int | None,
}


def _option_docs() -> dict[str, str]:
    """Each option's description, from TrainerOptions' ``Attributes`` (docstring_parser comes with jsonargparse's
    ``signatures`` extra; without it the options have no help text)."""
    try:
        import docstring_parser
    except ImportError:  # pragma: no cover - part of jsonargparse[signatures]
        return {}
    docs = {
        p.arg_name: " ".join((p.description or "").split())
        for p in docstring_parser.parse(TrainerOptions.__doc__ or "").params
    }
    docs["seed"] = (
        "Seeds each stage with seed + global_rank (keel's option). null (LightningCLI's default): the "
        "seed_everything value, or no seeding when seed_everything is false."
    )
    for name in NONE_MEANS_DEFAULT:
        docs[name] = docs.get(name, "") + " null: keel's default, as in Lightning."
    for name, value in LIGHTNING_ONLY.items():
        docs[name] = f"Lightning's option, accepted only at Lightning's default ({value!r}): {REASONS[name]}"
    return docs


def _option_parameters() -> list[inspect.Parameter]:
    """The Trainer's keywords as jsonargparse sees them: Lightning's in Lightning's order, then keel's own."""
    hints = typing.get_type_hints(TrainerOptions)
    order = list(LIGHTNING_TRAINER_DEFAULTS) + [
        name for name in _OPTION_FIELDS if name not in LIGHTNING_TRAINER_DEFAULTS
    ]
    params = []
    for name in order:
        if name in LIGHTNING_ONLY:
            annotation, default = _LIGHTNING_ONLY_TYPES.get(name, type(LIGHTNING_ONLY[name])), LIGHTNING_ONLY[name]
        else:
            f = _OPTION_FIELDS[name]
            annotation = _CLI_TYPES.get(name, hints[name])
            if name in NONE_MEANS_DEFAULT:
                annotation = annotation | None
            default = f.default if f.default is not dataclasses.MISSING else None
            if name in ("callbacks", "seed"):
                default = None  # the CLI's own lists are appended; seed follows seed_everything
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    return params


def _init_parameters(trainer_class: Any) -> tuple[list[inspect.Parameter], bool]:
    """The named keywords of ``trainer_class`` (a Trainer subclass or a function returning a Trainer) other than
    keel's ``**options``, and whether it passes further keywords on to the Trainer (``**kwargs``)."""
    is_class = isinstance(trainer_class, type)
    target = (
        next(vars(c)["__init__"] for c in trainer_class.__mro__ if "__init__" in vars(c)) if is_class else trainer_class
    )
    if target is vars(Trainer)["__init__"]:
        return [], True
    hints = typing.get_type_hints(target)
    params, forwards = [], False
    for p in list(inspect.signature(target).parameters.values())[1 if is_class else 0 :]:
        if p.kind == p.VAR_KEYWORD:
            forwards = True
        elif p.kind != p.VAR_POSITIONAL:
            params.append(p.replace(kind=p.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation)))
    return params, forwards


def trainer_arguments(trainer_class: Any = Trainer) -> type:
    """A stand-in class whose ``__init__`` signature (and docstring) is the Trainer's keywords: what jsonargparse
    reads to build ``--trainer.*``. Parsing never instantiates it; :meth:`LightningCLI.instantiate_trainer` passes
    the parsed values to ``trainer_class``."""
    own, forwards = _init_parameters(trainer_class)
    names = {p.name for p in own}
    params = own + ([p for p in _option_parameters() if p.name not in names] if forwards else [])
    docs = _option_docs()
    doc_lines = [f"    {p.name}: {docs[p.name]}" for p in params if docs.get(p.name)]
    name = getattr(trainer_class, "__name__", "Trainer")

    def __init__(self: Any, **options: Any) -> None:
        raise TypeError(f"{name}'s CLI signature is not instantiated: pass the parsed options to {name}(...).")

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    __init__.__signature__ = inspect.Signature([self_param, *params])  # type: ignore[attr-defined]
    __init__.__doc__ = "The Trainer's options (docs/options.md).\n\nArgs:\n" + "\n".join(doc_lines)
    return type(name, (), {"__init__": __init__, "__doc__": trainer_class.__doc__, "__module__": __name__})


def trainer_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """The parsed ``--trainer.*`` values as keel's keywords: Lightning's keywords at their default are dropped
    (at another value they raise), and ``None`` for an option in :data:`NONE_MEANS_DEFAULT` is keel's default."""
    refused = []
    for name, default in LIGHTNING_ONLY.items():
        if name in config:
            value = config.pop(name)
            if value != default:
                refused.append(
                    f"--trainer.{name}={value!r} is a Lightning option keel does not support: {REASONS[name]}"
                )
    if refused:
        raise ValueError("\n".join(refused))
    return {k: v for k, v in config.items() if not (v is None and k in NONE_MEANS_DEFAULT)}


# ---------------------------------------------------------------------- optimizers and schedulers from the config


def automatic(
    class_type: type | tuple[type, ...], register: dict[str, tuple[type | tuple[type, ...], str]]
) -> list[str]:
    """The keys of ``register`` (a parser's optimizers or schedulers: key -> (class, link_to)) added as
    ``"AUTOMATIC"`` for a subclass of ``class_type``: the ones ``configure_optimizers`` is built from."""
    types = class_type if isinstance(class_type, tuple) else (class_type,)
    found = []
    for key, (base_class, link_to) in register.items():
        bases = base_class if isinstance(base_class, tuple) else (base_class,)
        if link_to == "AUTOMATIC" and any(issubclass(c, types) for c in bases):
            found.append(key)
    return found


def _class_path_from_class(class_type: type) -> str:
    return class_type.__module__ + "." + class_type.__name__


def global_add_class_path(class_type: type, init_args: Any = None) -> dict[str, Any]:
    """``{"class_path": ..., "init_args": ...}`` for ``class_type`` (an optimizer group added for one class)."""
    if init_args is not None and hasattr(init_args, "as_dict"):
        init_args = init_args.as_dict()
    return {"class_path": _class_path_from_class(class_type), "init_args": init_args or {}}


def add_class_path_generator(class_type: type) -> Callable[[Any], dict[str, Any]]:
    """The ``compute_fn`` of an argument link from a one-class group: its init args with the class path."""

    def add_class_path(init_args: Any) -> dict[str, Any]:
        return global_add_class_path(class_type, init_args)

    return add_class_path


def instantiate_class(args: Any, init: dict[str, Any]) -> Any:
    """Instantiate ``init["class_path"]`` with the positional ``args`` and ``init["init_args"]`` (Lightning's)."""
    kwargs = init.get("init_args", {})
    if not isinstance(args, tuple):
        args = (args,)
    class_module, class_name = init["class_path"].rsplit(".", 1)
    module = __import__(class_module, fromlist=[class_name])
    return getattr(module, class_name)(*args, **kwargs)


def option_hints(message: str, groups: dict[str, list[str]]) -> list[str]:
    """keel's hints for a parser error ``message``: for each option it names (``--group.name`` or
    ``'group.name'``) that the group lacks (``groups``: nested key -> its ``key.option`` names), the closest option
    and, for the Trainer, why keel lacks a Lightning one; for a ``lightning.*`` class path, how to rewrite it; for
    the ambiguous ``ModelCheckpoint`` / ``CSVLogger`` / ``TensorBoardLogger``, which one is Lightning's."""
    hints = []
    for key, name in dict.fromkeys(re.findall(r"(?:--|')(\w+)\.(\w+)\b(?![.\w])", message)):
        options = [o.split(".", 1)[1] for o in groups.get(key, [])]
        if not options or name in options:
            continue
        if key == "trainer" and name in REASONS:
            hints.append(f"keel: --trainer.{name} is a Lightning option keel does not support: {REASONS[name]}")
        close = difflib.get_close_matches(name, options, n=1)
        if close:
            hints.append(f"keel: did you mean --{key}.{close[0]}?")
    if re.search(r"(?<![\w.])(lightning|pytorch_lightning)\.\w", message):
        hints.append(
            "keel: class paths name keel's classes: rewrite `lightning.pytorch.X.Name` (and `pytorch_lightning."
            "X.Name`) as `callbacks.lightning.Name`, or give the bare class name (`class_path: Name`)."
        )
    for name, differs in _LIGHTNING_FLAVOURED.items():
        if f"Multiple subclasses with name {name}" in message:
            hints.append(
                f"keel: Lightning's {name} is `callbacks.lightning.{name}` ({differs}); the other is keel's own."
            )
    return hints


# The classes the Lightning layer subclasses with Lightning's defaults: a bare class path names both.
_LIGHTNING_FLAVOURED = {
    "ModelCheckpoint": "one plain file per save",
    "CSVLogger": "logs under lightning_logs/",
    "TensorBoardLogger": "logs under lightning_logs/",
}
