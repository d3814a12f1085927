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

import torch

from trainer.distributed import comm
from trainer.loggers.logger import DummyExperiment, Logger, _to_plain, _yaml_safe, flatten_params
from trainer.loggers.tracking import with_prefix
from trainer.observability.rank_zero import rank_zero_warn

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.tensorboard import SummaryWriter

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
        prefix: Put before every metric name with ``-`` (Lightning's): ``prefix="a"`` logs ``loss`` as ``a-loss``.
        flush_logs_every_n_steps: Lightning's; accepted, no effect: every row is flushed as it is written.
    """

    METRICS_FILE = "metrics.csv"
    HPARAMS_FILE = "hparams.yaml"

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "keel_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__(save_dir, name, version)
        self.prefix = prefix
        self._keys: list[str] | None = None  # metric columns (without "step"); None until the file is read
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None  # bound to self._file
        self._hparams: dict[str, Any] = {}

    @property
    def metrics_file_path(self) -> str:
        return os.path.join(self.log_dir, self.METRICS_FILE)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        metrics = with_prefix(metrics, self.prefix)
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
        _write_hparams(self._ensure_log_dir(), self._hparams, params)

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
    in the same folder. The options after ``version`` are Lightning 2.6's and do what they do there.

    Args:
        save_dir: Root folder of the logs.
        name: Experiment name (sub-folder); None or ``""`` for none.
        version: See :class:`Logger`.
        log_graph: Write the model's graph at the start of ``fit`` (:meth:`log_graph`), traced with the task's
            ``example_input_array``; a warning instead when it has none.
        default_hp_metric: :meth:`log_hyperparams` without metrics also writes ``hp_metric`` = -1 at step 0 and
            names it in the HPARAMS tab's metrics (Lightning's placeholder, for a task that logs
            ``self.log("hp_metric", value)`` later). False: no ``hp_metric``.
        prefix: Put before every metric name with ``-``: ``prefix="a"`` logs ``loss`` as ``a-loss``.
        sub_dir: A folder inside the run folder for the event files, which then become the ``log_dir``.
        **writer_kwargs: Passed to ``SummaryWriter`` (e.g. ``flush_secs``, ``max_queue``).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "keel_logs",
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | os.PathLike | None = None,
        **writer_kwargs: Any,
    ) -> None:
        super().__init__(save_dir, name, version)
        self._log_graph = log_graph
        self._default_hp_metric = default_hp_metric
        self.prefix = prefix
        self.sub_dir = None if sub_dir is None else os.fspath(sub_dir)
        self._writer_kwargs = writer_kwargs
        self._writer: SummaryWriter | None = None
        self._hparams: dict[str, Any] = {}

    @property
    def log_dir(self) -> str:
        """The run folder (:attr:`Logger.log_dir`), joined with ``sub_dir`` when one was given."""
        run_dir = super().log_dir
        return os.path.join(run_dir, self.sub_dir) if self.sub_dir else run_dir

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

    def log_metrics(self, metrics: dict[str, float], step: int | None) -> None:
        writer = self.experiment
        for name, value in with_prefix(metrics, self.prefix).items():
            writer.add_scalar(name, value, global_step=step)

    def log_hyperparams(self, params: dict[str, Any], metrics: Any = None, step: int | None = None) -> None:
        """Writes ``params`` for the HPARAMS tab (flattened with ``/``), as a text summary and, merged with the
        earlier ones, to ``log_dir/hparams.yaml`` (as Lightning's TensorBoardLogger and keel's CSVLogger do).

        The hparams plugin's three summaries (experiment, session start, session end) go into this
        run's own event file, so the HPARAMS tab lists this run next to its scalars.

        Args:
            params: A possibly nested mapping (a dict or an omegaconf ``DictConfig``).
            metrics: Lightning's: metric name to value, written as scalars at ``step`` and named in the HPARAMS
                tab (a number alone is ``hp_metric``). None: ``{"hp_metric": -1}`` with ``default_hp_metric``.
            step: The step of those scalars (None: 0).
        """
        if comm.get_rank() != 0:  # a task's own call in a hook that runs on every rank (Lightning: rank 0 only)
            return
        flat = flatten_params(params)
        if flat:
            _write_hparams(self._ensure_log_dir(), self._hparams, params)
        if metrics is None:
            metrics = {"hp_metric": -1} if self._default_hp_metric else {}
        elif not isinstance(metrics, dict):
            metrics = {"hp_metric": metrics}
        if not flat and not metrics:
            return
        from torch.utils.tensorboard.summary import hparams

        writer = self.experiment
        if metrics:
            self.log_metrics(metrics, step)
        experiment, session_start, session_end = hparams(flat, metrics)
        file_writer = writer._get_file_writer()  # what SummaryWriter.add_hparams uses, minus its sub-run
        for summary in (experiment, session_start, session_end):
            file_writer.add_summary(summary, step)
        if not flat:
            return
        lines = ["| name | value |", "|---|---|"]
        lines += ["| {} | {} |".format(key, str(value).replace("|", r"\|")) for key, value in flat.items()]
        writer.add_text("hparams", "\n".join(lines), global_step=0)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """With ``log_graph=True``: the graph of ``model`` traced on ``input_array`` (None: the model's
        ``example_input_array``, a tensor or a tuple of the forward's arguments, moved to the model's device).

        Not under FSDP with several ranks: tracing on rank 0 alone would wait for the others (a warning instead).
        """
        if not self._log_graph:
            return
        input_array = getattr(model, "example_input_array", None) if input_array is None else input_array
        if input_array is None:
            rank_zero_warn(
                "Could not log computational graph to TensorBoard: The `model.example_input_array` attribute"
                " is not set or `input_array` was not given."
            )
        elif not isinstance(input_array, (torch.Tensor, tuple)):
            rank_zero_warn(
                "Could not log computational graph to TensorBoard: The `input_array` or `model.example_input_array`"
                f" has type {type(input_array)} which can't be traced by TensorBoard. Make the input array a tuple"
                " representing the positional arguments to the model's `forward()` implementation."
            )
        elif comm.get_world_size() > 1 and any(type(m).__name__.startswith("FSDP") for m in model.modules()):
            rank_zero_warn("TensorBoardLogger(log_graph=True): no graph under FSDP with several ranks.")
        else:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            if isinstance(input_array, torch.Tensor):
                input_array = input_array.to(device)
            else:
                input_array = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in input_array)
            self.experiment.add_graph(model, input_array)

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


def _write_hparams(log_dir: str, merged: dict[str, Any], params: Any) -> None:
    """Merges ``params`` into ``merged`` and rewrites ``log_dir/hparams.yaml`` with it."""
    from omegaconf import OmegaConf

    merged.update(_yaml_safe(_to_plain(params)))
    with open(os.path.join(log_dir, CSVLogger.HPARAMS_FILE), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create(merged)))


def _tensorboard_available() -> bool:
    """True when the tensorboard package can be found (without importing it: that takes ~0.5 s)."""
    return importlib.util.find_spec("tensorboard") is not None


def default_loggers(option: Any, default_root_dir: str | None, *, name: str = "keel_logs") -> list[Logger]:
    """Turns the Trainer's ``logger`` option into a list of loggers.

    Args:
        option: ``True`` for the default logger (TensorBoard in ``default_root_dir/<name>``, or CSV
            when tensorboard is not installed, with a warning once); ``False`` or None for none; a
            :class:`Logger`; or a list / tuple of them.
        default_root_dir: Root folder of the default logger; the current directory when None.
        name: The default logger's folder: the Trainer's ``default_log_name`` (``keel_logs``; ``lightning_logs``
            under ``callbacks.lightning``).

    Returns:
        The loggers, in order (the first one's folder is the run directory).

    Raises:
        ValueError: Any other value; the message names the option, the value and the valid choices.
    """
    global _warned_no_tensorboard
    if option is True:
        save_dir = default_root_dir or os.getcwd()
        if _tensorboard_available():
            return [TensorBoardLogger(save_dir=save_dir, name=name)]
        if not _warned_no_tensorboard:
            _warned_no_tensorboard = True
            rank_zero_warn(
                "logger=True but tensorboard is not installed: logging to CSV instead "
                "(`pip install tensorboard` for TensorBoard)."
            )
        return [CSVLogger(save_dir=save_dir, name=name)]
    if option is False or option is None:
        return []
    if isinstance(option, Logger):
        return [option]
    if isinstance(option, (list, tuple)) and all(isinstance(item, Logger) for item in option):
        return list(option)
    raise ValueError(f"Invalid Trainer option logger={option!r}; expected {_VALID_LOGGER_CHOICES}.")
