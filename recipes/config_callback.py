"""The resolved Hydra config of a run: in the run directory, in every checkpoint, compared on resume.

:class:`SaveConfig` is the callback ``recipes.train`` adds to every run built from config:

* at ``setup`` of the first ``fit`` (the loggers have resolved the run directory by then, on every rank)
  rank 0 writes ``<run dir>/config.yaml``, headed by the command that composed it, and hands the config to
  every logger's ``log_config`` (W&B and MLflow record it in the tracked run);
* every checkpoint gets ``checkpoint["config"]``: the same config as plain containers, which
  ``torch.load(weights_only=True)`` reads back;
* when ``fit`` resumes from a checkpoint whose config differs from the current one, rank 0 logs one
  WARNING listing every difference as ``key: old -> new``.

Which value wins on resume: the CURRENT config (the command line of the run that resumes). The
checkpoint's config is a record, never applied. What a checkpoint restores is state, not config: the
weights, the optimizer state (its param groups carry ``lr``, ``weight_decay`` and ``betas``, so a changed
``task.lr`` does not reach an optimizer restored from a checkpoint), the scheduler's progress, the data
cursor and the callbacks' state.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from trainer.callback import Callback
from trainer.storage import is_url, join, local_dir, sync_mirrors

if TYPE_CHECKING:  # pragma: no cover
    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
# Top-level checkpoint key of the config. (trainer/checkpoint/files.py holds the Trainer's own keys; this one is
# written by a callback, so it lives with the callback.)
K_CONFIG = "config"
_ABSENT = "<absent>"


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b.c": leaf}``; lists are leaves, an empty mapping is the leaf ``{}``."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for every leaf that differs, sorted by key.

    A key present on one side only shows ``"<absent>"`` on the other.
    """
    flat_old, flat_new = flatten(old), flatten(new)
    return [
        (key, flat_old.get(key, _ABSENT), flat_new.get(key, _ABSENT))
        for key in sorted(set(flat_old) | set(flat_new))
        if flat_old.get(key, _ABSENT) != flat_new.get(key, _ABSENT)
    ]


def format_diff(diff: list[tuple[str, Any, Any]]) -> str:
    """The WARNING's body: one ``key: old -> new`` line per difference."""
    return "\n".join(f"  {key}: {old!r} -> {new!r}" for key, old, new in diff)


class SaveConfig(Callback):
    """Keeps the run's resolved config in ``<run dir>/config.yaml`` and in every checkpoint.

    Every rank runs every hook; only rank 0 writes the file and logs the resume warning. A resumed run
    whose config differs from the ``config.yaml`` already in its run directory keeps the earlier file as
    ``config.1.yaml`` (then ``config.2.yaml``, ...) and writes its own as ``config.yaml``.

    Args:
        cfg: The composed config, without the ``hydra`` node. Resolved once, here.
        command: The command line that composed it, written as the file's first line.
    """

    def __init__(self, cfg: DictConfig | Mapping[str, Any], command: str) -> None:
        container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        self.config: dict[str, Any] = container  # type: ignore[assignment]
        self.command = command
        self.path: str | None = None
        self._stage: str | None = None

    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        self._stage = stage
        if stage != "fit" or self.path is not None:
            return
        self.path = join(trainer.log_dir, CONFIG_FILE)
        version = getattr(trainer.loggers[0], "version", None) if trainer.loggers else None
        if not trainer.continue_run_directory and version is not None and "logger.version=" not in self.command:
            # A job of a sweep: rerun as written, its command must reopen this job's run directory, not the newest;
            # the recorded config says the same, so the rerun's config is this one.
            self.command += f" logger.version={version}"
            if isinstance(self.config.get("logger"), dict):
                self.config["logger"]["version"] = version
        if trainer.is_global_zero:  # a run directory on object storage: written to its local mirror, then uploaded
            self._write(os.path.join(local_dir(trainer.log_dir, download=True), CONFIG_FILE))
            if is_url(trainer.log_dir):
                sync_mirrors()
            for logger in trainer.loggers:  # trackers outside the run directory (W&B, MLflow) record it too
                logger.log_config(self.config)

    def _write(self, path: str) -> None:
        text = f"# {self.command}\n" + OmegaConf.to_yaml(OmegaConf.create(self.config))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.isfile(path):
            with open(path) as f:
                if f.read() == text:  # a restart of the same run: nothing to do
                    return
            index = 1
            while os.path.exists(os.path.join(os.path.dirname(path), f"config.{index}.yaml")):
                index += 1
            os.replace(path, os.path.join(os.path.dirname(path), f"config.{index}.yaml"))
        with open(path, "w") as f:
            f.write(text)

    def on_save_checkpoint(self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[K_CONFIG] = self.config

    def on_load_checkpoint(self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]) -> None:
        # Only a resumed fit is compared: test(ckpt_path="best") loads this run's own checkpoint.
        if self._stage != "fit" or not trainer.is_global_zero:
            return
        saved = checkpoint.get(K_CONFIG)
        if saved is None:
            log.info("The checkpoint holds no config (not saved by recipes.train); the current config is used.")
            return
        diff = config_diff(saved, self.config)
        if diff:
            log.warning(
                "Resuming from a checkpoint whose config differs in %d key(s) (key: checkpoint -> current). "
                "The current config wins; the checkpoint restores only state (weights, optimizer and "
                "scheduler state including their learning rates, data cursor, callbacks):\n%s",
                len(diff),
                format_diff(diff),
            )
