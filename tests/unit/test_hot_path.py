"""The per-step shortcuts of the training loop (issue: overhead within 5% of a hand-written loop) keep
every behaviour: hooks resolved per epoch are exactly the overridden ones, in order; the non-finite
check's one-number verdict finds the same step as a full search; batch sizes for self.log are still
inferred; torch's own backward/step under the precision plugin; the batch copier's fallbacks."""

from __future__ import annotations

import collections
import math
import os
import sys
import types

import pytest
import torch
from models import Regression, quiet, regression_data
from torch.nn import functional as F
from torch.utils.data import DataLoader

from trainer import Callback, TaskModule, Trainer
from trainer.data.transfer import BatchCopier
from trainer.hooks import TrainHooks, overrides
from trainer.step.nonfinite import NonFiniteGuard
from trainer.step.precision import Precision


class Recorder(Callback):
    def __init__(self, log: list[str], name: str) -> None:
        self.log_, self.name = log, name

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.log_.append(f"{self.name}.end")


class AllHooks(Callback):
    def __init__(self, log: list[str]) -> None:
        self.log_ = log

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        self.log_.append("all.on_train_batch_start")

    def on_before_backward(self, trainer, task, loss) -> None:
        self.log_.append("all.on_before_backward")

    def on_after_backward(self, trainer, task) -> None:
        self.log_.append("all.on_after_backward")

    def on_before_optimizer_step(self, trainer, task, optimizer) -> None:
        self.log_.append("all.on_before_optimizer_step")

    def on_before_zero_grad(self, trainer, task, optimizer) -> None:
        self.log_.append("all.on_before_zero_grad")

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.log_.append("all.on_train_batch_end")


class HookedTask(Regression):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log_ = log

    def on_before_backward(self, loss) -> None:
        self.log_.append("task.before_backward")


def test_only_overridden_hooks_are_resolved_in_calling_order() -> None:
    log: list[str] = []
    task = HookedTask(log)
    first, second, plain = Recorder(log, "first"), Recorder(log, "second"), Callback()
    second.on_after_backward = lambda trainer, t: log.append("second.after_backward (instance)")
    hooks = TrainHooks("trainer", task, [first, plain, second])
    assert len(hooks.on_before_backward) == 1 and hooks.on_before_backward[0] == task.on_before_backward
    assert len(hooks.on_train_batch_end) == 2  # first, second; the plain Callback's no-op is left out
    assert len(hooks.on_after_backward) == 1 and hooks.on_train_batch_start == () and hooks.on_before_zero_grad == ()
    for hook in hooks.on_train_batch_end:
        hook(None, None, 0)
    hooks.on_after_backward[0]()
    assert log == ["first.end", "second.end", "second.after_backward (instance)"]
    assert overrides(object(), Callback, "on_before_zero_grad")  # not a Callback at all: never skipped


def test_a_fit_calls_every_overridden_hook_every_step_in_order() -> None:
    log: list[str] = []
    task = HookedTask(log)
    Trainer(**quiet(max_steps=3, callbacks=[Recorder(log, "cb"), AllHooks(log)])).fit(
        task, DataLoader(regression_data(24), batch_size=8)
    )
    step = [
        "all.on_train_batch_start",
        "task.before_backward",
        "all.on_before_backward",
        "all.on_after_backward",
        "all.on_before_optimizer_step",
        "all.on_before_zero_grad",
        "cb.end",
        "all.on_train_batch_end",
    ]
    assert log == step * 3


def test_a_callback_added_in_on_train_epoch_start_runs_that_epoch() -> None:
    log: list[str] = []

    class Adder(Callback):
        def on_train_epoch_start(self, trainer, task) -> None:
            if trainer.current_epoch == 0:
                trainer.callbacks.append(Recorder(log, "late"))

    Trainer(**quiet(max_epochs=1, callbacks=[Adder()])).fit(Regression(), DataLoader(regression_data(16), batch_size=8))
    assert log == ["late.end", "late.end"]


@pytest.mark.parametrize("bad_at", [None, 0, 37, 1023, 1024, 1500])
def test_nonfinite_check_names_the_first_bad_step_across_folds(bad_at) -> None:
    guard = NonFiniteGuard(enabled=True, world_size=1, device=torch.device("cpu"))
    for step in range(1, 1601):
        value = float("nan") if bad_at is not None and step - 1 in (bad_at, bad_at + 5) else float(step)
        guard.record(step, torch.tensor(value))
    if bad_at is None:
        guard.check("here")
        return
    with pytest.raises(FloatingPointError, match=rf"\(nan\) at step {bad_at + 1} on rank 0 \(caught here"):
        guard.check("here")


