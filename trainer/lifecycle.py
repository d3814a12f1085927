"""What happens around every stage (fit / validate / test / predict): seeding, setup hooks, teardown.

The Trainer calls :func:`init_process_group` and :func:`setup_stage` before the stage's loop, and
:func:`teardown_stage` after it, also when the loop raised. All run on every rank. They read the Trainer's
public attributes (the task, the datamodule, the callbacks, the loggers, the options) and hand the Trainer to
the hooks; they never touch its private state. The Trainer is named here for types only.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from trainer.distributed import comm
from trainer.distributed.watchdog import Watchdog, nccl_flight_recorder_env_defaults, start_for_run
from trainer.hooks import warn_uncalled_hooks
from trainer.observability.rank_zero import rank_zero_only
from trainer.options import resolve_seed
from trainer.storage import local_dir, sync_mirrors

if TYPE_CHECKING:
    from trainer.callback import Callback
    from trainer.module import TaskModule
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's, NumPy's (when installed) and torch's global generators (CPU and CUDA); returns the seed.

    Lightning's signature. ``seed=None`` reads ``PL_GLOBAL_SEED`` from the environment, else uses 0. Sets
    ``PL_GLOBAL_SEED``, as Lightning does: a Trainer built without ``seed=`` then uses this seed at every stage
    (``seed + global_rank``, and the training sampler's shuffle); ``Trainer(seed=...)`` wins over it.
    ``workers`` is accepted for Lightning compatibility: keel always seeds DataLoader workers per
    (seed, rank, worker, epoch) for the loaders it adapts (trainer/data/loaders.py), which is what Lightning's
    ``workers=True`` asks for.
    """
    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", "0"))
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed_everything(seed={seed!r}): expected an int or None.")
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    if workers:
        os.environ["PL_SEED_WORKERS"] = "1"
    if verbose:
        _log_seed(seed)
    _seed_generators(seed)
    return seed


_SHOWN_SEED: list[int] = []  # the seed seed_everything announced on this process's console, if it did


@rank_zero_only
def _log_seed(seed: int) -> None:
    # Rank 0 only, like Lightning's: seed_everything usually runs before the Trainer configures per-rank logging.
    log.info("Seed set to %d", seed)
    # Shown only where a handler prints INFO (before any logging setup Python's last-resort handler drops it).
    _SHOWN_SEED[:] = [seed] if log.isEnabledFor(logging.INFO) and logging.getLogger().handlers else []


