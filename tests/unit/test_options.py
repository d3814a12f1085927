"""Every invalid Trainer option raises a ValueError naming the option, before any process group exists."""

from __future__ import annotations

import pytest
import torch

from trainer import Trainer
from trainer.options import TrainerOptions

INVALID = [
    ("max_epochs", 0),
    ("max_epochs", -2),
    ("max_epochs", 1.5),
    ("max_steps", 0),
    ("max_steps", -5),
    ("max_steps", "10"),
    ("accumulate_grad_batches", 0),
    ("accumulate_grad_batches", 2.0),
    ("accumulate_grad_batches", True),
    ("global_batch_size", 0),
    ("global_batch_size", 16.0),
    ("global_batch_size", {2: 32}),
    ("precision", "1"),
    ("precision", "fp8"),
    ("precision", 8),
    ("gradient_clip_val", 0),
    ("gradient_clip_val", -1.0),
    ("gradient_clip_val", float("inf")),
    ("gradient_clip_val", "1.0"),
    ("gradient_clip_algorithm", "l2"),
    ("val_check_interval", 0),
    ("val_check_interval", 1.5),
    ("check_val_every_n_epoch", 0),
    ("limit_train_batches", -1),
    ("limit_train_batches", 1.5),
    ("limit_val_batches", "all"),
    ("limit_test_batches", -0.1),
    ("limit_predict_batches", 2.5),
    ("num_sanity_val_steps", -2),
    ("fast_dev_run", -1),
    ("fast_dev_run", 0.5),
    ("log_every_n_steps", 0),
    ("seed", "zero"),
    ("seed", 1.0),
    ("deterministic", "yes"),
    ("accelerator", "tpu"),
    ("accelerator", "gpu"),
    ("default_root_dir", 3),
    ("enable_progress_bar", 1),
    ("enable_checkpointing", None),
    ("sync_batchnorm", "no"),
    ("process_group_timeout", 0),
    ("process_group_timeout", "30s"),
    ("predict_return", "rank0"),
    ("preemption_check_interval", 0),
    ("init_timeout", 0),
    ("watchdog_timeout", -1),
    ("on_nonfinite", "ignore"),
    ("min_epochs", -1),
    ("min_steps", 1.5),
    ("benchmark", "yes"),
    ("memory_plan", "yes"),
    ("uneven_batches", "pad"),
    ("stream_reshard", "skip"),
    ("initial_weights", 3),
    ("initial_weights_rename", ["model."]),
    ("initial_weights_strict", "yes"),
    ("devices", 0),
    ("num_nodes", 0),
    ("strategy", "deepspeed"),
    ("strategy", 3),
    ("logger", "tensorboard"),
    ("profiler", "advanced"),
    ("profiler", True),
    ("callbacks", ["not a callback"]),
]


@pytest.mark.parametrize("name,value", INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_option_raises_named_value_error(name: str, value: object, monkeypatch: pytest.MonkeyPatch) -> None:
    created = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: created.append(1))
    with pytest.raises(ValueError) as info:
        Trainer(**{name: value})
    message = str(info.value)
    assert name in message, message
    shown = value[0] if name == "callbacks" else value  # the offending element is named
    assert repr(shown) in message or type(shown).__name__ in message, message
    assert "expected" in message or "Valid" in message or "not a" in message, message
    assert not created, "no process group may be created for an invalid option"


def test_every_option_has_an_invalid_case() -> None:
    """A new option must come with a bad-value case above (or be listed as free-form here)."""
    names = {f for f in TrainerOptions.__dataclass_fields__} - {"drop_incomplete_accumulation", "enable_model_summary"}
    covered = {name for name, _ in INVALID}
    assert names - covered == set()


def test_unknown_option_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown Trainer option 'max_epoch': did you mean 'max_epochs'"):
        Trainer(max_epoch=3)


def test_16_mixed_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"precision='16-mixed' needs CUDA.*bf16-mixed"):
        Trainer(precision="16-mixed", accelerator="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cuda"):
        Trainer(accelerator="cuda")


def test_lightning_precision_spellings_are_normalised() -> None:
    assert Trainer(precision="bf16", logger=False).precision == "bf16-mixed"
    assert Trainer(precision=64, logger=False).precision == "64"
    assert Trainer(precision="32-true", logger=False).precision == "32"


def test_partial_torchrun_environment_is_refused_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK"):
        Trainer(logger=False)


def test_the_trainer_signature_spells_out_every_option_as_trainer_options_does() -> None:
    """One source of truth: Trainer.__init__ has a keyword for every TrainerOptions field, in order, with the same
    type and default (a field with a factory default is None there), so editors and mypy see them."""
    import dataclasses
    import inspect

    from trainer import Trainer
    from trainer.options import TrainerOptions

    params = list(inspect.signature(Trainer.__init__).parameters.values())[1:]
    fields = dataclasses.fields(TrainerOptions)
    assert [p.name for p in params] == [f.name for f in fields]
    for param, f in zip(params, fields):
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, param
        if f.default is dataclasses.MISSING:
            assert param.default is None and param.annotation == f"{f.type} | None", (param, f.type)
        else:
            assert param.default == f.default and param.annotation == f.type, (param, f.default, f.type)


def test_a_misspelled_option_is_named_with_the_closest_ones() -> None:
    from trainer import Trainer

    with pytest.raises(
        ValueError, match=r"Unknown Trainer option 'enable_progressbar': did you mean 'enable_progress_bar'"
    ):
        Trainer(enable_progressbar=False)
    with pytest.raises(TypeError, match="keywords"):
        Trainer(3)
