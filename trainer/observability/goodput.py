"""Goodput across restarts: how much of a job's wall time produced training progress that was kept.

Rank 0 appends one JSON line to ``<run dir>/goodput.jsonl`` when a fit starts (the step it resumed at, the
checkpoint load time, when its process started), on every logging step (the step reached and its phase seconds
since the fit started, :mod:`trainer.observability.phases`) and at the end of the fit. The run directory is the same
for every restart of a job (a logger's version is pinned by the job's identity), so the file holds every attempt.
:func:`account` reads it back: an attempt's steps past the step the next attempt resumed at were recomputed; the
time from an attempt's last line to the next attempt's process start was lost to the failure and the restart.
``python -m trainer.doctor goodput RUN_DIR`` prints it (docs/slow-runs.md).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from trainer.observability.phases import PHASES

FILE = "goodput.jsonl"
#: The phases that are not a training step's own work: they are counted on their own lines.
_NOT_STEPS = ("checkpoint", "evaluation")


def process_start_time() -> float:
    """When this process started (wall clock, to 10 ms): its age from ``/proc`` (the start in clock ticks since
    boot, and the time since boot) taken from now; now where that cannot be read."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            since_boot = float(uptime.read().split()[0])
        return time.time() - max(0.0, since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class Ledger:
    """Rank 0's lines in ``<folder>/goodput.jsonl``: opened, appended and closed per line (a SIGKILL loses
    nothing written before it). ``folder`` None: a run without a run directory, nothing is written."""

    def __init__(self, folder: str | None, run: str | None) -> None:
        self.path = os.path.join(folder, FILE) if folder is not None else None
        self.run = run

    def start(self, *, step: int, load_s: float, attempt: int, world_size: int) -> None:
        self._write(
            event="start",
            process_start=process_start_time(),
            attempt=attempt,
            step=step,
            load_s=load_s,
            world_size=world_size,
        )

    def progress(self, step: int, seconds: Sequence[float], *, end: bool = False) -> None:
        """The step reached and rank 0's seconds per phase since its fit started."""
        self._write(event="end" if end else "progress", step=step, seconds=dict(zip(PHASES, seconds)))

    def _write(self, **record: Any) -> None:
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"run": self.run, "time": time.time(), **record}) + "\n")


def read(folder: str) -> list[dict[str, Any]]:
    """The lines of ``<folder>/goodput.jsonl``; a torn last line (a kill mid-write) is left out."""
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: keel records goodput in the run directory of a fit that has a logger (the "
            "folder that holds metrics.csv or the TensorBoard events: trainer.log_dir); pass that folder."
        )
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def account(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The job's goodput from its ledger lines: the last run identity's attempts (a fit started without an
    identity, a plain ``python train.py``, is a job of its own)."""
    attempts: list[tuple[Mapping[str, Any], Mapping[str, Any]]] = []  # (start line, last line)
    for record in records:
        if record.get("event") == "start":
            if not attempts or record.get("run") is None or record.get("run") != attempts[-1][0].get("run"):
                attempts = []  # another job: its account starts afresh
            attempts.append((record, record))
        elif attempts and record.get("run") == attempts[-1][0].get("run"):
            attempts[-1] = (attempts[-1][0], record)
    if not attempts:
        raise ValueError("the ledger holds no fit start: nothing to account")
    figures = dict.fromkeys(
        (
            "productive_s",
            "recomputed_s",
            "checkpoint_save_s",
            "checkpoint_load_s",
            "evaluation_s",
            "startup_s",
            "restart_s",
        ),
        0.0,
    )
    steps_recomputed = 0
    for k, (start, last) in enumerate(attempts):
        resumed = int(start["step"])
        following = attempts[k + 1][0] if k + 1 < len(attempts) else None
        reached = max(int(last["step"]), int(following["step"]) if following is not None else 0)
        kept_until = int(following["step"]) if following is not None else reached
        done, kept = reached - resumed, max(0, min(kept_until, reached) - resumed)
        seconds = last.get("seconds") or {}
        step_s = sum(float(t) for p, t in seconds.items() if p not in _NOT_STEPS)
        kept_s = step_s * kept / done if done > 0 else 0.0
        figures["productive_s"] += kept_s
        figures["recomputed_s"] += step_s - kept_s
        steps_recomputed += done - kept
        figures["checkpoint_save_s"] += float(seconds.get("checkpoint", 0.0))
        figures["evaluation_s"] += float(seconds.get("evaluation", 0.0))
        figures["checkpoint_load_s"] += float(start["load_s"])
        figures["startup_s"] += max(0.0, float(start["time"]) - float(start["process_start"]) - float(start["load_s"]))
        if k > 0:
            figures["restart_s"] += max(0.0, float(start["process_start"]) - float(attempts[k - 1][1]["time"]))
    first, (_, final) = attempts[0][0], attempts[-1]
    wall = float(final["time"]) - float(first["process_start"])
    figures["other_s"] = max(0.0, wall - sum(figures.values()))
    return {
        "run": first.get("run"),
        "finished": final.get("event") == "end",
        "attempts": len(attempts),
        "restarts": len(attempts) - 1,
        "wall_s": wall,
        "goodput": figures["productive_s"] / wall if wall > 0 else 0.0,
        "steps_kept": int(final["step"]),
        "steps_recomputed": steps_recomputed,
        **figures,
    }


def report(figures: Mapping[str, Any]) -> str:
    """The account as the lines ``python -m trainer.doctor goodput`` prints."""
    wall = float(figures["wall_s"])

    def line(name: str, key: str, what: str) -> str:
        s = float(figures[key])
        return f"  {name:<18} {s:9.1f} s  {100 * s / wall if wall > 0 else 0.0:5.1f}%  {what}"

    state = "finished" if figures["finished"] else "not finished (running, or stopped by a failure)"
    return "\n".join(
        [
            f"goodput of {figures['run'] or 'a job without a run identity'}: {100 * figures['goodput']:.1f}% "
            f"({state}; {figures['attempts']} attempt(s), {figures['restarts']} restart(s))",
            f"  {'wall':<18} {wall:9.1f} s  100.0%  from the first process start to the last record",
            line("productive", "productive_s", f"training steps that were kept ({figures['steps_kept']} steps)"),
            line("recomputed", "recomputed_s", f"steps run again after a restart ({figures['steps_recomputed']})"),
            line("restart", "restart_s", "from a failed attempt's last record to the next process start"),
            line("startup", "startup_s", "process start to the first step (imports, process group, setup)"),
            line("checkpoint load", "checkpoint_load_s", "reading the checkpoint a restart resumed from"),
            line("checkpoint save", "checkpoint_save_s", "training blocked by saves"),
            line("evaluation", "evaluation_s", "validation during fit"),
            line("other", "other_s", "the rest: sanity check, hooks at fit end"),
        ]
    )
