"""The hook order that ``trainer/callback.py`` documents, unrolled for the run of tests/harness/scripts/hook_order.py
(tests/unit/test_hook_order_one_process.py and tests/integration/test_hook_order.py compare with it)."""

from __future__ import annotations

from launch import REPO_ROOT

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "hook_order.py"


def both(hook: str) -> list[str]:
    """The task's hook runs first, then the callbacks' (Callback docstring, first sentence)."""
    return [f"task.{hook}", f"cb.{hook}"]


def micro_batch(*, completes_step: bool) -> list[str]:
    """One micro-batch, from the Callback docstring: ``on_train_batch_start -> on_before_backward ->
    on_after_backward``, then for the step's k-th micro-batch ``on_before_optimizer_step -> (optimizer.step)
    -> on_train_batch_end``; earlier micro-batches call ``on_train_batch_end`` right after their backward.
    ``training_step`` runs between batch start and backward (docs/design.md section 5)."""
    events = [
        *both("on_train_batch_start"),
        "task.training_step",
        *both("on_before_backward"),
        *both("on_after_backward"),
    ]
    if completes_step:
        events += [*both("on_before_optimizer_step"), "optimizer.step", *both("on_before_zero_grad")]
    return events + both("on_train_batch_end")


def evaluation_run(stage: str, batches: int) -> list[str]:
    """A validation / test run from the Callback docstring: the task's ``on_<stage>_model_eval``,
    ``on_<stage>_start``, ``on_<stage>_epoch_start``, per batch ``on_<stage>_batch_start`` -> step ->
    ``on_<stage>_batch_end``, then ``on_<stage>_epoch_end``, ``on_<stage>_end``, the task's
    ``on_<stage>_model_train``."""
    per_batch = [*both(f"on_{stage}_batch_start"), f"task.{stage}_step", *both(f"on_{stage}_batch_end")]
    return [
        f"task.on_{stage}_model_eval",
        *both(f"on_{stage}_start"),
        *both(f"on_{stage}_epoch_start"),
        *per_batch * batches,
        *both(f"on_{stage}_epoch_end"),
        *both(f"on_{stage}_end"),
        f"task.on_{stage}_model_train",
    ]


def validation_epoch(batches: int) -> list[str]:
    return evaluation_run("validation", batches)


def expected_events() -> list[str]:
    """The docstring's ``fit`` pseudo-code, unrolled for 2 epochs x 2 optimizer steps x 2 micro-batches,
    2 validation batches (1 in the sanity check); then ``validate``, ``test`` and ``predict``, each between
    its ``setup(stage)`` and ``teardown(stage)``."""
    fit = [*both("setup(fit)"), *both("on_fit_start")]
    fit += ["cb.on_sanity_check_start", *validation_epoch(1), "cb.on_sanity_check_end"]  # num_sanity_val_steps=1
    fit += both("on_train_start")
    for _epoch in range(2):
        fit += both("on_train_epoch_start")
        for _step in range(2):
            fit += micro_batch(completes_step=False) + micro_batch(completes_step=True)
        fit += validation_epoch(2)  # validation at epoch end, before on_train_epoch_end
        fit += both("on_train_epoch_end")
    fit += [*both("on_train_end"), *both("on_fit_end"), *both("teardown(fit)")]
    validate = [*both("setup(validate)"), *validation_epoch(2), *both("teardown(validate)")]
    test = [*both("setup(test)"), *evaluation_run("test", 2), *both("teardown(test)")]
    per_batch = [*both("on_predict_batch_start"), "task.predict_step", *both("on_predict_batch_end")]
    predict = [
        *both("setup(predict)"),
        "task.on_predict_model_eval",
        *both("on_predict_start"),
        *both("on_predict_epoch_start"),
        *per_batch * 2,
        *both("on_predict_epoch_end"),
        *both("on_predict_end"),
        *both("teardown(predict)"),
    ]
    return fit + validate + test + predict


def first_difference(actual: list[str], expected: list[str]) -> str:
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a != e:
            return f"first difference at event {i}: got {a!r}, expected {e!r}; context {actual[max(0, i - 4) : i + 4]}"
    return f"lengths differ: {len(actual)} vs {len(expected)}"
