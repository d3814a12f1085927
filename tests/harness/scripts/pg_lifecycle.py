"""Process-group lifecycle under torchrun: created on first use, still usable after a caught exception,
destroyed at interpreter exit, also when an exception ends the script (``--uncaught``)."""

from __future__ import annotations

import atexit
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch.distributed as tdist
from models import Regression, quiet, regression_data
from torch.utils.data import DataLoader

from trainer import Trainer


class Failing(Regression):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("boom at step 2")
        return super().training_step(batch, batch_idx)


def say(msg: str) -> None:
    sys.stdout.write(f"rank {tdist.get_rank() if tdist.is_initialized() else '?'} {msg}\n")
    sys.stdout.flush()


def main() -> None:
    assert not tdist.is_initialized()
    # atexit runs the last-registered handler first: registered before keel's, this one runs after it.
    atexit.register(lambda: sys.stdout.write(f"initialized at exit: {tdist.is_initialized()}\n"))
    trainer = Trainer(**quiet(max_epochs=1))
    if "--uncaught" in sys.argv:
        trainer.fit(Failing(), DataLoader(regression_data(), batch_size=8))
    try:
        trainer.fit(Failing(), DataLoader(regression_data(), batch_size=8))
    except RuntimeError as exc:
        sys.stdout.write(f"caught {exc}; initialized after exception: {tdist.is_initialized()}\n")
    trainer = Trainer(**quiet(max_epochs=1))
    trainer.fit(Regression(), DataLoader(regression_data(), batch_size=8))
    say(f"initialized after fit: {tdist.is_initialized()} world {tdist.get_world_size()}")


if __name__ == "__main__":
    main()
