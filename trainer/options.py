"""Trainer options: one typed record, validated before anything distributed happens.

``Trainer(**options)`` builds a :class:`TrainerOptions`; every check here runs in ``__post_init__``, so a
bad value raises ``ValueError`` naming the option, the value and the valid choices before any process
group exists (docs/design.md section 10). The Hydra schema of ``conf/trainer`` mirrors this dataclass.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

from trainer.storage import location

if TYPE_CHECKING:  # pragma: no cover
    from trainer.distributed.launcher import DistEnv

Precision = Literal["32", "64", "bf16-mixed", "16-mixed"]
# initial_weights_rename: a function of a source name (None drops the entry), or {source_prefix: task_prefix}
Rename = Callable[[str], "str | None"] | Mapping[str, str]
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


def _is_int(value: Any) -> TypeGuard[int]:
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

    Units (docs/design.md section 4): ``max_steps``, ``val_check_interval`` (an int), ``log_every_n_steps`` count
    optimizer steps; ``accumulate_grad_batches`` counts micro-batches per optimizer step;
    ``global_batch_size`` counts samples per optimizer step, all ranks together (trainer/data/global_batch.py).

    The ``Attributes`` below are the option reference: the documentation's options page is generated from them
    (docs/hooks/options_page.py; tests/unit/test_docs.py checks that every field has exactly one entry). One entry per
    field, ``name: description``, continuation lines indented further.

    Attributes:
        max_epochs: Epochs to train; -1 for no limit. None: 1000 epochs when ``max_steps`` is also unset
            (Lightning's default), otherwise no epoch limit.
        max_steps: Optimizer steps to train; -1 for no limit.
        min_epochs: Lightning's lower bound: a stop request (``trainer.should_stop``, e.g. from ``EarlyStopping``)
            before this many epochs have run waits until they have (and until ``min_steps`` is met).
        min_steps: Lightning's lower bound in optimizer steps: a stop request before this many steps waits until
            they have run (and until ``min_epochs`` is met).
        accumulate_grad_batches: Micro-batches per optimizer step: an int, ``{epoch: k}`` or
            ``{"step": {global_step: k}}``. Not together with ``global_batch_size``.
        global_batch_size: Samples per optimizer step, all ranks together: an int, ``{epoch: G}`` or
            ``{"step": {global_step: G}}``. At every (re)start keel derives ``accumulate_grad_batches = G /
            (world size x micro-batch)`` and refuses sizes that do not divide (elastic runs). Not together with
            ``accumulate_grad_batches``.
        drop_incomplete_accumulation: Drop the short last accumulation window of an epoch instead of normalising
            the loss by its real length.
        precision: ``"32"``, ``"64"``, ``"bf16-mixed"`` or ``"16-mixed"`` (CUDA only); Lightning's spellings
            (``"bf16"``, ``"16"``, ``"32-true"``, ``"64-true"``) are accepted.
        gradient_clip_val: Gradient clipping threshold (> 0); None: no clipping.
        gradient_clip_algorithm: ``"norm"`` (the global norm over all parameters) or ``"value"``.
        val_check_interval: Validate every N optimizer steps (an int) instead of at epoch ends; or, a float in
            (0.0, 1.0], every that fraction of the training epoch, counted in batches as Lightning does: after every
            ``max(1, int(batches_per_epoch * fraction))`` batches of the epoch, also inside an accumulation window
            (1.0: at epoch ends). A fraction below 1.0 needs a training loader with a length and
            ``check_val_every_n_epoch``.
        check_val_every_n_epoch: Validate at the end of every N-th epoch (when ``val_check_interval`` is None or
            1.0), or in every N-th epoch (a fraction).
        limit_train_batches: An int: training batches per epoch; a float: the fraction of the loader.
        limit_val_batches: An int: batches per validation run; a float: the fraction of the loader.
        limit_test_batches: An int: batches of ``test``; a float: the fraction of the loader.
        limit_predict_batches: An int: batches of ``predict``; a float: the fraction of the loader.
        num_sanity_val_steps: Validation batches run before training (-1: all); their metrics are discarded.
        fast_dev_run: True or n: run n (True: 1) batches of training and validation, one epoch; a smoke test, so
            no logger runs and ``ModelCheckpoint`` saves nothing (but a preemption or exception save).
        log_every_n_steps: Logging steps: the only steps that read metrics to the host and reduce them across
            ranks.
        seed: Seeds Python, NumPy and torch at the start of each stage with ``seed + global_rank``; the training
            sampler's shuffle uses ``seed``. None: the global generators are not seeded. Not given: the seed of the
            program's ``seed_everything(n)`` (Lightning's ``PL_GLOBAL_SEED``, read at each stage start), else 0.
            Each stage logs (rank 0) the seed it uses and where it came from.
        deterministic: ``torch.use_deterministic_algorithms(True)`` (and ``cudnn.benchmark`` off).
        benchmark: True / False: set ``torch.backends.cudnn.benchmark`` when the Trainer is built (Lightning's
            option); None leaves it as it is.
        accelerator: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
        devices: Lightning's keyword, checked against the launcher: processes per node (``LOCAL_WORLD_SIZE``), or
            ``"auto"`` / -1 for whatever torchrun or SLURM started. A mismatch raises with the ``torchrun``
            command to use (keel never starts processes).
        num_nodes: Lightning's keyword, checked against the launcher: world size / processes per node. None: from
            the launcher.
        strategy: ``"auto"``, ``"ddp"`` or None: DDP when the launch has more than one process; ``"fsdp"``: FSDP2
            at any world size; or a strategy object with its settings: ``DDPStrategy(find_unused_parameters=True)``,
            ``FSDPStrategy(units=["Block"], cpu_offload=True)`` (``from trainer import DDPStrategy, FSDPStrategy``;
            in a Hydra config a node with ``_target_``). Any other value raises, naming the alternatives.
        default_root_dir: Where loggers create the run directory; None: the current directory.
        callbacks: A list of ``callbacks.Callback``; ``ModelCheckpoint`` and ``ProgressBar`` are added unless
            given or switched off.
        logger: True (TensorBoard), False, a ``trainer.loggers.Logger`` or a list of them.
        profiler: None (off, free), ``"simple"`` (time per loop phase, a table at the end of each stage on rank
            0), ``"pytorch"`` (torch.profiler traces per rank in ``<run dir>/profiler/``), ``"passthrough"``
            (off) or a ``trainer.observability.profiler.Profiler``.
        enable_progress_bar: Add a ``ProgressBar``.
        enable_checkpointing: Add a ``ModelCheckpoint`` (saves at each epoch end).
        enable_model_summary: Log the task's parameter count and size at the start of ``fit`` (rank 0).
        memory_plan: Log (rank 0) at the first training batch of ``fit`` what a rank holds at the peak of a step
            under this run's strategy, world size and precision, estimated on fake tensors (``trainer.memory``),
            and on CUDA whether it fits the device (a few seconds once per fit). Off by default: it has not yet been
            checked against a real CUDA peak; ``python -m trainer.memory`` plans before a run.
        sync_batchnorm: Convert BatchNorm layers to ``SyncBatchNorm`` when the world size is > 1 (Lightning's
            Trainer option).
        process_group_timeout: Seconds (or a ``timedelta``) for process-group init and collectives.
        init_timeout: Seconds to join the process group (reach the rendezvous, wait for every rank); separate
            from ``process_group_timeout``.
        watchdog_timeout: Seconds without progress before a rank dumps its stacks to the run directory and exits.
            None: 600 s (capped at ``process_group_timeout``) in a distributed run, off in one process.
        on_nonfinite: A NaN/inf training loss: ``"error"`` (losses stay on the device; checked on logging steps,
            at epoch ends, before every checkpoint and at the end of ``fit``; every rank stops with the first bad
            step named) or ``"skip"`` (the step is skipped on every rank; one host read and, in DDP, one
            all-reduce per step).
        uneven_batches: Loaders keel does not shard (and streams), with different batch counts per rank: run the
            common number (``"truncate"``, with a warning naming the counts) or raise (``"error"``).
        stream_reshard: Resuming a stream (a training loader that saves its own position, trainer/data/streams.py)
            mid-epoch at another world size, which only LitData can continue: ``"error"`` refuses the resume with
            the reason; ``"restart_epoch"`` warns and starts that epoch again from its first batch.
        predict_return: ``"all_ranks"`` (every rank gets the predictions) or ``"rank_zero"`` (other ranks get
            None).
        initial_weights: Where the task's starting weights come from: a ``.safetensors`` file, a Hugging Face
            folder (``model.safetensors.index.json`` and its shards), a ``torch.save``'d state dict or a keel
            checkpoint. Loaded once per task after the strategy placed it (sharded under FSDP: each rank reads only
            its slices), unless a checkpoint is resumed or given to ``ckpt_path``. None: the task's own
            initialisation.
        initial_weights_rename: Maps the file's names to the task's: a function of a name (None drops the entry)
            or ``{source_prefix: task_prefix}``.
        initial_weights_strict: Every task entry must be in the file and every file entry in the task (after
            renaming); False: what does not match is logged and keeps its initialisation. Shapes always match.
        preemption_check_interval: In a distributed run, the ranks agree on SIGTERM/SIGUSR1/SIGINT every N optimizer
            steps (one tiny all-reduce each, waited for). None: at every step, with no host sync: under DDP with
            automatic optimization the flags ride on the gradient all-reduce; elsewhere (FSDP, manual optimization)
            on one small asynchronous all-reduce a step, read at the next step.
    """

    max_epochs: int | None = None
    max_steps: int = -1
    # Lightning's lower bounds: a stop request (trainer.should_stop) waits until both are met.
    min_epochs: int | None = None
    min_steps: int | None = None
    accumulate_grad_batches: int | dict = 1
    global_batch_size: int | dict | None = None
    drop_incomplete_accumulation: bool = False
    precision: str = "32"
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    limit_train_batches: int | float = 1.0
    limit_val_batches: int | float = 1.0
    limit_test_batches: int | float = 1.0
    limit_predict_batches: int | float = 1.0
    num_sanity_val_steps: int = 2
    fast_dev_run: bool | int = False
    log_every_n_steps: int = 50
    seed: int | None = 0
    # Not a field: False when Trainer() got no seed, so each stage resolves it (resolve_seed); True otherwise.
    seed_given = True
    deterministic: bool = False
    benchmark: bool | None = None  # torch.backends.cudnn.benchmark, set when the Trainer is built (None: leave)
    accelerator: str = "auto"
    # Lightning's launch keywords. keel never starts processes: they must match what torchrun / SLURM
    # started (checked by check_lightning_keywords once the environment is known).
    devices: int | str = "auto"
    num_nodes: int | None = None
    strategy: Any = "auto"  # a string of trainer.distributed.selection.STRATEGIES or a Strategy object
    default_root_dir: str | None = None
    callbacks: list[Any] = field(default_factory=list)
    logger: Any = True
    # None / "simple" / "pytorch" / "passthrough" / a trainer.observability.profiler.Profiler; a Profiler after
    # __post_init__.
    profiler: Any = None
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    enable_model_summary: bool = True
    memory_plan: bool = False
    sync_batchnorm: bool = False
    process_group_timeout: float = 1800.0
    init_timeout: float = 300.0
    watchdog_timeout: float | None = None
    on_nonfinite: str = "error"
    uneven_batches: str = "truncate"
    predict_return: str = "all_ranks"
    preemption_check_interval: int | None = None
    stream_reshard: str = "error"
    initial_weights: str | None = None
    initial_weights_rename: Any = None  # a function of a source name, or {source_prefix: task_prefix}
    initial_weights_strict: bool = True

    def __post_init__(self) -> None:
        # Always in this order, so that with several bad values the same one is reported first.
        self._check_limits_and_accumulation()
        self._check_step_and_loop_options()
        self._check_launch_options()
        self._check_run_options()

    def _check_limits_and_accumulation(self) -> None:
        """The step and epoch limits, accumulation and the global batch."""
        if self.max_epochs is not None:
            _check_int("max_epochs", self.max_epochs, minimum=-1)
            if self.max_epochs == 0:
                raise _fail("max_epochs", 0, "an integer >= 1, -1 (no epoch limit) or None")
        if not _is_int(self.max_steps) or self.max_steps < -1 or self.max_steps == 0:
            raise _fail("max_steps", self.max_steps, "an integer >= 1, or -1 for no step limit")
        if isinstance(self.accumulate_grad_batches, dict):
            from trainer.step.accumulation import parse_schedule

            parse_schedule(self.accumulate_grad_batches)
        else:
            _check_int("accumulate_grad_batches", self.accumulate_grad_batches, minimum=1)
        if self.global_batch_size is not None:
            parse_global_batch(self.global_batch_size)
            if self.accumulate_grad_batches != 1:
                raise ValueError(
                    f"Trainer options global_batch_size={self.global_batch_size!r} and accumulate_grad_batches="
                    f"{self.accumulate_grad_batches!r} both set accumulation: with global_batch_size keel derives "
                    "accumulate_grad_batches = global_batch_size / (world size x micro-batch size) at every "
                    "(re)start. Pass only one of them (a schedule goes in global_batch_size as {epoch: G} or "
                    "{'step': {global_step: G}})."
                )

    def _check_step_and_loop_options(self) -> None:
        """Precision, clipping, validation and batch limits, logging, seeding and the boolean flags."""
        self.precision = _normalise_precision(self.precision)
        if self.gradient_clip_val is not None:
            if isinstance(self.gradient_clip_val, bool) or not isinstance(self.gradient_clip_val, (int, float)):
                raise _fail("gradient_clip_val", self.gradient_clip_val, "a finite number > 0, or None")
            if not math.isfinite(self.gradient_clip_val) or self.gradient_clip_val <= 0:
                raise _fail("gradient_clip_val", self.gradient_clip_val, "a finite number > 0, or None")
        if self.gradient_clip_algorithm not in CLIP_ALGORITHMS:
            raise _fail("gradient_clip_algorithm", self.gradient_clip_algorithm, f"one of {CLIP_ALGORITHMS}")
        interval = self.val_check_interval
        expected = "an int number of optimizer steps >= 1, a float in (0.0, 1.0] (a fraction of the epoch) or None"
        if isinstance(interval, float):
            if not 0.0 < interval <= 1.0:
                raise _fail("val_check_interval", interval, expected)
            if self.check_val_every_n_epoch is None:
                raise ValueError(
                    f"Trainer option val_check_interval={interval!r} is a fraction of the epoch, but "
                    "check_val_every_n_epoch=None counts no epochs (Lightning refuses it too): give "
                    "check_val_every_n_epoch (1: every epoch), or an int val_check_interval (optimizer steps)."
                )
        elif interval is not None and not (_is_int(interval) and interval >= 1):
            raise _fail("val_check_interval", interval, expected)
        _check_int("check_val_every_n_epoch", self.check_val_every_n_epoch, minimum=1, allow_none=True)
        for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
            _check_limit(name, getattr(self, name))
        _check_int("num_sanity_val_steps", self.num_sanity_val_steps, minimum=-1)
        if not (isinstance(self.fast_dev_run, bool) or (_is_int(self.fast_dev_run) and self.fast_dev_run >= 0)):
            raise _fail("fast_dev_run", self.fast_dev_run, "a bool or an int >= 0 (number of batches)")
        _check_int("log_every_n_steps", self.log_every_n_steps, minimum=1)
        _check_int("min_epochs", self.min_epochs, minimum=0, allow_none=True)
        _check_int("min_steps", self.min_steps, minimum=0, allow_none=True)
        if self.benchmark is not None and not isinstance(self.benchmark, bool):
            raise _fail("benchmark", self.benchmark, "True, False or None (leave torch.backends.cudnn.benchmark as is)")
        if self.seed is not None and not _is_int(self.seed):
            raise _fail("seed", self.seed, "an int or None")
        for name in (
            "deterministic",
            "enable_progress_bar",
            "enable_checkpointing",
            "enable_model_summary",
            "sync_batchnorm",
            "drop_incomplete_accumulation",
            "initial_weights_strict",
            "memory_plan",
        ):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "True or False")

    def _check_launch_options(self) -> None:
        """Devices, the run directory, callbacks and the timeouts (the strategy is checked when the Trainer builds
        it: trainer.distributed.selection.build_strategy)."""
        if self.accelerator not in ACCELERATORS:
            raise _fail("accelerator", self.accelerator, f"one of {ACCELERATORS}")
        self.devices = _normalise_devices(self.devices)
        _check_int("num_nodes", self.num_nodes, minimum=1, allow_none=True)
        if self.default_root_dir is not None and not isinstance(self.default_root_dir, (str, bytes)):
            try:
                self.default_root_dir = str(self.default_root_dir.__fspath__())
            except AttributeError:
                raise _fail("default_root_dir", self.default_root_dir, "a path (str or os.PathLike) or None") from None
        if isinstance(self.default_root_dir, str):  # a URL stays a URL, never a local folder "s3:"
            self.default_root_dir = location(self.default_root_dir, "Trainer(default_root_dir=...)")
        if self.callbacks is None:
            self.callbacks = []
        if not isinstance(self.callbacks, (list, tuple)):
            self.callbacks = [self.callbacks]
        self.callbacks = list(self.callbacks)
        timeout = self.process_group_timeout
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise _fail("process_group_timeout", self.process_group_timeout, "a number of seconds > 0 or a timedelta")
        self.process_group_timeout = float(timeout)
        for name in ("init_timeout", "watchdog_timeout"):
            value = getattr(self, name)
            if isinstance(value, datetime.timedelta):
                value = value.total_seconds()
            if value is None and name == "watchdog_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise _fail(
                    name,
                    getattr(self, name),
                    "a number of seconds > 0 or a timedelta" + (" or None" if name == "watchdog_timeout" else ""),
                )
            setattr(self, name, float(value))

    def _check_run_options(self) -> None:
        """The profiler, the fault policies, predict's return, and Lightning's default of 1000 epochs."""
        from trainer.observability.profiler import resolve_profiler

        self.profiler = resolve_profiler(self.profiler)  # raises ValueError naming the option for a bad value
        if self.on_nonfinite not in ("error", "skip"):
            raise _fail("on_nonfinite", self.on_nonfinite, "'error' or 'skip'")
        if self.uneven_batches not in ("truncate", "error"):
            raise _fail("uneven_batches", self.uneven_batches, "'truncate' or 'error'")
        if self.stream_reshard not in ("error", "restart_epoch"):
            raise _fail("stream_reshard", self.stream_reshard, "'error' or 'restart_epoch'")
        _check_int("preemption_check_interval", self.preemption_check_interval, minimum=1, allow_none=True)
        if self.predict_return not in ("all_ranks", "rank_zero"):
            raise _fail("predict_return", self.predict_return, "'all_ranks' or 'rank_zero'")
        if self.initial_weights is not None:
            if not isinstance(self.initial_weights, (str, os.PathLike)):
                raise _fail(
                    "initial_weights", self.initial_weights, "a path or URL of weights or a checkpoint, or None"
                )
            self.initial_weights = location(self.initial_weights, "Trainer(initial_weights=...)")
        if self.initial_weights_rename is not None:
            try:
                rename_function(self.initial_weights_rename)
            except ValueError:
                raise _fail(
                    "initial_weights_rename",
                    self.initial_weights_rename,
                    "a function of a file's name (returning the task's name, or None to drop it) or "
                    "{source_prefix: task_prefix}",
                ) from None
        if self.max_epochs is None and self.max_steps == -1:
            # Lightning's default: 1000 epochs when neither limit is given.
            self.max_epochs = 1000

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> TrainerOptions:
        """Build from keyword arguments, refusing unknown names with the list of valid ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        lightning = sorted(set(options) & set(LIGHTNING_UNSUPPORTED))
        moved = sorted(set(options) & set(MOVED_TO_STRATEGY))
        unknown = sorted(set(options) - known - set(lightning) - set(moved))
        lines = [
            f"Trainer option {name!r} is a Lightning option keel does not support: {LIGHTNING_UNSUPPORTED[name]}"
            for name in lightning
        ]
        lines += [_moved_to_strategy(name, options[name]) for name in moved]
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"valid: {sorted(known)}"
            lines.append(f"Unknown Trainer option {name!r}: {hint}")
        if lines:
            raise ValueError("\n".join(lines))
        built = cls(**options)
        built.seed_given = "seed" in options
        resolve_seed(built)
        return built

    def changed(self) -> dict[str, Any]:
        """:meth:`resolved`, only the options whose value differs from the default (the start-of-run line)."""
        defaults = TrainerOptions().resolved()
        return {k: v for k, v in self.resolved().items() if k not in defaults or defaults[k] != v}

    def resolved(self) -> dict[str, Any]:
        """The options as plain values, for the start-of-run log line and the checkpoint."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "callbacks":
                value = [type(cb).__name__ for cb in value]
            elif f.name == "profiler":
                value = type(value).__name__
            elif f.name == "strategy" and not isinstance(value, (str, type(None))):
                value = {"name": type(value).__name__, **value.settings()}
            elif f.name == "initial_weights_rename" and callable(value):
                value = getattr(value, "__qualname__", type(value).__name__)
            elif f.name == "logger" and not isinstance(value, (bool, type(None))):
                value = [type(lg).__name__ for lg in (value if isinstance(value, (list, tuple)) else [value])]
            out[f.name] = value
        return out


