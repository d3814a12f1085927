"""Count host-device syncs and collectives per micro-batch of a fit (run under torchrun, 2 ranks).

Writes OUT/rank{R}.json: a list of windows, one per micro-batch, with the global step after it, the
host syncs (.item/.cpu/bool/.tolist/float/int/.numpy), Python-level collectives, and DDP gradient
all-reduces (bucket count, from a communication hook) that happened between the start of that
micro-batch and the start of the next.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/

import torch.distributed as tdist
from models import Regression, quiet, regression_data
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

from trainer import Callback, Trainer
from trainer.distributed import strategy as ddp_strategy

SYNC_OPS = {"item", "cpu", "__bool__", "tolist", "__float__", "__int__", "numpy"}
COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "send",
    "recv",
]
counts: Counter[str] = Counter()


class CountSyncs(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        # keel's host buffers (the preemption flags, copied to the host without waiting and read a step later) hold
        # host values: reading them is not a device read
        if name in SYNC_OPS and not getattr(args[0] if args else None, "keel_host_buffer", False):
            counts["sync:" + name] += 1
        return func(*args, **(kwargs or {}))


def count_collective(name: str):
    original = getattr(tdist, name)

    def wrapped(*args, **kwargs):
        counts["collective:" + name] += 1
        return original(*args, **kwargs)

    return wrapped


for _name in COLLECTIVES:
    setattr(tdist, _name, count_collective(_name))


_setup = ddp_strategy.DDPStrategy.setup


def counting_setup(self, task, *, manual):
    """keel's DDP registers no communication hook (the preemption flags ride on a parameter's gradient): the bucket
    all-reduces are counted by a hook that does what DDP does without one (divide, all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = _setup(self, task, manual=manual)

    def counting_allreduce(state, bucket):
        counts["ddp_allreduce"] += 1
        future = allreduce_hook(state, bucket)
        counts["collective:all_reduce"] -= 1  # the hook's own all_reduce is DDP's
        return future

    if self.ddp is not None:
        self.ddp.register_comm_hook(None, counting_allreduce)
    return model


ddp_strategy.DDPStrategy.setup = counting_setup


class Windows(Callback):
    def __init__(self) -> None:
        self.windows: list[dict] = []
        self.mark: Counter[str] = Counter()

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        if self.windows:
            self.windows[-1]["counts"] = dict(counts - self.mark)
        self.mark = Counter(counts)
        self.windows.append({"batch_idx": batch_idx, "step_before": trainer.global_step})

    def on_train_end(self, trainer, task) -> None:
        self.windows[-1]["counts"] = dict(counts - self.mark)


class LoggingTask(Regression):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)  # self.log("train/loss", loss) every micro-batch
        self.log("train/other", loss * 2, prog_bar=True)
        return loss


def main() -> None:
    out = Path(sys.argv[1])
    windows = Windows()
    trainer = Trainer(**quiet(max_steps=12, accumulate_grad_batches=2, log_every_n_steps=4, callbacks=[windows]))
    with CountSyncs():
        trainer.fit(LoggingTask(), DataLoader(regression_data(256), batch_size=4))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(windows.windows))


if __name__ == "__main__":
    main()
