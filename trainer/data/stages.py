"""Which loaders a stage runs: resolved, adapted to this rank, and limited.

A stage's loaders come from the call (``fit(train_dataloaders=...)``), else from the datamodule's or the task's
``*_dataloader()`` hook; each is adapted (sharded) for this rank by :mod:`trainer.data.loaders`, and a stage runs
at most ``limit_*_batches`` batches of each. These functions read the Trainer's public attributes only (the task,
the datamodule, the rank, the world size and the options); the Trainer is named here for types only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.data.loaders import AdaptedLoader, adapt_eval_loader, adapt_train_loader, limit_batches, resolve_loaders

if TYPE_CHECKING:
    from trainer.trainer import Trainer

_DATALOADER_HOOK = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}


def _resolve(trainer: Trainer, stage: str, given: Any) -> list[Any]:
    assert trainer.task is not None  # set for the whole stage (Trainer._run)
    return resolve_loaders(trainer.datamodule if trainer.datamodule is not None else trainer.task, stage, given)


def train_loader(trainer: Trainer, given: Any) -> AdaptedLoader:
    """The one training loader of ``fit``, with keel's resumable distributed sampler where it can be rebuilt."""
    loaders = _resolve(trainer, "train", given)
    if len(loaders) != 1:
        raise ValueError(
            "Trainer.fit needs exactly one training dataloader (train_dataloaders=..., a datamodule, or "
            f"task.train_dataloader()); got {len(loaders)}."
        )
    return adapt_train_loader(loaders[0], **trainer.strategy.distributed_sampler_kwargs, seed=trainer.options.seed or 0)


def eval_loaders(trainer: Trainer, stage: str, given: Any, *, required: bool = False) -> list[AdaptedLoader]:
    """The loaders of ``validate`` / ``test`` / ``predict``, each sharded without padding for this rank.

    Raises:
        ValueError: ``required`` (a stage run on its own) and no loader was found.
    """
    loaders = [
        adapt_eval_loader(loader, **trainer.strategy.distributed_sampler_kwargs, seed=trainer.options.seed or 0)
        for loader in _resolve(trainer, stage, given)
    ]
    if required and not loaders:
        raise ValueError(
            f"Trainer.{stage}() found no dataloader: pass dataloaders=..., a datamodule, or implement "
            f"task.{_DATALOADER_HOOK[stage]}()."
        )
    return loaders


def batch_limit(trainer: Trainer, loader: Any, name: str) -> int | None:
    """Batches to run from ``loader`` under the ``limit_*_batches`` option ``name`` and ``fast_dev_run``."""
    options = trainer.options
    return limit_batches(loader, getattr(options, name), name, fast_dev_run=options.fast_dev_run)
