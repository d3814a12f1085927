"""The charlm recipe with its training text read as a stream of sharded files (``data=charlm_stream``).

``CharStreamDataModule`` splits the text by file exactly as :class:`recipes.charlm.CharDataModule` does, writes the
training windows once into ``num_shards`` JSON-lines files (``prepare_data``: local rank 0; reused while their
manifest matches), and streams them with Hugging Face ``datasets`` (``load_dataset("json", data_files=...,
streaming=True)``): keel splits the stream by rank, saves its position per rank in every checkpoint and resumes
it exactly (docs/data.md). The shard order is reshuffled every epoch (``shuffle(seed, buffer_size=1)``: no
example buffer, so resume stays exact). Validation and test stay the in-memory windows of the parent class.

    python -m recipes.train +experiment=charlm data=charlm_stream
    torchrun --standalone --nproc-per-node 2 -m recipes.train +experiment=charlm data=charlm_stream

Needs the ``streaming`` extra (``pip install 'keel-trainer[streaming]'``: torchdata and datasets).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from recipes.charlm import CharDataModule

log = logging.getLogger(__name__)


def collate_windows(rows: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """JSON rows ``{"ids": [block_size + 1 ints]}`` -> ``(x, y)``, ``y`` being ``x`` shifted by one."""
    ids = torch.tensor([row["ids"] for row in rows], dtype=torch.long)
    return ids[:, :-1], ids[:, 1:]


class CharStreamDataModule(CharDataModule):
    """:class:`~recipes.charlm.CharDataModule` whose training split is streamed from sharded files.

    Args:
        shards_dir: Folder of the training shards (``part-00000.jsonl``, ... and ``manifest.json``).
        num_shards: Files the training windows are dealt into, round-robin (a multiple of the world size lets
            keel split the stream by shard, not by example).
        shuffle_shards: Reshuffle the shard order every epoch (``seed`` below, then the epoch).
        shuffle_seed: Seed of the shard order.
        *args, **kwargs: :class:`~recipes.charlm.CharDataModule`'s (``block_size``, ``batch_size``, ...).
    """

    def __init__(
        self,
        *args: Any,
        shards_dir: str = "charlm_shards",
        num_shards: int = 8,
        shuffle_shards: bool = True,
        shuffle_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"CharStreamDataModule(num_shards={num_shards!r}): expected an int >= 1.")
        self.shards_dir = Path(shards_dir)
        self.num_shards, self.shuffle_shards, self.shuffle_seed = num_shards, shuffle_shards, shuffle_seed

    def _manifest(self) -> dict[str, Any]:
        return {
            "files": self.files.get("train", []),
            "block_size": self.block_size,
            "stride": self.train_stride,
            "num_shards": self.num_shards,
            "max_chars": self.max_chars,
            "split_seed": self.split_seed,
        }

    def prepare_data(self) -> None:
        """Write the training windows into shards (local rank 0, before every rank's ``setup``)."""
        super().setup("fit")
        manifest = self.shards_dir / "manifest.json"
        if manifest.is_file() and json.loads(manifest.read_text()) == self._manifest():
            return
        self.shards_dir.mkdir(parents=True, exist_ok=True)
        data, span = self.splits["train"], len(self.splits["train"]) - self.block_size
        files = [open(self.shards_dir / f"part-{k:05d}.jsonl", "w") for k in range(self.num_shards)]
        try:
            starts = list(range(0, span - 1, self.train_stride))
            starts = starts[: len(starts) - len(starts) % self.num_shards]  # every shard the same length
            for i, start in enumerate(starts):
                window = data[start : start + self.block_size + 1].tolist()
                files[i % self.num_shards].write(json.dumps({"ids": window}) + "\n")
        finally:
            for f in files:
                f.close()
        manifest.write_text(json.dumps(self._manifest()))  # last: shards without it are rewritten
        log.info("charlm: %d training shards written to %s", self.num_shards, self.shards_dir)

    def train_dataloader(self) -> DataLoader:
        from datasets import load_dataset

        shards = sorted(str(p) for p in self.shards_dir.glob("part-*.jsonl"))
        if not shards:
            raise RuntimeError(f"CharStreamDataModule: no shards in {self.shards_dir}; prepare_data() writes them.")
        stream = load_dataset("json", data_files=shards, split="train", streaming=True)
        if self.shuffle_shards:
            stream = stream.shuffle(seed=self.shuffle_seed, buffer_size=1)
        return DataLoader(stream, batch_size=self.batch_size, num_workers=self.num_workers, collate_fn=collate_windows)
