"""Hook signatures as Lightning calls them (issue 23, item 2): the evaluation and predict batch hooks get
``dataloader_idx`` only when the stage has several dataloaders, for the task's hooks and every callback's.

The expected calls and messages are Lightning 2.6.6's, measured with the reference install: with one loader
``on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx)``; with two, one more positional
argument (0, then 1); a module hook or step that cannot take that call raises Lightning's RuntimeError before
the run; a callback that cannot take it fails in Lightning with Python's TypeError, in keel with a RuntimeError
naming the hook and the fix, also before the run.

Also ``trainer.callback_metrics`` / ``logged_metrics`` / ``progress_bar_metrics`` per stage (item 6): each stage
starts them empty, as Lightning 2.6.6 does (measured contents below).
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import pytest
import torch
from models import quiet
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import callbacks.lightning as L
from trainer import Callback, TaskModule, Trainer

# (stage method, hook, whether the hook takes `outputs` first)
HOOKS = [
    ("validate", "on_validation_batch_start", False),
    ("validate", "on_validation_batch_end", True),
    ("test", "on_test_batch_start", False),
    ("test", "on_test_batch_end", True),
    ("predict", "on_predict_batch_start", False),
    ("predict", "on_predict_batch_end", True),
]
PREFIX = {"validate": "val", "test": "test", "predict": "predict"}


def data(n: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 3), torch.randn(n, 1)), batch_size=2)  # 2 batches


class Task(TaskModule):
    """Lightning's documented step signatures (``dataloader_idx=0``), so only the hooks under test vary."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        pass

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        pass

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def hook_fn(calls: list, form: str, *, outputs: bool, callback: bool) -> Any:
    """A hook as a Lightning user writes it, a real ``def``: ``form`` is "none" (no dataloader_idx), "required"
    or "default" (``dataloader_idx=0``). It records ``(batch_idx,)`` or ``(batch_idx, dataloader_idx)``."""
    lead = ["trainer", "pl_module"] * callback + ["outputs"] * outputs + ["batch", "batch_idx"]
    tail = {"none": "", "required": ", dataloader_idx", "default": ", dataloader_idx=0"}[form]
    record = "(batch_idx,)" if form == "none" else "(batch_idx, dataloader_idx)"
    namespace: dict[str, Any] = {"calls": calls}
    exec(f"def hook(self, {', '.join(lead)}{tail}):\n    calls.append({record})\n", namespace)
    return namespace["hook"]


def make(hook: str, form: str, *, outputs: bool) -> tuple[Task, Callback, list, list]:
    """A task and a callback (both subclasses, as users write them) whose ``hook`` has the signature ``form``."""
    task_calls: list = []
    cb_calls: list = []
    task_cls = type("T", (Task,), {hook: hook_fn(task_calls, form, outputs=outputs, callback=False)})
    cb_cls = type("C", (L.Callback,), {hook: hook_fn(cb_calls, form, outputs=outputs, callback=True)})
    return task_cls(), cb_cls(), task_calls, cb_calls


def run(stage: str, task: TaskModule, cb: Callback, loaders: Any) -> Any:
    return getattr(Trainer(**quiet(callbacks=[cb])), stage)(task, loaders)


@pytest.mark.parametrize(("stage", "hook", "outputs"), HOOKS)
def test_lightning_signature_without_dataloader_idx_runs_with_one_loader(stage: str, hook: str, outputs: bool) -> None:
    task, cb, task_calls, cb_calls = make(hook, "none", outputs=outputs)
    run(stage, task, cb, data())
    # Lightning 2.6.6: (batch, batch_idx) for each of the 2 batches, no dataloader_idx.
    assert task_calls == cb_calls == [(0,), (1,)]


