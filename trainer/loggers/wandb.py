"""``WandbLogger``: Weights & Biases, with Lightning's constructor, one W&B run per keel run directory.

``wandb`` is an optional extra (``pip install -e ".[wandb]"``), imported on the first write, on rank 0
only (the Trainer calls loggers on global rank 0 only, docs/design.md section 7).
"""

from __future__ import annotations

import glob
import logging
import os
import secrets
import string
from typing import TYPE_CHECKING, Any, cast

from trainer.distributed import comm
from trainer.loggers import tracking, wandb_records
from trainer.loggers.logger import DummyExperiment, Logger, _to_plain, _yaml_safe
from trainer.storage import local_dir

if TYPE_CHECKING:  # pragma: no cover
    from wandb.sdk.wandb_run import Run

log = logging.getLogger(__name__)

STATE_FILE = "wandb_run.json"
# Seconds between W&B's flushes of its run file (its own default: 15). What a killed process had not flushed is
# lost; a shorter interval loses less, and the resumed run re-logs whatever the file lacks after its checkpoint.
FLUSH_INTERVAL = 1.0
FINISH_TIMEOUT = 30.0  # seconds finalize waits for W&B to finish writing the run file
_ID_ALPHABET = string.ascii_lowercase + string.digits


def _new_run_id() -> str:
    """Eight lower-case letters and digits, the shape of ids W&B generates itself."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))


class WandbLogger(Logger):
    """Logs metrics, hyperparameters and the resolved config to a W&B run (online or offline).

    The keel run directory is ``save_dir/<project>/version_N`` (Lightning puts checkpoints in
    ``save_dir/<project>/<version>`` too), and W&B writes its own files under ``<run dir>/wandb/``
    unless ``dir`` says otherwise. The W&B run id is chosen once, stored in ``<run dir>/wandb_run.json``
    before the run is opened, and read back by every later process of the same run directory, so a
    torchrun restart, a SLURM requeue or ``logger.version=N`` continues the same W&B run
    (``resume="allow"``) instead of starting a new one.

    Each metric key is recorded at most once per step and in increasing steps (``step=`` is the global
    step): a resumed job re-runs the steps after its last checkpoint, and those the W&B run already has
    are not sent again. "Already has" is read from W&B's own run files of the earlier attempts
    (``<dir>/wandb/*-<id>/run-<id>.wandb``), so a step that a killed process logged but W&B never wrote
    is logged again by the resumed one. W&B writes that file every second here (``FLUSH_INTERVAL``,
    unless ``settings`` is given) and keeps the newest step in memory until a later step is logged:
    a SIGKILL loses that tail, and only the steps of it after the last checkpoint are logged again.

    Args:
        name: Display name of the W&B run; None: ``<project>/version_N``.
        save_dir: Root folder of the run directories (Lightning's ``save_dir``).
        version: Lightning's meaning: the W&B run id to use or resume, as a ``str`` (also the run folder's
            name). An ``int`` N pins keel's ``version_N`` folder, whose stored W&B id is then reused.
            None: the next free ``version_N`` and a new id (or the stored one after a restart).
        offline: Write the run to disk only (``wandb sync <run dir>/wandb/offline-run-*`` uploads it later).
            ``WANDB_MODE=offline`` does the same.
        dir: Where W&B writes its files; None: the run directory.
        id: Same as a ``str`` ``version`` (Lightning's alias); takes precedence over it.
        anonymous: Lightning's flag: log anonymously (``anonymous="allow"``).
        project: The W&B project, also keel's experiment folder; None: ``$WANDB_PROJECT``, else
            ``"keel_logs"``.
        log_model: True: when ``fit`` succeeds, upload ``<run dir>/checkpoints/*.ckpt`` as one W&B
            artifact of type ``model``. False: nothing is uploaded.
        experiment: An existing ``wandb`` run to log to instead of opening one (it is not finished here).
        prefix: Prepended to every metric key with ``-`` (Lightning's ``prefix``).
        checkpoint_name: Name of the model artifact; None: ``model-<run id>``.
        **kwargs: Passed to ``wandb.init`` (``entity``, ``tags``, ``group``, ``notes``, ``job_type``,
            ``settings``, ...).
    """

    def __init__(
        self,
        name: str | None = None,
        save_dir: str | os.PathLike = ".",
        version: int | str | None = None,
        offline: bool = False,
        dir: str | os.PathLike | None = None,
        id: str | None = None,
        anonymous: bool | None = None,
        project: str | None = None,
        log_model: bool = False,
        experiment: Run | None = None,
        prefix: str = "",
        checkpoint_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        project = project or os.environ.get("WANDB_PROJECT") or "keel_logs"
        run_id = id if id is not None else (version if isinstance(version, str) else None)
        folder_version: int | str | None = run_id if run_id is not None else version
        super().__init__(save_dir, name=project, version=folder_version)
        self.project = project
        self.display_name = name
        self.offline = offline
        self.dir = os.fspath(dir) if dir is not None else None
        self.anonymous = anonymous
        self.log_model = tracking.check_log_model(log_model, type(self).__name__)
        self.prefix = prefix
        self.checkpoint_name = checkpoint_name
        self._requested_id = run_id
        self._init_kwargs = kwargs
        self._run: Run | None = experiment
        self._own_run = experiment is None
        self._state: dict[str, Any] = {}
        self._marks = tracking.StepWatermarks()

    # ------------------------------------------------------------------------------------------ the run
    @property
    def state_path(self) -> str:
        """``<run dir>/wandb_run.json``: the W&B run id, written before the run is opened."""
        return os.path.join(local_dir(self.log_dir, download=True), STATE_FILE)  # on object storage: the mirror

    @property
    def run_id(self) -> str | None:
        """The W&B run id (known once the run is opened, or given to the constructor)."""
        if self._run is not None:
            return self._run.id
        return self._state.get("id") or self._requested_id

    @property
    def experiment(self) -> Run:
        """The ``wandb`` run, opened (or resumed) on first use (Lightning's name). Rank 0 only: other ranks get
        a :class:`~trainer.loggers.logger.DummyExperiment` that does nothing."""
        if comm.get_rank() != 0:
            return DummyExperiment()  # type: ignore[return-value]
        if self._run is None:
            self._run = self._open()
        return self._run

    def _open(self) -> Run:
        log_dir = self._ensure_log_dir()
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                'WandbLogger needs the wandb package: `pip install -e ".[wandb]"` (or `pip install wandb`).'
            ) from exc
        state = tracking.read_state(self.state_path)
        run_id = self._requested_id or state.get("id") or _new_run_id()
        if state.get("id") not in (None, run_id):
            log.warning(
                "WandbLogger: %s names W&B run %s but id=%r was given; logging to %s.",
                self.state_path,
                state["id"],
                run_id,
                run_id,
            )
        self._state = {"id": run_id, "project": self.project}
        tracking.write_state(self.state_path, self._state)  # before the run exists: a restart keeps the id
        wandb_dir = self.dir or log_dir
        earlier = self._run_files(wandb_dir, run_id)
        self._marks = tracking.StepWatermarks(wandb_records.last_steps(earlier))
        init: dict[str, Any] = {
            "project": self.project,
            "name": self.display_name or os.path.relpath(self.log_dir, self.save_dir),
            "id": run_id,
            "dir": wandb_dir,
            "resume": "allow",
        }
        if self.offline:
            init["mode"] = "offline"
        if self.anonymous:
            init["anonymous"] = "allow"
        if "settings" not in self._init_kwargs and "x_transaction_log_flush_interval" in wandb.Settings.model_fields:
            init["settings"] = wandb.Settings(x_transaction_log_flush_interval=FLUSH_INTERVAL)
        init.update(self._init_kwargs)
        os.makedirs(wandb_dir, exist_ok=True)
        run = wandb.init(**init)
        log.info(
            "W&B run %s (%s%s) in %s",
            run.id,
            f"resumed after step {max(self._marks.steps.values())}, " if self._marks.steps else "",
            "offline" if run.offline else "online",
            log_dir,
        )
        return run

    @staticmethod
    def _run_files(wandb_dir: str, run_id: str) -> list[str]:
        """W&B's run files of earlier processes of this run (``offline-run-*-<id>`` or ``run-*-<id>``)."""
        pattern = os.path.join(glob.escape(wandb_dir), "wandb", f"*run-*-{glob.escape(run_id)}*", f"run-{run_id}.wandb")
        return sorted(path for path in glob.glob(pattern) if "latest-run" not in path)

    # ------------------------------------------------------------------------------------------ writes
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        run = self.experiment
        fresh = self._marks.fresh(tracking.with_prefix(metrics, self.prefix), step)
        if not fresh:
            return
        fresh["trainer/global_step"] = step  # Lightning's x-axis key, for dashboards made with Lightning
        run.log(fresh, step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Merges ``params`` (nested) into the run's config; the same values again change nothing."""
        plain = _yaml_safe(_to_plain(params))
        if plain:
            self.experiment.config.update(plain, allow_val_change=True)

    def log_config(self, config: dict[str, Any]) -> None:
        """The resolved run config, under the run config's ``config`` key."""
        self.log_hyperparams({"config": config})

    def finalize(self, status: str) -> None:
        """Uploads the checkpoints (``log_model=True`` and success), then finishes the W&B run.

        A later write (``test`` after ``fit``) resumes the same W&B run.
        """
        if self._run is None:
            return
        if self.log_model and status == "success":
            files = tracking.checkpoint_files(self.log_dir)
            if files:
                import wandb

                artifact = wandb.Artifact(self.checkpoint_name or f"model-{self._run.id}", type="model")
                for path in files:
                    artifact.add_file(path)
                self._run.log_artifact(artifact, aliases=["latest"])
        if self._own_run:
            run_file = getattr(self._run.settings, "sync_file", None)
            self._run.finish(exit_code=0 if status == "success" else 1)
            self._run = None
            # finish() returns before wandb's service has written the run file to the end; wait for it, so
            # that a later stage or process that reads it (the steps already recorded) sees all of it.
            written = bool(run_file) and os.path.isfile(cast(str, run_file))  # none when disabled or without a run file
            if written and not wandb_records.wait_for_exit(cast(str, run_file), timeout=FINISH_TIMEOUT):
                log.warning("W&B had not finished writing %s after %.0f s.", run_file, FINISH_TIMEOUT)

    def __repr__(self) -> str:
        return (
            f"WandbLogger(project={self.project!r}, save_dir={self.save_dir!r}, version={self.version!r}, "
            f"run_id={self.run_id!r})"
        )
