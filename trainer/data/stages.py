"""Which loaders a stage runs: resolved, adapted to this rank, and limited.

A stage's loaders come from the call (``fit(train_dataloaders=...)``), else from the datamodule's or the task's
``*_dataloader()`` hook (``source``: the datamodule when there is one, else the task); each is adapted (sharded)
for this rank by :mod:`trainer.data.loaders` with the strategy's sampler settings, and a stage runs at most
``limit_*_batches`` batches of each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.data.loaders import AdaptedLoader, adapt_eval_loader, adapt_train_loader, limit_batches, resolve_loaders

if TYPE_CHECKING:  # pragma: no cover
    from trainer.data.loaders import LoaderSource
    from trainer.distributed.strategy import Strategy
    from trainer.options import TrainerOptions

_DATALOADER_HOOK = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}


def train_loader(source: LoaderSource, given: Any, *, strategy: Strategy, seed: int | None) -> AdaptedLoader:
    """The one training loader of ``fit``, with keel's resumable distributed sampler where it can be rebuilt."""
    loaders = resolve_loaders(source, "train", given)
    if len(loaders) != 1:
        raise ValueError(
            "Trainer.fit needs exactly one training dataloader (train_dataloaders=..., a datamodule, or "
            f"task.train_dataloader()); got {len(loaders)}."
        )
    return adapt_train_loader(loaders[0], **strategy.distributed_sampler_kwargs, seed=seed or 0)


def eval_loaders(
    source: LoaderSource, stage: str, given: Any, *, strategy: Strategy, seed: int | None, required: bool = False
) -> list[AdaptedLoader]:
    """The loaders of ``validate`` / ``test`` / ``predict``, each sharded without padding for this rank.

    Raises:
        ValueError: ``required`` (a stage run on its own) and no loader was found.
    """
    loaders = [
        adapt_eval_loader(loader, **strategy.distributed_sampler_kwargs, seed=seed or 0)
        for loader in resolve_loaders(source, stage, given)
    ]
    if required and not loaders:
        raise ValueError(
            f"Trainer.{stage}() found no dataloader: pass dataloaders=..., a datamodule, or implement "
            f"task.{_DATALOADER_HOOK[stage]}()."
        )
    return loaders


def batch_limit(options: TrainerOptions, loader: Any, name: str) -> int | None:
    """Batches to run from ``loader`` under the ``limit_*_batches`` option ``name`` and ``fast_dev_run``."""
    return limit_batches(loader, getattr(options, name), name, fast_dev_run=options.fast_dev_run)