SEED_GIVEN = "Trainer(seed=...)"
SEED_FROM_ENV = "seed_everything (PL_GLOBAL_SEED)"
SEED_DEFAULT = "keel's default: no Trainer(seed=...), no seed_everything"


def resolve_seed(options: TrainerOptions) -> str:
    """Set ``options.seed`` to the seed the run uses and return where it came from: the ``seed`` option when
    ``Trainer(seed=...)`` got one (None included); else the program's ``seed_everything(n)``, which sets
    ``PL_GLOBAL_SEED`` (read now, so a call after ``Trainer()`` counts at the next stage), as Lightning's samplers
    read it; else 0.

    Raises:
        ValueError: ``PL_GLOBAL_SEED`` is set but not an integer.
    """
    if options.seed_given:
        return SEED_GIVEN
    env = os.environ.get("PL_GLOBAL_SEED")
    if env is None:
        options.seed = 0
        return SEED_DEFAULT
    try:
        options.seed = int(env)
    except ValueError:
        raise ValueError(
            f"PL_GLOBAL_SEED={env!r} in the environment is not an integer (seed_everything(n) sets it); unset it, "
            "call seed_everything(n) with an int, or pass Trainer(seed=n)."
        ) from None
    return SEED_FROM_ENV


_GLOBAL_BATCH_EXPECTED = (
    "an int >= 1 (samples per optimizer step, all ranks together), a {epoch: G} or "
    "{'step': {global_step: G}} schedule, or None"
)


