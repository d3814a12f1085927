"""The block rank 0 prints when ``fit`` ends: where the run's files are and the metrics it ended with.

A user's own script gets it as the recipes do: the run directory, each logger's folder, the best and last
checkpoints, the steps and epochs trained, then every metric as the loggers last received it (reduced over the
ranks, one name per value, 4 significant digits). The bar's own ``loss`` (the step loss keel shows when the task
logs nothing to the bar) is not a logged metric, so it is not repeated next to the task's ``train/loss``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class FinishedFit(Protocol):
    """What the summary reads of a Trainer whose ``fit`` ended (its public, Lightning-named attributes)."""

    @property
    def log_dir(self) -> str: ...
    @property
    def loggers(self) -> Sequence[Any]: ...
    @property
    def checkpoint_callback(self) -> Any: ...
    @property
    def global_step(self) -> int: ...
    @property
    def current_epoch(self) -> int: ...
    @property
    def logged_metrics(self) -> Mapping[str, Any]: ...


TITLE = " keel run summary "
WIDTH = 78


def _where(path: str | None) -> str | None:
    """A local path made absolute (it is printed to be copied); a URL as it is."""
    if not path:
        return None
    return path if "://" in path else os.path.abspath(path)


def _logger_kind(logger: Any) -> str:
    """``tensorboard``, ``csv``, or the logger's class name."""
    name = type(logger).__name__
    return {"TensorBoardLogger": "tensorboard", "CSVLogger": "csv"}.get(name, name)


def of_fit(trainer: FinishedFit, seconds: float) -> dict[str, Any]:
    """The summary of the fit that just ended, the same on every rank.

    Returns:
        ``run_dir``, ``logs`` (``[(kind, folder)]`` per logger), ``monitor``, ``best_model_path`` (None without a
        monitored checkpoint), ``best_model_score``, ``last_model_path``, ``global_step``, ``epochs``,
        ``seconds``, and ``metrics`` (name -> float, sorted by name: what the loggers last received, ``epoch``
        left out as it is a line of its own).
    """
    checkpoint = trainer.checkpoint_callback
    monitor = getattr(checkpoint, "monitor", None)
    best = _where(getattr(checkpoint, "best_model_path", None)) if monitor else None
    score = getattr(checkpoint, "best_model_score", None) if best else None
    return {
        "run_dir": _where(trainer.log_dir),
        "logs": [(_logger_kind(lg), _where(lg.log_dir)) for lg in trainer.loggers],
        "monitor": monitor,
        "best_model_path": best,
        "best_model_score": None if score is None else float(score),
        "last_model_path": _where(getattr(checkpoint, "last_model_path", None)),
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "seconds": seconds,
        "metrics": metrics_of(trainer),
    }


def metrics_of(trainer: FinishedFit) -> dict[str, float]:
    """What the loggers last received for each name (reduced as logged), sorted by name; ``epoch`` left out."""
    return {name: float(value) for name, value in sorted(trainer.logged_metrics.items()) if name != "epoch"}


def format_summary(summary: dict[str, Any], *, tested_on: str | None = None) -> str:
    """The block: where things are, then one ``name  value`` line per metric. ``tested_on`` names what a test
    run after the fit used (its ``test/*`` metrics are then among ``summary["metrics"]``)."""
    best = summary["best_model_path"] or "- (no monitored checkpoint)"
    if summary["best_model_path"] and summary["best_model_score"] is not None:
        best += f"  ({summary['monitor']}={summary['best_model_score']:.4g})"
    lines = ["=" * 30 + TITLE + "=" * 30, f"run dir          {summary['run_dir']}"]
    lines += [f"{kind:<16} {folder}" for kind, folder in summary["logs"]] or ["logs             - (no logger)"]
    lines += [
        f"best checkpoint  {best}",
        f"last checkpoint  {summary['last_model_path'] or '-'}",
        f"trained          {summary['global_step']} steps, {summary['epochs']} epochs; "
        f"{summary['seconds']:.1f} s fit{' + test' if tested_on else ''}",
    ]
    if summary["metrics"]:
        lines.append("metrics          as last logged" + (f"; test/* on the {tested_on}" if tested_on else ""))
        width = max(30, *(len(name) for name in summary["metrics"]))
        lines += [f"  {name:<{width}} {value:.4g}" for name, value in summary["metrics"].items()]
    else:
        lines.append("metrics          - (none logged: no logging step ran; see log_every_n_steps)")
    return "\n".join(lines + ["=" * WIDTH])
