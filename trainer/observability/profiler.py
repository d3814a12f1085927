"""Profilers: where a step's time goes (``Trainer(profiler="simple" | "pytorch")``), with Lightning's API.

A profiler times named *actions* (:meth:`Profiler.start` / :meth:`Profiler.stop`, or the
:meth:`Profiler.profile` context manager in user code). The Trainer drives it as a phase clock: at every
phase boundary of its loop it calls :meth:`Profiler.transition`, which ends the phase in progress and
starts the next, so the phases partition the stage's time (each moment counted once)::

    data_wait          fetching the next training batch (the loader's time as the loop sees it)
    forward            moving the batch to the device, on_train_batch_start hooks, training_step, the loss
    backward           on_before_backward hooks, backward (DDP's gradient all-reduce overlaps it), on_after_backward
    optimizer_step     unscale, on_before_optimizer_step hooks, clip, optimizer.step, schedulers, zero_grad
    logging            reading and reducing a logging step's metrics and writing them to the loggers
    callbacks          on_train_batch_end hooks (callbacks and the task)
    checkpoint         assembling and writing a checkpoint (ModelCheckpoint, preemption saves)
    validation         validation batches (their data, validation_step and hooks)

Contract (who calls what, on which rank):

* :meth:`Profiler.setup` at the start of each stage on every rank, once the run directory is known;
  :meth:`Profiler.teardown` at its end on every rank. ``teardown`` logs :meth:`Profiler.summary` on
  rank 0 (through ``logging``, at INFO) and, when ``filename`` is set, writes it to a file per rank.
* Profiling never communicates between ranks: each rank measures itself; the table is rank 0's.
* Off means free: the default :class:`PassThroughProfiler` has ``enabled = False`` and the Trainer reads
  that flag once per stage and then calls nothing on the hot path (no context manager is entered).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch.profiler

log = logging.getLogger(__name__)

PROFILER_CHOICES = ("simple", "pytorch", "passthrough")
# The loop's phase names (trainer/distributed/watchdog.py PHASE_*) as profiler actions.
PHASE_ACTIONS: dict[str, str] = {
    "data": "data_wait",
    "training_step": "forward",
    "backward": "backward",
    "optimizer_step": "optimizer_step",
    "metrics_reduction": "logging",
    "checkpoint": "checkpoint",
    "validation_step": "validation",
    "test_step": "test",
    "predict_step": "predict",
    "preemption_check": "preemption_check",
    "callbacks": "callbacks",
    "setup": "setup",
    "barrier": "barrier",
    "teardown": "teardown",
}
# PyTorchProfiler advances torch.profiler's schedule when one of these actions stops (one optimizer step).
STEP_ACTION = "optimizer_step"


class Profiler:
    """Base class: named start/stop timings, a text summary, per-stage setup and teardown.

    Subclasses implement :meth:`start`, :meth:`stop` and :meth:`summary`. One action may not be started
    twice before it stops; different actions may nest.

    Args:
        dirpath: Folder of the summary files; None: the run directory given to :meth:`setup`.
        filename: When set, :meth:`teardown` also writes the summary to
            ``dirpath/<filename>-<stage>-rank<R>.txt``; None: the summary is only logged (rank 0).
    """

    #: False only for :class:`PassThroughProfiler`: the Trainer then skips every profiling call.
    enabled: bool = True

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = None) -> None:
        self.dirpath: str | None = os.fspath(dirpath) if dirpath is not None else None
        self.filename = filename
        self.stage: str | None = None
        self.rank = 0
        self._phase: str | None = None  # the phase in progress (see transition)

    def setup(self, stage: str, run_dir: str | None = None, rank: int = 0) -> None:
        """Called by the Trainer at the start of ``stage`` on every rank, after the run directory exists.

        Args:
            stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``.
            run_dir: The run directory (``trainer.log_dir``); the default :attr:`dirpath`.
            rank: This process's global rank.
        """
        self.stage = stage
        self.rank = rank
        if self.dirpath is None and run_dir is not None:
            self.dirpath = run_dir

    def start(self, action_name: str) -> None:
        """Starts timing ``action_name``."""
        raise NotImplementedError

    def stop(self, action_name: str) -> None:
        """Stops timing ``action_name`` (started by :meth:`start`)."""
        raise NotImplementedError

    @contextmanager
    def profile(self, action_name: str) -> Iterator[None]:
        """``with profiler.profile("my_phase"): ...`` times the block (stopped also when it raises)."""
        self.start(action_name)
        try:
            yield
        finally:
            self.stop(action_name)

    def transition(self, phase: str) -> None:
        """Ends the phase in progress (if any) and starts ``phase``: the loop's phase clock.

        The Trainer calls it at every phase boundary of its loop (the same points at which it reports
        progress to the hang watchdog), so the phases partition the stage's time: each moment is counted
        once, in the phase the loop was in. Loop phase names map to action names through
        :data:`PHASE_ACTIONS` (``"data"`` -> ``"data_wait"``); other names are used as they are.
        """
        action = PHASE_ACTIONS.get(phase, phase)
        current = self._phase
        if current == action:
            return
        if current is not None:
            self.stop(current)
        self._phase = action
        self.start(action)

    def _end_phase(self) -> None:
        if self._phase is not None:
            self.stop(self._phase)
            self._phase = None

    def profile_iterable(self, iterable: Iterable[Any], action_name: str) -> Iterator[Any]:
        """Yields from ``iterable``, timing each ``next()`` as ``action_name`` (e.g. ``data_wait``)."""
        iterator = iter(iterable)
        while True:
            self.start(action_name)
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self.stop(action_name)
            yield item

    def summary(self) -> str:
        """A human-readable report of what was measured in the current stage."""
        raise NotImplementedError

    def describe(self) -> None:
        """Logs the summary on rank 0 and writes the per-rank file when ``filename`` is set."""
        text = self.summary()
        if not text:
            return
        if self.rank == 0:
            log.info("Profiler summary (%s, rank 0):\n%s", self.stage, text)
        if self.filename and self.dirpath:
            os.makedirs(self.dirpath, exist_ok=True)
            path = os.path.join(self.dirpath, f"{self.filename}-{self.stage}-rank{self.rank}.txt")
            with open(path, "w") as handle:
                handle.write(text + "\n")

    def teardown(self, stage: str | None = None) -> None:
        """Called by the Trainer at the end of each stage on every rank: ends the phase in progress,
        describes, then resets."""
        self._end_phase()
        self.describe()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dirpath={self.dirpath!r}, filename={self.filename!r})"


class PassThroughProfiler(Profiler):
    """The default: measures nothing. ``enabled`` is False, so the Trainer does not even call it."""

    enabled = False

    def transition(self, phase: str) -> None:
        pass

    def start(self, action_name: str) -> None:
        pass

    def stop(self, action_name: str) -> None:
        pass

    def summary(self) -> str:
        return ""


class SimpleProfiler(Profiler):
    """Wall-clock time per action: count, mean, total and share of the stage, as a table.

    Each start/stop pair costs two ``time.perf_counter()`` calls and a few dict operations (about a
    microsecond); only running sums are kept, so memory does not grow with the number of steps.

    Args:
        dirpath: See :class:`Profiler`.
        filename: See :class:`Profiler`.
        extended: Also show the fastest and slowest call of each action.
    """

    def __init__(
        self, dirpath: str | os.PathLike | None = None, filename: str | None = None, *, extended: bool = True
    ) -> None:
        super().__init__(dirpath, filename)
        self.extended = extended
        self._clock: Callable[[], float] = time.perf_counter
        self._started: dict[str, float] = {}
        # action -> [count, total, min, max]
        self.recorded: dict[str, list[float]] = {}
        self._stage_start: float | None = None

    def setup(self, stage: str, run_dir: str | None = None, rank: int = 0) -> None:
        super().setup(stage, run_dir, rank)
        self._stage_start = self._clock()

    def start(self, action_name: str) -> None:
        if action_name in self._started:
            raise ValueError(f"SimpleProfiler: {action_name!r} was started again before it stopped.")
        self._started[action_name] = self._clock()

    def stop(self, action_name: str) -> None:
        end = self._clock()
        begin = self._started.pop(action_name, None)
        if begin is None:
            raise ValueError(f"SimpleProfiler: {action_name!r} was stopped but never started.")
        duration = end - begin
        stats = self.recorded.get(action_name)
        if stats is None:
            self.recorded[action_name] = [1, duration, duration, duration]
        else:
            stats[0] += 1
            stats[1] += duration
            if duration < stats[2]:
                stats[2] = duration
            if duration > stats[3]:
                stats[3] = duration

    def summary(self) -> str:
        """The table, slowest total first; "Total" is the stage's wall time since :meth:`setup`."""
        if not self.recorded:
            return ""
        wall = self._clock() - self._stage_start if self._stage_start is not None else 0.0
        wall = wall or sum(stats[1] for stats in self.recorded.values())
        header = ["Action", "Count", "Mean (ms)", "Total (s)", "% of stage"]
        if self.extended:
            header += ["Min (ms)", "Max (ms)"]
        rows = [["Total (stage wall time)", "-", "-", f"{wall:.3f}", "100.0"] + (["-", "-"] if self.extended else [])]
        for name, (count, total, low, high) in sorted(self.recorded.items(), key=lambda item: -item[1][1]):
            row = [name, f"{int(count)}", f"{1e3 * total / count:.3f}", f"{total:.3f}", f"{100 * total / wall:.1f}"]
            if self.extended:
                row += [f"{1e3 * low:.3f}", f"{1e3 * high:.3f}"]
            rows.append(row)
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

        def fmt(row: list[str]) -> str:
            return (
                "| "
                + " | ".join(
                    cell.ljust(width) if i == 0 else cell.rjust(width)
                    for i, (cell, width) in enumerate(zip(row, widths))
                )
                + " |"
            )

        rule = "|" + "|".join("-" * (width + 2) for width in widths) + "|"
        return "\n".join([fmt(header), rule, *(fmt(row) for row in rows)])

    def teardown(self, stage: str | None = None) -> None:
        super().teardown(stage)
        self.recorded = {}
        self._started = {}
        self._stage_start = None


