"""``MLFlowLogger``: MLflow tracking with Lightning's constructor, one MLflow run per keel run directory.

``mlflow`` is an optional extra (``pip install -e ".[mlflow]"``), imported on the first write, on rank 0
only (the Trainer calls loggers on global rank 0 only, docs/design.md section 7). The default tracking store
is a local SQLite file, ``<save_dir>/mlflow.db`` (MLflow 3 refuses the plain file store by default), so
``mlflow ui --backend-store-uri sqlite:///<save_dir>/mlflow.db`` shows every run under ``save_dir``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.distributed import comm
from trainer.loggers import tracking
from trainer.loggers.logger import DummyExperiment, Logger
from trainer.storage import is_url, local_dir

if TYPE_CHECKING:  # pragma: no cover
    from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)

STATE_FILE = "mlflow_run.json"
DB_FILE = "mlflow.db"
RUN_DIR_TAG = "keel.run_dir"  # the run directory, a tag of the MLflow run: found again if the state file is lost
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
_BATCH = 100  # MLflow's limit of params per log_batch call (metrics: 1000)
_INVALID_KEY = re.compile(r"[^a-zA-Z0-9_\-./ ]")


class MLFlowLogger(Logger):
    """Logs metrics, hyperparameters and the resolved config to an MLflow run.

    The keel run directory is ``save_dir/<experiment_name>/version_N``. The MLflow run is created on
    the first write and its id stored in ``<run dir>/mlflow_run.json`` (and as the run's ``keel.run_dir``
    tag), so every later process of the same run directory (torchrun restart, SLURM requeue,
    ``logger.version=N``) continues the same MLflow run.

    Each metric key is recorded at most once per step and in increasing steps: when a run is resumed,
    the last step per key is read back from the tracking store, and the steps a resumed job re-runs
    after its last checkpoint are not logged twice. MLflow params cannot change once logged: a resumed
    run logs only params it does not have yet and warns about any whose value changed.

    Args:
        experiment_name: MLflow experiment, created if missing; also keel's experiment folder.
        run_name: Display name of the run; None: ``<experiment_name>/version_N``.
        tracking_uri: None: ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<save_dir>/mlflow.db``.
        tags: Tags set when the run is created.
        save_dir: Root folder of the run directories and of the default SQLite store.
        log_model: True: when ``fit`` succeeds, upload ``<run dir>/checkpoints/*.ckpt`` as artifacts
            under ``checkpoints/``. False: nothing is uploaded.
        prefix: Prepended to every metric key with ``-`` (Lightning's ``prefix``).
        artifact_location: Artifact root of a new experiment; None with the default SQLite store:
            ``<save_dir>/mlartifacts``; None otherwise: the tracking server's default.
        run_id: An existing MLflow run to log to (resumed); None: the stored one, else a new run.
        synchronous: Passed to MLflow's ``log_batch`` (False: log asynchronously); None: MLflow's default.
        version: keel's run folder: ``int`` N pins ``version_N``, a ``str`` names the folder; None: the
            next free ``version_N`` (the same one again after a restart).
    """

    def __init__(
        self,
        experiment_name: str = "keel_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, Any] | None = None,
        save_dir: str | os.PathLike = "./mlruns",
        log_model: bool = False,
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
        synchronous: bool | None = None,
        *,
        version: int | str | None = None,
    ) -> None:
        super().__init__(save_dir, name=experiment_name, version=version)
        if is_url(self.save_dir) and tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI"):
            raise ValueError(
                f"MLFlowLogger(save_dir={self.save_dir!r}) needs tracking_uri=... (or $MLFLOW_TRACKING_URI): its "
                "default store is a SQLite file under save_dir, and SQLite cannot live in a bucket. Give a tracking "
                "server's URI, or a local save_dir."
            )
        self.experiment_name = experiment_name
        self.run_name = run_name
        self._default_store = tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI")
        self.tracking_uri: str = (
            tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or ("sqlite:///" + str(Path(self.save_dir).resolve() / DB_FILE))
        )
        self.tags = dict(tags or {})
        self.log_model = tracking.check_log_model(log_model, type(self).__name__)
        self.prefix = prefix
        self.artifact_location = artifact_location
        self.synchronous = synchronous
        self._requested_run_id = run_id
        self._client: MlflowClient | None = None
        self._run_id: str | None = None
        self._experiment_id: str | None = None
        self._running = False
        self._marks = tracking.StepWatermarks()
        self._warned_keys: set[str] = set()

    # ------------------------------------------------------------------------------------------ the run
    @property
    def state_path(self) -> str:
        """``<run dir>/mlflow_run.json``: the MLflow run id, experiment id and tracking URI."""
        return os.path.join(local_dir(self.log_dir, download=True), STATE_FILE)  # on object storage: the mirror

    @property
    def experiment(self) -> MlflowClient:
        """The ``MlflowClient``, with this logger's run created or resumed (Lightning's name). Rank 0 only:
        other ranks get a :class:`~trainer.loggers.logger.DummyExperiment` that does nothing."""
        if comm.get_rank() != 0:
            return DummyExperiment()  # type: ignore[return-value]
        if self._client is None:
            self._open()
        elif not self._running:
            self._client.update_run(self._run_id, status="RUNNING")  # type: ignore[arg-type]
            self._running = True
        assert self._client is not None
        return self._client

    @property
    def run_id(self) -> str | None:
        """The MLflow run id (known once the run is opened, or given to the constructor)."""
        return self._run_id or self._requested_run_id

    @property
    def experiment_id(self) -> str | None:
        return self._experiment_id

    def _open(self) -> None:
        log_dir = self._ensure_log_dir()
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(
                'MLFlowLogger needs the mlflow package: `pip install -e ".[mlflow]"` (or `pip install mlflow`).'
            ) from exc
        client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment_id = self._experiment(client)
        state = tracking.read_state(self.state_path)
        run_id = (
            self._requested_run_id
            or state.get("run_id")
            or self._find_run(client, experiment_id, self._run_dir_tag(log_dir))
        )
        if run_id is None:
            tags = {RUN_DIR_TAG: self._run_dir_tag(log_dir), **{k: str(v) for k, v in self.tags.items()}}
            run = client.create_run(
                experiment_id, tags=tags, run_name=self.run_name or os.path.relpath(self.log_dir, self.save_dir)
            )
            run_id = run.info.run_id
            steps: dict[str, int] = {}
        else:
            client.update_run(run_id, status="RUNNING")
            steps = self._recorded_steps(client, run_id)
        tracking.write_state(
            self.state_path, {"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": self.tracking_uri}
        )
        self._client, self._run_id, self._experiment_id, self._running = client, run_id, experiment_id, True
        self._marks = tracking.StepWatermarks(steps)
        log.info(
            "MLflow run %s (%s) of experiment %r in %s",
            run_id,
            "resumed" if steps or state else "new",
            self.experiment_name,
            self.tracking_uri,
        )

    def _experiment(self, client: MlflowClient) -> str:
        found = client.get_experiment_by_name(self.experiment_name)
        if found is not None:
            return found.experiment_id
        location = self.artifact_location
        if location is None and self._default_store:
            location = (Path(self.save_dir).resolve() / "mlartifacts").as_uri()
        try:
            return client.create_experiment(self.experiment_name, artifact_location=location)
        except Exception:  # another job created it first
            found = client.get_experiment_by_name(self.experiment_name)
            if found is None:
                raise
            return found.experiment_id

    def _run_dir_tag(self, log_dir: str) -> str:
        """The run directory as the run's tag: its URL on object storage (the same from every node)."""
        return self.log_dir if is_url(self.log_dir) else os.path.abspath(log_dir)

    @staticmethod
    def _find_run(client: MlflowClient, experiment_id: str, run_dir: str) -> str | None:
        """The run tagged with this run directory (its state file was not written: killed right after)."""
        runs = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_DIR_TAG}` = '{run_dir}'", max_results=1)
        return runs[0].info.run_id if runs else None

    @staticmethod
    def _recorded_steps(client: MlflowClient, run_id: str) -> dict[str, int]:
        """The last step of every metric the run already has, read from the store (once, on resume)."""
        return {
            key: max(point.step for point in client.get_metric_history(run_id, key))
            for key in client.get_run(run_id).data.metrics
        }

    # ------------------------------------------------------------------------------------------ writes
    def _key(self, key: str) -> str:
        clean = _INVALID_KEY.sub("_", key)
        if clean != key and key not in self._warned_keys:
            self._warned_keys.add(key)
            log.warning("MLflow metric names allow letters, digits, '_-./ ' only: %r is logged as %r.", key, clean)
        return clean

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        client = self.experiment
        named = {self._key(key): value for key, value in tracking.with_prefix(metrics, self.prefix).items()}
        fresh = self._marks.fresh(named, step)
        if not fresh:
            return
        stamp = int(time.time() * 1000)
        batch = [Metric(key, float(value), stamp, step) for key, value in fresh.items()]
        extra = {} if self.synchronous is None else {"synchronous": self.synchronous}
        for start in range(0, len(batch), 1000):
            client.log_batch(self._run_id, metrics=batch[start : start + 1000], **extra)  # type: ignore[arg-type]

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Logs ``params`` flattened with ``/`` as MLflow params; params the run already has are kept."""
        from mlflow.entities import Param

        client = self.experiment
        existing = client.get_run(self._run_id).data.params  # type: ignore[arg-type]
        new: list[Any] = []
        changed: list[str] = []
        for key, value in tracking.flat_items(params):
            key = _INVALID_KEY.sub("_", key)[:250]
            value = value[:MAX_PARAM_LENGTH]
            if key not in existing:
                new.append(Param(key, value))
                existing[key] = value
            elif existing[key] != value:
                changed.append(f"{key}: {existing[key]!r} -> {value!r}")
        for start in range(0, len(new), _BATCH):
            client.log_batch(self._run_id, params=new[start : start + _BATCH])  # type: ignore[arg-type]
        if changed:
            log.warning(
                "MLflow run %s keeps its first value of %d param(s) (MLflow params cannot change):\n  %s",
                self._run_id,
                len(changed),
                "\n  ".join(changed),
            )

    def log_config(self, config: dict[str, Any]) -> None:
        """The resolved run config: ``config.yaml`` among the run's artifacts and ``config/...`` params."""
        client = self.experiment
        client.log_dict(self._run_id, config, "config.yaml")  # type: ignore[arg-type]
        self.log_hyperparams({"config": config})

    def finalize(self, status: str) -> None:
        """Uploads the checkpoints (``log_model=True`` and success) and marks the run FINISHED or FAILED.

        A later write (``test`` after ``fit``) sets the run back to RUNNING.
        """
        if self._client is None or not self._running:
            return
        if self.log_model and status == "success":
            for path in tracking.checkpoint_files(self.log_dir):
                self._client.log_artifact(self._run_id, path, artifact_path="checkpoints")
        status_name = "FINISHED" if status == "success" else "FAILED"
        self._client.set_terminated(self._run_id, status_name)  # type: ignore[arg-type]
        self._running = False

    def __repr__(self) -> str:
        return (
            f"MLFlowLogger(experiment_name={self.experiment_name!r}, save_dir={self.save_dir!r}, "
            f"version={self.version!r}, tracking_uri={self.tracking_uri!r}, run_id={self.run_id!r})"
        )