def test_finite_losses_whose_sum_overflows_are_not_reported() -> None:
    guard = NonFiniteGuard(enabled=True, world_size=1, device=torch.device("cpu"))
    for step in range(1, 4):
        guard.record(step, torch.tensor(1e308, dtype=torch.float64))
    guard.check("here")  # the sum is inf; the exact search finds every loss finite
    guard.record(4, torch.tensor(math.inf))
    with pytest.raises(FloatingPointError, match=r"\(inf\) at step 4"):
        guard.check("again")


def test_self_log_still_weights_epoch_means_by_the_batch_size() -> None:
    class Sizes(Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("size", float(batch[0].shape[0]), on_step=False, on_epoch=True)  # mean weighted by batch size
            return loss

    trainer = Trainer(**quiet(max_epochs=1))
    trainer.fit(Sizes(), DataLoader(regression_data(20), batch_size=8))  # batches of 8, 8, 4
    assert float(trainer.callback_metrics["size"]) == pytest.approx((8 * 8 + 8 * 8 + 4 * 4) / 20)
    assert trainer._metrics.batch is None  # no batch kept after the stage


def test_plain_precision_binds_torchs_own_backward_and_step() -> None:
    plain, mixed = Precision("32", torch.device("cpu")), Precision("bf16-mixed", torch.device("cpu"))
    assert plain.backward is torch.Tensor.backward and not plain.autocasts and mixed.autocasts
    w = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.SGD([w], lr=1.0)
    plain.backward((w * torch.tensor([1.0, 2.0])).sum())
    plain.optimizer_step(optimizer)
    assert w.tolist() == [-1.0, -2.0]


def test_move_to_the_cpu_skips_loader_batches_but_not_outputs_from_any_device() -> None:
    """A loader's batch headed for the CPU is returned as it is (the hot path); predictions (made on any device)
    are walked and every tensor brought to the CPU (on a GPU: test_gpu_one_process.py)."""
    from trainer.data.transfer import move_to_device

    out = {"y": torch.ones(2), "extra": [torch.zeros(1)]}
    assert move_to_device(out, torch.device("cpu")) is out
    moved = move_to_device(out, torch.device("cpu"), from_any_device=True)
    assert moved is not out and moved["extra"] is not out["extra"] and torch.equal(moved["y"], out["y"])


def test_batch_copier_on_cpu_is_move_to_device() -> None:
    batch = [torch.ones(2), {"y": torch.zeros(2, dtype=torch.float32)}]
    assert BatchCopier(torch.device("cpu"), float_dtype=None, overlap=True)(batch) is batch
    moved = BatchCopier(torch.device("cpu"), float_dtype=torch.float64, overlap=True)(batch)
    assert moved[0].dtype == torch.float64 and moved[1]["y"].dtype == torch.float64


def test_step_adapter_runs_training_step_without_module_dispatch() -> None:
    from trainer.distributed.strategy import StepAdapter

    class Task(TaskModule):
        def training_step(self, batch):  # no batch_idx, as Lightning allows
            return batch * 2

    adapter = StepAdapter(Task())
    adapter.register_forward_pre_hook(lambda *a: pytest.fail("internal adapter: module hooks are not dispatched"))
    assert adapter(torch.tensor(3.0), 0).item() == 6.0


def test_step_adapter_binds_a_training_step_replaced_on_the_instance() -> None:
    from trainer.distributed.strategy import StepAdapter

    task = Regression()
    adapter = StepAdapter(task)
    assert adapter.run_step == task.training_step
    task.training_step = lambda batch, batch_idx: torch.tensor(7.0)  # as FSDP's register_fsdp_forward_method does
    adapter.bind()
    assert adapter(None, 0).item() == 7.0


class _CountHostReads(torch.overrides.TorchFunctionMode):
    READS = {"item", "cpu", "__bool__", "tolist", "__float__", "__int__", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Summed(Regression):
    """A summed loss with ``num_items``: the sample count, as an int or as a tensor (never read by the task)."""

    def __init__(self, as_tensor: bool) -> None:
        super().__init__()
        self.as_tensor = as_tensor

    def training_step(self, batch, batch_idx):
        x, y = batch
        count = torch.tensor(len(x)) if self.as_tensor else len(x)
        return {"loss": F.mse_loss(self(x), y, reduction="sum"), "num_items": count}


@pytest.mark.parametrize("task", ["mean", "num_items int", "num_items tensor"])
def test_a_logging_step_reads_the_host_once_in_one_process(task: str) -> None:
    """The step metrics and the non-finite verdict travel in one device-to-host copy (on CUDA: the
    logging step's only sync); ordinary steps read nothing, token-normalised (num_items) ones included."""
    mode, per_step = _CountHostReads(), []

    class Windows(Callback):
        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
            per_step.append(mode.count)
            mode.count = 0

    trainer = Trainer(**quiet(max_steps=12, log_every_n_steps=4, callbacks=[Windows()]))
    model = Regression() if task == "mean" else _Summed(as_tensor=task.endswith("tensor"))
    with mode:
        trainer.fit(model, DataLoader(regression_data(128), batch_size=8))
    assert per_step[1:] == [0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]  # steps 2..12; the first window holds the setup
    assert set(trainer.callback_metrics) >= ({"loss", "train/loss"} if task == "mean" else {"loss"})


def test_read_to_host_keeps_every_value_exact_in_one_read() -> None:
    from trainer.data.transfer import read_to_host

    assert read_to_host([]) == []
    assert read_to_host([torch.tensor(1.5), torch.tensor(float("nan"))])[0] == 1.5
    assert read_to_host([torch.tensor(2**40 + 1), torch.tensor(1.0)]) == [2.0**40 + 1, 1.0]  # no float32 rounding
    assert read_to_host([torch.ones(2), torch.tensor(0.5, dtype=torch.bfloat16), torch.tensor(True)]) == [
        1.0,
        1.0,
        0.5,
        1.0,
    ]
    assert all(type(v) is float for v in read_to_host([torch.tensor(3), torch.tensor(4)]))


# The calls keel's own code makes in one ordinary training step of the default loop (one process, a plain fp32
# task, no logger, checkpointing or bar, not a logging step): its own functions, and what they call (the task's
# training_step, backward, optimizer.step, the loader's next batch, builtins such as time.perf_counter). A change
# that adds a per-step duty changes this number: decide whether the step may pay for it (docs/performance.md, "The
# per-step budget"), then set the new number here. 39 before the plain epoch (Trainer._plain_epoch).
CALLS_PER_STEP = 18
_KEEL_CODE = (os.sep + "trainer" + os.sep, os.sep + "callbacks" + os.sep)


class CountCalls(Callback):
    """Counts, between the ends of steps ``start`` and ``stop``, every call made from keel's code."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self.calls: collections.Counter[str] = collections.Counter()

    def _profile(self, frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_back is not None and frame.f_back.f_code.co_filename.endswith(".py"):
            caller, name = frame.f_back.f_code, frame.f_code.co_qualname
        elif event == "c_call":
            caller, name = frame.f_code, getattr(arg, "__qualname__", repr(arg))
        else:
            return
        if any(part in caller.co_filename for part in _KEEL_CODE):
            self.calls[f"{caller.co_qualname} -> {name}"] += 1

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.start:
            sys.setprofile(self._profile)
        elif trainer.global_step == self.stop:
            sys.setprofile(None)


class Plain(TaskModule):
    """The tiny config: a linear model, mean-squared error, SGD, and nothing logged."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_an_ordinary_training_step_makes_the_budgeted_number_of_calls() -> None:
    counter = CountCalls(start=20, stop=40)
    trainer = Trainer(**quiet(max_steps=50, log_every_n_steps=1000, callbacks=[counter]))
    try:
        trainer.fit(Plain(), DataLoader(regression_data(1024), batch_size=8))
    finally:
        sys.setprofile(None)
    steps = counter.stop - counter.start
    per_step = sum(counter.calls.values()) / steps
    listing = "\n".join(f"{n / steps:6.2f}  {call}" for call, n in counter.calls.most_common())
    assert per_step == CALLS_PER_STEP, (
        f"keel's code makes {per_step:g} calls per ordinary training step; the budget is {CALLS_PER_STEP} "
        f"(tests/unit/test_hot_path.py). A per-step duty is a decision: make it free on ordinary steps, or "
        f"measure it (python benchmarks/overhead.py), say why it is worth it in docs/performance.md and set the "
        f"budget. The calls:\n{listing}"
    )


def test_a_loss_with_one_value_per_sample_is_refused_with_the_fix() -> None:
    class PerSample(Plain):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return F.mse_loss(self.net(x), y, reduction="none").reshape(-1)

    trainer = Trainer(**quiet(max_steps=1))
    with pytest.raises(ValueError, match=r"got a tensor of shape \(8,\) .* Return its mean \(loss.mean\(\)\)"):
        trainer.fit(PerSample(), DataLoader(regression_data(16), batch_size=8))


class _MixedOutputs(Regression):
    """A scalar loss on even batches, a dict on odd ones (the plain epoch's fallback), a scheduler, hooks and
    self.log: every branch of the plain epoch."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(scheduler="step")
        self.log_ = log

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss if batch_idx % 2 == 0 else {"loss": loss, "extra": batch_idx}

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.log_.append(f"start {batch_idx}")

    def on_after_backward(self) -> None:
        self.log_.append("after_backward")


@pytest.mark.parametrize("plain", [True, False])
def test_the_plain_epoch_trains_exactly_as_the_general_loop(plain: bool, monkeypatch) -> None:
    """The same fit through the plain epoch and, with it turned off, through the general loop: the same weights to
    the bit, the same hooks in the same order with the same outputs, the same metrics and validation."""
    runs_plain = Trainer._runs_plain

    def fit(use_plain: bool):
        decided: list[bool] = []

        def decide(self, plan):  # type: ignore[no-untyped-def]
            decided.append(runs_plain(self, plan))
            return decided[-1] and use_plain

        monkeypatch.setattr(Trainer, "_runs_plain", decide)
        log: list[str] = []

        class Outputs(Callback):
            def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
                log.append(f"end {batch_idx} {sorted(outputs)} {float(outputs['loss']):.6f} {trainer.global_step}")

        task = _MixedOutputs(log)
        trainer = Trainer(**quiet(max_epochs=2, log_every_n_steps=2, val_check_interval=3, callbacks=[Outputs()]))
        trainer.fit(task, DataLoader(regression_data(56), batch_size=8), DataLoader(regression_data(16), batch_size=8))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith("perf/")}  # timings
        assert "perf/steps_per_s" in trainer.callback_metrics  # the phase clock was read either way
        return task.state_dict(), log, metrics, decided, (trainer.global_step, trainer.state.batches_done)

    weights, log, metrics, decided, counters = fit(plain)
    general_weights, general_log, general_metrics, _, general_counters = fit(False)
    assert decided == [True, True]  # both epochs qualify; the general run turned it off
    assert all(torch.equal(weights[k], general_weights[k]) for k in weights)
    assert log == general_log and metrics == general_metrics and counters == general_counters == (14, 0)
    assert "val/loss" in metrics and log.count("after_backward") == 14
    assert sum(entry.startswith("end") and "'extra'" in entry for entry in log) == 6  # dicts reached the hooks


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("accumulate_grad_batches", 2),
        ("gradient_clip_val", 1.0),
        ("precision", "bf16-mixed"),
        ("on_nonfinite", "skip"),
        ("watchdog_timeout", 60.0),
    ],
)
def test_the_plain_epoch_is_left_for_the_general_loop_when_a_step_needs_more(option: str, value, monkeypatch) -> None:
    decided: list[bool] = []
    runs_plain = Trainer._runs_plain
    monkeypatch.setattr(Trainer, "_runs_plain", lambda self, plan: decided.append(runs_plain(self, plan)) or False)
    Trainer(**quiet(max_steps=2, **{option: value})).fit(Plain(), DataLoader(regression_data(32), batch_size=8))
    assert decided == [False]


def test_the_carrying_adapter_holds_its_ddp_weakly_so_refcounting_frees_it() -> None:
    """DDP's adapter reads whether the micro-batch syncs from the DDP around it. Held as a module attribute, DDP
    became a submodule of its own module: a cycle only the garbage collector breaks, which then freed DDP's reducer
    at interpreter exit while a gloo thread waited for the GIL (2-rank runs hung at exit). Here a stand-in wrapper
    holds the adapter as DDP does; with the collector off, dropping it must free it."""
    import gc
    import weakref

    from trainer.distributed.strategy import _CarryingAdapter, _SyncMark

    adapter = _CarryingAdapter(Regression(), _SyncMark(torch.device("cpu")))
    wrapper = torch.nn.Module()
    wrapper.module = adapter
    adapter.attach(wrapper)  # type: ignore[arg-type]
    assert list(adapter.children()) == [adapter.task]
    gc.disable()
    try:
        alive = weakref.ref(wrapper)
        del wrapper
        assert alive() is None
    finally:
        gc.enable()
