"""Why is my run slow, in one process: the diagnosis rank 0 makes of per-rank phase times, read from numbers (the
phase clock, with CUDA's events and streams stood in for), goodput across restarts, and the throughput metrics of a
fit. Real 2-rank runs in which the cause is made to happen: tests/integration/test_slow_runs.py."""

from __future__ import annotations

import logging
import time

import pytest

from trainer.observability.phases import PHASES, ROW, Diagnosis, PhaseClock


def row(steps: int = 10, **ms_per_step: float) -> list[float]:
    """A rank's interval: ``ms_per_step`` of each named phase, for ``steps`` optimizer steps."""
    return [ms_per_step.get(p, 0.0) * steps / 1e3 for p in PHASES] + [float(steps)]


def test_a_rank_slow_in_its_loader_is_named_once_and_again_only_when_the_diagnosis_changes(caplog) -> None:
    diag = Diagnosis(hosts=["node-a", "node-b"], patience=3)
    fast, slow = row(data=2, forward=10, backward=50, optimizer=3), row(data=41, forward=10, backward=11, optimizer=3)
    with caplog.at_level(logging.WARNING, logger="trainer.observability.phases"):
        for _ in range(2):
            metrics = diag.update([fast, slow])
        assert diag.warnings == []  # two intervals: not yet (patience 3)
        for _ in range(5):
            metrics = diag.update([fast, slow])
    (said,) = diag.warnings
    assert said.startswith("rank 1 on node-b: data wait 41 ms/step vs median 22 ms: its loader is the bottleneck")
    assert [r.getMessage() for r in caplog.records] == [f"Slow run: {said}."]
    assert metrics["perf/slowest_rank"] == 1.0 and metrics["perf/steps_per_s"] == pytest.approx(1000 / 65)
    assert metrics["perf/data_wait_frac"] == pytest.approx((2 / 65 + 41 / 65) / 2)
    # The cause goes away for three intervals, then comes back on the other rank: said again, once each.
    for _ in range(3):
        diag.update([fast, fast])
    for _ in range(4):
        diag.update([slow, fast])
    assert len(diag.warnings) == 2 and diag.warnings[1].startswith("rank 0 on node-a: data wait")


def test_compute_collective_waits_and_data_bound_jobs() -> None:
    """Under DDP the forward waits for nobody: a rank slow there is named; a rank whose backward is long because it
    waits in the all-reduce is not. Under FSDP (forward_waits) the forward is not judged. Every rank waiting for
    data: data-bound."""
    slow_step, waiting = row(data=1, forward=50, backward=10), row(data=1, forward=10, backward=50)
    ddp, fsdp = Diagnosis(patience=2), Diagnosis(patience=2, forward_waits=True)
    for _ in range(2):
        ddp.update([slow_step, waiting])
        fsdp.update([slow_step, waiting])
    assert ddp.warnings == [
        "rank 0: forward 50 ms/step vs median 30 ms: its compute is slower (another job on its "
        "GPU or CPU, a throttled device, a larger batch)"
    ]
    assert fsdp.warnings == []
    bound = Diagnosis(patience=2)
    for _ in range(2):
        bound.update([row(data=40, forward=10), row(data=38, forward=12)])
    assert bound.warnings[0].startswith("every rank waits for data (39 ms a step, median; the step takes 50 ms)")
    assert Diagnosis().update([row(steps=0)]) == {}  # no optimizer step in the interval: nothing to say


def test_the_time_budget_sums_every_interval_and_names_the_slowest_rank() -> None:
    diag = Diagnosis(hosts=["a", "b"], patience=9)
    for _ in range(3):
        diag.update([row(data=1, forward=10, backward=9), row(data=30, forward=10, backward=0)])
    diag.add([row(steps=2, data=1, forward=10, backward=9), row(steps=2, data=30, forward=10, backward=0)])
    budget = diag.budget()
    assert budget["steps"] == 32 and budget["slowest_rank"] == 1 and budget["wall_s"] == pytest.approx(1.28)
    assert budget["per_rank_seconds"][0]["forward"] == pytest.approx(0.32)
    assert budget["share_of_slowest"]["data"] == pytest.approx(30 / 40)
    assert diag.budget_line().startswith("Time budget of fit: 32 steps in 1.3 s; the slowest rank, 1 on b: data 75%")


