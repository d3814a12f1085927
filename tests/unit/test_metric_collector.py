"""Lightning-style ``self.log`` in one process: metric objects (duck-typed and torchmetrics), reduce_fx,
rank_zero_only.

Cross-rank rules are checked here with a simulated world (one MetricCollector per "rank" in a thread,
``all_gather_object`` replaced by a thread barrier: fast, exact); on 2 real ranks
(``tests/harness/scripts/lightning_port_ddp.py``) in tests/integration/test_metrics_objects.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from models import Regression, quiet, regression_data
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer import Callback, TaskModule, Trainer
from trainer import metrics as metrics_mod
from trainer.metrics import MetricCollector, is_metric_object

# ---------------------------------------------------------------------------- helpers


class CountingMean:
    """A metric object without torchmetrics: ``update`` / ``compute`` / ``reset``, calls counted."""

    def __init__(self) -> None:
        self.compute_calls = 0
        self.reset_calls = 0
        self.total, self.count = 0.0, 0

    def update(self, values: torch.Tensor) -> None:
        self.total += float(values.double().sum())
        self.count += values.numel()

    def compute(self) -> torch.Tensor:
        self.compute_calls += 1
        return torch.tensor(self.total / self.count, dtype=torch.float64)

    def reset(self) -> None:
        self.reset_calls += 1
        self.total, self.count = 0.0, 0


class Fixed:
    """A metric object whose compute() returns a given value (a stand-in for an already-synced metric)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.reset_calls = 0

    def compute(self) -> Any:
        return self.value

    def reset(self) -> None:
        self.reset_calls += 1


