"""``Tuner`` under DDP: every rank runs ``lr_find`` on tests/harness/tuner_program.py's program with half the global
batch, then fits a few steps at the suggested rate; ``scale_batch_size`` is refused.

Usage: tuner_ddp.py OUT_DIR BATCH. Writes OUT_DIR/rank{R}.json: the search's learning rates and losses, its
suggestion, the task's rate afterwards, the weights after the fit, and the batch-size search's refusal.
(tests/integration/test_tuner_ddp.py runs the same program in one process with the global batch and compares.)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import tuner_program as program

import callbacks.lightning as L
from callbacks.tuner import Tuner


def main(out: Path, batch: int) -> dict:
    classes = program.build(L)
    L.seed_everything(42, verbose=False)
    model, dm = classes["Net"](), classes["Data"](batch_size=batch)
    trainer = L.Trainer(**program.trainer_kwargs(str(out), max_steps=5))
    tuner = Tuner(trainer)
    finder = tuner.lr_find(model, datamodule=dm)
    assert finder is not None
    result = {
        "world_size": trainer.world_size,
        "strategy": trainer.strategy.name,
        "lrs": finder.results["lr"],
        "losses": finder.results["loss"],
        "suggestion": finder.suggestion(),
        "index": finder._optimal_idx,
        "model_lr": model.hparams.lr,
        "global_step": trainer.global_step,
    }
    trainer.fit(model, datamodule=dm)
    result["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
    try:
        tuner.scale_batch_size(model, datamodule=dm)
    except ValueError as exc:
        result["refusal"] = str(exc)
    return result


if __name__ == "__main__":
    out_dir, batch = Path(sys.argv[1]), int(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(main(out_dir, batch)))