def test_the_phase_clock_adds_each_mark_to_the_phase_it_closes(monkeypatch) -> None:
    now = iter([0.0, 1.0, 1.5, 4.0, 4.25, 5.0])
    monkeypatch.setattr("trainer.observability.phases.time.perf_counter", lambda: next(now))
    clock = PhaseClock(global_step=3)  # t=0, "other"
    clock.enter("data")  # t=1: other += 1
    clock.enter("training_step")  # 1.5: data += 0.5
    clock.enter("backward")  # 4: forward += 2.5
    clock.enter("optimizer_step")  # 4.25: backward += 0.25
    taken = clock.take(global_step=5)  # 5: optimizer += 0.75
    assert len(taken) == ROW and taken == row(steps=2, data=250, forward=1250, backward=125, optimizer=375, other=500)
    assert clock.totals == [0.0] * len(PHASES)


def test_the_forward_is_judged_only_where_it_waits_for_nobody() -> None:
    """DDP or one device with automatic optimization: the forward holds no collective. Manual optimization times
    the whole step (its backward and gradient all-reduce too) as the forward, so it is not judged there."""
    from models import Regression, quiet, regression_data
    from torch.utils.data import DataLoader

    from trainer import Trainer

    class Manual(Regression):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            opt.step()

    waits = {}
    for task in (Regression(), Manual()):
        trainer = Trainer(**quiet(max_steps=2))
        trainer.fit(task, DataLoader(regression_data(16), batch_size=4))
        waits[type(task).__name__] = trainer._efficiency.diagnosis.forward_waits
    assert waits == {"Regression": False, "Manual": True}


def test_checkpoint_bound_and_communication_bound_jobs_and_the_backward_judged_where_its_sync_is_split() -> None:
    """Every rank blocked by saves: checkpoint-bound. With the gradient sync split out of the backward (DDP's
    hook), the backward is compute and is judged; every rank waiting in the sync with nobody slower:
    communication-bound. A rank that waits in the sync for a slower one is not blamed: the slower one is."""
    saving = Diagnosis(patience=2)
    for _ in range(2):
        saving.update([row(data=1, forward=5, checkpoint=30), row(data=1, forward=5, checkpoint=31)])
    assert saving.warnings[0].startswith("saving checkpoints blocks every rank 30 ms a step (median; the step takes")
    assert "checkpoint-bound" in saving.warnings[0] and "async_save=True" in saving.warnings[0]
    split = Diagnosis(patience=2, backward_waits=False)
    for _ in range(2):
        split.update([row(data=1, forward=5, backward=5, sync=40), row(data=1, forward=5, backward=6, sync=41)])
    assert split.warnings[0].startswith("every rank waits 40 ms a step for the gradient all-reduce to finish")
    assert "communication-bound" in split.warnings[0]
    straggler, unsplit = Diagnosis(patience=2, backward_waits=False), Diagnosis(patience=2)
    for _ in range(2):
        rows = [row(data=1, forward=5, backward=45, sync=2), row(data=1, forward=5, backward=5, sync=42)]
        straggler.update(rows)
        unsplit.update(rows)
    assert straggler.warnings == [
        "rank 0: backward 45 ms/step vs median 25 ms: its compute is slower (another job on its GPU or CPU, a "
        "throttled device, a larger batch)"
    ]
    assert unsplit.warnings == []  # without the split, a long backward may be a wait: not judged
    toy = Diagnosis(patience=2, backward_waits=False)  # a balanced 2-rank run of a tiny model: 1 ms of a 3 ms step
    for _ in range(4):
        toy.update([row(data=0.2, forward=0.8, backward=0.9, sync=1.0), row(data=0.2, forward=0.8, backward=1, sync=1)])
    assert toy.warnings == []


