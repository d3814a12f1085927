"""Trainer options: one typed record, validated before anything distributed happens.

``Trainer(**options)`` builds a :class:`TrainerOptions`; every check here runs in ``__post_init__``, so a
bad value raises ``ValueError`` naming the option, the value and the valid choices before any process
group exists (DESIGN.md section 10). The Hydra schema of ``conf/trainer`` mirrors this dataclass.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

Precision = Literal["32", "64", "bf16-mixed", "16-mixed"]
Accelerator = Literal["auto", "cpu", "cuda"]

PRECISIONS: tuple[str, ...] = ("32", "64", "bf16-mixed", "16-mixed")
# Lightning spellings accepted on input and normalised to the canonical names above.
_PRECISION_ALIASES: dict[str, str] = {
    "32-true": "32",
    "64-true": "64",
    "bf16": "bf16-mixed",
    "16": "16-mixed",
    "fp32": "32",
    "fp64": "64",
    "double": "64",
}
ACCELERATORS: tuple[str, ...] = ("auto", "cpu", "cuda")
CLIP_ALGORITHMS: tuple[str, ...] = ("norm", "value")


def _fail(name: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"Trainer option {name}={value!r} is invalid: expected {expected}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, *, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < minimum:
        raise _fail(name, value, f"an integer >= {minimum}" + (" or None" if allow_none else ""))


def _check_limit(name: str, value: Any) -> None:
    """``limit_*_batches``: an int count of batches (>= 0) or a fraction in [0, 1] of the loader."""
    if _is_int(value):
        if value < 0:
            raise _fail(name, value, "an int >= 0 (number of batches) or a float in [0.0, 1.0] (fraction)")
        return
    if isinstance(value, float) and 0.0 <= value <= 1.0:
        return
    raise _fail(name, value, "an int >= 0 (number of batches) or a float in [0.0, 1.0] (fraction)")


@dataclass
class TrainerOptions:
    """Every option of :class:`trainer.Trainer`, with Lightning's names and defaults where they exist.

    Units (DESIGN.md section 4): ``max_steps``, ``val_check_interval``, ``log_every_n_steps`` count
    optimizer steps; ``accumulate_grad_batches`` counts micro-batches per optimizer step.
    """

    max_epochs: int | None = None
    max_steps: int = -1
    accumulate_grad_batches: int | dict = 1
    drop_incomplete_accumulation: bool = False
    precision: str = "32"
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    val_check_interval: int | None = None
    check_val_every_n_epoch: int | None = 1
    limit_train_batches: int | float = 1.0
    limit_val_batches: int | float = 1.0
    limit_test_batches: int | float = 1.0
    limit_predict_batches: int | float = 1.0
    num_sanity_val_steps: int = 2
    fast_dev_run: bool | int = False
    log_every_n_steps: int = 50
    seed: int | None = 0
    deterministic: bool = False
    accelerator: str = "auto"
    default_root_dir: str | None = None
    callbacks: list[Any] = field(default_factory=list)
    logger: Any = True
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    enable_model_summary: bool = True
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float | None = None
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False
    process_group_timeout: float = 1800.0
    predict_return: str = "all_ranks"
    preemption_check_interval: int | None = None

    def __post_init__(self) -> None:
        if self.max_epochs is not None:
            _check_int("max_epochs", self.max_epochs, minimum=-1)
            if self.max_epochs == 0:
                raise _fail("max_epochs", 0, "an integer >= 1, -1 (no epoch limit) or None")
        if not _is_int(self.max_steps) or self.max_steps < -1 or self.max_steps == 0:
            raise _fail("max_steps", self.max_steps, "an integer >= 1, or -1 for no step limit")
        if isinstance(self.accumulate_grad_batches, dict):
            from trainer.accumulation import parse_schedule

            parse_schedule(self.accumulate_grad_batches)
        else:
            _check_int("accumulate_grad_batches", self.accumulate_grad_batches, minimum=1)
        self.precision = _normalise_precision(self.precision)
        if self.gradient_clip_val is not None:
            if isinstance(self.gradient_clip_val, bool) or not isinstance(self.gradient_clip_val, (int, float)):
                raise _fail("gradient_clip_val", self.gradient_clip_val, "a finite number > 0, or None")
            if not math.isfinite(self.gradient_clip_val) or self.gradient_clip_val <= 0:
                raise _fail("gradient_clip_val", self.gradient_clip_val, "a finite number > 0, or None")
        if self.gradient_clip_algorithm not in CLIP_ALGORITHMS:
            raise _fail("gradient_clip_algorithm", self.gradient_clip_algorithm, f"one of {CLIP_ALGORITHMS}")
        if self.val_check_interval is not None:
            if isinstance(self.val_check_interval, float):
                raise _fail(
                    "val_check_interval",
                    self.val_check_interval,
                    "an int number of optimizer steps >= 1 or None (keel counts optimizer steps, not a "
                    "fraction of the epoch)",
                )
            _check_int("val_check_interval", self.val_check_interval, minimum=1)
        _check_int("check_val_every_n_epoch", self.check_val_every_n_epoch, minimum=1, allow_none=True)
        for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
            _check_limit(name, getattr(self, name))
        _check_int("num_sanity_val_steps", self.num_sanity_val_steps, minimum=-1)
        if not (isinstance(self.fast_dev_run, bool) or (_is_int(self.fast_dev_run) and self.fast_dev_run >= 0)):
            raise _fail("fast_dev_run", self.fast_dev_run, "a bool or an int >= 0 (number of batches)")
        _check_int("log_every_n_steps", self.log_every_n_steps, minimum=1)
        if self.seed is not None and not _is_int(self.seed):
            raise _fail("seed", self.seed, "an int or None")
        for name in (
            "deterministic",
            "enable_progress_bar",
            "enable_checkpointing",
            "enable_model_summary",
            "find_unused_parameters",
            "static_graph",
            "gradient_as_bucket_view",
            "broadcast_buffers",
            "sync_batchnorm",
            "drop_incomplete_accumulation",
        ):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "True or False")
        if self.accelerator not in ACCELERATORS:
            raise _fail("accelerator", self.accelerator, f"one of {ACCELERATORS}")
        if self.default_root_dir is not None and not isinstance(self.default_root_dir, (str, bytes)):
            try:
                self.default_root_dir = str(self.default_root_dir.__fspath__())
            except AttributeError:
                raise _fail("default_root_dir", self.default_root_dir, "a path (str or os.PathLike) or None") from None
        if self.callbacks is None:
            self.callbacks = []
        if not isinstance(self.callbacks, (list, tuple)):
            self.callbacks = [self.callbacks]
        self.callbacks = list(self.callbacks)
        if self.bucket_cap_mb is not None:
            if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)) or self.bucket_cap_mb <= 0:
                raise _fail("bucket_cap_mb", self.bucket_cap_mb, "a number of megabytes > 0, or None")
        timeout = self.process_group_timeout
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise _fail("process_group_timeout", self.process_group_timeout, "a number of seconds > 0 or a timedelta")
        self.process_group_timeout = float(timeout)
        _check_int("preemption_check_interval", self.preemption_check_interval, minimum=1, allow_none=True)
        if self.predict_return not in ("all_ranks", "rank_zero"):
            raise _fail("predict_return", self.predict_return, "'all_ranks' or 'rank_zero'")
        if self.max_epochs is None and self.max_steps == -1:
            # Lightning's default: 1000 epochs when neither limit is given.
            self.max_epochs = 1000

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> "TrainerOptions":
        """Build from keyword arguments, refusing unknown names with the list of valid ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"Unknown Trainer option(s) {unknown}. Valid options: {sorted(known)}."
            )
        return cls(**options)

    def resolved(self) -> dict[str, Any]:
        """The options as plain values, for the start-of-run log line and the checkpoint."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "callbacks":
                value = [type(cb).__name__ for cb in value]
            elif f.name == "logger" and not isinstance(value, (bool, type(None))):
                value = [type(lg).__name__ for lg in (value if isinstance(value, (list, tuple)) else [value])]
            out[f.name] = value
        return out


def _normalise_precision(value: Any) -> str:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(text, str):
        text = _PRECISION_ALIASES.get(text, text)
        if text in PRECISIONS:
            return text
    raise _fail("precision", value, f"one of {PRECISIONS}")
