"""Rank-zero helpers and per-rank logging (docs/design.md section 7).

Every rank runs every hook; only side effects are gated to rank 0. Python logging is configured per
rank when the Trainer is built: rank 0 at INFO, other ranks at WARNING, every line tagged with its rank.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_log = logging.getLogger("trainer")


def _env_rank() -> int:
    """This process's global rank from the launcher's environment (0 when not launched)."""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            if name == "SLURM_PROCID" and int(os.environ.get("SLURM_NTASKS", "1") or 1) <= 1:
                continue
            return int(value)
    return 0


def rank_zero_only(fn: Callable[P, T]) -> Callable[P, T | None]:
    """Run ``fn`` on global rank 0 only; other ranks get None. Never wrap a function that calls a collective."""

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> T | None:
        if _env_rank() == 0:
            return fn(*args, **kwargs)
        return None

    return wrapped


def _env_world_size() -> int:
    """The job's process count from the launcher's environment (1 when not launched)."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return max(int(value), 1)
    return 1


def _ensure_logging() -> None:
    """Before any Trainer exists (a script's top, a DataModule), configure per-rank logging the way the
    Trainer will, so that rank 0's INFO lines print (Lightning's logger works from import). A process whose
    root logger already has handlers (Hydra, the user's own config) is left alone."""
    if not logging.getLogger().handlers:
        configure_logging(_env_rank(), _env_world_size())


@rank_zero_only
def rank_zero_info(message: str, *args: Any) -> None:
    """Log at INFO on global rank 0; prints also before any Trainer exists."""
    _ensure_logging()
    _log.info(message, *args)


@rank_zero_only
def rank_zero_debug(message: str, *args: Any) -> None:
    """Log at DEBUG on global rank 0 (shown when the ``trainer`` logger is at DEBUG)."""
    _ensure_logging()
    _log.debug(message, *args)


@rank_zero_only
def rank_zero_warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 3) -> None:
    """``warnings.warn`` on global rank 0 (Python shows it once per call site, with or without a Trainer)."""
    warnings.warn(message, category, stacklevel=stacklevel)


class _RankTagFormatter(logging.Formatter):
    """Wraps a handler's formatter and prefixes ``[rank N]`` while formatting (records stay untouched); with one
    process (``tag`` False) the inner formatter alone."""

    def __init__(self, inner: logging.Formatter | None, rank: int, tag: bool = True) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.rank, self.tag = rank, tag

    def format(self, record: logging.LogRecord) -> str:
        if not self.tag:
            return self.inner.format(record)
        original = record.msg
        record.msg = f"[rank {self.rank}] {original}"
        try:
            return self.inner.format(record)
        finally:
            record.msg = original


# The console format keel installs: the logger's name (where a line comes from) only where several processes write.
_FORMATS = {True: "%(asctime)s %(levelname)s %(name)s: %(message)s", False: "%(asctime)s %(levelname)s %(message)s"}


# Libraries keel runs whose INFO lines would reach the console through the root logger (keel's is at INFO on rank
# 0): object storage (botocore, s3fs, fsspec), HTTP, file locks, and the trackers' clients.
QUIET_LIBRARIES = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "filelock", "mlflow", "wandb", "alembic")


_SHOWN_WARNINGS: set[tuple[type, str]] = set()


def _show_once(show: Any) -> Any:
    """``warnings.showwarning`` that prints each distinct warning (category and text) once per run.

    Python's own filter repeats a warning whenever its registry is reset, which every ``warnings.catch_warnings``
    block in a library does, and once per call site: a warning torch raises per parameter or per step printed
    dozens of times. ``catch_warnings(record=True)`` (``pytest.warns``) bypasses this and records every warning.
    """

    def showwarning(
        message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        key = (category, str(message))
        if key in _SHOWN_WARNINGS:
            return
        _SHOWN_WARNINGS.add(key)
        show(message, category, filename, lineno, file, line)

    showwarning.keel_once = True  # type: ignore[attr-defined]
    return showwarning


def configure_logging(rank: int, world_size: int = 1) -> None:
    """Rank 0 logs at INFO, other ranks at WARNING; with several processes each line is prefixed ``[rank N]``
    and names its logger, with one process neither; the libraries in :data:`QUIET_LIBRARIES` log at WARNING
    unless the program set their level.

    Installs a stream handler on the root logger when it has none (a plain script), and otherwise
    (Hydra, a user's own config) adds the rank tag to the existing handlers: their own format is kept, unless it
    is keel's (the recipes' ``conf/train.yaml``).
    Idempotent; a later call (a Trainer in another job layout) updates what an earlier one set.
    """
    several = world_size > 1
    root = logging.getLogger()
    if not root.handlers:
        handler: logging.Handler = logging.StreamHandler()
        handler.keel_console = True  # type: ignore[attr-defined]  # keel's own: its format follows the layout
        root.addHandler(handler)
    for handler in root.handlers:
        inner = handler.formatter.inner if isinstance(handler.formatter, _RankTagFormatter) else handler.formatter
        if inner is not None and getattr(inner, "_fmt", None) in _FORMATS.values():  # the recipes' Hydra config
            handler.keel_console = True  # type: ignore[attr-defined]  # uses keel's format: it follows the layout
        if getattr(handler, "keel_console", False):
            handler.setFormatter(_RankTagFormatter(logging.Formatter(_FORMATS[several], "%H:%M:%S"), rank, several))
        elif isinstance(handler.formatter, _RankTagFormatter):
            handler.formatter.rank, handler.formatter.tag = rank, several
        elif type(handler).__module__.split(".")[0] != "_pytest":  # leave pytest's capture handlers alone
            handler.setFormatter(_RankTagFormatter(handler.formatter, rank, several))
    level = logging.INFO if rank == 0 else logging.WARNING
    root.setLevel(level)
    for name in ("trainer", "callbacks", "recipes"):
        logging.getLogger(name).setLevel(level)
    for name in QUIET_LIBRARIES:  # their INFO lines (every S3 request's credentials lookup...) are not the run's
        library = logging.getLogger(name)
        if library.level == logging.NOTSET:  # a level the program set is kept
            library.setLevel(logging.WARNING)
    if rank != 0:
        warnings.filterwarnings("ignore", category=UserWarning, module=r"(trainer|callbacks)\..*")
    _SHOWN_WARNINGS.clear()  # a new Trainer is a new run: its warnings are shown again, each once
    if not getattr(warnings.showwarning, "keel_once", False):
        warnings.showwarning = _show_once(warnings.showwarning)
