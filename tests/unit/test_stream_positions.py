"""Streaming data in one process (trainer/data/streams.py): a plain DataLoader over a stateful dataset becomes a
stateful one, the position saved is the one after the batches trained, a save at the end of an epoch resumes with the
whole next epoch, a position from another loader is refused, map-style data is not a stream, and a Hugging Face
stream reshuffles every epoch. Runs that crash or are SIGKILLed and resume exactly, on 1 and 2 ranks:
tests/integration/test_streams.py."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer.data.loaders import adapt_train_loader
from trainer.data.streams import Stream, adapt_stream, not_stateful_reason

torchdata = pytest.importorskip("torchdata.stateful_dataloader")


class _Counting(IterableDataset):
    def __init__(self, n: int = 10) -> None:
        self.n, self.pos = n, 0

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield torch.tensor([self.pos - 1])
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def test_a_plain_dataloader_over_a_stateful_dataset_becomes_a_stateful_dataloader() -> None:
    collate = lambda rows: torch.cat(rows)  # noqa: E731
    user = DataLoader(_Counting(), batch_size=3, collate_fn=collate, drop_last=True)
    adapted = adapt_train_loader(user, num_replicas=1, rank=0, seed=0)
    assert isinstance(adapted.stream, Stream) and adapted.stream.kind == "stateful"
    assert isinstance(adapted.loader, torchdata.StatefulDataLoader)
    assert adapted.loader.batch_size == 3 and adapted.loader.drop_last and adapted.loader.collate_fn is collate
    assert [b.tolist() for b in adapted.stream.batches(0)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_the_saved_position_is_the_one_after_the_batches_trained() -> None:
    """The loop reads one batch ahead when the epoch length is unknown; the saved state is the one after the
    batches it trained on, so the look-ahead batch is trained after a resume, not skipped."""
    stream = adapt_stream(DataLoader(_Counting(), batch_size=2), num_replicas=1, rank=0)
    assert stream is not None
    batches = stream.batches(0)
    got = [next(batches).tolist(), next(batches).tolist()]  # batch 1 fetched: the look-ahead of batch 0
    saved = stream.state_dict(batches_done=1, epoch_finished=False)
    assert got == [[[0], [1]], [[2], [3]]]
    again = adapt_stream(DataLoader(_Counting(), batch_size=2), num_replicas=1, rank=0)
    assert again is not None
    again.load_state_dict(saved)
    assert again.take_resume() and not again.take_resume()
    assert next(again.batches(1)).tolist() == [[2], [3]]


class _Epochs(IterableDataset):
    """Six items per epoch, numbered by epoch and split over DataLoader workers; iter() starts the epoch unless a
    state was loaded (torchdata's convention)."""

    def __init__(self) -> None:
        self.epoch, self.next, self.resume_at = 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start, self.resume_at = self.resume_at, 0
        for k, i in enumerate(range(worker, 6, workers)):
            if k >= start:
                self.next = k + 1
                yield torch.tensor([100 * self.epoch + i])

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at = state["next"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_save_at_the_end_of_an_epoch_resumes_with_the_whole_next_epoch(workers: int) -> None:
    """torchdata restores a finished epoch's state as one that yields nothing more; keel saves no position for a
    finished epoch (only the loader's generator), so the next epoch after the resume is whole and the same."""

    def stream() -> Stream:
        made = adapt_stream(DataLoader(_Epochs(), batch_size=2, num_workers=workers), num_replicas=1, rank=0)
        assert made is not None
        return made

    first = stream()
    assert len(list(first.batches(0))) == 3 + (workers > 0)  # two workers: 3 items each, a short batch each
    saved = first.state_dict(3, epoch_finished=True)
    first.set_epoch(1)
    uninterrupted = [b.tolist() for b in first.batches(0)]
    resumed = stream()
    resumed.load_state_dict(saved)
    resumed.set_epoch(1)
    assert not resumed.take_resume()  # epoch 1 starts at its first batch
    again = [b.tolist() for b in resumed.batches(0)]
    assert again == uninterrupted and sorted(i for batch in again for (i,) in batch) == list(range(100, 106))


def test_a_position_from_another_loader_is_refused() -> None:
    stream = adapt_stream(DataLoader(_Counting(), batch_size=2), num_replicas=1, rank=0)
    assert stream is not None
    saved = dict(stream.state_dict(0, False), loader="StreamingDataLoader over StreamingDataset", kind="litdata")
    with pytest.raises(ValueError, match="saved by StreamingDataLoader over StreamingDataset .* resume with the"):
        stream.load_state_dict(saved)


def test_map_style_data_is_not_a_stream() -> None:
    loader = DataLoader(list(range(8)), batch_size=2)
    assert adapt_stream(loader, num_replicas=1, rank=0) is None and not_stateful_reason(loader) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert adapt_train_loader(loader, num_replicas=1, rank=0, seed=0).stream is None


datasets = pytest.importorskip("datasets")


def test_a_hugging_face_stream_reshuffles_every_epoch(tmp_path: Path) -> None:
    """keel calls set_epoch on the stream, so a shard-shuffled Hugging Face stream has a new order every epoch, the
    order Hugging Face gives that epoch (an unsplit stream in one process)."""
    files = []
    for shard in range(8):
        files.append(str(tmp_path / f"part-{shard}.jsonl"))
        Path(files[-1]).write_text("".join(json.dumps({"id": i}) + "\n" for i in range(shard, 96, 8)))

    def stream():
        rows = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
        return rows.shuffle(seed=3, buffer_size=1)  # the shard order only: resume stays exact

    adapted = adapt_train_loader(DataLoader(stream(), batch_size=96), num_replicas=1, rank=0, seed=0)
    assert adapted.stream is not None and adapted.stream.kind == "huggingface"
    orders = []
    for epoch in (0, 1):
        adapted.stream.set_epoch(epoch)
        (batch,) = list(adapted.stream.batches(0))
        expected = stream()
        expected.set_epoch(epoch)
        assert batch["id"].tolist() == [row["id"] for row in expected]
        orders.append(batch["id"].tolist())
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1]) == list(range(96))
