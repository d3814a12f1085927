"""Samplers and DataLoader adaptation: resumable sharded training, padding-free evaluation.

Only a plain ``torch.utils.data.DataLoader`` with the stock samplers is rebuilt, from its
documented public attributes (no constructor introspection); a training loader that saves its own
position is a stream (:mod:`trainer.data.streams`); anything else is used as-is
with a warning saying what is lost and what to pass instead. Rank and world size are
arguments: this module never imports ``torch.distributed``; the few agreements between ranks about
data a loader keel does not shard (:func:`agree_on_batches`, :class:`~trainer.data.streams.AllRanksHaveData`,
:func:`warn_if_unsharded`) are collectives through :mod:`trainer.distributed.comm`.
"""

from __future__ import annotations

import hashlib
import logging
import random
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from trainer.data.streams import AllRanksHaveData, Stream, adapt_stream, loader_settings, not_stateful_reason
from trainer.data.transfer import tensors_in
from trainer.distributed import comm

logger = logging.getLogger(__name__)

_STATE_KEYS = frozenset({"epoch", "cursor", "seed"})
# How an epoch's order follows from (seed, epoch): 2 mixes them (no two pairs share an order); 1, ``seed + epoch``
# (seed n's orders were seed n+1's one epoch later), is kept for the saves written before 2, so they resume exactly.
ORDER = 2
_PLAIN_LOADER = (
    "pass a plain torch.utils.data.DataLoader(dataset, batch_size=..., shuffle=...) "
    "and keel adds the distributed sampler"
)


def _derive_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from its parts (``hash()`` is salted per process; this is not)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _check_replicas(dataset_len: int, num_replicas: int, rank: int) -> None:
    if dataset_len < 0:
        raise ValueError(f"dataset_len must be >= 0, got {dataset_len}")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")