class PyTorchProfiler(Profiler):
    """``torch.profiler`` traces per rank, written to ``<run dir>/profiler/`` on a schedule.

    Each rank writes ``rank<R>.<stage>.<time>.pt.trace.json`` files (one per active window of the
    schedule) through ``torch.profiler.tensorboard_trace_handler``: Chrome-trace JSON, which
    ``tensorboard --logdir <run dir>`` shows with the PyTorch profiler plugin (``torch-tb-profiler``),
    and which chrome://tracing or https://ui.perfetto.dev open directly. The Trainer's actions appear in
    the trace as ``record_function`` ranges, and the schedule advances once per optimizer step (so a
    ``validate`` / ``test`` / ``predict`` stage, which has none, records nothing with the default schedule).
    :meth:`summary` is the ``key_averages()`` table of the last active window.

    Args:
        dirpath: Folder of the traces; None: ``<run dir>/profiler``.
        filename: See :class:`Profiler` (the summary text file).
        schedule: A ``torch.profiler.schedule(...)`` callable; None:
            ``schedule(wait=1, warmup=1, active=3, repeat=1)`` (steps 2-4 of each stage are recorded).
        activities: ``torch.profiler.ProfilerActivity`` values; None: CPU, plus CUDA when available.
        record_shapes: Passed to ``torch.profiler.profile``.
        profile_memory: Passed to ``torch.profiler.profile``.
        with_stack: Passed to ``torch.profiler.profile`` (large traces).
        sort_by_key: Column the summary table is sorted by.
        row_limit: Rows of the summary table.
        **profiler_kwargs: Any other ``torch.profiler.profile`` argument.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        *,
        schedule: Callable[[int], Any] | None = None,
        activities: list[Any] | None = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        sort_by_key: str = "self_cpu_time_total",
        row_limit: int = 20,
        **profiler_kwargs: Any,
    ) -> None:
        super().__init__(dirpath, filename)
        self._schedule = schedule
        self._activities = activities
        self._kwargs = dict(
            record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack, **profiler_kwargs
        )
        self.sort_by_key = sort_by_key
        self.row_limit = row_limit
        self._user_dirpath = self.dirpath
        self._profiler: torch.profiler.profile | None = None
        self._ranges: dict[str, Any] = {}
        self._summary = ""

    @property
    def trace_dir(self) -> str | None:
        """Where this stage's traces go (known after :meth:`setup`)."""
        return self.dirpath

    def setup(self, stage: str, run_dir: str | None = None, rank: int = 0) -> None:
        import torch
        from torch import profiler as torch_profiler

        self.stage, self.rank = stage, rank
        self.dirpath = self._user_dirpath or (os.path.join(run_dir, "profiler") if run_dir is not None else "profiler")
        activities = self._activities
        if activities is None:
            activities = [torch_profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch_profiler.ProfilerActivity.CUDA)
        schedule = self._schedule or torch_profiler.schedule(wait=1, warmup=1, active=3, repeat=1)
        self._summary = ""
        self._profiler = torch_profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self._on_trace_ready(
                torch_profiler.tensorboard_trace_handler(self.dirpath, worker_name=f"rank{rank}.{stage}")
            ),
            **self._kwargs,
        )
        self._profiler.__enter__()

    def _on_trace_ready(
        self, handler: Callable[[torch.profiler.profile], None]
    ) -> Callable[[torch.profiler.profile], None]:
        def ready(prof: torch.profiler.profile) -> None:
            handler(prof)
            self._summary = prof.key_averages().table(sort_by=self.sort_by_key, row_limit=self.row_limit)
            log.debug("PyTorchProfiler (rank %d) wrote a trace to %s", self.rank, self.dirpath)

        return ready

    def start(self, action_name: str) -> None:
        if action_name in self._ranges:
            raise ValueError(f"PyTorchProfiler: {action_name!r} was started again before it stopped.")
        if self._profiler is None:
            return  # outside a stage: nothing records
        from torch.autograd.profiler import record_function

        scope = record_function(action_name)
        scope.__enter__()
        self._ranges[action_name] = scope

    def stop(self, action_name: str) -> None:
        scope = self._ranges.pop(action_name, None)
        if scope is not None:
            scope.__exit__(None, None, None)
        if action_name == STEP_ACTION and self._profiler is not None:
            self._profiler.step()

    def summary(self) -> str:
        return self._summary

    def teardown(self, stage: str | None = None) -> None:
        self._end_phase()  # closes its range (and steps the schedule after an optimizer_step phase)
        for scope in reversed(list(self._ranges.values())):
            scope.__exit__(None, None, None)
        self._ranges = {}
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)  # flushes a window that is still recording
            self._profiler = None
        super().teardown(stage)


def check_profiler(option: Any) -> None:
    """Raises the ``ValueError`` of :func:`resolve_profiler` for an invalid ``profiler`` option, building nothing."""
    if option is None or isinstance(option, Profiler):
        return
    if isinstance(option, str) and option.lower() in PROFILER_CHOICES:
        return
    raise ValueError(
        f"Trainer option profiler={option!r} is invalid: expected None, 'simple', 'pytorch', 'passthrough' "
        "or a trainer.observability.profiler.Profiler instance."
    )


def resolve_profiler(option: Any) -> Profiler:
    """Turns the Trainer's ``profiler`` option into a :class:`Profiler`.

    Args:
        option: None (no profiling: :class:`PassThroughProfiler`), ``"simple"``, ``"pytorch"``,
            ``"passthrough"``, or a :class:`Profiler` instance.

    Raises:
        ValueError: Any other value, naming the option, the value and the choices.
    """
    if option is None:
        return PassThroughProfiler()
    if isinstance(option, Profiler):
        return option
    check_profiler(option)
    return {"simple": SimpleProfiler, "pytorch": PyTorchProfiler, "passthrough": PassThroughProfiler}[option.lower()]()
