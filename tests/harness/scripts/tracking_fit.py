"""A fit that logs every step to MLflow (SQLite) and W&B (offline) under any launcher, checkpointing every
step and always starting with ckpt_path="last".

  tracking_fit.py ROOT [--steps N] [--kill-at S] [--kill-rank R]

Writes runs under ROOT/runs (run directory ROOT/runs/exp/version_N, MLflow store ROOT/runs/mlflow.db).
--kill-at S SIGKILLs rank R at step S on the first attempt (TORCHELASTIC_RESTART_COUNT 0), after that step
was logged (at S-1, Lightning's axis) and before its checkpoint, so the restart re-runs step S. It first waits
(at most --kill-delay seconds, default 30) until W&B's run file holds step S-1's row (logged at S-2; W&B flushes
it every trainer.loggers.wandb.FLUSH_INTERVAL seconds), as it would in a run killed mid-training; step S's row
itself is still in W&B's memory (a row is written once a later step is logged) and dies with the process.
--kill-signal TERM sends SIGTERM instead: keel's preemption path saves at the step boundary and exits 75.
At the end rank 0 writes ROOT/result-attempt<K>.json: the run ids and the run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/harness/scripts

import torch
from resume_fit import Classifier, data
from torch.utils.data import DataLoader

from trainer import Callback, Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.loggers import MLFlowLogger, WandbLogger, wandb_records


class KillAt(Callback):
    def __init__(self, step: int, rank: int, delay: float, sig: signal.Signals) -> None:
        self.step, self.rank, self.delay, self.sig = step, rank, delay, sig

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (
            first
            and trainer.optimizer_stepped
            and trainer.global_step == self.step
            and trainer.global_rank == self.rank
        ):
            self._wait_for_wandb(trainer, self.step - 2)  # step S - 1, logged at S - 2
            os.kill(os.getpid(), self.sig)

    def _wait_for_wandb(self, trainer, step: int) -> None:
        """Up to --kill-delay seconds until W&B's run file holds ``step`` (it flushes every second)."""
        wandb_logger = next((lg for lg in trainer.loggers if isinstance(lg, WandbLogger)), None)
        deadline = time.monotonic() + self.delay
        while wandb_logger is not None and time.monotonic() < deadline:
            files = WandbLogger._run_files(wandb_logger.log_dir, wandb_logger.run_id)
            if wandb_records.last_steps(files).get("train/loss", -1) >= step:
                return
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--kill-delay", type=float, default=30.0)
    parser.add_argument(
        "--kill-signal",
        choices=("KILL", "TERM"),
        default="KILL",
        help="TERM: keel's preemption path (save at the step boundary, exit 75, restart)",
    )
    args = parser.parse_args()
    root = Path(args.root)
    loggers = [
        MLFlowLogger(experiment_name="exp", save_dir=root / "runs"),
        WandbLogger(project="exp", save_dir=root / "runs", offline=True),
    ]
    kill = KillAt(args.kill_at, args.kill_rank, args.kill_delay, getattr(signal, f"SIG{args.kill_signal}"))
    callbacks = [kill, ModelCheckpoint(every_n_train_steps=1, save_top_k=1)]
    trainer = Trainer(
        max_steps=args.steps,
        logger=loggers,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=callbacks,
        seed=7,
    )
    task = Classifier()
    torch.manual_seed(0)
    trainer.fit(
        task, DataLoader(data(32), batch_size=4, shuffle=True), DataLoader(data(8, 1), batch_size=4), ckpt_path="last"
    )
    if trainer.is_global_zero:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        result = {
            "mlflow": loggers[0].run_id,
            "wandb": loggers[1].run_id,
            "run_dir": trainer.log_dir,
            "tracking_uri": loggers[0].tracking_uri,
            "world_size": trainer.world_size,
        }
        (root / f"result-attempt{attempt}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
