"""What the W&B and MLflow loggers share: a small state file in the run directory, per-key step
watermarks, prefixes and the checkpoints that ``log_model`` uploads.

A tracked run (a W&B run, an MLflow run) outlives the process that opened it: a torchrun restart or a
SLURM requeue lands in the same keel run directory (``Logger.resolve_version`` and the ``.keel_run_id``
marker) and must continue the same tracked run. The tracked run's id is therefore kept in the run
directory. A resumed job also re-runs the steps between its last checkpoint and the point where it was
killed; the tracked run already has those, so each metric key is sent only for steps after the last one
recorded for it (its *watermark*), which is what makes a killed-and-resumed run log every step exactly once.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from trainer.storage import is_url

log = logging.getLogger(__name__)

CHECKPOINT_SUFFIXES = (".ckpt", ".pt")


def read_state(path: str) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when the file does not exist."""
    try:
        with open(path) as handle:
            state = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("Ignoring unreadable tracking state %s (%s): a new tracked run will be opened.", path, exc)
        return {}
    return state if isinstance(state, dict) else {}


def write_state(path: str, state: dict[str, Any]) -> None:
    """Writes ``state`` as JSON through a temporary file and a rename: a kill never leaves half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump(state, handle, sort_keys=True)
    os.replace(tmp, path)


class StepWatermarks:
    """The last step recorded per metric key; a key is sent at most once per step, in increasing steps.

    Args:
        steps: Known last steps per key, read from what the tracked run already holds (earlier attempts).
    """

    def __init__(self, steps: dict[str, int] | None = None) -> None:
        self.steps: dict[str, int] = dict(steps or {})
        self.skipped = 0

    def fresh(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """The part of ``metrics`` not yet recorded at ``step`` or later; marks it recorded."""
        out: dict[str, float] = {}
        for key, value in metrics.items():
            if step > self.steps.get(key, -1):
                out[key] = value
                self.steps[key] = step
            else:
                self.skipped += 1
        if len(out) != len(metrics):
            log.debug(
                "step %d: %d metric(s) already recorded by the tracked run, not sent again",
                step,
                len(metrics) - len(out),
            )
        return out


def with_prefix(metrics: dict[str, float], prefix: str, separator: str = "-") -> dict[str, float]:
    """Lightning's ``prefix``: ``{"loss": 1}`` with prefix ``"train"`` -> ``{"train-loss": 1}``."""
    if not prefix:
        return metrics
    return {f"{prefix}{separator}{key}": value for key, value in metrics.items()}


def checkpoint_files(log_dir: str) -> list[str]:
    """The checkpoint files that ``log_model=True`` uploads: ``<run dir>/checkpoints/*.ckpt``, sorted.

    That is the folder of the default ``ModelCheckpoint`` (``dirpath=None``); temporary files of an
    unfinished save (names starting with ``.``) are left out.
    """
    folder = os.path.join(log_dir, "checkpoints")
    if is_url(log_dir):
        log.warning(
            "log_model: the checkpoints of %s are on object storage already; the tracker gets none of them (they "
            "stay in the bucket, where ckpt_path='last' finds them).",
            log_dir,
        )
        return []
    if not os.path.isdir(folder):
        return []
    return sorted(
        os.path.join(folder, name)
        for name in os.listdir(folder)
        if name.endswith(CHECKPOINT_SUFFIXES)
        and not name.startswith(".")
        and os.path.isfile(os.path.join(folder, name))
    )


def check_log_model(value: Any, owner: str) -> bool:
    """``log_model`` must be a bool: checkpoints are uploaded once, when ``fit`` succeeds.

    Raises:
        ValueError: ``"all"`` (Lightning's upload-every-save mode) or any other non-bool.
    """
    if isinstance(value, bool):
        return value
    raise ValueError(
        f"{owner}(log_model={value!r}) is invalid: expected True (upload <run dir>/checkpoints/*.ckpt when fit "
        "succeeds) or False. keel has no log_model='all': checkpoints stay in the run directory and every save "
        "is not uploaded as it happens."
    )


def flat_items(params: dict[str, Any], sep: str = "/") -> Iterable[tuple[str, str]]:
    """``(flattened key, str value)`` pairs of a nested mapping, in order (MLflow params are strings)."""
    from trainer.loggers.logger import flatten_params

    for key, value in flatten_params(params, sep=sep).items():
        yield key, str(value)