def test_the_phase_clock_splits_a_backward_at_its_last_all_reduce_launch(monkeypatch) -> None:
    class Mark:
        at = 0.0

    mark = Mark()
    now = iter([0.0, 1.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    monkeypatch.setattr("trainer.observability.phases.time.perf_counter", lambda: next(now))
    clock = PhaseClock(sync=mark)  # t=0
    clock.enter("backward")  # 1
    mark.at = 2.5  # the hook launched the last bucket's all-reduce
    clock.enter("optimizer_step")  # 3: backward 1.5, sync 0.5
    clock.enter("backward")  # 4: optimizer 1
    clock.enter("data")  # 5: no launch since 4 (no_sync micro-batch): all backward
    taken = clock.take(global_step=1)  # 6
    assert taken == row(steps=1, other=1000, backward=2500, sync=500, optimizer=1000, data=1000)


class Stream:
    """A device stream for the timing events below: ``queued`` seconds of work launched, ``done`` of them run."""

    def __init__(self) -> None:
        self.queued = self.done = 0.0
        self.events = 0

    def event(self) -> Event:
        self.events += 1
        return Event(self)


class Event:
    """``torch.cuda.Event(enable_timing=True)`` on a :class:`Stream`: recorded after the work launched so far."""

    def __init__(self, stream: Stream) -> None:
        self.stream, self.at = stream, -1.0

    def record(self) -> None:
        self.at = self.stream.queued

    def query(self) -> bool:
        return self.stream.done >= self.at

    def synchronize(self) -> None:
        self.stream.done = max(self.stream.done, self.stream.queued)

    def elapsed_time(self, end: Event) -> float:
        assert self.query() and end.query(), "torch raises for an event that has not completed"
        return (end.at - self.at) * 1e3


def test_on_cuda_the_device_times_come_from_events_read_without_waiting_and_split_at_the_sync() -> None:
    """Each mark records an event on the compute stream; a logging step reads the events the stream has passed
    (no wait: the rest count in the next read); the hook's event at the last all-reduce launch splits the device's
    backward into compute and sync; events are reused, not made each step."""
    from trainer.observability.phases import DeviceTimeline

    stream = Stream()
    mark = type("Mark", (), {"at": 0.0, "event": stream.event()})()
    clock = PhaseClock(sync=mark, device=DeviceTimeline(stream.event))
    device = slice(len(PHASES) + 1, None)

    def step() -> None:
        clock.enter("training_step")
        stream.queued += 0.030  # the forward's kernels
        clock.enter("backward")
        stream.queued += 0.050  # the gradients
        mark.at = time.perf_counter()
        mark.event.record()  # the hook launches the last bucket's all-reduce
        stream.queued += 0.020  # the stream waits for it
        clock.enter("optimizer_step")
        stream.queued += 0.010
        clock.enter("data")

    step()
    assert clock.take(global_step=1)[device] == [0.0] * len(PHASES)  # the host ran ahead: nothing has run yet
    stream.done = stream.queued - 0.015  # the stream is in the sync
    step()
    taken = clock.take(global_step=2)
    assert taken[device] == pytest.approx(row(steps=1, forward=30, backward=50)[: len(PHASES)])
    for _ in range(5):
        step()
    clock.take(global_step=7, wait=True)  # the end of fit waits for the stream
    made = stream.events
    step()
    taken = clock.take(global_step=8, wait=True)
    assert taken[device] == pytest.approx(row(steps=1, forward=30, backward=50, sync=20, optimizer=10)[: len(PHASES)])
    assert stream.events == made  # the events read are reused: none is made on the hot path any more


def test_the_device_events_between_two_reads_are_bounded() -> None:
    """With no logging step for a long time the events do not pile up: at the limit a mark folds the completed
    ones into the totals, and waits for the oldest only when the device is that far behind; no time is lost."""
    from trainer.observability.phases import DeviceTimeline

    stream = Stream()
    timeline = DeviceTimeline(stream.event)
    clock = PhaseClock(device=timeline)
    for _ in range(200):  # 200 steps of 3 marks, the device keeping up
        clock.enter("training_step")
        stream.queued += 0.003
        clock.enter("optimizer_step")
        stream.queued += 0.001
        clock.enter("data")
        stream.done = stream.queued
    assert len(timeline._pending) < DeviceTimeline.LIMIT and stream.events <= DeviceTimeline.LIMIT + 2
    for _ in range(2 * DeviceTimeline.LIMIT):  # the host runs far ahead: it waits for the oldest at the limit
        clock.enter("training_step")
        stream.queued += 0.003
        clock.enter("data")
    assert len(timeline._pending) <= DeviceTimeline.LIMIT
    taken = clock.take(global_step=200 + 2 * DeviceTimeline.LIMIT, wait=True)
    forward = taken[len(PHASES) + 1 :][PHASES.index("forward")]
    assert forward == pytest.approx(0.003 * (200 + 2 * DeviceTimeline.LIMIT))


def test_on_cuda_the_compute_phases_are_judged_by_the_device_not_by_the_launches() -> None:
    """The host launches both ranks' forwards in 1 ms and waits for the device later (in the logging step's
    read): only the device's times tell that rank 0 computes 40 ms a step and rank 1 10 ms."""
    host = row(data=1, forward=1, backward=1, sync=1, optimizer=1, logging=45)
    rows = [host + row(forward=40, backward=2, optimizer=1)[:-1], host + row(forward=10, backward=2, optimizer=1)[:-1]]
    diagnosis = Diagnosis(hosts=["node-a", "node-b"], patience=2, backward_waits=False)
    for _ in range(2):
        metrics = diagnosis.update(rows)
    assert diagnosis.warnings == [
        "rank 0 on node-a: forward 40 ms/step vs median 25 ms: its compute is slower (another job on its GPU or CPU, "
        "a throttled device, a larger batch)"
    ]
    assert metrics["perf/slowest_rank"] == 0
    launches = Diagnosis(patience=2, backward_waits=False)
    for _ in range(2):
        launches.update([host, host])
    assert launches.warnings == []
    assert diagnosis.budget()["per_rank_device_seconds"][0]["forward"] == pytest.approx(0.8)
    assert "per_rank_device_seconds" not in launches.budget()
    comm = Diagnosis(patience=2, backward_waits=False)
    for _ in range(2):
        comm.update([host + row(forward=5, backward=5, sync=30)[:-1]] * 2)
    assert comm.warnings[0].startswith("every rank waits 30 ms a step for the gradient all-reduce")


def test_goodput_accounts_restarts_recomputed_steps_and_the_time_between_attempts() -> None:
    from trainer.observability.goodput import account, report

    def seconds(**s: float) -> dict[str, float]:
        return {p: s.get(p, 0.0) for p in PHASES}

    records = [
        {"run": "old", "event": "start", "time": 1.0, "process_start": 0.0, "step": 0, "load_s": 0.0},
        {"run": "job", "event": "start", "time": 105.0, "process_start": 100.0, "step": 0, "load_s": 0.0},
        {"run": "job", "event": "progress", "time": 130.0, "step": 10, "seconds": seconds(forward=20, checkpoint=4)},
        {"run": "job", "event": "progress", "time": 135.0, "step": 12, "seconds": seconds(forward=24, checkpoint=5)},
        # killed after step 12; the last save was at step 8; the restart starts its process at t=150
        {"run": "job", "event": "start", "time": 160.0, "process_start": 150.0, "step": 8, "load_s": 3.0},
        {"run": "job", "event": "end", "time": 180.0, "step": 20, "seconds": seconds(data=2, forward=10, evaluation=6)},
    ]
    figures = account(records)
    assert figures["run"] == "job" and figures["attempts"] == 2 and figures["restarts"] == 1 and figures["finished"]
    assert figures["wall_s"] == 80.0 and figures["steps_kept"] == 20 and figures["steps_recomputed"] == 4
    assert figures["productive_s"] == pytest.approx(24 * 8 / 12 + 12)  # 8 of the first 12 steps were kept
    assert figures["recomputed_s"] == pytest.approx(24 * 4 / 12)
    assert figures["restart_s"] == 15.0 and figures["startup_s"] == 5.0 + 7.0 and figures["checkpoint_load_s"] == 3.0
    assert figures["checkpoint_save_s"] == 5.0 and figures["evaluation_s"] == 6.0
    assert figures["goodput"] == pytest.approx(28 / 80)
    assert sum(figures[k] for k in figures if k.endswith("_s") and k != "wall_s") == pytest.approx(80.0)
    assert report(figures).splitlines()[0] == "goodput of job: 35.0% (finished; 2 attempt(s), 1 restart(s))"


def test_throughput_metrics_samples_tokens_and_mfu_in_the_loggers_and_the_progress_bar(
    monkeypatch, tmp_path, caplog
) -> None:
    """samples/s is the global batch times steps/s; tokens/s and MFU come from what the task reports per
    micro-batch of one rank (``tokens_per_batch``; ``flops_per_batch``, Lightning's name) and the device's listed
    peak (patched here: a CPU has none, so no MFU is logged without it). The progress bar shows them after the
    task's own numbers; ``progress_bar_metrics`` keeps only what the task logged with ``prog_bar=True``, as in
    Lightning."""
    import csv
    import io
    import logging

    from models import Regression, quiet, regression_data
    from torch.utils.data import DataLoader

    from trainer import Trainer
    from trainer.loggers import CSVLogger
    from trainer.observability.progress import ProgressBar

    class Reporting(Regression):
        tokens_per_batch, flops_per_batch = 32, 2e6

    shown = {}
    for peak in (None, 1e9):
        monkeypatch.setattr("trainer.observability.efficiency.device_peak_flops", lambda device, dtype, peak=peak: peak)
        logger = CSVLogger(str(tmp_path), name=f"peak{peak}", version=0)
        bar = ProgressBar(log_every_n_steps_when_not_tty=3, stream=io.StringIO())  # not a terminal: log lines
        options = quiet(max_steps=6, log_every_n_steps=3, accumulate_grad_batches=2, logger=logger)
        trainer = Trainer(**{**options, "enable_progress_bar": True, "callbacks": [bar]})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trainer.observability.progress"):
            trainer.fit(Reporting(), DataLoader(regression_data(64), batch_size=4))
        perf = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("perf/")}
        assert set(trainer.progress_bar_metrics) == {"loss"}  # keel's loss; the task logs nothing with prog_bar
        lines = [r.getMessage() for r in caplog.records if r.name == "trainer.observability.progress"]
        assert len(lines) == 2, lines  # steps 3 and 6
        shown[peak] = dict(part.split("=") for part in lines[-1].split(" | ")[1].split(" ")[1:])  # after loss
    rate = perf["perf/steps_per_s"]
    assert perf["perf/samples_per_s"] == pytest.approx(rate * 8)  # micro-batch 4 x accumulation 2 x 1 rank
    assert perf["perf/tokens_per_s"] == pytest.approx(rate * 2 * 32)
    assert perf["perf/mfu"] == pytest.approx(rate * 2 * 2e6 / 1e9)
    assert set(shown[None]) == {"data_wait", "tokens/s"} and set(shown[1e9]) == {"data_wait", "tokens/s", "mfu"}
    # shown as percentages: mfu to 0.1%, data_wait to 1%
    assert float(shown[1e9]["mfu"].rstrip("%")) / 100 == pytest.approx(perf["perf/mfu"], abs=0.0005 + 1e-9)
    assert float(shown[1e9]["data_wait"].rstrip("%")) / 100 == pytest.approx(perf["perf/data_wait_frac"], abs=0.005)
    with open(tmp_path / "peak1000000000.0" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows if r["perf/mfu"]] == ["2", "5"]  # the logging steps' own rows (0-based step)
    assert all(r["train/loss"] for r in rows if r["perf/mfu"])


def test_a_task_that_logs_a_perf_name_keeps_its_value_and_is_warned_once(caplog) -> None:
    """keel's ``perf/`` names are its own; a task that logs one of them keeps its value (in every logged dict) and
    hears once which name clashed; keel's other perf metrics are still logged."""
    import logging

    from models import Regression, quiet, regression_data
    from torch.utils.data import DataLoader

    from trainer import Trainer

    class OwnSpeed(Regression):
        def training_step(self, batch, batch_idx):
            self.log("perf/steps_per_s", 123.0)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(**quiet(max_steps=6, log_every_n_steps=2))
    with caplog.at_level(logging.WARNING, logger="trainer.observability.efficiency"):
        trainer.fit(OwnSpeed(), DataLoader(regression_data(64), batch_size=4))
    assert float(trainer.callback_metrics["perf/steps_per_s"]) == 123.0
    assert "perf/data_wait_frac" in trainer.callback_metrics  # keel's others are still there
    warnings = [r.getMessage() for r in caplog.records if "a name keel uses" in r.getMessage()]
    assert len(warnings) == 1 and "perf/steps_per_s" in warnings[0], warnings


def test_a_verdict_that_comes_and_goes_is_said_once_and_one_machine_gets_no_network_advice(caplog) -> None:
    """Seen on 2 CPU ranks of one machine: communication-bound, then not, then again, seven warnings in 15 s with
    advice about NCCL's network interface. Now once a run for each distinct verdict, and no network advice when
    every rank is on one host."""
    waiting, balanced = row(data=1, forward=5, backward=5, sync=40), row(data=1, forward=5, backward=5, sync=0)
    one = Diagnosis(patience=2, backward_waits=False, hosts=["vm", "vm"])
    two = Diagnosis(patience=2, backward_waits=False, hosts=["node-a", "node-b"])
    with caplog.at_level(logging.WARNING, logger="trainer.observability.phases"):
        for rows in [[waiting, waiting]] * 2 + ([[balanced, balanced]] * 2 + [[waiting, waiting]] * 2) * 3:
            one.update(rows)
            two.update(rows)
    assert len(one.warnings) == len(two.warnings) == 1
    assert len([r for r in caplog.records if "communication-bound" in r.getMessage()]) == 2  # one per Diagnosis
    assert "the ranks share one machine, so no network is involved" in one.warnings[0]
    assert "NCCL" not in one.warnings[0] and "GLOO_SOCKET_IFNAME under gloo" in two.warnings[0]
