"""``python -m recipes.train`` (console script ``keel-train``): fit and test a task from Hydra config.

The config tree is ``conf/`` (see :func:`recipes.config_dir.config_dir`); ``conf/train.yaml`` composes
the groups ``trainer``, ``task``, ``data``, ``callbacks`` and ``logger``. Examples::

    python -m recipes.train                                   # the digits recipe
    python -m recipes.train trainer.max_epochs=5 logger=csv   # any key, any group
    python -m recipes.train ~callbacks.progress test=false    # drop a callback, skip the test split
    torchrun --nproc-per-node 2 -m recipes.train              # DDP: same command, same run directory

Run directory: ``${output_dir}/${name}/version_N``. The logger picks N (rank 0 takes the next free
number and broadcasts it; ``logger.version=N`` pins it), the Trainer's run directory is the logger's
folder, and everything a run writes lands there: TensorBoard events (or metrics.csv), ``config.yaml``
and ``checkpoints/``. ``ckpt_path: last`` (the default) resumes from that folder's latest checkpoint and
is a no-op in a fresh one. Hydra writes no files (``hydra.output_subdir: null``, logging to stderr
only) and never changes the working directory.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import recipes.trainer_schema  # noqa: F401  (registers trainer/options_schema in Hydra's ConfigStore)
from recipes.config_dir import config_dir
from trainer import Callback, DataModule, TaskModule, Trainer, seed_everything
from trainer.loggers import Logger, TensorBoardLogger

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"


class SaveConfig(Callback):
    """Writes the resolved config to ``<run dir>/config.yaml``, headed by the command that composed it.

    Once, at ``setup`` of the first ``fit``: the loggers have resolved the run directory by then (on
    every rank, before callbacks are set up). Only rank 0 writes.

    Args:
        cfg: The composed config (without the ``hydra`` node).
        command: The command line that composed it, written as the file's first line.
    """

    def __init__(self, cfg: DictConfig, command: str) -> None:
        self.cfg = cfg
        self.command = command
        self.path: str | None = None

    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        if stage != "fit" or self.path is not None:
            return
        self.path = os.path.join(trainer.log_dir, CONFIG_FILE)
        if not trainer.is_global_zero:
            return
        os.makedirs(trainer.log_dir, exist_ok=True)
        with open(self.path, "w") as f:
            f.write(f"# {self.command}\n" + OmegaConf.to_yaml(self.cfg, resolve=True))


def build(cfg: DictConfig, *, command: str = "python -m recipes.train") -> tuple[Trainer, TaskModule, DataModule]:
    """Instantiates the Trainer, the task and the datamodule from a composed ``conf/train.yaml``.

    Seeds the global generators with ``trainer.seed`` first, so that the task's initial weights are the
    same on every run (the Trainer seeds only at the start of ``fit``, after the task exists).

    Args:
        cfg: The composed config.
        command: Recorded in ``config.yaml``.

    Returns:
        ``(trainer, task, datamodule)``.
    """
    options: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)  # type: ignore[assignment]
    if options.get("seed") is not None:
        seed_everything(options["seed"])
    datamodule = instantiate(cfg.data)
    task = instantiate(cfg.task)
    # A dict keyed by name, so that entries can be changed or removed (~callbacks.progress) from the
    # command line; null entries are skipped.
    callbacks: list[Callback] = [instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node is not None]
    config = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    callbacks.append(SaveConfig(config, command))
    logger_cfg = cfg.get("logger")
    logger: Logger | bool = instantiate(logger_cfg) if logger_cfg is not None else False
    trainer = Trainer(**options, callbacks=callbacks, logger=logger)
    return trainer, task, datamodule


def run(cfg: DictConfig, *, command: str = "python -m recipes.train") -> dict[str, Any]:
    """Fits (resuming from ``cfg.ckpt_path``), tests the best checkpoint when ``cfg.test``, then prints
    a summary on rank 0.

    Returns:
        The summary (the same on every rank): ``metrics`` (name -> float), ``run_dir``,
        ``tensorboard_dir``, ``monitor``, ``best_model_path`` (None without a monitored checkpoint),
        ``best_model_score``, ``last_model_path``, ``tested_on``, ``global_step``, ``epochs``, ``seconds``.
    """
    trainer, task, datamodule = build(cfg, command=command)
    start = time.monotonic()
    trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    checkpoint = trainer.checkpoint_callback
    monitor = getattr(checkpoint, "monitor", None)
    best_path = (getattr(checkpoint, "best_model_path", "") or None) if monitor else None
    tested_on = None
    if cfg.test:
        # "best" needs a monitored save; without one, test the weights fit ended with.
        trainer.test(task, datamodule=datamodule, ckpt_path="best" if best_path else None)
        tested_on = "best checkpoint" if best_path else "final weights"
    summary = {
        "metrics": {name: float(value) for name, value in sorted(trainer.callback_metrics.items())},
        "run_dir": trainer.log_dir,
        "tensorboard_dir": next((lg.log_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None),
        "monitor": monitor,
        "best_model_path": best_path,
        "best_model_score": getattr(checkpoint, "best_model_score", None) if best_path else None,
        "last_model_path": getattr(checkpoint, "last_model_path", "") or None,
        "tested_on": tested_on,
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "seconds": time.monotonic() - start,
    }
    if trainer.is_global_zero:
        print(format_summary(summary), flush=True)
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run block: where things are, then every metric (``name  value`` lines)."""
    best = summary["best_model_path"] or "- (no monitored checkpoint)"
    if summary["best_model_path"] and summary["best_model_score"] is not None:
        best += f"  ({summary['monitor']}={summary['best_model_score']:.6f})"
    tensorboard = summary["tensorboard_dir"] or "- (no TensorBoardLogger)"
    lines = [
        "=" * 30 + " keel run summary " + "=" * 30,
        f"run dir          {summary['run_dir']}",
        f"tensorboard      {tensorboard}",
        f"best checkpoint  {best}",
        f"last checkpoint  {summary['last_model_path'] or '-'}",
        f"trained          {summary['global_step']} steps, {summary['epochs']} epochs; "
        f"{summary['seconds']:.1f} s fit{' + test' if summary['tested_on'] else ''}",
        "metrics          val/* from the last validation"
        + (f", test/* on the {summary['tested_on']}" if summary["tested_on"] else ""),
    ]
    lines += [f"  {name:<14} {value:.6f}" for name, value in summary["metrics"].items()]
    return "\n".join(lines + ["=" * 78])


@hydra.main(config_path=config_dir(), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Entry point of ``python -m recipes.train`` and of the ``keel-train`` console script."""
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task)
    run(cfg, command=shlex.join(["python", "-m", "recipes.train", *overrides]))


if __name__ == "__main__":
    main()