@pytest.mark.parametrize(("stage", "hook", "outputs"), HOOKS)
def test_two_loaders_pass_dataloader_idx_positionally(stage: str, hook: str, outputs: bool) -> None:
    task, cb, task_calls, cb_calls = make(hook, "required", outputs=outputs)
    run(stage, task, cb, [data(), data()])
    # Lightning 2.6.6: (batch_idx, dataloader_idx) = (0, 0), (1, 0), then (0, 1), (1, 1).
    assert task_calls == cb_calls == [(0, 0), (1, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize(("stage", "hook", "outputs"), HOOKS)
@pytest.mark.parametrize("loaders", [1, 2])
def test_dataloader_idx_default_works_with_one_and_two_loaders(
    stage: str, hook: str, outputs: bool, loaders: int
) -> None:
    task, cb, task_calls, cb_calls = make(hook, "default", outputs=outputs)
    run(stage, task, cb, data() if loaders == 1 else [data(), data()])
    expected = [(0, 0), (1, 0)] + ([(0, 1), (1, 1)] if loaders == 2 else [])
    assert task_calls == cb_calls == expected


def test_varargs_callback_gets_what_lightning_passes() -> None:
    seen: list = []

    class Spy(L.Callback):
        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, *args, **kwargs):
            seen.append((batch_idx, args, kwargs))

    trainer = Trainer(**quiet(callbacks=[Spy()]))
    trainer.validate(Task(), [data(), data()])
    trainer.validate(Task(), data())
    # Lightning 2.6.6: positional, never a keyword; nothing extra with one loader.
    assert seen == [(0, (0,), {}), (1, (0,), {}), (0, (1,), {}), (1, (1,), {}), (0, (), {}), (1, (), {})]


@pytest.mark.parametrize(("stage", "hook", "outputs"), HOOKS)
def test_task_hook_without_dataloader_idx_and_two_loaders_raises_lightnings_error(
    stage: str, hook: str, outputs: bool
) -> None:
    task, _, task_calls, _ = make(hook, "none", outputs=outputs)
    # Lightning 2.6.6's message (its _verify_dataloader_idx_requirement), raised before any batch runs.
    message = (
        f"You provided multiple `{PREFIX[stage]}_dataloader`, but no `dataloader_idx` argument in `T.{hook}()`. "
        "Try adding `dataloader_idx=0` to its signature."
    )
    with pytest.raises(RuntimeError) as info:
        getattr(Trainer(**quiet()), stage)(task, [data(), data()])
    assert str(info.value) == message and task_calls == []


@pytest.mark.parametrize(("stage", "hook", "outputs"), HOOKS)
def test_task_hook_requiring_dataloader_idx_with_one_loader_raises_lightnings_error(
    stage: str, hook: str, outputs: bool
) -> None:
    task, _, _, _ = make(hook, "required", outputs=outputs)
    message = (
        f"You provided only a single `{PREFIX[stage]}_dataloader`, but have included `dataloader_idx` in "
        f"`T.{hook}()`. Either remove the argument or give it a default value i.e. `dataloader_idx=0`."
    )
    with pytest.raises(RuntimeError) as info:
        getattr(Trainer(**quiet()), stage)(task, data())
    assert str(info.value) == message


@pytest.mark.parametrize(("stage", "hook", "outputs"), HOOKS)
def test_callback_that_cannot_take_the_call_is_named_before_the_run(stage: str, hook: str, outputs: bool) -> None:
    started: list[str] = []
    for form, loaders, fix in (("none", [data(), data()], "Add `dataloader_idx=0`"), ("required", data(), "default")):
        _, cb, _, cb_calls = make(hook, form, outputs=outputs)
        cb.on_validation_start = cb.on_test_start = cb.on_predict_start = lambda *a: started.append("start")
        # Lightning 2.6.6 calls the hook and fails with Python's TypeError; keel names it first.
        with pytest.raises(RuntimeError, match=f"C.{hook}.*{fix}"):
            run(stage, Task(), cb, loaders)
        assert cb_calls == [] and started == []


def test_steps_follow_lightnings_dataloader_idx_rules() -> None:
    class NoIdx(Task):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            pass

    class Required(Task):
        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> torch.Tensor:
            return self.net(batch[0])

    trainer = Trainer(**quiet())
    trainer.validate(NoIdx(), data())  # one loader: no dataloader_idx needed
    # Lightning 2.6.6's messages.
    with pytest.raises(RuntimeError, match=r"multiple `val_dataloader`, but no `dataloader_idx` argument in `NoIdx"):
        trainer.validate(NoIdx(), [data(), data()])
    with pytest.raises(RuntimeError, match=r"only a single `predict_dataloader`, but have included `dataloader_idx`"):
        trainer.predict(Required(), data())
    assert [len(p) for p in trainer.predict(Required(), [data(), data()])] == [2, 2]


def test_default_predict_step_takes_several_loaders() -> None:
    """keel's default ``predict_step`` (``self(batch)``), like Lightning's, with two predict loaders."""

    class Forward(TaskModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)

        def forward(self, batch: Any) -> torch.Tensor:
            return self.net(batch[0])

    out = Trainer(**quiet()).predict(Forward(), [data(), data(6)])
    assert [len(p) for p in out] == [2, 3] and out[1][2].shape == (2, 1)


def test_fit_validation_and_sanity_check_pass_dataloader_idx() -> None:
    task, cb, task_calls, cb_calls = make("on_validation_batch_end", "required", outputs=True)
    Trainer(**quiet(callbacks=[cb], max_epochs=1, num_sanity_val_steps=1)).fit(task, data(), [data(), data()])
    sanity = [(0, 0), (0, 1)]  # one batch of each loader
    assert task_calls == cb_calls == sanity + [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_training_batch_hooks_take_no_dataloader_idx() -> None:
    """Lightning 2.6.6: ``on_train_batch_start(batch, batch_idx)``, ``on_train_batch_end(outputs, batch,
    batch_idx)`` (callbacks: ``trainer, pl_module`` first), never a dataloader_idx."""
    calls: list = []

    class T(Task):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            calls.append(("task.start", batch_idx))

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            calls.append(("task.end", batch_idx))

    class C(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            calls.append(("cb.start", batch_idx))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            calls.append(("cb.end", batch_idx))

    Trainer(**quiet(callbacks=[C()], max_epochs=1)).fit(T(), data())
    assert calls == [(f"{who}.{when}", i) for i in (0, 1) for when in ("start", "end") for who in ("task", "cb")]


# Lightning 2.6.6's base signatures (parameter names after self; None: no default), read from its source.
LIGHTNING_MODULE_HOOKS = {
    "on_train_batch_start": [("batch", None), ("batch_idx", None)],
    "on_train_batch_end": [("outputs", None), ("batch", None), ("batch_idx", None)],
    **{
        f"on_{stage}_batch_start": [("batch", None), ("batch_idx", None), ("dataloader_idx", 0)]
        for stage in ("validation", "test", "predict")
    },
    **{
        f"on_{stage}_batch_end": [("outputs", None), ("batch", None), ("batch_idx", None), ("dataloader_idx", 0)]
        for stage in ("validation", "test", "predict")
    },
}


@pytest.mark.parametrize("hook", sorted(LIGHTNING_MODULE_HOOKS))
def test_base_hook_signatures_match_lightning(hook: str) -> None:
    def params(fn: Any, skip: int) -> list[tuple[str, Any]]:
        found = list(inspect.signature(fn).parameters.values())[skip:]
        return [(p.name, None if p.default is p.empty else p.default) for p in found]

    assert params(getattr(TaskModule, hook), 1) == LIGHTNING_MODULE_HOOKS[hook]
    # Callbacks: (self, trainer, pl_module, ...) in Lightning; keel names the second `task` (positional).
    assert params(getattr(Callback, hook), 3) == LIGHTNING_MODULE_HOOKS[hook]


# ---------------------------------------------------------------------- callback_metrics per stage (item 6)
class Logs(TaskModule):
    """Logs in every stage; lr=0 keeps the weights, so the values are the same in Lightning and keel."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.l(batch[0]), batch[1])
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train_only_epoch", 1.0, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", 2.0, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", 4.0, prog_bar=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.l(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def seeded_data(n: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(n)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


# Lightning 2.6.6, measured (Trainer(max_epochs=1, log_every_n_steps=1, logger=False), the same module, data and
# torch.manual_seed(0) before building it): each stage starts with empty dicts and leaves only its own metrics.
FIT_TRAIN = {"train_loss_epoch": 1.7178, "train_loss_step": 1.3169, "train_only_epoch": 1.0}
LIGHTNING = {
    "fit": {
        "callback_metrics": {"train_loss": 1.7178, **FIT_TRAIN, "val_loss": 2.0},
        "logged_metrics": {**FIT_TRAIN, "val_loss": 2.0},
        "progress_bar_metrics": {"train_loss_epoch": 1.7178, "train_loss_step": 1.3169, "val_loss": 2.0},
    },
    "validate": {name: {"val_loss": 2.0} for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics")},
    "test": {name: {"test_loss": 4.0} for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics")},
    "predict": {name: {} for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics")},
}


def keel_view(trainer: Trainer) -> dict[str, dict[str, float]]:
    """The three dicts as Lightning's would read, less keel's documented additions: ``loss`` (the optimised loss
    keel shows in the progress bar during fit when the task shows nothing there), the ``epoch`` keel sends the
    loggers with each row, and the ``perf/`` metrics of logging steps (docs/slow-runs.md)."""
    view = {}
    for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
        values = getattr(trainer, name)
        view[name] = {
            k: round(float(v), 4) for k, v in values.items() if k not in ("loss", "epoch") and not k.startswith("perf/")
        }
    return view


def test_callback_metrics_hold_the_last_stages_metrics_only() -> None:
    torch.manual_seed(0)
    task = Logs()
    trainer = Trainer(**quiet(max_epochs=1, log_every_n_steps=1))
    assert keel_view(trainer) == {n: {} for n in ("callback_metrics", "logged_metrics", "progress_bar_metrics")}
    trainer.fit(task, seeded_data(), seeded_data())
    assert keel_view(trainer) == LIGHTNING["fit"]
    # keel adds the optimised loss as ``loss`` only for a task that shows nothing of its own in the bar; this one does
    assert "loss" not in trainer.callback_metrics and "loss" not in trainer.progress_bar_metrics
    trainer.validate(task, seeded_data(), verbose=False)
    assert keel_view(trainer) == LIGHTNING["validate"]
    trainer.test(task, seeded_data(), verbose=False)
    assert keel_view(trainer) == LIGHTNING["test"]
    trainer.predict(task, seeded_data())
    assert keel_view(trainer) == LIGHTNING["predict"]
    assert trainer.callback_metrics == {} and trainer.logged_metrics == {}  # nothing at all, "epoch" included


def test_a_reference_kept_to_one_stages_metrics_keeps_them_after_the_next_stage_starts() -> None:
    """lightning-hydra-template's src/train.py, as written there: ``train_metrics = trainer.callback_metrics``,
    then ``trainer.test(...)``, then ``{**train_metrics, **test_metrics}`` is the dict its sweeps optimise. Lightning
    starts each stage with new dicts, so the training values survive the test."""
    torch.manual_seed(0)
    task = Logs()
    trainer = Trainer(**quiet(max_epochs=1, log_every_n_steps=1))
    trainer.fit(task, seeded_data(), seeded_data())
    train_metrics = trainer.callback_metrics
    kept = {
        name: dict(getattr(trainer, name)) for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics")
    }
    references = {name: getattr(trainer, name) for name in kept}
    trainer.test(task, seeded_data(), verbose=False)
    test_metrics = trainer.callback_metrics
    metric_dict = {**train_metrics, **test_metrics}
    assert {k: round(float(v), 4) for k, v in metric_dict.items() if not k.startswith("perf/")} == {
        **LIGHTNING["fit"]["callback_metrics"],
        **LIGHTNING["test"]["callback_metrics"],
    }
    assert references == kept  # every dict of fit, as fit left it
    assert keel_view(trainer) == LIGHTNING["test"]


def test_test_first_then_fit_holds_fits_metrics_only() -> None:
    torch.manual_seed(0)
    task = Logs()
    trainer = Trainer(**quiet(max_epochs=1, log_every_n_steps=1))
    trainer.test(task, seeded_data(), verbose=False)
    assert keel_view(trainer) == LIGHTNING["test"]
    trainer.fit(task, seeded_data(), seeded_data())
    assert keel_view(trainer) == LIGHTNING["fit"]


def test_step_and_epoch_metric_has_its_plain_name_in_callback_metrics() -> None:
    """Lightning 2.6.6, measured in ``on_train_batch_end`` / ``on_train_epoch_end`` over 2 epochs of 2 batches:
    ``train_loss`` is the latest step value during an epoch, the epoch value after it; never in the loggers' or
    the progress bar's dicts."""
    seen: list = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            seen.append(round(float(trainer.callback_metrics["train_loss"]), 4))

        def on_train_epoch_end(self, trainer, task):
            seen.append(round(float(trainer.callback_metrics["train_loss"]), 4))
            assert "train_loss" not in trainer.progress_bar_metrics and "train_loss" not in trainer.logged_metrics

    torch.manual_seed(0)
    Trainer(**quiet(max_epochs=2, log_every_n_steps=1, callbacks=[Spy()])).fit(Logs(), seeded_data())
    assert seen == [2.1188, 1.3169, 1.7178] * 2


def _optimizer_hooks(manual: bool) -> type[Task]:
    """A task that defines the hooks of automatic optimization (and ``backward``), under automatic or manual
    optimization; a class of its own per call, as keel warns once per class."""

    class Hooks(Task):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not manual

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            if not manual:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return None

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            pass

        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            pass

        def lr_scheduler_step(self, scheduler, metric):
            pass

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            pass

        def backward(self, loss, *args, **kwargs):
            loss.backward()

    return Hooks


@pytest.mark.parametrize("manual", [False, True])
def test_automatic_optimization_hooks_are_warned_only_under_automatic_optimization(manual: bool) -> None:
    """Lightning 2.6.6, the same task fitted for one epoch: under automatic optimization it calls
    ``optimizer_step``, ``optimizer_zero_grad``, ``lr_scheduler_step``, ``configure_gradient_clipping`` and
    ``backward``; under manual optimization only ``backward`` (from ``manual_backward``). keel calls none of them,
    so it warns about those Lightning would have called, and only those."""
    import warnings

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        Trainer(**quiet(max_epochs=1)).fit(_optimizer_hooks(manual)(), data())
    named = sorted(
        str(w.message).split(".")[1].split(" ")[0]
        for w in record
        if "a Lightning hook that keel never calls" in str(w.message)
    )
    automatic = [
        "backward",
        "configure_gradient_clipping",
        "lr_scheduler_step",
        "optimizer_step",
        "optimizer_zero_grad",
    ]
    assert named == (["backward"] if manual else automatic)


# ---------------------------------------------------------------------- stage flags while fit validates
class Augments(Logs):
    """The public tutorial's pattern: augment in on_after_batch_transfer only ``if self.trainer.training``; and the
    flags each step hook sees."""

    def __init__(self) -> None:
        super().__init__()
        self.augmented = 0
        self.seen: dict[str, set[tuple[bool, bool, bool, bool]]] = collections.defaultdict(set)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer.training:
            self.augmented += 1
        return batch

    def _flags(self, hook: str) -> None:
        t = self.trainer
        self.seen[f"{t.state_stage}:{hook}"].add((t.training, t.validating, t.sanity_checking, t.testing))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._flags("training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._flags("validation_step (sanity)" if self.trainer.sanity_checking else "validation_step")
        super().validation_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._flags("test_step")
        super().test_step(batch, batch_idx)


def test_training_is_false_while_fit_validates_so_only_training_batches_are_augmented() -> None:
    """Lightning's flags: ``training`` only in the training loop; ``validating`` in a validation loop, fit's
    included; fit's sanity check is ``sanity_checking`` alone (RunningStage.SANITY_CHECKING)."""
    task = Augments()
    trainer = Trainer(**quiet(max_epochs=2, num_sanity_val_steps=1))
    trainer.fit(task, seeded_data(16), seeded_data(8))
    assert task.augmented == trainer.global_step == 8  # 2 epochs of 4 batches; none of the validation batches
    trainer.validate(task, seeded_data(8), verbose=False)
    trainer.test(task, seeded_data(8), verbose=False)
    #                         (training, validating, sanity_checking, testing)
    assert dict(task.seen) == {
        "fit:training_step": {(True, False, False, False)},
        "fit:validation_step (sanity)": {(False, False, True, False)},
        "fit:validation_step": {(False, True, False, False)},
        "validate:validation_step": {(False, True, False, False)},
        "test:test_step": {(False, False, False, True)},
    }