def parse_global_batch(value: Any) -> tuple[str, list[tuple[int, int]]]:
    """Validate ``global_batch_size``: an int >= 1, ``{epoch: G}`` or ``{"step": {global_step: G}}``.

    A schedule's first key must be 0 (there is no global batch "before" it). trainer/data/global_batch.py turns the
    result into an accumulation schedule at each (re)start.

    Returns:
        ``(clock, [(start, G), ...])`` with ``clock`` "epoch" or "step".

    Raises:
        ValueError: naming the option, the offending value and what is expected.
    """
    if _is_int(value):
        if value < 1:
            raise _fail("global_batch_size", value, _GLOBAL_BATCH_EXPECTED)
        return "epoch", [(0, value)]
    if not isinstance(value, dict):
        raise _fail("global_batch_size", value, _GLOBAL_BATCH_EXPECTED)
    from trainer.step.accumulation import parse_schedule

    try:
        clock, items = parse_schedule(value, name="global_batch_size")
    except ValueError as exc:
        raise _fail("global_batch_size", value, f"{_GLOBAL_BATCH_EXPECTED} ({exc})") from None
    if items[0][0] != 0:
        raise _fail(
            "global_batch_size",
            value,
            f"a schedule whose first {clock} key is 0 (the global batch from the start of the run)",
        )
    return clock, items


