"""Experiment loggers: metrics and hyperparameters to files under a versioned run folder.

A logger owns one folder, ``save_dir/name/version_N`` (Lightning's layout). The only distributed thing
a logger does is :meth:`Logger.resolve_version`, a collective that every rank calls at the same point
so that all ranks agree on ``N`` (DESIGN.md section 9). Everything else writes files and is called by
the Trainer on global rank 0 only (DESIGN.md section 7).

tensorboard (and omegaconf, for YAML) are imported where they are used, so ``import trainer`` stays
cheap (DESIGN.md section 11). :class:`WandbLogger` and :class:`MLFlowLogger` live in their own modules
(re-exported here) and import ``wandb`` / ``mlflow`` only when they first write.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import os
import socket
import re
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

from trainer import dist
from trainer.rank_zero import rank_zero_warn

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"version_(\d+)")
_VALID_LOGGER_CHOICES = "True, False, a trainer.loggers.Logger or a list of them"
_warned_no_tensorboard = False


RUN_ID_MARKER = ".keel_run_id"


def run_identity() -> str | None:
    """What stays the same across restarts of one job: torchrun's run id, else SLURM's job id.

    A job of Hydra's ``submitit_local`` launcher is named by submitit's local job id (its controller's
    pid): that launcher runs a sweep's jobs at the same time, so each needs a run directory of its own.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    if run_id == "none":  # torchrun without --rdzv-id: its agent (our parent) lives across restarts
        agent = _agent_identity()
        if agent is not None:
            return f"torchrun-agent:{agent}"
    local_job = os.environ.get("SUBMITIT_LOCAL_JOB_ID")
    if local_job:  # before SLURM's: submitit_local jobs started inside an allocation share its job id
        return f"submitit-local:{socket.gethostname()}:{local_job}"
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    if not job_id:
        return None
    # The step id tells apart two srun steps in one allocation; a requeued job starts again at step 0.
    return f"slurm:{job_id}.{os.environ.get('SLURM_STEP_ID', os.environ.get('SLURM_STEPID', 'batch'))}"


def _agent_identity() -> str | None:
    """Host, pid and start time of the parent process (the torchrun agent), stable across restarts."""
    agent = os.getppid()
    try:
        with open(f"/proc/{agent}/stat") as handle:
            start_time = handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return f"{socket.gethostname()}:{agent}:{start_time}"


