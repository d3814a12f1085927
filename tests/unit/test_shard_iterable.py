"""``shard_iterable`` (trainer/data/loaders.py), the split of a stream over ranks that the uneven-data runs of
tests/integration/test_robustness.py rely on: the ranks' shards are disjoint and together complete."""

from __future__ import annotations

from trainer.data.loaders import shard_iterable


def test_shard_iterable_gives_disjoint_complete_shards() -> None:
    shards = [list(shard_iterable(range(10), rank=r, world_size=3)) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(10))
    assert shards[1] == [1, 4, 7]