class FakeWorld:
    """``n`` simulated ranks, one thread each; ``dist.all_gather_object`` gathers across the threads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=10)
        self.slots: list[Any] = [None] * n
        self.local = threading.local()
        self.calls: list[str] = []  # collectives, as seen by the ranks (each appends its own)

    def _gather(self, obj: Any) -> list[Any]:
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.calls.append("all_gather_object")
        return self._gather(obj)

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.calls.append("all_gather_tensor")
        return [t.clone() for t in self._gather(tensor)]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert op == "max", op
        self.calls.append("all_reduce")
        tensor.copy_(torch.stack(self._gather(tensor)).max(dim=0).values)
        return tensor

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.n
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # re-raised in the test thread
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        if errors:
            raise errors[0]
        return results


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> FakeWorld:
    w = FakeWorld(2)
    for name in ("all_gather_object", "all_gather_tensor", "all_reduce"):
        monkeypatch.setattr(metrics_mod.comm, name, getattr(w, name))
    monkeypatch.setattr(metrics_mod.comm, "is_initialized", lambda: True)
    monkeypatch.setattr(metrics_mod.comm, "get_world_size", lambda: w.n)
    monkeypatch.setattr(metrics_mod.comm, "is_rank_zero", lambda: w.local.rank == 0)
    monkeypatch.setattr(metrics_mod.comm, "get_rank", lambda: w.local.rank)
    return w


def log(c: MetricCollector, name: str, value: Any, **kw: Any) -> None:
    args = dict(on_step=None, on_epoch=None, prog_bar=False, logger=True, batch_size=None, reduce_fx="mean")
    args.update(kw)
    c.log(name, value, **args)


def forwards_rank_zero_only() -> bool:
    """Whether TaskModule.log passes rank_zero_only on to the collector (the pending module.py patch)."""
    seen: dict = {}
    probe = TaskModule()
    probe._trainer = SimpleNamespace(_metrics=SimpleNamespace(log=lambda name, value, **kw: seen.update(kw)))
    probe.log("probe", 1.0, rank_zero_only=True)
    return seen.get("rank_zero_only") is True


# ---------------------------------------------------------------------------- collector on a simulated world


def test_step_metrics_with_the_same_names_everywhere_take_tensor_collectives(world: FakeWorld) -> None:
    def rank_fn(rank: int):
        c = MetricCollector()
        for fx in ("sum", "max", "min", "mean"):
            log(c, f"s_{fx}", torch.tensor(float(rank + 1)), reduce_fx=fx)
        log(c, "r0", float(100 + rank), rank_zero_only=True)
        local = c.read_step()[0]
        values, _, _, flags = c.exchange_step(local, flags=(float(rank == 1), 0.0), row=(rank + 0.5, 10.0 * rank))
        return values, flags, c.rows

    (r0, f0, rows0), (r1, f1, rows1) = world.run(rank_fn)
    assert r0 == r1 == {"s_sum": 3.0, "s_max": 2.0, "s_min": 1.0, "s_mean": 1.5, "r0": 100.0}
    assert f0 == f1 == [1.0, 0.0]  # the max over ranks of each flag rides along
    assert rows0 == rows1 == [[0.5, 0.0], [1.5, 10.0]]  # and every rank's row (the phase times), in rank order
    # Per rank: one all-reduce (the names' hash, the flags and the rows) and one all-gather of the values.
    assert sorted(world.calls) == ["all_gather_tensor"] * 2 + ["all_reduce"] * 2


def test_step_metrics_with_different_names_fall_back_and_keep_the_flags(world: FakeWorld) -> None:
    def rank_fn(rank: int):
        c = MetricCollector()
        log(c, "shared", float(rank), reduce_fx="sum")
        if rank == 1:
            log(c, "only_rank1", 7.0, reduce_fx="sum")
        values, _, _, flags = c.reduce_step(flags=(0.0, float(rank == 0)))
        return values, flags

    (r0, f0), (r1, f1) = world.run(rank_fn)
    assert r0 == r1 == {"shared": 1.0, "only_rank1": 7.0} and f0 == f1 == [0.0, 1.0]
    assert sorted(world.calls) == ["all_gather_object"] * 2 + ["all_reduce"] * 2


def test_step_metrics_honour_reduce_fx_across_ranks(world: FakeWorld) -> None:
    def rank_fn(rank: int) -> dict[str, float]:
        c = MetricCollector()
        for fx in ("sum", "max", "min", "mean"):
            log(c, f"s_{fx}", torch.tensor(float(rank + 1)), reduce_fx=fx)
        log(c, "s_torch_sum", float(rank + 1), reduce_fx=torch.sum)  # Lightning's callable spelling
        log(c, "r0", float(100 + rank), rank_zero_only=True)
        if rank == 1:
            log(c, "only_rank1", 7.0, reduce_fx="sum")
        return c.reduce_step()[0]

    r0, r1 = world.run(rank_fn)
    assert r0 == r1  # every rank gets the same values
    assert r0 == {
        "s_sum": 3.0,
        "s_max": 2.0,
        "s_min": 1.0,
        "s_mean": 1.5,
        "s_torch_sum": 3.0,
        "r0": 100.0,
        "only_rank1": 7.0,
    }


def test_epoch_metrics_honour_reduce_fx_across_ranks(world: FakeWorld) -> None:
    batches = {0: [(1.0, 1), (2.0, 3)], 1: [(6.0, 2)]}  # (value, batch size) per rank

    def rank_fn(rank: int) -> dict[str, float]:
        c = MetricCollector()
        c.stage = "validate"
        for value, bs in batches[rank]:
            for fx in ("sum", "max", "min", "mean"):
                log(c, f"e_{fx}", torch.tensor(value), reduce_fx=fx, batch_size=bs)
            log(c, "r0", value, batch_size=bs, rank_zero_only=True)
        return c.reduce_epoch()[0]

    r0, r1 = world.run(rank_fn)
    assert r0 == r1
    assert r0["e_sum"] == 9.0 and r0["e_max"] == 6.0 and r0["e_min"] == 1.0
    assert r0["e_mean"] == pytest.approx((1 * 1 + 2 * 3 + 6 * 2) / 6)  # weighted by batch size, all ranks
    assert r0["r0"] == pytest.approx((1 * 1 + 2 * 3) / 4)  # rank 0's own weighted mean only


def test_synced_metric_object_is_not_reduced_again(world: FakeWorld) -> None:
    def rank_fn(rank: int) -> tuple[dict[str, float], dict[str, float]]:
        c = MetricCollector()
        c.stage = "validate"
        count = Fixed(torch.tensor(37.0))  # compute() already returns the global count on every rank
        for _ in range(3):
            log(c, "count", count, reduce_fx="sum")  # reduce_fx does not apply to metric objects
        epoch = c.reduce_epoch()[0]
        c.stage = "train"
        running = Fixed(torch.tensor(5.0))
        log(c, "acc", running, on_step=True, on_epoch=True)
        step = c.reduce_step()[0]
        return epoch, dict(step, **c.reduce_epoch()[0], resets=float(count.reset_calls + running.reset_calls))

    (e0, s0), (e1, s1) = world.run(rank_fn)
    assert e0 == e1 == {"count": 37.0}
    assert s0 == s1 == {"acc_step": 5.0, "acc_epoch": 5.0, "resets": 2.0}


def test_unsynced_metric_object_uses_rank_zero_and_warns(world: FakeWorld, caplog: pytest.LogCaptureFixture) -> None:
    def rank_fn(rank: int) -> dict[str, float]:
        c = MetricCollector()
        c.stage = "validate"
        log(c, "local", Fixed(float(rank + 10)))
        return c.reduce_epoch()[0]

    with caplog.at_level(logging.WARNING, logger="trainer.metrics"):
        r0, r1 = world.run(rank_fn)
    assert r0 == r1 == {"local": 10.0}
    assert "does not sync" in caplog.text and caplog.text.count("'local'") == 1


# ---------------------------------------------------------------------------- collector errors


def test_duck_typing_and_errors() -> None:
    assert is_metric_object(CountingMean()) and not is_metric_object(torch.tensor(1.0))
    assert not is_metric_object(SimpleNamespace(compute=lambda: 1.0))  # no reset(): not a metric object
    c = MetricCollector()
    c.stage = "validate"
    log(c, "m", CountingMean())
    with pytest.raises(ValueError, match="another metric object"):
        log(c, "m", CountingMean())
    with pytest.raises(ValueError, match="metric object under this name"):
        log(c, "m", 1.0)
    log(c, "v", 1.0)
    with pytest.raises(ValueError, match="already logged a value"):
        log(c, "v", CountingMean())
    with pytest.raises(ValueError, match="reduce_fx='median'"):
        log(c, "w", 1.0, reduce_fx="median")
    c.reset()
    log(c, "vec", Fixed(torch.ones(3)))
    with pytest.raises(ValueError, match=r"'vec'.*shape \(3,\).*scalar"):
        c.reduce_epoch()
    log(c, "coll", Fixed({"a": torch.tensor(1.0)}))
    with pytest.raises(ValueError, match="log_dict"):
        c.reduce_epoch()
    with pytest.raises(ValueError, match="metric object"):
        log(c, "obj", object())


# ---------------------------------------------------------------------------- through the Trainer


class DuckTask(Regression):
    """Logs a duck-typed metric object in validation (mean target) and in training (running mean)."""

    def __init__(self) -> None:
        super().__init__(dtype=torch.float64)
        self.val_metric = CountingMean()
        self.train_metric = CountingMean()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.train_metric.update(y)
        self.log("train_mean", self.train_metric, on_step=True, on_epoch=True)
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_metric.update(y)
        self.log("val_mean", self.val_metric)


class Snapshots(Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.validations: list[dict[str, float]] = []
        self.calls: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.is_logging_step:
            self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_validation_epoch_end(self, trainer, task) -> None:
        self.validations.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.calls.append((task.val_metric.compute_calls, task.val_metric.reset_calls))


def test_duck_metric_accumulates_over_batches_and_resets_once_per_epoch() -> None:
    train, val = regression_data(24, dtype=torch.float64), regression_data(23, seed=1, dtype=torch.float64)
    snaps = Snapshots()
    task = DuckTask()
    trainer = Trainer(
        **quiet(max_epochs=3, log_every_n_steps=1, precision="64", num_sanity_val_steps=2, callbacks=[snaps])
    )
    trainer.fit(task, DataLoader(train, batch_size=8), DataLoader(val, batch_size=5))
    val_mean = val.tensors[1].mean().item()
    # Sanity pass (2 batches, not published) + 3 epochs: one compute() and one reset() per evaluation epoch,
    # and each epoch's value covers all 5 batches of that epoch only (it was reset in between).
    assert snaps.calls == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert [v["val_mean"] for v in snaps.validations[1:]] == pytest.approx([val_mean] * 3, rel=1e-12)
    # Training: on_step reads compute() of the running state (everything since the epoch start) at each
    # logging step; the epoch value is the whole epoch; reset once per epoch.
    y = train.tensors[1].view(-1)
    running = [y[: 8 * (i + 1)].mean().item() for i in range(3)]
    assert [s["train_mean_step"] for s in snaps.steps] == pytest.approx(running * 3, rel=1e-12)
    assert trainer.callback_metrics["train_mean_epoch"].item() == pytest.approx(y.mean().item(), rel=1e-12)
    assert task.train_metric.reset_calls == 3 and task.train_metric.compute_calls == 3 * 3 + 3
    # validate() alone: one more compute/reset.
    result = trainer.validate(task, DataLoader(val, batch_size=5))[0]
    assert result["val_mean"] == pytest.approx(val_mean, rel=1e-12)
    assert (task.val_metric.compute_calls, task.val_metric.reset_calls) == (5, 5)


class Classifier(TaskModule):
    def __init__(self, features: int = 6, classes: int = 4) -> None:
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        torch.manual_seed(0)
        self.net = torch.nn.Linear(features, classes)
        self.acc = MulticlassAccuracy(num_classes=classes, average="micro")
        self.macro = MulticlassAccuracy(num_classes=classes, average="macro")

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = self(x).argmax(-1)
        self.acc(preds, y)  # Lightning's idiom: forward updates the state
        self.macro.update(preds, y)
        self.log("val_acc", self.acc)
        self.log_dict({"val_macro": self.macro})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_torchmetrics_accuracy_equals_hand_computed() -> None:
    pytest.importorskip("torchmetrics")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(90, 6, generator=g), torch.randint(0, 4, (90,), generator=g)
    ds = TensorDataset(x, y)
    task = Classifier()
    trainer = Trainer(**quiet(max_epochs=2))
    trainer.fit(task, DataLoader(ds, batch_size=16), DataLoader(ds, batch_size=7))
    result = trainer.validate(task, DataLoader(ds, batch_size=7))[0]
    with torch.no_grad():
        preds = task(x).argmax(-1)
    accuracy = (preds == y).double().mean().item()
    per_class = [(preds[y == k] == k).double().mean().item() for k in range(4)]
    assert result["val_acc"] == pytest.approx(accuracy, abs=1e-6)
    assert result["val_macro"] == pytest.approx(sum(per_class) / 4, abs=1e-6)
    assert 0.0 < accuracy < 1.0  # a real check, not a degenerate one


def test_task_log_forwards_rank_zero_only() -> None:
    if not forwards_rank_zero_only():
        pytest.skip("pending the trainer/module.py patch: TaskModule.log must forward rank_zero_only")
    assert forwards_rank_zero_only()