class Logger:
    """Base class of keel's loggers: a versioned folder plus ``log_metrics`` / ``log_hyperparams``.

    Contract:

    * :meth:`resolve_version` is a collective: the Trainer calls it on every rank, at the start of each
      stage, before anything is written. It never creates folders.
    * :meth:`log_metrics`, :meth:`log_hyperparams` and :meth:`finalize` write files. The Trainer calls
      them on global rank 0 only; subclasses need no rank checks. Values are host floats already.
    * :meth:`finalize` may be called several times (after ``fit`` and again after ``test``); a later
      ``log_*`` call reopens whatever it closed.

    Args:
        save_dir: Root folder of the logs.
        name: Experiment name, a sub-folder of ``save_dir``; None or ``""`` for none.
        version: ``int`` N for ``version_N``, a ``str`` used as the folder name as is, or None to pick
            the next free ``version_N`` in :meth:`resolve_version`.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "keel_logs",
        version: int | str | None = None,
    ) -> None:
        self.save_dir: str = os.path.expanduser(os.fspath(save_dir))
        self.name: str | None = name
        self.version: int | str | None = version

    @property
    def root_dir(self) -> str:
        """``save_dir/name``, or ``save_dir`` when ``name`` is None or empty: the folder of the versions."""
        return os.path.join(self.save_dir, self.name) if self.name else self.save_dir

    @property
    def log_dir(self) -> str:
        """This run's folder: ``root_dir/version_N`` (int version) or ``root_dir/<version>`` (str version).

        Raises:
            RuntimeError: The version is None and :meth:`resolve_version` has not run yet.
        """
        if self.version is None:
            raise RuntimeError(
                f"{type(self).__name__}.log_dir is unknown until the version is resolved: call "
                "resolve_version() on every rank first (the Trainer does it at the start of each stage), "
                "or pass version=... to the constructor."
            )
        folder = f"version_{self.version}" if isinstance(self.version, int) else str(self.version)
        return os.path.join(self.root_dir, folder)

    def resolve_version(self) -> None:
        """Picks the next free ``version_N`` on rank 0 and shares it with every rank.

        A collective (one ``broadcast_object``) when the version is still None: every rank must call it
        at the same point. Idempotent: once resolved (or given to the constructor), the version is kept
        and nothing is communicated, so ``fit`` then ``test`` write to the same folder. Creates nothing.
        """
        if self.version is not None:
            return
        picked = self._pick_version() if dist.get_rank() == 0 else None
        self.version = dist.broadcast_object(picked, src=0)  # type: ignore[assignment]
        log.debug("%s resolved version %s under %s", type(self).__name__, self.version, self.root_dir)

    def _pick_version(self) -> int:
        """A restarted job (same ``run_identity()``) gets its own folder back; a new run gets the next one.

        The chosen folder is created with a ``.keel_run_id`` marker so that a torchrun restart or a
        SLURM requeue of the same job lands in the same run directory and resumes from its checkpoints.
        """
        identity = run_identity()
        if identity is not None:
            for entry in sorted(os.listdir(self.root_dir)) if os.path.isdir(self.root_dir) else []:
                marker = os.path.join(self.root_dir, entry, RUN_ID_MARKER)
                if _VERSION_DIR.fullmatch(entry) and os.path.isfile(marker):
                    with open(marker) as handle:
                        if handle.read().strip() == identity:
                            return int(_VERSION_DIR.fullmatch(entry).group(1))  # type: ignore[union-attr]
        version = self._next_version()
        if identity is not None:
            # Claimed by an exclusive mkdir: jobs that start at the same moment (a submitit sweep on one
            # node) would otherwise all pick the same next free N and share one run directory.
            os.makedirs(self.root_dir, exist_ok=True)
            while True:
                folder = os.path.join(self.root_dir, f"version_{version}")
                try:
                    os.mkdir(folder)
                    break
                except FileExistsError:
                    version += 1
            with open(os.path.join(folder, RUN_ID_MARKER), "w") as handle:
                handle.write(identity)
        return version

    def _next_version(self) -> int:
        """``max(N) + 1`` over the ``version_N`` folders in :attr:`root_dir`, or 0 when there are none."""
        try:
            entries = os.listdir(self.root_dir)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        found = [
            int(match.group(1))
            for entry in entries
            if (match := _VERSION_DIR.fullmatch(entry)) and os.path.isdir(os.path.join(self.root_dir, entry))
        ]
        return max(found) + 1 if found else 0

    def _ensure_log_dir(self) -> str:
        """Creates and returns :attr:`log_dir`; resolves the version first in a single process.

        Raises:
            RuntimeError: The version is unresolved in a distributed job (resolving it here, on rank 0
                alone, would hang the collective).
        """
        if self.version is None and dist.get_world_size() == 1:
            self.resolve_version()
        path = self.log_dir
        os.makedirs(path, exist_ok=True)
        return path

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Records scalar metrics at optimizer step ``step``. Called on global rank 0 only.

        Args:
            metrics: Metric name to host float.
            step: The global step (optimizer steps) the values belong to.
        """
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Records the run's hyperparameters (the resolved options). Called on global rank 0 only.

        Args:
            params: A possibly nested mapping (a dict or an omegaconf ``DictConfig``).
        """
        raise NotImplementedError

    def log_config(self, config: dict[str, Any]) -> None:
        """Records the run's resolved config once (``recipes.train`` calls it at the start of ``fit``, rank 0).

        The default does nothing: the run directory's ``config.yaml`` already holds it. Trackers that
        live outside the run directory (W&B, MLflow) override it.

        Args:
            config: The composed config as plain nested dicts and lists.
        """

    def finalize(self, status: str) -> None:
        """Flushes and closes open files. Safe to call several times; a later ``log_*`` reopens them.

        Args:
            status: ``"success"`` or ``"failed"``.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(save_dir={self.save_dir!r}, name={self.name!r}, version={self.version!r})"


class DummyExperiment:
    """What a logger's ``experiment`` is on a rank other than 0 (Lightning's ``DummyExperiment``): every
    attribute is a no-op callable, so ``self.logger.experiment.add_image(...)`` in a hook that runs on
    every rank writes nothing there (no second event file in the run directory)."""

    def _nothing(self, *args: Any, **kwargs: Any) -> "DummyExperiment":
        return self

    def __getattr__(self, name: str) -> Any:
        return self._nothing

    def __getitem__(self, key: Any) -> "DummyExperiment":
        return self

    def __bool__(self) -> bool:
        return False


def _to_plain(params: Any) -> Any:
    """An omegaconf config (resolved) or any nested mapping as plain dicts and lists."""
    if type(params).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(params, resolve=True)
    if isinstance(params, Mapping):
        return {key: _to_plain(value) for key, value in params.items()}
    if isinstance(params, (list, tuple)):
        return [_to_plain(value) for value in params]
    return params