def _normalise_precision(value: Any) -> str:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(text, str):
        text = _PRECISION_ALIASES.get(text, text)
        if text in PRECISIONS:
            return text
    raise _fail("precision", value, f"one of {PRECISIONS}")


# ---------------------------------------------------------------------- Lightning compatibility

# Lightning Trainer keywords (2.x, and common 1.x ones) that keel refuses, with why and what to do instead.
# Never silently ignored: Trainer.from_kwargs names them with this text.
LIGHTNING_UNSUPPORTED: dict[str, str] = {
    "max_time": "use max_steps / max_epochs, or a callback that sets trainer.should_stop at a deadline "
    "(callbacks.Timer); on a cluster time limit keel saves on SIGTERM/SIGUSR1 and resumes with ckpt_path='last'.",
    "overfit_batches": "pass limit_train_batches=N with an unshuffled loader, and the same loader as validation.",
    "inference_mode": "keel evaluates under torch.no_grad(); wrap your own code in torch.inference_mode() if needed.",
    "use_distributed_sampler": "keel always adds its resumable distributed sampler to a plain DataLoader "
    "(docs/design.md section 6); a loader it cannot adapt is used as is, with a warning saying why.",
    "replace_sampler_ddp": "keel always adds its resumable distributed sampler to a plain DataLoader "
    "(docs/design.md section 6); a loader it cannot adapt is used as is, with a warning saying why.",
    "reload_dataloaders_every_n_epochs": "loaders are built once per fit; let the dataset read fresh data itself "
    "(set_epoch on your sampler or dataset is called by keel's sampler each epoch).",
    "detect_anomaly": "wrap trainer.fit(...) in `with torch.autograd.detect_anomaly():`.",
    "barebones": "pass logger=False, enable_checkpointing=False, enable_progress_bar=False, "
    "enable_model_summary=False.",
    "plugins": "keel has no plugin system: precision is precision=..., the cluster environment is read from "
    "torchrun / SLURM, checkpoint I/O is keel's own.",
    "model_registry": "upload the checkpoints that ModelCheckpoint writes with your registry's client.",
    "auto_lr_find": "call Tuner(trainer).lr_find(model, ...) before fit (callbacks.tuner).",
    "auto_scale_batch_size": "call Tuner(trainer).scale_batch_size(model, ...) before fit (callbacks.tuner).",
    "gpus": "use accelerator='cuda' with `torchrun --nproc-per-node G` (devices=G is checked against it).",
    "tpu_cores": "keel runs on CPU and CUDA only.",
    "ipus": "keel runs on CPU and CUDA only.",
    "num_processes": "launch with `torchrun --nproc-per-node N` (devices=N is checked against it).",
    "auto_select_gpus": "select GPUs with CUDA_VISIBLE_DEVICES; each process uses cuda:LOCAL_RANK.",
    "resume_from_checkpoint": "pass ckpt_path=... (or ckpt_path='last') to fit().",
    "track_grad_norm": "log torch.nn.utils.get_total_norm(...) in on_before_optimizer_step.",
    "weights_save_path": "pass ModelCheckpoint(dirpath=...).",
    "checkpoint_callback": "use enable_checkpointing=..., or pass a ModelCheckpoint in callbacks.",
    "stochastic_weight_avg": "use torch.optim.swa_utils in your task.",
    "terminate_on_nan": "the on_nonfinite option decides what a non-finite loss does ('error', the default, "
    "or 'skip').",
    "amp_backend": "use precision='16-mixed' or 'bf16-mixed' (torch.autocast).",
    "amp_level": "use precision='16-mixed' or 'bf16-mixed' (torch.autocast).",
    "move_metrics_to_cpu": "metrics stay on the device and are read to the host on logging steps only.",
    "multiple_trainloader_mode": "fit takes exactly one training loader; combine datasets in one loader.",
    "prepare_data_per_node": "DataModule.prepare_data runs on local rank 0 of every node.",
    "flush_logs_every_n_steps": "loggers write at every logging step (log_every_n_steps).",
    "progress_bar_refresh_rate": "pass ProgressBar(...) in callbacks, or enable_progress_bar=False.",
    "weights_summary": "use enable_model_summary=..., or callbacks.ModelSummary.",
    "process_position": "pass ProgressBar(...) in callbacks.",
    "log_gpu_memory": "log torch.cuda.memory_allocated() yourself, or use callbacks.ThroughputMonitor.",
}


