"""resume_fit.py's fit with ``ModelCheckpoint(async_save=...)`` and faults aimed at the background write.

Always starts with ckpt_path="last". The faults patch DCP's write of this rank's data file
(``FileSystemWriter.write_data``, on DCP's writer thread; its ``path`` is the save's temporary folder
``.<name>.tmp-<8 hex>``). Faults on demand (first attempt only: TORCHELASTIC_RESTART_COUNT == 0 or unset,
and no --resumed):
  --crash-at S          raise on every rank at step S (after that step's save was submitted)
  --sigterm-at S        SIGTERM rank --kill-rank at step S (keel saves synchronously and exits 75)
  --block-write-at S    on rank --kill-rank the background write of step S's save writes half of its data
                        file into the temporary folder, touches OUT/blocked, then blocks forever; at step
                        S + 1 (before that step's save) the rank waits for OUT/blocked and SIGKILLs itself:
                        killed during a background write
  --fail-write-at S     on rank --fail-rank the background write of step S's save sleeps 0.3 s, writes part
                        of its data file, then fails as a full disk does (OSError ENOSPC)
  --slow-write SEC      every background write sleeps SEC first (a save is in flight for a while; always)
Writes OUT/rank{R}.pt with the final weights when the fit completes; OUT/error{R}.json (the step and the
error) when the fit raises; OUT/restart{N}.json (rank 0: the checkpoint folder's entries, the pointer and
the files of every temporary folder) when attempt N > 0 of torchrun --max-restarts starts.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/harness/scripts
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch
from resume_fit import Classifier, CrashAfterSave, data
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.data import DataLoader

from trainer import Callback, Trainer
from trainer.checkpoint.files import read_pointer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def snapshot(ckpt_dir: Path) -> dict:
    """What a new attempt finds in the checkpoint folder (before it saves anything)."""
    entries = sorted(os.listdir(ckpt_dir)) if ckpt_dir.is_dir() else []
    return {
        "entries": entries,
        "pointer": read_pointer(ckpt_dir) if ckpt_dir.is_dir() else None,
        "temporary": {
            name: sorted(os.listdir(ckpt_dir / name))
            for name in entries
            if ".tmp-" in name and (ckpt_dir / name).is_dir()
        },
    }


class Faults(Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.first_attempt = restart_count() == 0 and not args.resumed

    def setup(self, trainer, task, stage) -> None:
        args, rank = self.args, trainer.global_rank
        if restart_count() > 0 and rank == 0:
            record = Path(args.out) / f"restart{restart_count()}.json"
            record.write_text(json.dumps(snapshot(Path(args.ckpt_dir))))
        original = FileSystemWriter.write_data

        def write_data(writer, plan, planner):
            background = threading.current_thread() is not threading.main_thread()
            folder = Path(writer.path)
            if background and self.first_attempt and rank == args.kill_rank:
                if f"-step={args.block_write_at}.ckpt.tmp-" in folder.name:
                    with open(folder / f"__{rank}_0.distcp", "wb") as handle:  # half a data file
                        handle.write(b"PK\x03\x04" + os.urandom(4096))
                        handle.flush()
                        os.fsync(handle.fileno())
                    (Path(args.out) / "blocked").touch()
                    threading.Event().wait()  # never returns: the process is SIGKILLed meanwhile
            if background and self.first_attempt and rank == args.fail_rank:
                if f"-step={args.fail_write_at}.ckpt.tmp-" in folder.name:
                    time.sleep(0.3)  # this rank fails late: the other rank's write is done by then
                    with open(folder / f"__{rank}_0.distcp", "wb") as handle:
                        handle.write(b"\0" * 1000)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if background and args.slow_write:
                time.sleep(args.slow_write)
            return original(writer, plan, planner)

        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if not (trainer.optimizer_stepped and self.first_attempt):
            return
        step, mine = trainer.global_step, trainer.global_rank == self.args.kill_rank
        if step == self.args.sigterm_at and mine:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.args.block_write_at > 0 and step == self.args.block_write_at + 1 and mine:
            marker, deadline = Path(self.args.out) / "blocked", time.monotonic() + 60
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--sync", action="store_true", help="async_save=False (the reference)")
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--sigterm-at", type=int, default=-1)
    parser.add_argument("--block-write-at", type=int, default=-1)
    parser.add_argument("--fail-write-at", type=int, default=-1)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--slow-write", type=float, default=0.0)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--resumed", action="store_true", help="a manual second run: inject no faults")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    checkpoint = ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=1, save_top_k=1, async_save=not args.sync)
    callbacks = [Faults(args), checkpoint, CrashAfterSave(args)]
    trainer = Trainer(
        max_steps=args.steps,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        log_every_n_steps=3,
        preemption_check_interval=2,
        callbacks=callbacks,
        seed=7,
    )
    task = Classifier()
    try:
        trainer.fit(
            task,
            DataLoader(data(), batch_size=4, shuffle=True),
            DataLoader(data(20, 1), batch_size=5),
            ckpt_path="last",
        )
    except Exception as exc:
        error = {"step": trainer.global_step, "type": type(exc).__name__, "message": str(exc)}
        (Path(args.out) / f"error{trainer.global_rank}.json").write_text(json.dumps(error))
        raise
    assert not checkpoint._checkpointer.in_flight
    torch.save(
        {
            "weights": task.state_dict(),
            "step": trainer.global_step,
            "optimizer": trainer.optimizers[0].state_dict()["state"],
            "best": checkpoint.best_model_path,
            "last": checkpoint.last_model_path,
            "seen": task.seen,
        },
        Path(args.out) / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