class ResumableDistributedSampler(Sampler[int]):
    """Shuffles by (seed, epoch), shards by rank, and resumes at a global sample cursor.

    Every rank computes the same epoch permutation:
    ``torch.randperm(n, generator=torch.Generator().manual_seed(mix(seed, epoch)))`` when
    ``shuffle`` else ``range(n)``, ``mix`` a hash of the pair: it differs from epoch to epoch and
    from seed to seed (no two (seed, epoch) pairs share an order, so the runs of a seed sweep read
    independent orders), and is identical on a repeated run.

    The permutation is sliced at the global cursor, ``remaining = perm[cursor:]``, and
    made divisible by ``num_replicas``: ``drop_last=False`` pads with the last samples of
    ``perm`` (at most ``num_replicas - 1`` duplicates, the same ones wherever the epoch
    resumed; a single process never pads), ``drop_last=True`` truncates. Rank ``r`` yields
    ``remaining[r::num_replicas]``. Because the shards are strided, once every rank has
    consumed ``k`` local samples the samples consumed by all ranks together are exactly
    ``perm[cursor : cursor + k * num_replicas]``. The global cursor therefore advances by
    ``k * num_replicas``, and a checkpoint taken on N ranks resumes on M ranks at the
    right sample: nothing is re-read and nothing is skipped. The Trainer calls
    ``set_cursor(steps_done * batch_size * world_size)``.

    The cursor belongs to one epoch: ``set_epoch(e)`` keeps it only if it was set or
    loaded for epoch ``e``, so the next ``set_epoch(e + 1)`` starts at 0.

    Args:
        dataset_len: Number of samples in the (map-style) dataset.
        num_replicas: World size.
        rank: This process's rank in ``[0, num_replicas)``.
        shuffle: Shuffle by (seed, epoch) or keep dataset order.
        seed: Base seed of the shuffle; the same on every rank.
        drop_last: Truncate instead of padding to a multiple of ``num_replicas``.
        worker_generator: The ``generator`` of the DataLoader this sampler feeds, if any.
            Each ``set_epoch(e)`` reseeds it with a seed derived from
            ``(seed, rank, e)``, so the DataLoader workers' seeds (the loader draws a
            base seed from it on each ``iter()``) depend on the epoch, not on how
            often the loader was iterated. ``adapt_train_loader`` passes it.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        worker_generator: torch.Generator | None = None,
    ) -> None:
        _check_replicas(dataset_len, num_replicas, rank)
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.worker_generator = worker_generator
        self._seed = int(seed)
        self._order = ORDER  # a save's: how its orders were drawn
        self._epoch = 0
        self._cursor = 0
        self._cursor_epoch = 0  # the epoch self._cursor belongs to
        self._reseed_workers()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def cursor(self) -> int:
        """Global samples of the current epoch consumed by all ranks together."""
        return self._cursor

    @property
    def seed(self) -> int:
        return self._seed

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``'s permutation; reset the cursor unless it was set for ``epoch``."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._cursor_epoch:
            self._cursor = 0
            self._cursor_epoch = epoch
        self._epoch = epoch
        self._reseed_workers()

    def set_cursor(self, consumed: int) -> None:
        """Resume the current epoch after ``consumed`` samples (global, all ranks together).

        Args:
            consumed: Samples of this epoch already consumed by all ranks. A value past
                the end of the epoch (padding counted) leaves nothing to yield.
        """
        if consumed < 0:
            raise ValueError(f"cursor must be >= 0, got {consumed}")
        self._cursor = int(consumed)
        self._cursor_epoch = self._epoch

    def state_dict(self) -> dict[str, int]:
        """Returns ``{"epoch", "cursor", "seed", "order"}``; the cursor counts global samples."""
        return {"epoch": self._epoch, "cursor": self._cursor, "seed": self._seed, "order": self._order}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore epoch, cursor and seed; the cursor then applies to that epoch only.

        Args:
            state: A dict from :meth:`state_dict`, possibly saved with another world size.

        Raises:
            KeyError: If keys are missing or unknown; the message names them.
            ValueError: If the epoch or cursor is negative.
        """
        missing, unknown = _STATE_KEYS - state.keys(), state.keys() - _STATE_KEYS - {"order"}
        if missing or unknown:
            raise KeyError(
                f"{type(self).__name__}.load_state_dict: missing keys {sorted(missing)}, "
                f"unknown keys {sorted(map(str, unknown))}; expected {sorted(_STATE_KEYS)}"
            )
        epoch, cursor, seed = int(state["epoch"]), int(state["cursor"]), int(state["seed"])
        if epoch < 0 or cursor < 0:
            raise ValueError(f"epoch and cursor must be >= 0, got epoch={epoch}, cursor={cursor}")
        if seed != self._seed:  # the checkpoint's seed wins: resume needs its permutation
            logger.info("sampler seed %d restored from checkpoint (was %d)", seed, self._seed)
        order = int(state.get("order", 1))  # a save without it was written with seed + epoch
        if order not in (1, ORDER):
            raise ValueError(f"order {order} is from a newer keel; this one draws orders 1 and {ORDER}")
        self._seed, self._epoch, self._order = seed, epoch, order
        self._cursor, self._cursor_epoch = cursor, epoch
        self._reseed_workers()

    def _reseed_workers(self) -> None:
        if self.worker_generator is not None:
            self.worker_generator.manual_seed(_derive_seed(self._seed, self.rank, self._epoch))

    def _local_indices(self) -> torch.Tensor:
        n, replicas = self.dataset_len, self.num_replicas
        if self.shuffle:
            mixed = self._seed + self._epoch if self._order == 1 else _derive_seed("order", self._seed, self._epoch)
            generator = torch.Generator().manual_seed(mixed)
            perm = torch.randperm(n, generator=generator)
        else:
            perm = torch.arange(n)
        remaining = perm[self._cursor :]
        extra = len(remaining) % replicas
        if extra and self.drop_last:
            remaining = remaining[: len(remaining) - extra]
        elif extra:
            # The last `pad` samples of the epoch's permutation (cyclically, if it is shorter): the same
            # padding wherever the epoch resumed, so that a run resumed mid-epoch reads exactly what the
            # uninterrupted run reads, and samples not consumed yet unless fewer are left than the padding.
            pad = replicas - extra
            remaining = torch.cat([remaining, perm.repeat(-(-pad // n))[-pad:]])
        return remaining[self.rank :: replicas]

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle and (self.dataset_len - self._cursor) % self.num_replicas == 0:
            # In order and without padding: the same indices as _local_indices, counted lazily (no list of n ints
            # built at each epoch start).
            return iter(range(self._cursor + self.rank, self.dataset_len, self.num_replicas))
        # Every rank builds the whole permutation (O(n), like DistributedSampler).
        return iter(self._local_indices().tolist())

    def __len__(self) -> int:
        """Number of indices this rank yields from the current cursor."""
        left = max(self.dataset_len - self._cursor, 0)
        if self.drop_last:
            return left // self.num_replicas
        return -(-left // self.num_replicas)


class EvalShardSampler(Sampler[int]):
    """Contiguous evaluation shards without padding or duplicates.

    Rank ``r`` yields ``range(start_r, end_r)``; the first ``n % num_replicas`` ranks
    get one extra sample (like ``numpy.array_split``), so concatenating the per-rank
    outputs in rank order gives dataset order, and a sample-weighted metric over ranks
    equals the single-process metric, also for an odd ``n``. Some ranks may get fewer
    samples, or none when ``n < num_replicas``.

    Args:
        dataset_len: Number of samples in the (map-style) dataset.
        num_replicas: World size.
        rank: This process's rank in ``[0, num_replicas)``.
    """

    def __init__(self, dataset_len: int, *, num_replicas: int = 1, rank: int = 0) -> None:
        _check_replicas(dataset_len, num_replicas, rank)
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        base, extra = divmod(dataset_len, num_replicas)
        self.start = rank * base + min(rank, extra)
        self.end = self.start + base + (1 if rank < extra else 0)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return self.end - self.start


class _WorkerInit:
    """``worker_init_fn`` of rebuilt loaders: a module-level class so it pickles under spawn.

    Seeds ``random`` and ``numpy`` (when installed) from the worker's torch seed, which
    the DataLoader sets to ``base_seed + worker_id``, then calls the user's function.
    """

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        seed = torch.initial_seed() % 2**32
        random.seed(seed)
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            np.random.seed(seed)
        if self.user_fn is not None:
            self.user_fn(worker_id)


@dataclass
class AdaptedLoader:
    """A loader ready for the Trainer.

    Attributes:
        loader: The DataLoader to iterate: rebuilt, the stream's loader, or the user's own object as-is.
        sampler: keel's sampler in the rebuilt loader; ``None`` when used as-is.
        shuffle: The user's shuffle choice; ``None`` when used as-is.
        reason: Why the loader is used as-is; ``None`` when adapted.
    """

    loader: Iterable[Any]
    sampler: ResumableDistributedSampler | EvalShardSampler | None
    shuffle: bool | None
    reason: str | None
    stream: Stream | None = None  # a training loader that carries its own position (trainer/data/streams.py)
    agree: AllRanksHaveData | None = None  # made by the first epoch that needs it, kept for the fit


def _unadaptable_reason(loader: Iterable[Any]) -> tuple[str | None, bool | None]:
    """Returns ``(reason, None)`` if ``loader`` cannot be rebuilt, else ``(None, shuffle)``.

    Raises:
        ValueError: If the loader already uses a ``DistributedSampler``.
    """
    if not isinstance(loader, DataLoader):
        return f"it is not a torch.utils.data.DataLoader but a {type(loader).__qualname__}", None
    inner = getattr(loader.batch_sampler, "sampler", None)
    if isinstance(loader.sampler, DistributedSampler) or isinstance(inner, DistributedSampler):
        raise ValueError(
            "keel shards data itself; pass the DataLoader with shuffle=True/False and no DistributedSampler"
        )
    if type(loader) is not DataLoader:
        name = type(loader).__qualname__
        return f"it is a DataLoader subclass ({name}), which keel never rebuilds", None
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        name = type(dataset).__qualname__
        reason = f"its dataset is an IterableDataset ({name}); shard it yourself by rank and worker"
        return reason, None
    if not hasattr(dataset, "__len__"):
        return f"its dataset ({type(dataset).__qualname__}) has no __len__", None
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        return "automatic batching is disabled (batch_size=None)", None
    if type(batch_sampler) is not BatchSampler or batch_sampler.sampler is not loader.sampler:
        return f"it has a custom batch_sampler ({type(batch_sampler).__qualname__})", None
    sampler = loader.sampler
    if type(sampler) is SequentialSampler:
        return None, False
    if type(sampler) is RandomSampler:
        if not sampler.replacement and sampler._num_samples is None:
            return None, True
        settings = f"replacement={sampler.replacement}, num_samples={sampler._num_samples}"
        return f"its RandomSampler draws with {settings}", None
    return f"it has a custom sampler ({type(sampler).__qualname__})", None


def _rebuild(loader: DataLoader, sampler: Sampler[int], generator: torch.Generator) -> DataLoader:
    """A new DataLoader with ``loader``'s settings, ``sampler`` and seeded workers."""
    kwargs = dict(loader_settings(loader), worker_init_fn=_WorkerInit(loader.worker_init_fn), generator=generator)
    return DataLoader(loader.dataset, sampler=sampler, **kwargs)


def _adapt(
    loader: Iterable[Any], kind: Literal["train", "eval"], num_replicas: int, rank: int, seed: int
) -> AdaptedLoader:
    if not hasattr(type(loader), "__iter__"):
        raise TypeError(f"the {kind} dataloader must be iterable, got {type(loader).__qualname__}")
    _check_replicas(0, num_replicas, rank)
    stream = adapt_stream(loader, num_replicas=num_replicas, rank=rank, seed=seed) if kind == "train" else None
    if stream is not None:
        logger.debug("train loader %s resumes itself: rank %d/%d", stream.describe(), rank, num_replicas)
        return AdaptedLoader(stream.loader, None, None, None, stream=stream)
    reason, shuffle = _unadaptable_reason(loader)
    if reason is not None:
        _warn_as_is(loader, kind, reason, num_replicas)
        return AdaptedLoader(loader, None, None, reason)
    assert isinstance(loader, DataLoader) and shuffle is not None
    n = len(loader.dataset)  # type: ignore[arg-type]
    sampler: ResumableDistributedSampler | EvalShardSampler
    if kind == "train":
        # The sampler seeds this generator now and reseeds it on each set_epoch.
        generator = torch.Generator()
        sampler = ResumableDistributedSampler(
            n,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=False,
            worker_generator=generator,
        )
    else:
        generator = torch.Generator().manual_seed(_derive_seed(seed, rank, "eval"))
        sampler = EvalShardSampler(n, num_replicas=num_replicas, rank=rank)
    rebuilt = _rebuild(loader, sampler, generator)
    logger.debug("%s loader rebuilt: rank %d/%d, shuffle=%s", kind, rank, num_replicas, shuffle)
    return AdaptedLoader(rebuilt, sampler, shuffle, None)


def _warn_as_is(loader: Iterable[Any], kind: str, reason: str, num_replicas: int) -> None:
    if kind == "train" and (stream := not_stateful_reason(loader)) is not None:
        shard = (
            f" keel does not shard it across the {num_replicas} ranks either: each rank trains on whatever it yields."
            if num_replicas > 1
            else ""
        )
        warnings.warn(f"keel uses the train loader ({type(loader).__qualname__}) as-is: {stream}.{shard}", stacklevel=4)
        return
    if kind == "train":
        lost = (
            f"keel will not shard it across the {num_replicas} ranks (each rank sees "
            "whatever this loader yields) and cannot resume mid-epoch exactly"
            if num_replicas > 1
            else "keel cannot resume mid-epoch exactly"
        )
    elif num_replicas > 1:
        lost = (
            "metrics are computed over whatever each rank's loader yields; with "
            f"{num_replicas} ranks and an unsharded loader every sample is counted "
            f"{num_replicas} times"
        )
    else:
        logger.debug("eval loader %s used as-is: %s", type(loader).__qualname__, reason)
        return
    warnings.warn(
        f"keel uses the {kind} loader ({type(loader).__qualname__}) as-is because {reason}. "
        f"So {lost}. To fix this, {_PLAIN_LOADER}.",
        UserWarning,
        stacklevel=4,
    )


def adapt_train_loader(loader: Iterable[Any], *, num_replicas: int, rank: int, seed: int) -> AdaptedLoader:
    """Rebuild a plain training DataLoader around a :class:`ResumableDistributedSampler`.

    A loader is rebuilt only when it is exactly ``torch.utils.data.DataLoader`` over a
    map-style dataset with ``__len__``, whose sampler is the stock ``SequentialSampler``
    (``shuffle=False``) or ``RandomSampler`` without replacement or ``num_samples``
    (``shuffle=True``) inside a stock ``BatchSampler``. The rebuilt loader keeps
    batch_size, drop_last, collate_fn, num_workers, pin_memory(_device), timeout,
    multiprocessing_context, prefetch_factor, persistent_workers and in_order; the
    sampler mirrors the user's shuffle choice with keel's ``seed`` (a user's
    ``generator`` is replaced, see below).

    Worker seeding: the loader gets a ``generator`` that the sampler reseeds on each
    ``set_epoch(e)`` from ``(seed, rank, e)``; the DataLoader draws a base seed from it
    on each ``iter()`` and seeds worker ``w``'s torch RNG with ``base + w``. So each
    worker's seed is a function of (seed, rank, worker, epoch): identical on a repeated
    run and for a repeated iteration of the same epoch, different across ranks, workers
    and epochs. ``worker_init_fn`` then seeds ``random`` and ``numpy`` from it and calls
    the user's own ``worker_init_fn``. With ``persistent_workers=True`` workers are
    seeded once, on the first ``iter()``.

    Args:
        loader: The user's training loader (any iterable).
        num_replicas: World size.
        rank: This process's rank.
        seed: The run's seed; the same on every rank.

    Returns:
        The rebuilt loader and its sampler, or the loader as-is with the reason (and a
        warning saying what is lost: sharding when ``num_replicas > 1``, exact resume).

    Raises:
        TypeError: If ``loader`` is not iterable.
        ValueError: If the loader already uses a ``DistributedSampler``.
    """
    return _adapt(loader, "train", num_replicas, rank, seed)


def adapt_eval_loader(loader: Iterable[Any], *, num_replicas: int, rank: int, seed: int) -> AdaptedLoader:
    """Rebuild a plain evaluation DataLoader around an :class:`EvalShardSampler`.

    Same rules, arguments and errors as :func:`adapt_train_loader`, except that the
    contiguous shards never pad or shuffle, and the workers' generator is seeded once
    from ``(seed, rank)``. A user's ``drop_last=True`` applies per rank, so it drops
    different samples than one process would. A loader used as-is warns only when
    ``num_replicas > 1`` (every sample would be counted N times).
    """
    return _adapt(loader, "eval", num_replicas, rank, seed)


class ShardedIterable(torch.utils.data.IterableDataset):
    """Shards an iterable by rank and DataLoader worker: item ``i`` goes to exactly one (rank, worker).

    ``i % (world_size * num_workers) == rank * num_workers + worker_id``. Every rank and worker reads the
    whole source and keeps its share, which is right for cheap sources (files listed in order, generated
    samples); for expensive ones shard the source itself. Rank and world size default to the running
    process group's (read when iteration starts).
    """

    def __init__(self, source: Iterable[Any], *, rank: int | None = None, world_size: int | None = None) -> None:
        super().__init__()
        self.source = source
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[Any]:
        from trainer.distributed import comm

        rank = comm.get_rank() if self.rank is None else self.rank
        world = comm.get_world_size() if self.world_size is None else self.world_size
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        shards, mine = world * workers, rank * workers + worker
        for index, item in enumerate(self.source):
            if index % shards == mine:
                yield item


def shard_iterable(source: Iterable[Any], *, rank: int | None = None, world_size: int | None = None) -> ShardedIterable:
    """Wrap ``source`` so that each (rank, worker) yields a disjoint share; see :class:`ShardedIterable`."""
    return ShardedIterable(source, rank=rank, world_size=world_size)


def limit_batches(loader: Any, limit: int | float, name: str, *, fast_dev_run: bool | int = False) -> int | None:
    """Number of batches to run from ``loader`` after the ``limit_*_batches`` option ``name`` and
    ``fast_dev_run``; None when the loader has no ``len()`` and no limit applies.

    Raises:
        ValueError: ``limit`` is a fraction but the loader has no ``len()``.
    """
    if fast_dev_run:
        limit = 1 if fast_dev_run is True else int(fast_dev_run)
    try:
        length = len(loader)
    except TypeError:
        length = None
    if isinstance(limit, int) and not isinstance(limit, bool):
        return limit if length is None else min(limit, length)
    if length is None:
        if limit == 1.0:
            return None
        raise ValueError(
            f"Trainer option {name}={limit} is a fraction, but the loader has no len(); pass an int "
            "number of batches instead."
        )
    return int(length * limit)


class LoaderSource(Protocol):
    """Where a stage's loaders come from when none is given: a DataModule or a TaskModule (their ``DataHooks``)."""

    def train_dataloader(self) -> Any: ...
    def val_dataloader(self) -> Any: ...
    def test_dataloader(self) -> Any: ...
    def predict_dataloader(self) -> Any: ...


def resolve_loaders(source: LoaderSource, stage: str, given: Any) -> list[Any]:
    """The loaders of ``stage``: ``given`` (one loader or a list), else ``source``'s ``*_dataloader()``
    hook (the datamodule's, or the task's)."""
    if given is None:
        given = {
            "train": source.train_dataloader,
            "validate": source.val_dataloader,
            "test": source.test_dataloader,
            "predict": source.predict_dataloader,
        }[stage]()
    if given is None:
        return []
    if isinstance(given, (list, tuple)):
        return list(given)
    return [given]


def agree_on_batches(num_batches: int, device: torch.device, *, uneven: Literal["error", "truncate"]) -> int:
    """A loader keel does not shard may hold different amounts of data per rank: one collective per
    epoch so that every rank runs the same number of batches (``uneven_batches``).

    Raises:
        ValueError: the counts differ and ``uneven="error"``.
    """
    counts = torch.tensor([num_batches, -num_batches], device=device)
    comm.all_reduce(counts, "min")
    low, high = int(counts[0].item()), -int(counts[1].item())
    if low == high:
        return num_batches
    message = (
        f"Ranks have different numbers of training batches this epoch (min {low}, max {high}; this rank "
        f"{num_batches}), from a loader keel does not shard."
    )
    if uneven == "error":
        raise ValueError(message + " Pass a plain DataLoader so keel shards it evenly, or uneven_batches='truncate'.")
    logger.warning("%s Every rank runs %d (uneven_batches='truncate').", message, low)
    return low


def batch_fingerprint(batch: Any) -> str | None:
    """A digest of a batch's tensors (dtype, shape and the bytes of the first 4096 elements of each) that is
    the same in every process: blake2b, not ``hash()``, whose value for bytes is salted per process
    (``PYTHONHASHSEED``), so two ranks holding the same batch would never agree. None without tensors."""
    tensors = tensors_in(batch)
    if not tensors:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for t in tensors:
        head = t.detach().reshape(-1)[:4096].contiguous().cpu()  # the slice first: only 4096 elements move
        digest.update(f"{head.dtype}{tuple(t.shape)};".encode())
        digest.update(head.view(torch.uint8).numpy().tobytes() if head.numel() else b"")
    return digest.hexdigest()


def warn_if_unsharded(batch: Any, loader: Any) -> None:
    """First batch of a fit from an unsharded loader in DDP: warn if every rank got the same one
    (a collective: one object gather)."""
    fingerprints = comm.all_gather_object(batch_fingerprint(batch))
    if fingerprints[0] is not None and len(set(fingerprints)) == 1:
        logger.warning(
            "Every rank got the same first batch from %s: the data is probably not sharded by rank, so each "
            "rank trains on the same samples. Shard it (trainer.data.loaders.shard_iterable) or pass a plain "
            "DataLoader over a map-style dataset.",
            type(loader).__name__,
        )


@dataclass
class EpochPlan:
    """Where one training epoch starts and how its ranks stay in step (see :func:`plan_epoch`)."""

    start: int  # first batch index (a resume cursor), 0 for a fresh epoch
    samples_done: int  # global samples of the epoch already consumed (all ranks together)
    num_batches: int | None  # batches of the whole epoch after limits and agreement; None: unknown
    agree: Callable[[bool], bool] | None  # per-step "every rank still has data" (loader without len())
    samples_per_batch: int  # global samples one micro-batch consumes; 0 when keel does not shard
    batches: Iterable[Any]  # what the epoch iterates: the loader, or the stream from its resume position


def plan_epoch(
    train: AdaptedLoader,
    *,
    epoch: int,
    batches_done: int,
    samples_done: int,
    limit: Callable[[Iterable[Any]], int | None],
    replicas: int,
    device: torch.device,
    uneven: Literal["error", "truncate"],
) -> EpochPlan:
    """Set the sampler to ``epoch`` and the resume cursor, and make every rank run the same batches.

    ``limit(loader)`` gives the epoch's length after ``limit_train_batches``; it is read after the
    sampler is rewound to the epoch's start and before the cursor shortens it. A loader keel shards
    resumes at the global sample cursor, so nothing is re-read; one it cannot adapt restarts the epoch
    (with a warning). Collective when a loader keel does not shard runs on several ranks
    (:func:`agree_on_batches` once, or :class:`~trainer.data.streams.AllRanksHaveData` per step).
    """
    sampler = train.sampler if isinstance(train.sampler, ResumableDistributedSampler) else None
    stream = train.stream
    if sampler is not None:
        sampler.set_epoch(epoch)  # also rewinds the cursor to 0
    elif stream is not None:
        stream.set_epoch(epoch)
    num_batches = limit(train.loader)  # the whole epoch, before a resume cursor shortens the sampler
    agree = None
    if comm.get_world_size() > 1 and sampler is None:
        # A loader keel does not shard may hold different amounts of data per rank: agree first.
        if num_batches is not None:
            num_batches = agree_on_batches(num_batches, device, uneven=uneven)
        else:
            if train.agree is None:
                what = stream.describe() if stream is not None else type(train.loader).__qualname__
                train.agree = AllRanksHaveData(device, uneven, what)
            agree = train.agree
    start = batches_done
    if start and sampler is not None:
        sampler.set_cursor(samples_done)  # resume at the global sample cursor: nothing is re-read
    elif start and stream is not None and stream.take_resume():
        pass  # the stream continues from the position its checkpoint saved for this rank
    elif start:
        logger.warning(
            "Resuming mid-epoch with a loader that cannot continue where it was saved (%s): the epoch restarts "
            "from its first batch.",
            train.reason or "the checkpoint holds no position for it on this rank",
        )
        start = samples_done = 0
    batch_size = cast("DataLoader[Any]", train.loader).batch_size if sampler is not None else None
    if stream is not None:
        batch_size = stream.batch_size
    samples_per_batch = (batch_size or 0) * replicas  # data-parallel replicas: tensor-parallel ranks share a batch
    batches = stream.batches(start) if stream is not None else train.loader
    return EpochPlan(start, samples_done, num_batches, agree, samples_per_batch, batches)
