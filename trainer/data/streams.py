"""Streaming training data: loaders that carry their own position, sharded once per rank, resumed exactly.

A *stream* is a training loader whose position lives in the loader (or its dataset), not in a sampler keel
owns: anything with ``state_dict()`` / ``load_state_dict()`` (torchdata's ``StatefulDataLoader``, LitData's
``StreamingDataLoader``, a loader of your own), a plain ``DataLoader`` over a stateful ``IterableDataset`` (keel
rebuilds it as a ``StatefulDataLoader``), or a Hugging Face ``datasets.IterableDataset`` (keel splits it by rank
once, ``datasets.distributed.split_dataset_by_node``). :class:`Stream` iterates the loader for the loop and keeps
the loader's state after each batch it fetched, so a checkpoint saves, per rank, the position after exactly the
batches that were trained on (the loop reads one batch ahead when the epoch length is unknown). On resume that
state is loaded back before the first ``iter()``; the loop's own cursor (``TrainState``) keeps counting batches and
samples as for map-style data, so the step clock, logging and the elastic global batch see no difference.

Which positions survive what (docs/data.md): the same world size always resumes exactly; another world size only
when the library can re-split a position (LitData); otherwise ``Trainer(stream_reshard=...)`` decides: ``"error"``
refuses the resume with the reason, ``"restart_epoch"`` warns and starts the epoch again.

Libraries are imported only when the user's objects come from them (``sys.modules`` is checked first), so none is
a dependency. Rank and world size are arguments; the one agreement between ranks goes through
:mod:`trainer.distributed.comm`.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, IterableDataset

from trainer.distributed import comm

logger = logging.getLogger(__name__)

Kind = Literal["torchdata", "huggingface", "litdata", "stateful"]
_INSTALL = "pip install 'keel-trainer[streaming]'"


def is_stateful(obj: object) -> bool:
    """True when ``obj`` follows the stateful protocol (callable ``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _is_hf(dataset: object) -> bool:
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(dataset, datasets.IterableDataset)


def _is_litdata(obj: object, name: str = "StreamingDataLoader") -> bool:
    litdata = sys.modules.get("litdata")
    return litdata is not None and isinstance(obj, getattr(litdata, name))


class Stream:
    """A training loader that resumes itself: iterated by the loop, saved and loaded per rank.

    Args:
        loader: The loader to iterate (already sharded for this rank).
        kind: Where it comes from; decides how epochs are set and whether a position survives a new world size.
        rank: This process's rank.
        world_size: The number of ranks.
    """

    def __init__(self, loader: Iterable[Any], *, kind: Kind, rank: int, world_size: int, seed: int = 0) -> None:
        self.loader, self.kind, self.rank, self.world_size = loader, kind, rank, world_size
        self.batch_size: int | None = getattr(loader, "batch_size", None)
        # Each iter() of a DataLoader draws its workers' base seed from loader.generator, or from torch's global
        # generator when it has none: a resumed epoch would draw it at another point of training and move
        # training's randomness. keel gives such a loader a generator of its own, saved with the position.
        self.generator: torch.Generator | None = getattr(loader, "generator", None)
        if self.generator is None and isinstance(loader, DataLoader):
            self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
            loader.generator = self.generator
        self._generator_at_start: torch.Tensor | None = None
        self._after: dict[int, Any] = {}  # batch index -> the loader's state right after fetching it
        self._start = 0
        self._restored: Any = None  # a loaded state, not yet handed to the loader
        self._restored_generator: torch.Tensor | None = None
        self._resumable = False  # a state was loaded for this epoch's position

    @property
    def reshardable(self) -> bool:
        """Whether a position saved at another world size can continue here (LitData re-splits its own)."""
        return self.kind == "litdata"

    def describe(self) -> str:
        dataset = getattr(self.loader, "dataset", None)
        inner = f" over {type(dataset).__qualname__}" if dataset is not None else ""
        return f"{type(self.loader).__qualname__}{inner}"

    def set_epoch(self, epoch: int) -> None:
        """Tell the dataset the epoch (Hugging Face reshuffles its shards per epoch; LitData's loader and
        torchdata's keep their own epoch in their state, so they are left alone)."""
        dataset = getattr(self.loader, "dataset", None)
        if self.kind in ("huggingface", "stateful") and callable(getattr(dataset, "set_epoch", None)):
            dataset.set_epoch(epoch)  # type: ignore[union-attr]

    def batches(self, start: int) -> Iterator[Any]:
        """The epoch's batches from batch index ``start``, recording the loader's state after each fetch."""
        if self._restored is not None:
            self.loader.load_state_dict(self._restored)  # type: ignore[attr-defined]
            self._restored = None
        elif self.kind == "litdata":
            # LitData replays a loaded state at every iter() until one of its epochs runs to exhaustion; keel's
            # loop stops at len() without exhausting it, so the epoch after a resume must drop the flag.
            self.loader.restore = False  # type: ignore[attr-defined]
        self._resumable = False
        self._start, self._after = start, {}
        self._generator_at_start = self.generator.get_state() if self.generator is not None else None
        state_dict = self.loader.state_dict  # type: ignore[attr-defined]
        idx = start
        for batch in self.loader:
            self._after[idx] = state_dict()
            self._after.pop(idx - 2, None)  # the loop holds at most one batch beyond the last one trained
            yield batch
            idx += 1

    def state_dict(self, batches_done: int, epoch_finished: bool) -> dict[str, Any]:
        """This rank's position after ``batches_done`` batches of the epoch (all of them when it finished)."""
        generator = self.generator.get_state() if self.generator is not None else None
        if self._restored is not None:  # loaded and not iterated yet: the position is the loaded one
            state, generator = self._restored, self._restored_generator
        elif epoch_finished and self.kind != "litdata":
            # torchdata restores a finished epoch as one that yields nothing more (the next epoch would be empty),
            # so a finished epoch saves no position: the next one starts fresh, from the saved generator (its
            # shuffle and base seed) and set_epoch. LitData's own state carries its epoch and restores correctly.
            state = None
        elif epoch_finished or batches_done == self._start:
            state = self.loader.state_dict()  # type: ignore[attr-defined]
        else:
            state, generator = self._after[batches_done - 1], self._generator_at_start
        saved = {"kind": self.kind, "loader": self.describe(), "world_size": self.world_size, "state": state}
        return dict(saved, generator=generator)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Hand a saved position to the loader before its next ``iter()``.

        Raises:
            ValueError: the state was written by another kind of loader.
        """
        if saved.get("kind") != self.kind or saved.get("loader") != self.describe():
            raise ValueError(
                f"the checkpoint's data position was saved by {saved.get('loader')} ({saved.get('kind')}), but this "
                f"run trains from {self.describe()} ({self.kind}): resume with the loader the run was saved with, "
                "or start the run again."
            )
        generator = saved.get("generator")
        if generator is not None and self.generator is not None:
            self.generator.set_state(generator)  # the epoch's iter() draws the same base seed (and shuffle)
        if saved["state"] is not None:
            self._restored, self._restored_generator, self._resumable = saved["state"], generator, True

    def take_resume(self) -> bool:
        """True once after a position was loaded: the epoch continues where the save left it."""
        resumable, self._resumable = self._resumable, False
        return resumable


def adapt_stream(loader: Iterable[Any], *, num_replicas: int, rank: int, seed: int = 0) -> Stream | None:
    """A :class:`Stream` for a loader that carries its own position, sharded for this rank; None for any
    other loader (map-style data, or a stream that cannot save its position: see :func:`not_stateful_reason`)."""
    dataset = getattr(loader, "dataset", None)
    if _is_litdata(loader):
        _agree_litdata(dataset, num_replicas, rank)
        return Stream(loader, kind="litdata", rank=rank, world_size=num_replicas, seed=seed)
    if _is_litdata(dataset, "StreamingDataset"):
        return None  # its state needs LitData's own loader: not_stateful_reason() says so
    stateful_loader = _stateful_loader_class()
    if _is_hf(dataset) and stateful_loader is not None and type(loader) in (DataLoader, stateful_loader):
        _warn_hf_shuffle(dataset, getattr(loader, "num_workers", 0))
        split = _split_hf(dataset, num_replicas, rank)
        return Stream(
            _stateful_loader(loader, split), kind="huggingface", rank=rank, world_size=num_replicas, seed=seed
        )
    if is_stateful(loader):
        kind: Kind = "torchdata" if type(loader) is stateful_loader else "stateful"
        return Stream(loader, kind=kind, rank=rank, world_size=num_replicas, seed=seed)
    if type(loader) is DataLoader and isinstance(dataset, IterableDataset) and is_stateful(dataset):
        if stateful_loader is None:
            return None  # not_stateful_reason() says what to install
        return Stream(_stateful_loader(loader, dataset), kind="stateful", rank=rank, world_size=num_replicas, seed=seed)
    return None


def not_stateful_reason(loader: Iterable[Any]) -> str | None:
    """Why a streaming loader keel uses as-is cannot resume mid-epoch, with the fix; None for map-style data."""
    dataset = getattr(loader, "dataset", None)
    if _is_litdata(dataset, "StreamingDataset"):
        return (
            "its dataset is a LitData StreamingDataset in a plain DataLoader, whose position only LitData's own "
            "loader can save: use litdata.StreamingDataLoader(dataset, batch_size=..., num_workers=...)"
        )
    if isinstance(dataset, IterableDataset) and is_stateful(dataset) and _stateful_loader_class() is None:
        return (
            f"its dataset ({type(dataset).__qualname__}) can save its position but torchdata is not installed, so "
            f"keel cannot wrap the DataLoader into a StatefulDataLoader; a resume starts the epoch again: {_INSTALL}"
        )
    if isinstance(dataset, IterableDataset) or (dataset is None and not hasattr(loader, "__len__")):
        what = type(dataset).__qualname__ if dataset is not None else type(loader).__qualname__
        return (
            f"{what} saves no position, so a resume starts the epoch again from its first batch. To resume exactly, "
            "give the dataset state_dict() / load_state_dict() (keel then wraps the DataLoader into torchdata's "
            "StatefulDataLoader), or use torchdata's StatefulDataLoader, a Hugging Face streaming dataset or LitData"
        )
    return None


def _stateful_loader_class() -> type | None:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


def loader_settings(loader: DataLoader[Any]) -> dict[str, Any]:
    """A DataLoader's documented settings, to build another loader around another dataset or sampler: batch_size,
    drop_last, collate_fn, num_workers, pin_memory(_device), timeout, worker_init_fn, multiprocessing_context,
    generator, persistent_workers, prefetch_factor (with workers) and in_order (where torch has it)."""
    settings: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "collate_fn": loader.collate_fn,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "pin_memory_device": loader.pin_memory_device,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        settings["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        settings["in_order"] = loader.in_order
    return settings


def _stateful_loader(loader: Any, dataset: Any) -> Any:
    """``loader``'s settings around ``dataset``, as a torchdata ``StatefulDataLoader``."""
    cls = _stateful_loader_class()
    assert cls is not None  # checked by the caller
    if type(loader) is cls and dataset is getattr(loader, "dataset", None):
        return loader
    kwargs = loader_settings(loader)
    logger.debug("training loader %s wrapped into a StatefulDataLoader", type(loader).__qualname__)
    return cls(dataset, **kwargs)


def _split_hf(dataset: Any, num_replicas: int, rank: int) -> Any:
    """Split a Hugging Face stream by rank once (by shard when the shard count divides, else by example)."""
    if num_replicas == 1:
        return dataset
    done = getattr(dataset, "_distributed", None)
    if done is not None:
        if (done.rank, done.world_size) != (rank, num_replicas):
            raise ValueError(
                f"the training dataset was split with split_dataset_by_node(rank={done.rank}, "
                f"world_size={done.world_size}), but this is rank {rank} of {num_replicas}: pass the unsplit "
                "dataset and keel splits it for the ranks it runs on."
            )
        warnings.warn(
            "The training dataset is already split by node (split_dataset_by_node); keel does not split it again. "
            "Pass the unsplit dataset and keel splits it for whatever world size the run has.",
            UserWarning,
            stacklevel=5,
        )
        return dataset
    from datasets.distributed import split_dataset_by_node

    how = "by shard" if dataset.n_shards % num_replicas == 0 else "by example (the shard count does not divide)"
    logger.info("Splitting the Hugging Face stream over %d ranks %s.", num_replicas, how)
    return split_dataset_by_node(dataset, rank=rank, world_size=num_replicas)


def _warn_hf_shuffle(dataset: Any, num_workers: int) -> None:
    """What Hugging Face's own state cannot do for a shuffled stream (measured with datasets 5.2; docs/data.md)."""
    inner, buffer = getattr(dataset, "_ex_iterable", None), 0
    while inner is not None and not buffer:
        buffer = int(getattr(inner, "buffer_size", 0) or 0) if "Shuffled" in type(inner).__name__ else 0
        inner = getattr(inner, "ex_iterable", None)
    if not buffer:
        return
    lost = (
        f"Hugging Face datasets does not save the content of the shuffle buffer (buffer_size={buffer}), so a "
        f"mid-epoch resume skips the samples it held (up to {buffer} per DataLoader worker)"
        if buffer > 1
        else ""
    )
    if num_workers > 0:
        failing = (
            "restoring a shuffled stream that DataLoader workers read fails inside datasets (IndexError in "
            "load_state_dict; reproduced without keel)"
        )
        lost = f"{lost}; and {failing}" if lost else failing
    if lost:
        warnings.warn(
            f"The training stream is shuffled with a buffer: {lost}. For exact resume shuffle the shards "
            "(write more, smaller files) and pass shuffle=False, or accept the loss.",
            UserWarning,
            stacklevel=5,
        )


def _agree_litdata(dataset: Any, num_replicas: int, rank: int) -> None:
    """LitData reads rank and world size when the dataset is built, from the process group or the environment
    (``WORLD_SIZE``, ``GLOBAL_RANK``): built before keel's process group, every rank of a torchrun job believes it
    is rank 0. keel tells the dataset where it runs."""
    env = getattr(dataset, "distributed_env", None)
    if env is None or (env.world_size, env.global_rank) == (num_replicas, rank):
        return
    logger.info(
        "LitData dataset was built for rank %d of %d; this is rank %d of %d: keel sets its distributed env.",
        env.global_rank,
        env.world_size,
        rank,
        num_replicas,
    )
    dataset.distributed_env = type(env)(world_size=num_replicas, global_rank=rank, num_nodes=env.num_nodes)


class AllRanksHaveData:
    """Per window of a loader without ``len()`` on several ranks: do all of them still have data? One tiny
    all-reduce each (the documented cost). When some ranks ran out and others did not, ``uneven="error"``
    raises and ``"truncate"`` stops every rank, with one WARNING per fit naming the counts."""

    def __init__(self, device: torch.device, uneven: Literal["error", "truncate"], describe: str) -> None:
        self.device, self.uneven, self.describe = device, uneven, describe
        self.world_size = comm.get_world_size()
        self.warned = False

    def __call__(self, has_data: bool) -> bool:
        flag = torch.tensor([1.0 if has_data else 0.0], device=self.device)
        comm.all_reduce(flag, "sum")
        ranks_with_data = int(flag.item())
        if ranks_with_data in (0, self.world_size):
            return ranks_with_data > 0
        message = (
            f"The training loader ran out on {self.world_size - ranks_with_data} of {self.world_size} ranks while "
            f"{ranks_with_data} still had data ({self.describe})."
        )
        if self.uneven == "error":
            raise ValueError(
                message + " Give every rank the same number of batches (shard evenly, drop_last) or pass "
                "uneven_batches='truncate'."
            )
        if not self.warned:
            self.warned = True
            if comm.get_rank() == 0:  # the same count on every rank: said once per job
                logger.warning("%s Every rank stops here; the rest is dropped (uneven_batches='truncate').", message)
        return False


class StreamPositions:
    """Every rank's position in the training ``stream`` for a checkpoint, gathered like the RNG states: a list
    indexed by rank, None where the loader saves no position. Loaded after the loop's
    :class:`~trainer.state.TrainState` (``state``): whether the save was mid-epoch is read from it."""

    def __init__(
        self, stream: Stream | None, state: Any, *, rank: int, world_size: int, reshard: str, path: str = ""
    ) -> None:
        self.stream, self.state, self.rank, self.world_size = stream, state, rank, world_size
        self.reshard, self.path = reshard, path

    def state_dict(self) -> list[Any]:
        stream, state = self.stream, self.state
        mine = stream.state_dict(state.batches_done, state.epoch_finished) if stream is not None else None
        return comm.all_gather_object(mine)

    def load_state_dict(self, positions: list[Any]) -> None:
        stream, path = self.stream, self.path
        saved = [p for p in positions or [] if p is not None]
        if stream is None:
            if saved:
                raise ValueError(
                    f"{path} was saved while training from a stream ({saved[0]['loader']}), but this run's "
                    "training loader saves no position: resume with the loader the run was saved with."
                )
            return
        if not saved:
            return  # a save without positions (map-style data then, or an older keel): plan_epoch warns
        if len(positions) == self.world_size:
            stream.load_state_dict(positions[self.rank])
        elif stream.reshardable:
            stream.load_state_dict(saved[0])  # LitData re-splits the remaining samples of rank 0's position
        elif self.state.mid_epoch:
            epoch = self.state.current_epoch
            why = (
                f"{path} was saved mid-epoch at world size {len(positions)} by {saved[0]['loader']}, which "
                f"cannot continue its stream at world size {self.world_size}"
            )
            if self.reshard == "error":
                raise ValueError(
                    f"{why}. Resume at world size {len(positions)}, or pass stream_reshard='restart_epoch' to start "
                    f"epoch {epoch} again (its samples are seen twice)."
                )
            logger.warning("%s: epoch %d starts again (stream_reshard='restart_epoch').", why, epoch)