def _yaml_safe(value: Any) -> Any:
    """Nested dicts / lists of YAML scalars; any other leaf becomes ``str(leaf)``, keys become str."""
    if isinstance(value, Mapping):
        return {str(key): _yaml_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_safe(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def flatten_params(params: Mapping[str, Any], sep: str = "/") -> dict[str, int | float | str | bool]:
    """Flattens nested mappings with ``sep`` (``{"a": {"b": 1}}`` -> ``{"a/b": 1}``).

    Leaves that are not ``int``, ``float``, ``str`` or ``bool`` (None, lists, objects) become ``str``,
    which is what the TensorBoard HPARAMS tab accepts.
    """
    flat: dict[str, int | float | str | bool] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                visit(f"{prefix}{sep}{key}" if prefix else str(key), item)
        elif isinstance(value, (bool, int, float, str)):
            flat[prefix] = value
        else:
            flat[prefix] = str(value)

    for key, value in _to_plain(params).items():
        visit(str(key), value)
    return flat


class CSVLogger(Logger):
    """Writes ``log_dir/metrics.csv`` and ``log_dir/hparams.yaml``.

    ``metrics.csv`` has a ``step`` column and one column per metric name seen so far, in first-seen
    order; a row leaves the metrics it lacks empty. When a new name appears the file is rewritten with the
    wider header (as Lightning does), so the columns always line up. A ``metrics.csv`` already in the
    folder (a resumed run with a fixed version) is extended, not replaced.

    Args:
        save_dir: Root folder of the logs.
        name: Experiment name (sub-folder); None or ``""`` for none.
        version: See :class:`Logger`.
    """

    METRICS_FILE = "metrics.csv"
    HPARAMS_FILE = "hparams.yaml"

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "keel_logs",
        version: int | str | None = None,
    ) -> None:
        super().__init__(save_dir, name, version)
        self._keys: list[str] | None = None  # metric columns (without "step"); None until the file is read
        self._file: IO[str] | None = None
        self._writer: Any = None  # csv.DictWriter bound to self._file
        self._hparams: dict[str, Any] = {}

    @property
    def metrics_file_path(self) -> str:
        return os.path.join(self.log_dir, self.METRICS_FILE)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        path = os.path.join(self._ensure_log_dir(), self.METRICS_FILE)
        if self._keys is None:
            self._keys = self._read_header(path)
        new_keys = [key for key in metrics if key not in self._keys]
        if new_keys:
            self._keys.extend(new_keys)
            self._rewrite(path)
        if self._file is None:
            self._open(path)
        row = {"step": step, **metrics}
        self._writer.writerow(row)
        self._file.flush()  # type: ignore[union-attr]  # a crash loses no logged row

    def _read_header(self, path: str) -> list[str]:
        if not os.path.exists(path):
            return []
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        return [key for key in header if key != "step"]

    def _open(self, path: str) -> None:
        assert self._keys is not None
        fresh = not os.path.exists(path) or os.path.getsize(path) == 0
        self._file = open(path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=["step", *self._keys], restval="")
        if fresh:
            self._writer.writeheader()

    def _rewrite(self, path: str) -> None:
        """Rewrites the file with the current (wider) header; old rows keep their values, new cells empty."""
        self._close()
        assert self._keys is not None
        rows: list[dict[str, str]] = []
        if os.path.exists(path):
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        tmp = path + ".tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["step", *self._keys], restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Merges ``params`` into the hyperparameters logged so far and rewrites ``hparams.yaml``."""
        from omegaconf import OmegaConf

        self._hparams.update(_yaml_safe(_to_plain(params)))
        path = os.path.join(self._ensure_log_dir(), self.HPARAMS_FILE)
        with open(path, "w") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.create(self._hparams)))

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = self._writer = None

    def finalize(self, status: str) -> None:
        self._close()


