"""Experiment loggers: metrics and hyperparameters to files under a versioned run folder.

A logger owns one folder, ``save_dir/name/version_N`` (Lightning's layout). The only distributed thing
a logger does is :meth:`Logger.resolve_version`, a collective that every rank calls at the same point
so that all ranks agree on ``N`` (docs/design.md section 9). Everything else writes files and is called by
the Trainer on global rank 0 only (docs/design.md section 7).

tensorboard (and omegaconf, for YAML) are imported where they are used, so ``import trainer`` stays
cheap (docs/design.md section 11). The :class:`Logger` base and the run identity are in trainer/loggers/logger.py;
:class:`WandbLogger` and :class:`MLFlowLogger` live in their own modules.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import os
from typing import IO, TYPE_CHECKING, Any

from trainer.distributed import comm
from trainer.loggers.logger import DummyExperiment, Logger, _to_plain, _yaml_safe, flatten_params
from trainer.observability.rank_zero import rank_zero_warn

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.tensorboard import SummaryWriter

    from trainer.module import TaskModule

log = logging.getLogger(__name__)

_VALID_LOGGER_CHOICES = "True, False, a trainer.loggers.Logger or a list of them"
_warned_no_tensorboard = False


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
        self._writer: csv.DictWriter[str] | None = None  # bound to self._file
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
        assert self._file is not None and self._writer is not None  # opened together by _open
        row = {"step": step, **metrics}
        self._writer.writerow(row)
        self._file.flush()  # a crash loses no logged row

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
        if comm.get_rank() != 0:
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


def log_fit_start(loggers: list[Logger], task: TaskModule, options: dict[str, Any], *, summary: bool) -> None:
    """Rank 0, at the start of ``fit``: the model summary line (when ``summary``) and the hyperparameters
    (the resolved Trainer options, and the task's ``hparams`` unless ``save_hyperparameters(logger=False)``)."""
    if summary:
        params = list(task.parameters())
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        size_mb = sum(p.numel() * p.element_size() for p in params) / 2**20
        log.info(
            "%s: %s parameters (%s trainable), %.2f MB.", type(task).__name__, f"{total:,}", f"{trainable:,}", size_mb
        )
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