def _seed_generators(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is optional
        pass


def setup_stage(trainer: Trainer, stage: str) -> None:
    """Seed (``seed + global_rank`` per rank; :func:`stage_seed`), agree on the run directory's version (a
    collective), set up the profiler (it knows the run directory then), prepare and set up the data
    (``prepare_data`` on local rank 0, the others wait at a barrier), then ``task.setup`` and the callbacks'
    ``setup``, in that order; last, ``callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics`` start
    empty, as new dicts (Lightning's reset, at the same point). The Trainer then has the strategy
    prepare the task (``configure_model``, its device and dtype, sharded and materialised:
    :meth:`~trainer.distributed.strategy.Strategy.prepare_model`). Reads the Trainer's public attributes, and gives its
    metric collector the new ``callback_metrics``."""
    task, datamodule, callbacks, profiler = trainer.task, trainer.datamodule, trainer.callbacks, trainer.profiler
    assert task is not None
    seed, deterministic = stage_seed(trainer, stage), trainer.options.deterministic
    if seed is not None:
        _seed_generators(seed + trainer.global_rank)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    continues = stage == "fit" and getattr(trainer, "_continues_run", False)  # fit(ckpt_path="last")
    for logger in trainer.loggers:
        # Rank 0 picks, all ranks agree (broadcast); the Trainer's loggers share the folder the first one picks.
        logger.resolve_version(continue_newest=continues, owner=f"trainer-{id(trainer):x}")
    if profiler is not None:
        profiler.setup(stage, run_dir=local_dir(trainer.log_dir), rank=trainer.global_rank)
        if profiler.enabled:
            profiler.transition("setup")  # the phase clock starts: data and task setup count as "setup"
    warn_uncalled_hooks(task, callbacks)  # a Lightning hook keel never calls is named, never ignored
    if trainer.local_rank == 0:
        if datamodule is not None:
            datamodule.prepare_data()
        task.prepare_data()
    comm.barrier(trainer.device)  # the other ranks of the node wait for the files
    if datamodule is not None:
        datamodule.setup(stage)
    task.setup(stage)
    for cb in callbacks:
        cb.setup(trainer, task, stage)
    # Each stage's metrics only, as in Lightning (after fit: fit's; after test: test's; after predict: none), in new
    # dicts as Lightning's reset makes them: a reference a program kept to the last stage's keeps its values.
    trainer.callback_metrics = trainer._metrics.live = {}
    trainer.logged_metrics, trainer.progress_bar_metrics = {}, {}


def seed_at_construction(seed: int | None, rank: int) -> None:
    """``Trainer(...)`` seeds the generators at once (``seed + rank``, as each stage does again), so a task built
    after the Trainer draws the same weights in every run."""
    if seed is not None:
        _seed_generators(seed + rank)


def warn_unseeded_task(task: TaskModule, seed: int | None) -> None:
    """Rank 0, at the start of a fit: say it when the task's weights were drawn before any seed was set (built
    before the Trainer and before ``seed_everything``): two runs of the script then start from different weights,
    whatever the Trainer's seed. Once per task."""
    drawn = getattr(task, "_built_with_seed", None)
    if seed is None or drawn is None or drawn < 2**32 or getattr(task, "_unseeded_warned", False):
        return
    if not any(p.device.type != "meta" for p in task.parameters()):
        return  # nothing drawn yet: configure_model builds the layers, after the stage's seeding
    task.__dict__["_unseeded_warned"] = True
    log.warning(
        "%s's weights were drawn before any seed was set (the task was built before the Trainer and before "
        "seed_everything), so two runs of this script start from different weights although the run is seeded "
        "(seed %d). Build the task after Trainer(...), or call seed_everything(%d) first.",
        type(task).__name__,
        seed,
        seed,
    )


def stage_seed(trainer: Trainer, stage: str) -> int | None:
    """The seed this stage uses (``trainer.options.seed``, resolved again now: ``Trainer(seed=...)``, else the
    program's ``seed_everything(n)``, else 0; :func:`trainer.options.resolve_seed`), logged on rank 0 with where
    it came from. The training sampler's shuffle and a resumed rank's fallback RNG read the same option."""
    source = resolve_seed(trainer.options)
    seed = trainer.options.seed
    if trainer.is_global_zero:
        if seed is None:
            log.info("Seed: none for %s (Trainer(seed=None)): the global generators are not seeded.", stage)
            return seed
        # seed_everything's own "Seed set to N" already told the console: this line says it again only at DEBUG.
        level = logging.DEBUG if source.startswith("seed_everything") and _SHOWN_SEED == [seed] else logging.INFO
        if trainer.world_size > 1:
            log.log(level, "Seed %d for %s, from %s: each rank seeds %d + its global rank.", seed, stage, source, seed)
        else:
            log.log(level, "Seed %d for %s, from %s.", seed, stage, source)
    return seed


def teardown_stage(trainer: Trainer, stage: str, *, failed: bool) -> None:
    """``teardown`` of the profiler (its summary), the task, the callbacks and the datamodule (all of them,
    even when one raises), then the loggers' ``finalize`` on rank 0. After a successful stage every rank
    leaves together (a barrier) and the first teardown error is raised; after a failed one the stage's own
    error wins and every teardown error is logged.
    """
    task, datamodule, callbacks, profiler = trainer.task, trainer.datamodule, trainer.callbacks, trainer.profiler
    assert task is not None
    errors: list[BaseException] = []
    steps = [lambda: task.teardown(stage)] + [(lambda cb=cb: cb.teardown(trainer, task, stage)) for cb in callbacks]
    if profiler is not None:
        steps.insert(0, lambda: profiler.teardown(stage))
    if datamodule is not None:
        steps.append(lambda: datamodule.teardown(stage))
    for step in steps:
        try:
            step()
        except Exception as exc:  # keep tearing down; report the first error below
            errors.append(exc)
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.finalize("failed" if failed else "success")
    sync_mirrors()  # a run directory on object storage: its logs, config and traces uploaded
    if not failed:
        # Leave every stage together: no rank exits (and tears gloo down at interpreter exit) while a
        # peer is still inside the stage's last collective.
        comm.barrier(trainer.device)
    if errors and not failed:
        raise errors[0]
    for error in errors:  # after a failed stage its own error wins; these are logged, never dropped
        log.error("Teardown after the failed %s stage: %s: %s", stage, type(error).__name__, error, exc_info=error)


def handle_failure(trainer: Trainer, task: TaskModule, exc: BaseException, teardown: Callable[[], None]) -> None:
    """A stage raised ``exc``: every callback's ``on_exception`` (one that raises is logged and the others
    still run: the run's error wins), then ``teardown`` in a ``finally``; an error of the teardown after the
    failure is logged, never dropped and never raised over ``exc``."""
    try:
        for cb in trainer.callbacks:
            try:
                cb.on_exception(trainer, task, exc)
            except Exception as hook_error:
                log.error(
                    "%s.on_exception raised %s: %s (while handling %s: %s)",
                    type(cb).__name__,
                    type(hook_error).__name__,
                    hook_error,
                    type(exc).__name__,
                    exc,
                )
    finally:
        try:
            teardown()
        except Exception as teardown_error:
            log.error(
                "Teardown after the failure (%s: %s) also failed: %s: %s",
                type(exc).__name__,
                exc,
                type(teardown_error).__name__,
                teardown_error,
                exc_info=teardown_error,
            )


def init_process_group(trainer: Trainer) -> bool:
    """Create the default process group if the launch needs one and none exists (a collective on first
    use); True when this call created it, so the Trainer owns it and destroys it at interpreter exit."""
    opts = trainer.options
    return comm.ensure_process_group(
        trainer.env,
        device=trainer.device,
        timeout=datetime.timedelta(seconds=opts.process_group_timeout),
        init_timeout=datetime.timedelta(seconds=opts.init_timeout),
        # NCCL's flight recorder on by default, so a collective timeout leaves a trace to read.
        backend_env=nccl_flight_recorder_env_defaults(local_dir(trainer.default_root_dir)),
        single_process=trainer.strategy.needs_process_group,
    )


def start_watchdog(trainer: Trainer) -> Watchdog | None:
    """A daemon thread that dumps this rank's stacks and exits if no beat arrives within
    ``watchdog_timeout`` seconds; None when the option is off."""
    opts = trainer.options
    return start_for_run(
        opts.watchdog_timeout,
        world_size=trainer.world_size,
        rank=trainer.global_rank,
        process_group_timeout=opts.process_group_timeout,
        run_dir=local_dir(trainer.log_dir),  # hang reports: local (a mirror of a run directory on object storage)
    )


def with_default_callbacks(
    callbacks: list[Callback],
    *,
    progress_bar: Callable[[], Callback] | None,
    checkpoint: Callable[[], Callback] | None,
    memory_plan: Callable[[], Callback] | None = None,
) -> list[Callback]:
    """``callbacks`` plus the built-ins the Trainer adds by default, each unless the user passed one of its
    kind: ``progress_bar`` (the ProgressBar class, when ``enable_progress_bar``), ``checkpoint`` (the
    ModelCheckpoint class, when ``enable_checkpointing``) and ``memory_plan`` (a MemoryPlan maker, when
    ``memory_plan`` is on). The classes are arguments so that this module imports no callback (and so not the
    Trainer they type-hint)."""
    if progress_bar is not None and not any(getattr(cb, "is_progress_bar", False) for cb in callbacks):
        callbacks.append(progress_bar())
    if checkpoint is not None and not any(getattr(cb, "is_model_checkpoint", False) for cb in callbacks):
        callbacks.append(checkpoint())
    if memory_plan is not None and not any(getattr(cb, "is_memory_plan", False) for cb in callbacks):
        callbacks.append(memory_plan())
    return callbacks