class TensorBoardLogger(Logger):
    """Writes TensorBoard event files to ``log_dir`` through ``torch.utils.tensorboard.SummaryWriter``.

    The writer is created on the first write (so nothing touches the disk before the version is
    resolved and something is logged), and closed by :meth:`finalize`; a later write opens a new one
    in the same folder.

    Args:
        save_dir: Root folder of the logs.
        name: Experiment name (sub-folder); None or ``""`` for none.
        version: See :class:`Logger`.
        **writer_kwargs: Passed to ``SummaryWriter`` (e.g. ``flush_secs``, ``max_queue``).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "keel_logs",
        version: int | str | None = None,
        **writer_kwargs: Any,
    ) -> None:
        super().__init__(save_dir, name, version)
        self._writer_kwargs = writer_kwargs
        self._writer: SummaryWriter | None = None

    @property
    def experiment(self) -> SummaryWriter:
        """The ``SummaryWriter``, created on first use (Lightning's name); a :class:`DummyExperiment` that
        writes nothing on ranks other than 0."""
        if dist.get_rank() != 0:
            return DummyExperiment()  # type: ignore[return-value]
        if self._writer is None:
            log_dir = self._ensure_log_dir()
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError(
                    "TensorBoardLogger needs the tensorboard package: `pip install tensorboard`, or use "
                    "trainer.loggers.CSVLogger instead."
                ) from exc
            self._writer = SummaryWriter(log_dir=log_dir, **self._writer_kwargs)
        return self._writer

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        writer = self.experiment
        for name, value in metrics.items():
            writer.add_scalar(name, value, global_step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Writes ``params`` for the HPARAMS tab (flattened with ``/``) and as a text summary.

        The hparams plugin's three summaries (experiment, session start, session end) go into this
        run's own event file, so the HPARAMS tab lists this run next to its scalars.
        """
        flat = flatten_params(params)
        if not flat:
            return
        from torch.utils.tensorboard.summary import hparams

        writer = self.experiment
        experiment, session_start, session_end = hparams(flat, {})
        file_writer = writer._get_file_writer()  # what SummaryWriter.add_hparams uses, minus its sub-run
        for summary in (experiment, session_start, session_end):
            file_writer.add_summary(summary)
        lines = ["| name | value |", "|---|---|"]
        lines += ["| {} | {} |".format(key, str(value).replace("|", r"\|")) for key, value in flat.items()]
        writer.add_text("hparams", "\n".join(lines), global_step=0)

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


def _tensorboard_available() -> bool:
    """True when the tensorboard package can be found (without importing it: that takes ~0.5 s)."""
    return importlib.util.find_spec("tensorboard") is not None


def log_fit_start(loggers: list[Logger], task: Any, options: dict[str, Any], *, summary: bool) -> None:
    """Rank 0, at the start of ``fit``: the model summary line (when ``summary``) and the hyperparameters
    (the resolved Trainer options, and the task's ``hparams`` unless ``save_hyperparameters(logger=False)``)."""
    if summary:
        params = list(task.parameters())
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        size_mb = sum(p.numel() * p.element_size() for p in params) / 2**20
        log.info("%s: %s parameters (%s trainable), %.2f MB.", type(task).__name__, f"{total:,}",
                 f"{trainable:,}", size_mb)
    hparams: dict[str, Any] = {"trainer": options}
    if task.hparams and task._log_hyperparams:
        hparams["task"] = dict(task.hparams)
    for logger in loggers:
        logger.log_hyperparams(hparams)


def default_loggers(option: Any, default_root_dir: str | None) -> list[Logger]:
    """Turns the Trainer's ``logger`` option into a list of loggers.

    Args:
        option: ``True`` for the default logger (TensorBoard in ``default_root_dir/keel_logs``, or CSV
            when tensorboard is not installed, with a warning once); ``False`` or None for none; a
            :class:`Logger`; or a list / tuple of them.
        default_root_dir: Root folder of the default logger; the current directory when None.

    Returns:
        The loggers, in order (the first one's folder is the run directory).

    Raises:
        ValueError: Any other value; the message names the option, the value and the valid choices.
    """
    global _warned_no_tensorboard
    if option is True:
        save_dir = default_root_dir or os.getcwd()
        if _tensorboard_available():
            return [TensorBoardLogger(save_dir=save_dir, name="keel_logs")]
        if not _warned_no_tensorboard:
            _warned_no_tensorboard = True
            rank_zero_warn(
                "logger=True but tensorboard is not installed: logging to CSV instead "
                "(`pip install tensorboard` for TensorBoard)."
            )
        return [CSVLogger(save_dir=save_dir, name="keel_logs")]
    if option is False or option is None:
        return []
    if isinstance(option, Logger):
        return [option]
    if isinstance(option, (list, tuple)) and all(isinstance(item, Logger) for item in option):
        return list(option)
    raise ValueError(f"Invalid Trainer option logger={option!r}; expected {_VALID_LOGGER_CHOICES}.")


# Trackers with their own modules, re-exported so that `from trainer.loggers import WandbLogger` works. Imported
# last: they subclass Logger. Neither imports its library until it first writes.
from trainer.mlflow_logger import MLFlowLogger  # noqa: E402,F401
from trainer.wandb_logger import WandbLogger  # noqa: E402,F401
