"""The loop's position in a run: :class:`TrainState`, owned by the Trainer and saved with every checkpoint.

The Trainer's ``global_step`` and ``current_epoch`` (Lightning's names) read it; the loop is the only writer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Step, epoch, whether the epoch had finished, and the data cursor of the epoch.

    ``data_parallel_size`` (the replicas that split the data) and ``global_batch`` (the record of
    trainer/data/global_batch.py) describe the layout the cursor counts in; the Trainer sets them before a
    save. :meth:`load_state_dict` restores the counters as saved; :meth:`continue_at` then adapts the cursor
    to this run's layout.
    """

    global_step: int = 0
    current_epoch: int = 0
    epoch_finished: bool = False  # True while on_train_epoch_end runs (a save then resumes at the next epoch)
    samples_done: int = 0  # global sample cursor of current_epoch (all ranks together)
    batches_done: int = 0  # micro-batches of current_epoch already consumed (each rank)
    data_parallel_size: int = 1
    global_batch: dict[str, Any] | None = None
    saved: dict[str, Any] | None = field(default=None, repr=False)  # the loaded record, until continue_at

    def reset(self) -> None:
        """A new fit starts at step 0 (a checkpoint restored after this moves it)."""
        self.global_step = self.current_epoch = self.samples_done = self.batches_done = 0
        self.epoch_finished, self.saved = False, None

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "epoch": self.current_epoch,
            "epoch_finished": self.epoch_finished,
            "samples_consumed": self.samples_done,
            "batches_done": self.batches_done,
            "world_size": self.data_parallel_size,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, loop: dict[str, Any]) -> None:
        self.global_step = int(loop["global_step"])
        if loop["epoch_finished"]:
            self.current_epoch, self.samples_done, self.batches_done = int(loop["epoch"]) + 1, 0, 0
        else:
            self.current_epoch = int(loop["epoch"])
            self.samples_done, self.batches_done = int(loop["samples_consumed"]), int(loop["batches_done"])
        self.saved = dict(loop)

    @property
    def mid_epoch(self) -> bool:
        return self.samples_done > 0 or self.batches_done > 0

    def continue_at(self, *, micro_batch: int | None, replicas: int) -> dict[str, Any] | None:
        """After a restore: keep the batch cursor when the layout is the one saved, else restart the batch
        index from the global sample cursor (which stays exact). Returns the loaded record (None when nothing
        was restored) for the loop's other resume checks."""
        saved, self.saved = self.saved, None
        if saved is None or saved["epoch_finished"]:
            return saved
        per_step = (micro_batch or 1) * replicas
        saved_world = int(saved.get("world_size", replicas))
        if saved_world != replicas or self.samples_done not in (0, self.batches_done * per_step):
            self.batches_done = -(-self.samples_done // per_step)
            log.warning(
                "Checkpoint was saved with %d data-parallel replica(s), resuming on %d (micro-batch %s): the "
                "data cursor resumes at sample %d of epoch %d.",
                saved_world,
                replicas,
                micro_batch,
                self.samples_done,
                self.current_epoch,
            )
        return saved
