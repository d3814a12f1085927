"""``python -m recipes.train`` (console script ``keel-train``): fit and test a task from Hydra config.

The config tree is ``conf/`` (see :func:`recipes.config_dir.config_dir`); ``conf/train.yaml`` composes
the groups ``trainer``, ``task``, ``data``, ``callbacks`` and ``logger``, and ``+experiment=<name>``
layers a whole recipe on top. Every ``_target_`` is instantiated here and nowhere else: the Trainer gets
only ``trainer.*``, the task only ``task.*``, the datamodule only ``data.*``. Examples::

    python -m recipes.train                                   # the digits recipe
    python -m recipes.train +experiment=charlm                # the character-level GPT
    python -m recipes.train trainer.max_epochs=5 logger=csv   # any key, any group
    python -m recipes.train ~callbacks.progress test=false    # drop a callback, skip the test split
    python -m recipes.train -m trainer.precision=32,bf16-mixed   # a sweep: one run per value
    torchrun --standalone --nproc-per-node 2 -m recipes.train    # DDP: same command, one run directory

Run directory: ``${output_dir}/${name}/version_N``. The logger picks N (rank 0 takes the next free
number and broadcasts it; ``logger.version=N`` pins it; a torchrun restart or SLURM requeue of the same
job finds its folder again through the ``.keel_run_id`` marker), the Trainer's run directory is the
logger's folder, and everything a run writes lands there: TensorBoard events (or metrics.csv),
``config.yaml`` and ``checkpoints/``. ``ckpt_path: last`` (the default) resumes from that folder's
latest checkpoint and is a no-op in a fresh one. Hydra writes no files of a single run
(``hydra.output_subdir: null``, logging to stderr only) and never changes the working directory.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from recipes.config_callback import SaveConfig
from recipes.config_dir import config_dir
from recipes.overrides import check_config_overrides
from recipes.trainer_schema import check_overrides, override_args  # importing it registers trainer/options_schema
from trainer import Callback, DataModule, TaskModule, Trainer, seed_everything
from trainer.distributed.launcher import run_identity
from trainer.loggers import Logger
from trainer.observability import summary as run_summary
from trainer.storage import is_url

log = logging.getLogger("recipes.train")  # also when run as __main__ (python -m recipes.train)


def local_dir(path: str) -> str:
    """``${keel_local:${output_dir}}`` in conf/: what Hydra and the data modules write as plain local files (a
    sweep's folder, data shards) stays local when ``output_dir`` is on object storage: ``s3://bucket/runs`` maps
    to ``outputs/s3/bucket/runs`` here; a path is itself. (A URL is never a local folder name.)"""
    if not is_url(path):
        return path
    scheme, rest = path.split("://", 1)
    return os.path.join("outputs", scheme, rest)


OmegaConf.register_new_resolver("keel_local", local_dir, replace=True)

COMMAND = "python -m recipes.train"


def _instantiate(node: Any) -> Any:
    # _convert_="all": the objects receive plain dicts and lists, not OmegaConf containers, so that
    # isinstance(x, dict) checks hold and save_hyperparameters() keeps them in checkpoints.
    return instantiate(node, _convert_="all")


def build(cfg: DictConfig, *, command: str = COMMAND) -> tuple[Trainer, TaskModule, DataModule | None]:
    """Instantiates the Trainer, the task and the datamodule from a composed ``conf/train.yaml``.

    Seeds the global generators with ``trainer.seed`` first, so that the task's initial weights are the
    same on every run and every rank (the Trainer seeds ``seed + rank`` only at the start of ``fit``,
    after the task exists). Nothing here starts a process group: a bad option fails before one exists.

    Args:
        cfg: The composed config. ``data`` may be absent (``~data``) when the task defines its own
            ``*_dataloader`` methods; ``logger`` may be absent (``~logger``) for no logger.
        command: Recorded as the first line of ``config.yaml``.

    Returns:
        ``(trainer, task, datamodule)``; ``datamodule`` is None without a ``data`` node.
    """
    options: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)  # type: ignore[assignment]
    if isinstance(options.get("strategy"), dict):  # trainer/strategy=fsdp: a strategy object with its settings
        options["strategy"] = _instantiate(cfg.trainer.strategy)
    if options.get("seed") is not None:
        seed_everything(options["seed"])
    data_cfg = cfg.get("data")
    datamodule = _instantiate(data_cfg) if data_cfg is not None else None
    task = _instantiate(cfg.task)
    # A dict keyed by name, so that entries can be changed, added (+callbacks.mine=...) or removed
    # (~callbacks.progress) from the command line; null entries are skipped.
    callbacks: list[Callback] = [
        _instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node is not None
    ]
    config = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    callbacks.append(SaveConfig(config, command))
    trainer = Trainer(**options, callbacks=callbacks, logger=_loggers(cfg))
    return trainer, task, datamodule


def _loggers(cfg: DictConfig) -> list[Logger] | bool:
    """``logger`` (the first: its folder is the run directory), then each of ``loggers`` (added with
    ``+logger@loggers.<name>=<option>``, e.g. ``+logger@loggers.wandb=wandb``), null entries skipped.

    An extra logger whose version is unset shares the first one's pinned version (``logger.version=N``),
    so that every logger reopens the same run directory; unpinned, they all resolve the same
    ``version_N`` because they share ``save_dir/name`` (``resolve_version`` runs for all before any writes).
    """
    nodes = [cfg.get("logger"), *(cfg.get("loggers") or {}).values()]
    built: list[Logger] = [_instantiate(node) for node in nodes if node is not None]
    for extra in built[1:]:
        if extra.version is None and built[0].version is not None and extra.root_dir == built[0].root_dir:
            extra.version = built[0].version
    return built or False


def run(cfg: DictConfig, *, command: str = COMMAND) -> dict[str, Any]:
    """Fits (resuming from ``cfg.ckpt_path``), tests the best checkpoint when ``cfg.test``, then prints
    a summary on rank 0.

    Returns:
        The summary (the same on every rank): ``metrics`` (name -> float), ``run_dir``, ``logs``
        (``[(kind, folder)]`` per logger), ``monitor``, ``best_model_path`` (None without a monitored
        checkpoint), ``best_model_score``, ``last_model_path``, ``tested_on``, ``global_step``,
        ``epochs``, ``seconds``.
    """
    trainer, task, datamodule = build(cfg, command=command)
    if _in_a_sweep():  # each job of a sweep is a run of its own (a restart of that job still finds its folder)
        trainer.continue_run_directory = False
    if trainer.is_global_zero:
        _warn_about_restarts()
    trainer.summary_on_fit_end = False  # printed below, with the test results
    start = time.monotonic()
    trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    summary = run_summary.of_fit(trainer, time.monotonic() - start)
    tested_on = None
    if cfg.get("test"):
        # "best" needs a monitored save; without one, test the weights fit ended with.
        best = summary["best_model_path"]
        trainer.test(task, datamodule=datamodule, ckpt_path="best" if best else None)
        tested_on = "best checkpoint" if best else "final weights"
        summary["metrics"] = dict(sorted({**summary["metrics"], **run_summary.metrics_of(trainer)}.items()))
        summary["seconds"] = time.monotonic() - start
    summary["tested_on"] = tested_on
    if trainer.is_global_zero:
        print(run_summary.format_summary(summary, tested_on=tested_on), flush=True)
        if _in_a_sweep():
            _SWEEP.append((_job_overrides(), summary))
    return summary


# The runs of this process's sweep (Hydra's basic launcher runs the jobs one after another here): (overrides, summary)
_SWEEP: list[tuple[list[str], dict[str, Any]]] = []


def _job_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task)


def sweep_table(runs: list[tuple[list[str], dict[str, Any]]]) -> str:
    """The end of a sweep: one row per run, the overrides that differ between runs, its run directory and its final
    metrics (4 significant digits; keel's perf/ measurements left out)."""
    width = max(len(o) for o, _ in runs)
    varying = [i for i in range(width) if len({o[i] if i < len(o) else None for o, _ in runs}) > 1]
    names = sorted({n for _, s in runs for n in s["metrics"] if not n.startswith("perf/")})
    header = ["run", "overrides", "run dir", *names]
    rows = [
        [
            str(i),
            " ".join(o[j] for j in varying if j < len(o)) or "-",
            s["run_dir"],
            *(f"{s['metrics'][n]:.4g}" if n in s["metrics"] else "-" for n in names),
        ]
        for i, (o, s) in enumerate(runs)
    ]
    lines = [f"keel sweep: {len(runs)} runs", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _warn_about_restarts() -> None:
    """torchrun without ``--standalone`` or ``--rdzv-id`` gives its workers the run id ``none``: a
    restart then cannot find this run's directory and starts a new one from scratch."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if os.environ.get("TORCHELASTIC_RUN_ID") == "none" and restarts > 0 and run_identity() is None:
        log.warning(
            "torchrun --max-restarts %d without --standalone or --rdzv-id: the job has no run id, so a "
            "restart starts a NEW run directory instead of resuming this one. Launch with "
            "`torchrun --standalone ...` (one node) or `--rdzv-id <job id>`.",
            restarts,
        )


def _in_a_sweep() -> bool:
    """Whether this is a job of a ``-m`` sweep (any launcher)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _check_sweep_launcher() -> None:
    """Refuses a ``-m`` sweep run by Hydra's basic launcher inside a torchrun/SLURM job.

    The basic launcher runs the sweep's jobs one after another in this process. Inside a torchrun or
    SLURM job they would all share the job's run identity (``trainer.distributed.launcher.run_identity``), so every
    job after the first would land in the first job's run directory and resume its checkpoint. Hydra's
    submitit launcher runs each job as its own SLURM job and is not affected.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    basic = hydra_cfg.runtime.choices.get("hydra/launcher") == "basic"
    if hydra_cfg.mode == RunMode.MULTIRUN and basic and run_identity() is not None:
        raise SystemExit(
            "keel: a -m sweep with Hydra's basic launcher cannot run inside a torchrun/SLURM job "
            f"({run_identity()}): its jobs would share one run directory. Launch one job per setting, "
            "or use hydra/launcher=submitit_slurm."
        )


def _check_submitit_local_tasks() -> None:
    """Refuses Hydra's ``submitit_local`` launcher with ``tasks_per_node`` > 1.

    That launcher starts the job's tasks as independent copies with submitit's own variables
    (``SUBMITIT_LOCAL_NTASKS``...), not torchrun's or SLURM's: keel would run each copy as a single
    process, all writing to one run directory.
    """
    ntasks = os.environ.get("SUBMITIT_LOCAL_NTASKS", "1").strip() or "1"
    if ntasks.isdigit() and int(ntasks) > 1:
        raise SystemExit(
            f"keel: hydra/launcher=submitit_local with tasks_per_node={ntasks} starts {ntasks} independent "
            "copies of this job (keel reads torchrun's or SLURM's variables, not submitit's local ones). Use "
            "tasks_per_node=1 with submitit_local, torchrun for several processes on one machine, or "
            "hydra/launcher=submitit_slurm."
        )


@hydra.main(config_path=config_dir(), config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    _check_sweep_launcher()
    _check_submitit_local_tasks()
    overrides = list(HydraConfig.get().overrides.task)
    run(cfg, command=shlex.join([*COMMAND.split(), *overrides]))


def main() -> None:
    """Entry point of ``python -m recipes.train`` and of the ``keel-train`` console script.

    Checks the command line's ``trainer.*`` overrides against the schema first (an unknown key or a
    wrong type exits with status 2, naming the key and listing the valid ones), then hands over to
    Hydra, which composes the config (exit status 1 on any other config error) and calls :func:`run`.
    """
    error = check_overrides(sys.argv[1:]) or check_config_overrides(override_args(sys.argv[1:]))
    if error is not None:
        print(f"keel: {error}", file=sys.stderr)  # before Hydra: logging is not configured yet
        raise SystemExit(2)
    _hydra_main()
    if len(_SWEEP) > 1:
        print(sweep_table(_SWEEP), flush=True)


if __name__ == "__main__":
    main()
