"""Tests for trainer/data/loaders.py: samplers and loader adaptation (single process; ranks simulated)."""

from __future__ import annotations

import pickle
import random
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from trainer.data.loaders import (
    AdaptedLoader,
    EvalShardSampler,
    ResumableDistributedSampler,
    _derive_seed,
    adapt_eval_loader,
    adapt_train_loader,
)

_LOSS_TRAIN = "will not shard it across the 2 ranks"
_LOSS_RESUME = "cannot resume mid-epoch exactly"
_LOSS_EVAL = "every sample is counted 2 times"
_FIX = r"pass a plain torch\.utils\.data\.DataLoader\(dataset, batch_size=\.\.\., shuffle=\.\.\.\)"


class _Range(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class _Rand(Dataset):
    """Returns (index, worker id, a numpy draw, a tag set by the user's worker_init_fn)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[int, int, float, int]:
        info = torch.utils.data.get_worker_info()
        return i, info.id if info else -1, float(np.random.rand()), _WORKER_TAG


_WORKER_TAG = 0


def _user_init(worker_id: int) -> None:
    global _WORKER_TAG
    _WORKER_TAG = 100 + worker_id


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


class _MyLoader(DataLoader):
    pass


class _EveryOther(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return (self.n + 1) // 2


def _batches(sampler: Sampler[int]) -> BatchSampler:
    return BatchSampler(sampler, batch_size=2, drop_last=False)


def _collate(batch: list[Any]) -> list[Any]:
    return batch


def _ranks(n: int, replicas: int, **kwargs: Any) -> list[ResumableDistributedSampler]:
    return [ResumableDistributedSampler(n, num_replicas=replicas, rank=r, **kwargs) for r in range(replicas)]


# --- ResumableDistributedSampler ---------------------------------------------------


def test_sequential_strided_on_two_ranks() -> None:
    r0, r1 = _ranks(7, 2, shuffle=False)
    assert list(r0) == [0, 2, 4, 6]
    assert list(r1) == [1, 3, 5, 6]  # padded with the epoch's last sample
    assert len(r0) == len(r1) == 4
    single = ResumableDistributedSampler(7, shuffle=False)
    assert list(single) == list(range(7))  # a single process never pads


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 10, 11])
def test_union_is_whole_dataset_plus_padding(n: int, replicas: int) -> None:
    out = [i for s in _ranks(n, replicas, shuffle=True, seed=3) for i in s]
    pad = -n % replicas
    assert len(out) == n + pad
    assert set(out) == set(range(n))
    assert sum(c - 1 for c in Counter(out).values()) == pad
    dropped = [i for s in _ranks(n, replicas, shuffle=True, drop_last=True) for i in s]
    assert len(dropped) == len(set(dropped)) == n - n % replicas


def test_shuffle_per_epoch_repeatable_and_same_on_all_ranks() -> None:
    a = ResumableDistributedSampler(50, shuffle=True, seed=7)
    e0 = list(a)
    a.set_epoch(1)
    e1 = list(a)
    assert e0 != e1 and sorted(e0) == sorted(e1) == list(range(50))
    b = ResumableDistributedSampler(50, shuffle=True, seed=7)
    assert list(b) == e0
    b.set_epoch(1)
    assert list(b) == e1
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(_derive_seed("order", 7, 1))).tolist()
    assert e1 == expected
    ranks = _ranks(50, 2, shuffle=True, seed=7)
    for s in ranks:
        s.set_epoch(1)
    assert list(ranks[0]) == expected[0::2] and list(ranks[1]) == expected[1::2]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("old", [1, 2, 3])
@pytest.mark.parametrize("new", [1, 2, 4])
def test_resume_on_another_world_size(old: int, new: int, shuffle: bool) -> None:
    n = 23
    perm = list(ResumableDistributedSampler(n, shuffle=shuffle, seed=5))
    for k in range(0, n // old + 1):
        consumed = [i for s in _ranks(n, old, shuffle=shuffle, seed=5) for i in list(s)[:k]]
        cursor = k * old
        assert sorted(consumed) == sorted(perm[:cursor])  # key property: a prefix of perm
        resumed_ranks = _ranks(n, new, shuffle=shuffle, seed=5)
        for s in resumed_ranks:
            s.set_cursor(cursor)
        resumed = [i for s in resumed_ranks for i in s]
        rest = perm[cursor:]
        pad = -len(rest) % new
        padding = (perm * new)[len(perm) * new - pad :] if pad else []  # the epoch's last samples
        assert sorted(resumed) == sorted(rest + padding)
        if len(rest) >= pad:  # else the padding must repeat samples consumed before the resume
            assert not set(resumed) & set(consumed)
        assert set(resumed) | set(consumed) == set(range(n))
        assert sum(len(s) for s in resumed_ranks) == len(resumed)


@pytest.mark.parametrize("replicas", [2, 3])
def test_resumed_mid_epoch_yields_the_rest_of_the_uninterrupted_shards(replicas: int) -> None:
    # An epoch that does not divide by the world size (1259 digits on 2 ranks): the padded samples must
    # not depend on where the epoch resumed, or the run resumed mid-epoch ends with other weights.
    n = 23
    whole = [list(s) for s in _ranks(n, replicas, shuffle=True, seed=5)]
    for k in range(len(whole[0]) + 1):
        resumed = _ranks(n, replicas, shuffle=True, seed=5)
        for s in resumed:
            s.set_cursor(k * replicas)
        assert [list(s) for s in resumed] == [shard[k:] for shard in whole]


def test_cursor_past_end_and_set_epoch_resets() -> None:
    s = ResumableDistributedSampler(10, num_replicas=3, rank=2, shuffle=False)
    s.set_cursor(12)  # 10 samples + 2 padded ones consumed
    assert list(s) == [] and len(s) == 0
    s.set_cursor(4)
    s.set_epoch(0)  # the cursor was set for this epoch: kept
    assert s.cursor == 4 and list(s) == [6, 9]
    s.set_epoch(1)
    assert s.cursor == 0 and len(s) == 4


def test_state_dict_round_trip_and_strict_load() -> None:
    s = ResumableDistributedSampler(30, num_replicas=2, rank=1, shuffle=True, seed=11)
    s.set_epoch(3)
    s.set_cursor(8)
    state = s.state_dict()
    assert state == {"epoch": 3, "cursor": 8, "seed": 11, "order": 2}
    t = ResumableDistributedSampler(30, num_replicas=3, rank=0, shuffle=True, seed=0)
    t.load_state_dict(state)
    t.set_epoch(3)  # loaded for exactly this epoch: the cursor survives
    assert t.state_dict() == state
    perm = torch.randperm(30, generator=torch.Generator().manual_seed(_derive_seed("order", 11, 3))).tolist()
    assert list(t) == perm[8:][0::3]
    t.set_epoch(4)
    assert t.cursor == 0
    with pytest.raises(KeyError, match=r"missing keys \['seed'\].*unknown keys \['bogus'\]"):
        t.load_state_dict({"epoch": 0, "cursor": 0, "bogus": 1})
    with pytest.raises(ValueError):
        t.load_state_dict({"epoch": 0, "cursor": -1, "seed": 0})


def test_a_save_from_before_mixed_orders_resumes_on_the_order_it_had() -> None:
    """A sampler state without "order" was written when epoch e's order came from seed + e: it resumes there (the
    rest of that epoch, and the epochs after), never on a new order that would re-read or skip samples."""
    t = ResumableDistributedSampler(30, num_replicas=2, rank=1, shuffle=True, seed=0)
    t.load_state_dict({"epoch": 3, "cursor": 8, "seed": 11})
    t.set_epoch(3)
    perm = torch.randperm(30, generator=torch.Generator().manual_seed(11 + 3)).tolist()
    assert list(t) == perm[8:][1::2] and t.state_dict()["order"] == 1
    with pytest.raises(ValueError, match="order 3 is from a newer keel"):
        t.load_state_dict({"epoch": 0, "cursor": 0, "seed": 0, "order": 3})


def test_seeds_of_a_sweep_share_no_epoch_order() -> None:
    """Seeds 0..9 over epochs 0..9: a hundred different orders. With seed + epoch, seed n + 1 read seed n's order
    one epoch earlier, and a seed sweep trained on correlated orders."""
    orders = set()
    for seed in range(10):
        sampler = ResumableDistributedSampler(64, shuffle=True, seed=seed)
        for epoch in range(10):
            sampler.set_epoch(epoch)
            orders.add(tuple(sampler))
    assert len(orders) == 100


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        ResumableDistributedSampler(4, num_replicas=2, rank=2, shuffle=False)
    with pytest.raises(ValueError):
        EvalShardSampler(4, num_replicas=0)
    with pytest.raises(ValueError):
        ResumableDistributedSampler(4, shuffle=False).set_cursor(-1)


# --- EvalShardSampler --------------------------------------------------------------


@pytest.mark.parametrize("n,replicas", [(11, 2), (11, 3), (10, 3), (2, 4), (0, 2)])
def test_eval_shards_contiguous_disjoint_complete(n: int, replicas: int) -> None:
    samplers = [EvalShardSampler(n, num_replicas=replicas, rank=r) for r in range(replicas)]
    shards = [list(s) for s in samplers]
    # Concatenation in rank order == dataset order implies disjoint, complete, contiguous.
    assert [i for shard in shards for i in shard] == list(range(n))
    expected = [a.tolist() for a in np.array_split(np.arange(n), replicas)]
    assert shards == expected
    assert [len(s) for s in samplers] == [len(e) for e in expected]


# --- adapt_train_loader / adapt_eval_loader ----------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
def test_plain_loader_is_rebuilt(shuffle: bool) -> None:
    loader = DataLoader(_Range(10), batch_size=3, shuffle=shuffle, drop_last=True, collate_fn=_collate)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train = adapt_train_loader(loader, num_replicas=2, rank=1, seed=4)
        ev = adapt_eval_loader(loader, num_replicas=2, rank=1, seed=4)
    assert isinstance(train, AdaptedLoader) and train.reason is None and train.shuffle is shuffle
    new = train.loader
    assert type(new) is DataLoader and new is not loader
    settings = (new.batch_size, new.drop_last, new.collate_fn, new.num_workers)
    assert settings == (3, True, _collate, 0)
    assert new.sampler is train.sampler and isinstance(train.sampler, ResumableDistributedSampler)
    assert train.sampler.shuffle is shuffle and train.sampler.rank == 1 and train.sampler.seed == 4
    assert list(new) == [list(train.sampler)[:3]]  # 5 local samples, batch 3, drop_last
    assert isinstance(ev.sampler, EvalShardSampler) and ev.loader.sampler is ev.sampler
    assert ev.shuffle is shuffle  # recorded; evaluation shards are never shuffled
    assert list(ev.loader) == [[5, 6, 7]]  # rank 1 of 2 holds 5..9; drop_last keeps one batch


def test_rebuilt_keeps_worker_settings() -> None:
    loader = DataLoader(_Range(8), batch_size=2, num_workers=2, prefetch_factor=3, persistent_workers=True)
    new = adapt_train_loader(loader, num_replicas=1, rank=0, seed=0).loader
    assert (new.num_workers, new.prefetch_factor, new.persistent_workers) == (2, 3, True)
    init = pickle.loads(pickle.dumps(new.worker_init_fn))  # picklable for spawn
    state = random.getstate(), np.random.get_state()
    try:
        init(0)
        expected = torch.initial_seed() % 2**32
        assert random.random() == random.Random(expected).random()
        assert np.random.rand() == np.random.RandomState(expected).rand()
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


def test_a_stream_without_position_is_used_as_is_and_says_what_a_resume_does() -> None:
    """An IterableDataset without state_dict: the warning says a resume restarts the epoch, how to make it exact,
    and (on several ranks) that keel does not shard it (tests/integration/test_streams.py covers the stateful kinds)."""
    loader = DataLoader(_Stream(), batch_size=2)
    with pytest.warns(
        UserWarning, match="saves no position, so a resume starts the epoch again.*state_dict.*not shard"
    ):
        out = adapt_train_loader(loader, num_replicas=2, rank=0, seed=0)
    assert out.loader is loader and out.stream is None


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda: _MyLoader(_Range(6), batch_size=2), "DataLoader subclass"),
        (lambda: DataLoader(_Range(6), batch_size=2, sampler=_EveryOther(6)), "custom sampler"),
        (
            lambda: DataLoader(_Range(6), batch_sampler=_batches(SequentialSampler(_Range(6)))),
            "custom batch_sampler",
        ),
        (
            lambda: DataLoader(_Range(6), sampler=RandomSampler(_Range(6), replacement=True)),
            "replacement=True",
        ),
        (
            lambda: DataLoader(_Range(6), sampler=RandomSampler(_Range(6), num_samples=3)),
            "num_samples=3",
        ),
        (lambda: [[0, 1], [2, 3]], "not a torch.utils.data.DataLoader"),
    ],
)
def test_unadaptable_loader_used_as_is(make: Any, reason: str) -> None:
    loader = make()
    with pytest.warns(UserWarning, match=f"{reason}.*{_LOSS_TRAIN}.*{_LOSS_RESUME}.*{_FIX}"):
        out = adapt_train_loader(loader, num_replicas=2, rank=0, seed=0)
    assert out == AdaptedLoader(loader, None, None, out.reason) and reason in str(out.reason)
    with pytest.warns(UserWarning, match=f"{reason}.*{_LOSS_EVAL}.*{_FIX}"):
        assert adapt_eval_loader(loader, num_replicas=2, rank=0, seed=0).loader is loader


def test_single_process_unadaptable_warnings() -> None:
    loader = _MyLoader(_Range(6), batch_size=2)
    with pytest.warns(UserWarning, match=_LOSS_RESUME) as record:
        adapt_train_loader(loader, num_replicas=1, rank=0, seed=0)
    assert all("shard" not in str(w.message) for w in record)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert adapt_eval_loader(loader, num_replicas=1, rank=0, seed=0).reason is not None


def test_distributed_sampler_and_non_iterable_rejected() -> None:
    ds = _Range(8)
    loader = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    for adapt in (adapt_train_loader, adapt_eval_loader):
        with pytest.raises(ValueError, match="keel shards data itself.*no DistributedSampler"):
            adapt(loader, num_replicas=2, rank=0, seed=0)
        with pytest.raises(TypeError, match="int"):
            adapt(42, num_replicas=2, rank=0, seed=0)  # type: ignore[arg-type]


def _epoch(adapted: AdaptedLoader, epoch: int) -> list[tuple[int, int, float, int]]:
    adapted.sampler.set_epoch(epoch)  # type: ignore[union-attr]
    return [tuple(row) for b in adapted.loader for row in zip(*(t.tolist() for t in b))]


def test_worker_seeding_is_deterministic_per_seed_rank_worker_epoch() -> None:
    def build(rank: int) -> AdaptedLoader:
        user = DataLoader(_Rand(), batch_size=2, shuffle=True, num_workers=2, worker_init_fn=_user_init)
        return adapt_train_loader(user, num_replicas=2, rank=rank, seed=1)

    a, b, other = build(0), build(0), build(1)
    first = _epoch(a, 0)
    assert _epoch(a, 0) == first  # repeated iteration of the same epoch: identical batches
    assert _epoch(b, 0) == first  # separately built loader, same seed and rank
    assert {w for _, w, _, _ in first} == {0, 1}
    assert {tag for *_, tag in first} == {100, 101}  # the user's worker_init_fn ran
    draws = [d for _, _, d, _ in first]
    assert len(set(draws)) == len(draws)  # distinct draws across workers and samples
    per_worker = {w: [d for _, ww, d, _ in first if ww == w] for w in (0, 1)}
    assert per_worker[0][0] != per_worker[1][0]
    assert {d for _, _, d, _ in _epoch(other, 0)}.isdisjoint(draws)  # rank 1 differs
    second = _epoch(a, 1)
    assert [i for i, *_ in second] != [i for i, *_ in first]
    assert {d for _, _, d, _ in second}.isdisjoint(draws)  # epoch 1 reseeds workers


def test_batch_fingerprint_is_a_digest_of_the_tensors() -> None:
    """What warn_if_unsharded compares across ranks (the 2-rank check: tests/integration/test_ddp.py)."""
    from trainer.data.loaders import batch_fingerprint

    x = torch.arange(12.0).reshape(4, 3)
    assert batch_fingerprint((x, torch.tensor([0, 1, 0, 1]))) == batch_fingerprint(
        (x.clone(), torch.tensor([0, 1, 0, 1]))
    )
    assert batch_fingerprint({"x": x}) == batch_fingerprint([x]) != batch_fingerprint([x + 1])  # nested batches too
    assert batch_fingerprint([x]) != batch_fingerprint([x.double()]) != batch_fingerprint([x.reshape(3, 4)])
    assert isinstance(batch_fingerprint([x.bfloat16(), torch.tensor(True), torch.zeros(0)]), str)
    assert batch_fingerprint({"ids": [1, 2]}) is None  # no tensor: nothing to compare