def _normalise_devices(value: Any) -> int | str:
    """Lightning's ``devices``: ``"auto"`` / ``-1`` (whatever the launcher started) or a count per node."""
    if value == "auto" or (_is_int(value) and value == -1) or value == "-1":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if _is_int(value) and value >= 1:
        return value
    if isinstance(value, (list, tuple)) or (isinstance(value, str) and "," in value):
        raise _fail(
            "devices",
            value,
            "a number of processes per node, 'auto' or -1 (keel does not pick device indices: every process "
            "uses cuda:LOCAL_RANK; select GPUs with CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 ...)",
        )
    raise _fail("devices", value, "an int >= 1 (processes per node), 'auto' or -1")


# The DDP and FSDP settings that were Trainer options, now keyword arguments of the strategy objects:
# old name -> (strategy class, its argument). Passing one to the Trainer raises with the new form.
MOVED_TO_STRATEGY: dict[str, tuple[str, str]] = {
    "find_unused_parameters": ("DDPStrategy", "find_unused_parameters"),
    "static_graph": ("DDPStrategy", "static_graph"),
    "gradient_as_bucket_view": ("DDPStrategy", "gradient_as_bucket_view"),
    "bucket_cap_mb": ("DDPStrategy", "bucket_cap_mb"),
    "broadcast_buffers": ("DDPStrategy", "broadcast_buffers"),
    "fsdp_units": ("FSDPStrategy", "units"),
    "fsdp_reshard_after_forward": ("FSDPStrategy", "reshard_after_forward"),
    "fsdp_cpu_offload": ("FSDPStrategy", "cpu_offload"),
    "fsdp_reduce_grads": ("FSDPStrategy", "reduce_grads"),
}


