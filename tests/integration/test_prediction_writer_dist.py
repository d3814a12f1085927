"""BasePredictionWriter on 2 ranks: each rank writes its own predictions with their dataset indices (nothing is
gathered, as in Lightning), and together the ranks write every sample of every loader once, with the index of the
sample each prediction was made from, and the same predictions as one process (tests/unit/test_prediction_writer.py
checks the calls against Lightning 2.6.6's in one process)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from launch import REPO_ROOT, spawn_ranks

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "prediction_writer.py"
sys.path.insert(0, str(SCRIPT.parent))
import prediction_writer as program  # noqa: E402


def written(root: Path, rank: int) -> tuple[dict[int, dict[int, float]], dict[str, Any]]:
    """Rank ``rank``'s batch files as {dataloader_idx: {dataset index: prediction}} (each index once), and its
    epoch file."""
    folder = root / f"rank{rank}"
    by_loader: dict[int, dict[int, float]] = {d: {} for d in range(len(program.SIZES))}
    for path in sorted(folder.glob("batch-*.pt")):
        _, loader_idx, _ = path.stem.split("-")
        record = torch.load(path)
        assert len(record["indices"]) == len(record["prediction"]) > 0
        for index, value in zip(record["indices"], record["prediction"].tolist()):
            assert index not in by_loader[int(loader_idx)], (path, index)
            by_loader[int(loader_idx)][index] = value
    return by_loader, torch.load(folder / "epoch.pt")


def check_epoch_file(by_loader: dict[int, dict[int, float]], epoch: dict[str, Any]) -> None:
    """The epoch write holds this rank's predictions and indices, batch for batch as the batch writes."""
    assert epoch["returned"] is None  # return_predictions=False: nothing returned, the writer still got them
    assert len(epoch["predictions"]) == len(epoch["indices"]) == len(program.SIZES)
    for loader_idx, (predictions, indices) in enumerate(zip(epoch["predictions"], epoch["indices"])):
        assert len(predictions) == len(indices)
        pairs = {i: v for batch, idx in zip(predictions, indices) for i, v in zip(idx, batch.tolist())}
        assert pairs == by_loader[loader_idx]


def test_each_rank_writes_its_own_samples_and_together_every_sample_once(tmp_path: Path) -> None:
    one = tmp_path / "one"
    assert program.predict_and_write(one) is None
    single, single_epoch = written(one, 0)
    check_epoch_file(single, single_epoch)
    for loader_idx, size in enumerate(program.SIZES):  # the right index: sample i of loader d is 100 * d + i
        assert single[loader_idx] == {i: 10.0 * (100 * loader_idx + i) for i in range(size)}

    two = tmp_path / "two"
    spawn_ranks(SCRIPT, str(two), nproc=2, timeout=180).check()
    ranks = [written(two, rank) for rank in (0, 1)]
    for by_loader, epoch in ranks:
        check_epoch_file(by_loader, epoch)
    for loader_idx in range(len(program.SIZES)):
        first, second = (ranks[rank][0][loader_idx] for rank in (0, 1))
        assert first and second and not set(first) & set(second)  # each rank wrote part, no sample twice
        assert {**first, **second} == single[loader_idx]
