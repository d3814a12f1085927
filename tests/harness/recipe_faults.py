"""Test-only callbacks that ``recipes.train`` runs from the command line (tests/ on PYTHONPATH)::

    KEEL_TEST_KILL_AT_STEP=3 python -m recipes.train +callbacks.killer._target_=recipe_faults.KillAtStep

Nothing in keel imports this module.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from trainer import Callback

KILL_AT_STEP = "KEEL_TEST_KILL_AT_STEP"  # optimizer step after which the process SIGKILLs itself
KILL_RANK = "KEEL_TEST_KILL_RANK"  # global rank that dies (default 0 in one process, 1 under torchrun)


class KillAtStep(Callback):
    """SIGKILLs its own process right after optimizer step ``$KEEL_TEST_KILL_AT_STEP``: a crash that
    leaves no chance to clean up or to save.

    Only on the rank ``$KEEL_TEST_KILL_RANK`` and only in the first attempt of a torchrun job
    (``TORCHELASTIC_RESTART_COUNT`` 0 or unset), so the restarted job runs to the end. Inert when the
    variable is unset.
    """

    def __init__(self) -> None:
        value = os.environ.get(KILL_AT_STEP)
        self.step = int(value) if value else None

    def on_train_batch_end(self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.step is None or not trainer.optimizer_stepped or trainer.global_step != self.step:
            return
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        victim = int(os.environ.get(KILL_RANK, "1" if trainer.world_size > 1 else "0"))
        if trainer.global_rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