def _moved_to_strategy(name: str, value: Any) -> str:
    cls, arg = MOVED_TO_STRATEGY[name]
    shown = [getattr(v, "__name__", v) for v in value] if isinstance(value, (list, tuple)) else value
    return (
        f"Trainer option {name!r} is now a setting of the strategy object: pass "
        f"Trainer(strategy={cls}({arg}={shown!r})) (from trainer import {cls}); in a Hydra config, "
        f"trainer.strategy: {{_target_: trainer.{cls}, {arg}: {shown!r}}} (docs/options.md)."
    )


def _launch_command(env: DistEnv, nodes: int, per_node: int) -> str:
    if env.launcher == "slurm":
        return f"srun --nodes {nodes} --ntasks-per-node {per_node} python your_script.py"
    return f"torchrun --nnodes {nodes} --nproc-per-node {per_node} your_script.py"


def check_lightning_keywords(options: TrainerOptions, env: DistEnv) -> None:
    """Check Lightning's ``devices`` / ``num_nodes`` against what the launcher started.

    keel never starts processes (docs/design.md section 1): ``devices`` must be the processes per node
    (``LOCAL_WORLD_SIZE``) or ``"auto"`` / -1, and ``num_nodes`` must be ``world_size // local_world_size``.
    Called by the Trainer right after :func:`trainer.distributed.launcher.detect_env`, before any process group exists.
    It also applies ``benchmark`` as Lightning does when its Trainer is built: True / False set
    ``torch.backends.cudnn.benchmark``; None leaves it as is.

    Raises:
        ValueError: naming the mismatch and the launch command that gives the requested layout.
    """
    if options.benchmark is not None:
        import torch

        torch.backends.cudnn.benchmark = options.benchmark
    env_nodes = env.world_size // env.local_world_size if env.world_size % env.local_world_size == 0 else None
    want_per_node = options.devices if _is_int(options.devices) else env.local_world_size
    want_nodes = options.num_nodes if options.num_nodes is not None else env_nodes
    asked = []
    if want_per_node != env.local_world_size:
        asked.append(f"devices={options.devices!r}")
    if options.num_nodes is not None and env_nodes is not None and options.num_nodes != env_nodes:
        asked.append(f"num_nodes={options.num_nodes!r}")
    if not asked:
        return
    if env.launcher == "single":
        started = "as a single process (no torchrun or SLURM environment)"
    else:
        started = (
            f"by {env.launcher} with {env.local_world_size} process(es) on this node and "
            f"{env_nodes if env_nodes is not None else '?'} node(s) (world size {env.world_size})"
        )
    command = _launch_command(env, want_nodes or 1, want_per_node)
    raise ValueError(
        f"Trainer({', '.join(asked)}) does not match the launch: this process was started {started}. keel "
        f"does not start processes itself; launch the layout you asked for with\n    {command}\nor pass "
        "devices='auto' and leave out num_nodes to use whatever the launcher started."
    )


def rename_function(rename: Rename | None, option: str = "initial_weights_rename") -> Callable[[str], str | None]:
    """``rename`` as a function of a source name: a callable as it is (None drops the entry), or a mapping of
    source prefixes to task prefixes (the longest matching prefix is replaced; ``""`` matches every name)."""
    if rename is None:
        return lambda name: name
    if callable(rename):
        return rename
    if isinstance(rename, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in rename.items()):
        prefixes = sorted(rename.items(), key=lambda kv: len(kv[0]), reverse=True)

        def by_prefix(name: str) -> str:
            for old, new in prefixes:
                if name.startswith(old):
                    return new + name[len(old) :]
            return name

        return by_prefix
    raise ValueError(
        f"Trainer option {option}={rename!r}: pass a function of a source name (returning the task's name, or None "
        "to drop the entry) or a mapping of source prefixes to task prefixes, e.g. {'model.': 'net.'}."
    )
