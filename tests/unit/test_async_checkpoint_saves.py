"""Async checkpoint saves in one process (ModelCheckpoint(async_save=True), trainer/checkpoint/async_save.py) on
the folder format (trainer/checkpoint/store.py): one save in flight, committed only after its write, staged copies
later steps cannot change; failed saves (disk full, no permission, read-only: the error names the save folder, and
the intact previous save stays ``last``) and the file mode of what a save writes. The runs that launch (exact
resume after a crash, a preemption or a SIGKILL, on one process and on 2 ranks) are in
tests/integration/test_async_checkpoint.py.

Seams patched to delay, hold or fail a background write: ``store._finish`` (rank 0, once every data file is
written: keel.pt, the manifest and the rename into place) and DCP's ``FileSystemWriter.write_data`` (every
rank's data file, on DCP's writer thread)."""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from async_saves import SAVE_FILES, hidden, loop_of, weights_of
from models import Regression, loader, quiet, regression_data
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from trainer import Callback, Trainer
from trainer.checkpoint import store
from trainer.checkpoint.async_save import AsyncCheckpointer, cpu_copy
from trainer.checkpoint.dcp_io import ReusedStaging
from trainer.checkpoint.files import POINTER_NAME, CheckpointSaveError, read_pointer, tensor_bytes, write_pointer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.checkpoint.reader import committed
from trainer.distributed.strategy import Strategy


def dcp_items(save: Path) -> dict[str, object]:
    """Every item of a save's DCP data files (model and optimizer state) by its path, without the save's
    identity (``identity_<rank>``: a fresh save id every save)."""
    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(save, Path(scratch) / "items.pt")
        items = torch.load(Path(scratch) / "items.pt", weights_only=True)
    flat: dict[str, object] = {}

    def walk(value: object, at: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{at}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, inner in enumerate(value):
                walk(inner, f"{at}/{i}")
        else:
            flat[at] = value

    walk({k: v for k, v in items.items() if not k.startswith("identity_")}, "")
    return flat


def assert_same_items(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    assert any("/model/" in k for k in a) and any("/optimizers/" in k for k in a)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key  # type: ignore[arg-type]
        else:
            assert value == b[key], key


# ---------------------------------------------------------------------- the machinery itself
def test_at_most_one_save_in_flight_and_commit_only_after_the_write() -> None:
    checkpointer, release, events = AsyncCheckpointer(), threading.Event(), []

    def blocked_write(staged):
        events.append(("write", staged))
        release.wait(10)

    checkpointer.submit(lambda: 1, blocked_write, lambda: events.append(("commit", 1)))
    assert checkpointer.in_flight and not checkpointer.poll()  # still writing: poll never blocks
    second = threading.Thread(
        target=lambda: checkpointer.submit(
            lambda: events.append(("stage", 2)) or 2,
            lambda s: events.append(("write", s)),
            lambda: events.append(("commit", 2)),
        )
    )
    second.start()
    time.sleep(0.3)
    assert events == [("write", 1)]  # the second save waits for the first before staging
    release.set()
    second.join(10)
    assert events[:3] == [("write", 1), ("commit", 1), ("stage", 2)]
    assert checkpointer.wait() and events[-1] == ("commit", 2) and not checkpointer.in_flight
    assert not checkpointer.wait() and not checkpointer.poll()  # nothing in flight: no-ops


def test_a_save_every_rank_refuses_is_raised_at_the_same_poll_on_every_rank() -> None:
    """Two "ranks" in one process, each with its checkpointer; their writes vote through a barrier (the
    collective). Rank b's write reaches the vote 0.3 s late and ends 0.3 s after it (a slow clean-up), while
    both main threads poll at every step boundary: both raise at the same one (AsyncCheckpointer.vote)."""
    checkpointers = {"a": AsyncCheckpointer(), "b": AsyncCheckpointer()}
    barrier, counts = threading.Barrier(2, timeout=30), {}

    def write_of(name: str, delay: float):
        def write(staged) -> None:
            time.sleep(delay)  # b: a slower write before the verdict

            def collective(polls: int) -> tuple[bool, int]:
                counts[name] = polls
                barrier.wait()
                return False, max(counts.values())  # every rank refuses

            assert checkpointers[name].vote(collective) is False
            time.sleep(delay)  # b: a slower clean-up after it
            raise FloatingPointError(f"refused on {name}")

        return write

    for name, delay in (("a", 0.0), ("b", 0.3)):
        checkpointers[name].submit(lambda: None, write_of(name, delay))
    raised: dict[str, int] = {}
    for step in range(1, 10_000):
        for name, checkpointer in checkpointers.items():
            if name not in raised:
                try:
                    checkpointer.poll()
                except FloatingPointError:
                    raised[name] = step
        if len(raised) == 2:
            break
        time.sleep(0.001)
    assert raised["a"] == raised["b"], raised
    assert not any(c.in_flight for c in checkpointers.values())


def test_a_failed_write_is_raised_once_on_the_main_thread_and_never_commits() -> None:
    checkpointer, commits = AsyncCheckpointer(), []

    def failing(staged):
        raise OSError(errno.ENOSPC, "No space left on device")

    checkpointer.submit(lambda: None, failing, lambda: commits.append(1))
    assert checkpointer._job is not None and checkpointer._job.done.wait(60)  # the write has failed
    with pytest.raises(OSError, match="No space"):
        checkpointer.poll()
    assert not commits and not checkpointer.in_flight and not checkpointer.poll()
    checkpointer.submit(lambda: None, failing, lambda: commits.append(1))
    assert checkpointer.wait(raise_errors=False) is False  # logged, not raised (an exception is propagating)
    assert not commits


def test_reused_staging_is_a_copy_later_in_place_changes_cannot_change() -> None:
    weight, step = torch.arange(6.0).reshape(2, 3), torch.tensor(3.0)
    state = {
        "model": OrderedDict(w=weight, b=torch.zeros(2)),
        "optimizers": [{"state": {"w": {"step": step}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}],
    }
    stager = ReusedStaging()
    staged = stager.stage(state)
    weight.add_(100.0)  # the optimizer steps on after staging
    step.add_(1)
    state["optimizers"][0]["param_groups"][0]["lr"] = 9.0
    assert torch.equal(staged["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert staged["model"]["w"].data_ptr() != weight.data_ptr() and staged["model"]["w"].device.type == "cpu"
    assert staged["optimizers"][0]["state"]["w"]["step"].item() == 3.0
    assert staged["optimizers"][0]["param_groups"][0]["lr"] == 0.1
    assert stager.staged("model") is staged["model"] and stager.staged("absent") == {}


def test_reused_staging_reuses_its_buffers_for_the_same_layout_only() -> None:
    stager, weight = ReusedStaging(), torch.ones(4, 3)
    first = stager.stage({"w": weight, "b": [torch.zeros(2)]})
    buffers = (first["w"].data_ptr(), first["b"][0].data_ptr())
    weight.mul_(5.0)
    second = stager.stage({"w": weight, "b": [torch.zeros(2)]})  # the next save, same layout
    assert (second["w"].data_ptr(), second["b"][0].data_ptr()) == buffers  # no fresh allocation
    assert torch.equal(second["w"], torch.full((4, 3), 5.0)) and second["w"].data_ptr() != weight.data_ptr()
    resized = stager.stage({"w": torch.full((5, 3), 2.0), "b": [torch.zeros(2)]})  # a resized parameter
    assert torch.equal(resized["w"], torch.full((5, 3), 2.0)) and resized["w"].data_ptr() not in buffers
    again = stager.stage({"w": torch.full((5, 3), 3.0), "b": [torch.zeros(2)]})
    assert again["w"].data_ptr() == resized["w"].data_ptr() and torch.equal(again["w"], torch.full((5, 3), 3.0))
    grown = stager.stage({"w": torch.ones(5, 3), "b": [torch.zeros(2)], "new": torch.arange(7.0)})  # state appeared
    assert torch.equal(grown["new"], torch.arange(7.0)) and torch.equal(grown["w"], torch.ones(5, 3))
    assert grown["new"].data_ptr() not in (*buffers, again["w"].data_ptr(), again["b"][0].data_ptr())


def test_cpu_copy_is_a_copy_later_steps_cannot_change() -> None:
    rng, counter = torch.get_rng_state(), torch.tensor([4])
    state = {
        "loop": {"global_step": 3, "seen": [1, 2]},
        "rng": [rng],
        "callbacks": OrderedDict(cb={"best": {"k": 1.0}, "count": counter}),
        "names": ("x", 1),
    }
    copied = cpu_copy(state)
    rng.zero_()
    counter.add_(1)
    state["loop"]["global_step"] = 4
    state["loop"]["seen"].append(3)
    state["callbacks"]["cb"]["best"]["k"] = 2.0
    assert copied["loop"] == {"global_step": 3, "seen": [1, 2]}
    assert torch.equal(copied["rng"][0], torch.get_rng_state()) and copied["rng"][0].data_ptr() != rng.data_ptr()
    assert isinstance(copied["callbacks"], OrderedDict) and copied["callbacks"]["cb"]["best"] == {"k": 1.0}
    assert copied["callbacks"]["cb"]["count"].tolist() == [4] and copied["names"] == ("x", 1)


# ---------------------------------------------------------------------- in one process
class SlowWrites:
    """Every background write takes ``delay`` s longer (``store._finish`` sleeps first on a worker thread)
    and how many saves are in flight at once is counted: a save is in flight from DCP's write of its data
    file (``FileSystemWriter.write_data``) to the end of ``_finish``."""

    def __init__(self, monkeypatch, delay: float) -> None:
        self.delay, self.active, self.most, self.background, self.lock = delay, 0, 0, 0, threading.Lock()
        write_data, finish = FileSystemWriter.write_data, store._finish

        def counted_write_data(writer, plan, planner):
            with self.lock:
                self.active += 1
                self.most = max(self.most, self.active)
            return write_data(writer, plan, planner)

        def slow_finish(job, files):
            try:
                if threading.current_thread() is not threading.main_thread():
                    self.background += 1
                    time.sleep(self.delay)
                return finish(job, files)
            finally:
                with self.lock:
                    self.active -= 1

        monkeypatch.setattr(FileSystemWriter, "write_data", counted_write_data)
        monkeypatch.setattr(store, "_finish", slow_finish)


def async_fit(
    tmp_path: Path,
    callbacks=(),
    *,
    before=(),
    task: Regression | None = None,
    max_steps: int = 8,
    **ckpt_kwargs,
) -> tuple[Trainer, ModelCheckpoint, Regression]:
    """A fit saving in the background every step into tmp_path/ck; ``before``: callbacks whose hooks run
    before ModelCheckpoint's, ``callbacks``: after it."""
    cb = ModelCheckpoint(dirpath=tmp_path / "ck", async_save=True, **{"every_n_train_steps": 1, **ckpt_kwargs})
    trainer = Trainer(
        **quiet(
            max_steps=max_steps,
            enable_checkpointing=True,
            callbacks=[*before, cb, *callbacks],
            seed=0,
            default_root_dir=str(tmp_path / "run"),
        )
    )
    task = task if task is not None else Regression(optimizer="adamw")
    trainer.fit(task, loader(regression_data(), 16))
    return trainer, cb, task


def test_async_saves_equal_sync_saves_and_the_end_of_fit_waits(tmp_path: Path, monkeypatch) -> None:
    slow = SlowWrites(monkeypatch, 0.15)
    trainer, cb, task = async_fit(tmp_path / "a", save_top_k=2)
    a, s = tmp_path / "a" / "ck", tmp_path / "s" / "ck"
    assert not cb._checkpointer.in_flight and slow.most == 1 and slow.background == 8  # one at a time, all 8
    assert read_pointer(a)[0] == "epoch=1-step=8.ckpt"  # committed before fit returned
    for name, value in task.state_dict().items():
        assert torch.equal(weights_of(a / "epoch=1-step=8.ckpt")[name], value), name
    sync_cb = ModelCheckpoint(dirpath=s, every_n_train_steps=1, save_top_k=2)
    Trainer(**quiet(max_steps=8, enable_checkpointing=True, callbacks=[sync_cb], seed=0)).fit(
        Regression(optimizer="adamw"), loader(regression_data(), 16)
    )
    assert (
        sorted(os.listdir(a))
        == sorted(os.listdir(s))
        == ["epoch=1-step=7.ckpt", "epoch=1-step=8.ckpt", "keel.claim", "last"]
    )
    assert read_pointer(a) == read_pointer(s)
    assert Path(cb.best_model_path).name == Path(sync_cb.best_model_path).name == "epoch=1-step=8.ckpt"
    for name in ("epoch=1-step=7.ckpt", "epoch=1-step=8.ckpt"):
        assert sorted(os.listdir(a / name)) == sorted(os.listdir(s / name)) == SAVE_FILES
        assert_same_items(dcp_items(a / name), dcp_items(s / name))  # the same weights and optimizer state
        assert loop_of(a / name) == loop_of(s / name)
    assert len(cb._checkpointer.history) == 8


class Gate(Callback):
    """The background write of step 3's save is held in ``_finish`` (its data files written, nothing
    committed) until HOLD s into step 4's hook; what the folder and the pointer say is recorded at every
    step boundary."""

    HOLD = 0.4

    def __init__(self, monkeypatch) -> None:
        self.release, self.seen, self.held = threading.Event(), {}, None
        finish = store._finish

        def gated(job, files):
            if job.target.name == "epoch=0-step=3.ckpt":
                self.held = (threading.current_thread() is threading.main_thread(), sorted(os.listdir(job.tmp)))
                self.release.wait(10)
            return finish(job, files)

        monkeypatch.setattr(store, "_finish", gated)

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        step, cb = trainer.global_step, trainer.checkpoint_callback
        ck = Path(cb.dirpath)
        if step == 3:
            self.weights_at_3 = {k: v.clone() for k, v in task.state_dict().items()}
        if step == 4:
            time.sleep(self.HOLD)
            self.release.set()
            assert cb._checkpointer._job.done.wait(10)  # written, renamed and the pointer swapped; done at step 5
        self.seen[step] = (
            (read_pointer(ck) or [None])[0],
            cb._checkpointer.in_flight,
            (ck / "epoch=0-step=3.ckpt").is_dir(),
        )
        if step == 5:  # before step 6's save prunes it
            self.saved_3, self.loop_3 = weights_of(ck / "epoch=0-step=3.ckpt"), loop_of(ck / "epoch=0-step=3.ckpt")


def test_the_loop_is_blocked_only_for_staging_and_the_pointer_swaps_after_the_folder_is_committed(
    tmp_path: Path, monkeypatch
) -> None:
    gate = Gate(monkeypatch)
    _, cb, _ = async_fit(tmp_path, [gate], every_n_train_steps=3, max_steps=7)
    assert gate.held == (False, [".metadata", "__0_0.distcp"])  # the worker thread: data files, nothing else yet
    assert gate.seen[3] == (None, True, False)  # being written: no folder, no pointer, and step 4 runs
    # Renamed into place and the pointer swapped on the worker thread; reported done at step 5's poll.
    assert gate.seen[4] == ("epoch=0-step=3.ckpt", True, True)
    assert gate.seen[5] == ("epoch=0-step=3.ckpt", False, True)
    for name, value in gate.weights_at_3.items():  # steps 4 and 5 ran meanwhile; the save holds step 3
        assert torch.equal(gate.saved_3[name], value), name
    assert gate.loop_3["global_step"] == 3
    times = cb._checkpointer.history[0]
    assert times.what.endswith("epoch=0-step=3.ckpt")
    assert times.background >= Gate.HOLD > 2 * times.blocked, times  # the loop waited for the staging only
    assert read_pointer(tmp_path / "ck")[0] == "epoch=1-step=6.ckpt"
    assert sorted(os.listdir(tmp_path / "ck")) == ["epoch=1-step=6.ckpt", "keel.claim", "last"]


class RaiseAt(Callback):
    def __init__(self, step: int) -> None:
        self.step, self.in_flight = step, None

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.in_flight = trainer.checkpoint_callback._checkpointer.in_flight
            raise RuntimeError(f"boom at step {self.step}")


def test_an_exception_waits_for_the_save_in_flight(tmp_path: Path, monkeypatch) -> None:
    slow, boom, task = SlowWrites(monkeypatch, 0.3), RaiseAt(3), Regression(optimizer="adamw")
    with pytest.raises(RuntimeError, match="boom at step 3"):
        async_fit(tmp_path, [boom], task=task)
    ck = tmp_path / "ck"
    assert boom.in_flight is True and slow.background == 3  # step 3's save was being written when it raised
    assert read_pointer(ck)[0] == "epoch=0-step=3.ckpt"
    assert sorted(os.listdir(ck)) == [
        "epoch=0-step=3.ckpt",
        "keel.claim",
        "last",
    ]  # step 2's pruned, no temporary folder
    for name, value in task.state_dict().items():
        assert torch.equal(weights_of(ck / "epoch=0-step=3.ckpt")[name], value), name


class NanAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(task.parameters())[0, 0] = float("nan")


class Steps(Callback):
    """Records every step boundary its hook reaches (placed after ModelCheckpoint)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.raised_at: int | None = None

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.steps.append(trainer.global_step)

    def on_exception(self, trainer, task, exception) -> None:
        self.raised_at, self.trainer = trainer.global_step, trainer


def test_non_finite_weights_are_refused_by_the_async_save_call_itself(tmp_path: Path, monkeypatch) -> None:
    slow, steps, checks, staged = SlowWrites(monkeypatch, 0.2), Steps(), [], []
    weights_finite, stage = Strategy.weights_finite, ReusedStaging.stage

    def checked(strategy, task):
        checks.append(threading.current_thread() is threading.main_thread())
        return weights_finite(strategy, task)

    def counted(stager, state_dict):
        staged.append(1)
        return stage(stager, state_dict)

    monkeypatch.setattr(Strategy, "weights_finite", checked)
    monkeypatch.setattr(ReusedStaging, "stage", counted)
    with pytest.raises(FloatingPointError, match=r"Refusing to write checkpoint .*step=3\.ckpt' at step 3") as info:
        async_fit(tmp_path, [steps], before=[NanAt(3)], max_steps=5)
    frames = traceback.extract_tb(info.value.__traceback__)
    assert not any(f.filename.endswith("async_save.py") for f in frames)  # not re-raised from the worker thread
    assert any(f.filename.endswith("model_checkpoint.py") and f.name == "save" for f in frames)
    assert steps.steps == [1, 2] and steps.raised_at == 3  # raised at step 3, by the save call
    assert checks == [True, True, True] and len(staged) == 2  # one check per save, on the main thread; no staging
    ck = tmp_path / "ck"
    assert read_pointer(ck)[0] == "epoch=0-step=2.ckpt"  # the save in flight was committed first
    assert (
        sorted(os.listdir(ck)) == ["epoch=0-step=2.ckpt", "keel.claim", "last"] and slow.background == 2
    )  # nothing written
    assert all(torch.isfinite(v).all() for v in weights_of(ck / "epoch=0-step=2.ckpt").values())


def test_async_save_option_is_checked() -> None:
    with pytest.raises(ValueError, match="async_save"):
        ModelCheckpoint(async_save="yes")  # type: ignore[arg-type]


def test_pruning_under_async_saves_leaves_the_two_newest_saves_and_the_pointer_only(tmp_path: Path) -> None:
    _, cb, _ = async_fit(tmp_path, save_top_k=2, max_steps=6)
    ck = tmp_path / "ck"
    assert sorted(os.listdir(ck)) == [
        "epoch=1-step=5.ckpt",
        "epoch=1-step=6.ckpt",
        "keel.claim",
        "last",
    ]  # hidden ones too
    for name in ("epoch=1-step=5.ckpt", "epoch=1-step=6.ckpt"):
        assert sorted(os.listdir(ck / name)) == SAVE_FILES
    assert read_pointer(ck)[0] == "epoch=1-step=6.ckpt" and committed(ck) == [
        "epoch=1-step=6.ckpt",
        "epoch=1-step=5.ckpt",
    ]
    assert sorted(Path(p).name for p in cb.best_k_models) == ["epoch=1-step=5.ckpt", "epoch=1-step=6.ckpt"]


class Exists(Callback):
    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, []

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.seen.append(self.path.exists())


def test_a_leftover_temporary_folder_is_removed_by_the_first_async_save(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    leftover = ck / ".epoch=0-step=1.ckpt.tmp-0123abcd"  # what a save killed before its rename leaves
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"PK\x03\x04" + os.urandom(256))
    probe = Exists(leftover)
    async_fit(tmp_path, before=[probe], max_steps=1)  # one step: one save
    assert probe.seen == [True]  # still there at step 1, before the save
    assert sorted(os.listdir(ck)) == ["epoch=0-step=1.ckpt", "keel.claim", "last"]
    assert (
        sorted(os.listdir(ck / "epoch=0-step=1.ckpt")) == SAVE_FILES
        and loop_of(ck / "epoch=0-step=1.ckpt")["global_step"] == 1
    )


# ---------------------------------------------------------------------- failed saves
def _mount_tmpfs(path: Path, options: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, f"keel-test-{uuid.uuid4().hex[:8]}", str(path)],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 1 MiB filesystem (tmpfs; needs root and mount rights, else the test is skipped)."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "size=1m"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights); see the monkeypatched tests")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=30)


@pytest.fixture
def read_only_disk(tmp_path: Path):
    disk = tmp_path / "ro"
    if not _mount_tmpfs(disk, "ro,size=1m"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights); see the monkeypatched tests")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=30)


def assert_save_error(exc: BaseException, path: Path, *, needed: int, reason: str, previous: Path | None) -> None:
    text = str(exc)
    assert isinstance(exc, CheckpointSaveError) and isinstance(exc, OSError), repr(exc)
    assert f"Could not write checkpoint {str(path)!r}: {reason}" in text
    assert f"({needed:,} bytes of tensors, in " in text and " free in " in text
    if previous is not None:
        assert f"the previous checkpoint {str(previous)!r} is intact" in text
    else:
        assert "no earlier checkpoint was touched" in text
    shown = "".join(traceback.format_exception(exc))
    assert shown.rstrip().splitlines()[-1].endswith(text)  # the last line of the traceback says it all
    assert "enforce fail" not in shown  # torch's follow-up error is not shown
    if path.parent.exists():
        assert not hidden(path.parent)  # no temporary folder or file left


class Wide(Regression):
    """About 720 KB of weights + AdamW state: one save fits on a 1 MiB disk, two do not."""

    def __init__(self) -> None:
        super().__init__(optimizer="adamw")
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 6000), nn.Tanh(), nn.Linear(6000, 1))


def fitted(tmp_path: Path, task: Regression) -> Trainer:
    """A trainer after a 1-step fit without checkpointing: Trainer.save_checkpoint writes synchronously."""
    trainer = Trainer(**quiet(max_steps=1, seed=0, default_root_dir=str(tmp_path / "run")))
    trainer.fit(task, loader(regression_data(), 16))
    return trainer


def run_tensor_bytes(trainer: Trainer, task: Regression) -> int:
    """What a save's data files hold: the weights and the optimizer state."""
    return tensor_bytes(task.state_dict()) + tensor_bytes(trainer.optimizers[0].state_dict())


def full_or_read_only(kind: str, request, tmp_path: Path) -> dict:
    """A save on a real disk that cannot take it. ``full-sync``: Trainer.save_checkpoint of a second save on
    a 1 MiB disk holding the first; ``full-async``: a fit saving Wide every step in the background on it
    (step 1's save fits, step 2's does not); ``read-only``: Trainer.save_checkpoint onto a read-only disk."""
    if kind == "full-sync":
        disk, task = request.getfixturevalue("small_disk"), Wide()
        trainer = fitted(tmp_path, task)
        trainer.save_checkpoint(disk / "a.ckpt")
        write_pointer(disk / "a.ckpt")
        with pytest.raises(Exception) as info:
            trainer.save_checkpoint(disk / "b.ckpt")  # another 720 KB on a 1 MiB disk
        return dict(
            error=info.value,
            disk=disk,
            path=disk / "b.ckpt",
            previous=disk / "a.ckpt",
            step=1,
            task=task,
            trainer=trainer,
        )
    if kind == "read-only":  # a fit with dirpath there is refused when it starts (the test below); a save is not
        disk, task = request.getfixturevalue("read_only_disk"), Regression(optimizer="adamw")
        trainer = fitted(tmp_path, task)
        with pytest.raises(Exception) as info:
            trainer.save_checkpoint(disk / "epoch=0-step=1.ckpt")
        return dict(
            error=info.value, disk=disk, path=disk / "epoch=0-step=1.ckpt", previous=None, trainer=trainer, task=task
        )
    disk, task = request.getfixturevalue("small_disk"), Wide()
    cb = ModelCheckpoint(dirpath=disk, every_n_train_steps=1, async_save=True)
    trainer = Trainer(
        **quiet(max_steps=4, enable_checkpointing=True, callbacks=[cb], seed=0, default_root_dir=str(tmp_path / "run"))
    )
    with pytest.raises(Exception) as info:
        trainer.fit(task, loader(regression_data(), 16))
    first = disk / "epoch=0-step=1.ckpt"
    return dict(
        error=info.value,
        disk=disk,
        path=disk / "epoch=0-step=2.ckpt",
        previous=first,
        step=1,
        task=task,
        trainer=trainer,
    )


@pytest.mark.parametrize("kind", ["full-sync", "full-async", "read-only"])
def test_a_full_or_read_only_disk_fails_naming_the_folder_and_loses_nothing(kind: str, request, tmp_path: Path) -> None:
    failed = full_or_read_only(kind, request, tmp_path)
    disk, previous = failed["disk"], failed["previous"]
    assert f"{str(failed['path'])!r}" in str(failed["error"]), failed["error"]  # the folder it could not write
    if previous is None:
        assert os.listdir(disk) == []  # nothing written, nothing left
        return
    claimed = [] if kind == "full-sync" else ["keel.claim"]  # full-sync: Trainer.save_checkpoint, no fit there
    assert sorted(os.listdir(disk)) == sorted([previous.name, *claimed, "last"])  # no temporary folder, nothing pruned
    assert read_pointer(disk) == [previous.name]
    assert loop_of(previous)["global_step"] == failed["step"]
    if kind == "full-sync":
        for name, value in failed["task"].state_dict().items():
            assert torch.equal(weights_of(previous)[name], value), name
        return
    resumed = Trainer(
        **quiet(
            max_steps=1,
            enable_checkpointing=True,
            seed=0,
            callbacks=[ModelCheckpoint(dirpath=disk, every_n_train_steps=100)],
            default_root_dir=str(tmp_path / "resumed"),
        )
    )
    resumed.fit(Wide(), loader(regression_data(), 16), ckpt_path="last")  # `last` still loads
    assert resumed.global_step == 1


def test_a_read_only_dirpath_is_refused_when_fit_starts(read_only_disk: Path, tmp_path: Path) -> None:
    trainer = Trainer(
        **quiet(max_steps=4, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=read_only_disk)])
    )
    with pytest.raises(PermissionError, match=r"is not writable by this user, so no checkpoint could be saved"):
        trainer.fit(Regression(), loader(regression_data(), 16))
    assert trainer.global_step == 0 and os.listdir(read_only_disk) == []


@pytest.mark.parametrize("kind", ["full-sync", "full-async", "read-only"])
def test_a_full_or_read_only_disk_is_a_checkpoint_save_error_explaining_it(kind: str, request, tmp_path: Path) -> None:
    failed = full_or_read_only(kind, request, tmp_path)
    error = failed["error"]
    code, reason = (
        (errno.EROFS, "Read-only file system (EROFS)")
        if kind == "read-only"
        else (errno.ENOSPC, "No space left on device (ENOSPC)")
    )
    assert isinstance(error, CheckpointSaveError) and error.errno == code, repr(error)
    needed = run_tensor_bytes(failed["trainer"], failed["task"])  # the same shapes at every step
    assert_save_error(error, failed["path"], needed=needed, reason=reason, previous=failed["previous"])


def _disk_full_in_finish(job, files) -> None:
    """``store._finish`` when the disk fills up while keel.pt is written (part of it is on disk)."""
    (job.tmp / "keel.pt").write_bytes(b"\0" * 1000)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_simulated(tmp_path: Path, monkeypatch) -> None:
    task = Regression(optimizer="adamw")
    trainer, ck = fitted(tmp_path, task), tmp_path / "ck"
    trainer.save_checkpoint(ck / "a.ckpt")
    write_pointer(ck / "a.ckpt")
    monkeypatch.setattr(store, "_finish", _disk_full_in_finish)
    with pytest.raises(CheckpointSaveError) as info:
        trainer.save_checkpoint(ck / "b.ckpt")
    assert info.value.errno == errno.ENOSPC
    assert_save_error(
        info.value,
        ck / "b.ckpt",
        needed=run_tensor_bytes(trainer, task),
        reason="No space left on device (ENOSPC)",
        previous=ck / "a.ckpt",
    )
    assert sorted(os.listdir(ck)) == ["a.ckpt", POINTER_NAME]
    for name, value in task.state_dict().items():
        assert torch.equal(weights_of(ck / "a.ckpt")[name], value), name


def _needs(text: str) -> float:
    """The bytes a save's error says it needs ("It needs about 120.0 KiB on disk"), to the precision it gives."""
    import re

    found = re.search(r"It needs about ([0-9.]+) (B|KiB|MiB|GiB)", text)
    assert found, text
    return float(found.group(1)) * 1024 ** ["B", "KiB", "MiB", "GiB"].index(found.group(2))


@pytest.mark.parametrize("weights_only", [False, True], ids=["save-folder", "weights-file"])
def test_the_space_a_refused_save_needs_counts_every_file_in_whole_blocks(
    tmp_path: Path, monkeypatch, weights_only: bool
) -> None:
    """A save of a small model is mostly overhead: DCP's per-item records, .metadata, keel.pt and the manifest, each
    taking whole blocks of the filesystem. The space a refused save says it needs is at least what the same save
    takes on the disk when it succeeds (it said "needs about 1.9 KiB" of an 80 KiB save: less than was free)."""
    task = Regression(optimizer="adamw")
    trainer, ck = fitted(tmp_path, task), tmp_path / "ck"
    trainer.save_checkpoint(ck / "a.ckpt", weights_only=weights_only)
    block = os.statvfs(ck).f_frsize or os.statvfs(ck).f_bsize
    written = [ck / "a.ckpt"] if weights_only else sorted((ck / "a.ckpt").iterdir())
    taken = sum(-(-p.stat().st_size // block) * block for p in written)
    finish, replace = store._finish, os.replace

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if weights_only:  # the plain file is written whole, then refused at its rename
        monkeypatch.setattr(os, "replace", lambda a, b: full() if str(b).endswith("b.ckpt") else replace(a, b))
    else:
        monkeypatch.setattr(
            store, "_finish", lambda job, files: full() if job.target.name == "b.ckpt" else finish(job, files)
        )
    with pytest.raises(CheckpointSaveError) as info:
        trainer.save_checkpoint(ck / "b.ckpt", weights_only=weights_only)
    needs = _needs(str(info.value))
    assert needs + 0.05 * 1024 >= taken, (str(info.value), taken)  # at least what it takes, to the .1f shown
    assert needs < 4 * taken, (str(info.value), taken)  # and of its size, not a guess of another order
    assert f"of whole {block:,}-byte blocks" in str(info.value)


def test_permission_denied_simulated(tmp_path: Path, monkeypatch) -> None:
    # Root ignores mode bits, so a chmod'ed folder proves nothing here: the refusal is simulated.
    def refuse(job, files):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(job.tmp / "keel.pt"))

    task = Regression(optimizer="adamw")
    trainer, ck = fitted(tmp_path, task), tmp_path / "ck"
    monkeypatch.setattr(store, "_finish", refuse)
    with pytest.raises(CheckpointSaveError) as info:
        trainer.save_checkpoint(ck / "x.ckpt")
    assert info.value.errno == errno.EACCES
    needed = run_tensor_bytes(trainer, task)
    assert_save_error(info.value, ck / "x.ckpt", needed=needed, reason="Permission denied (EACCES)", previous=None)
    assert "Make the folder writable" in str(info.value)
    assert os.listdir(ck) == []


class WaitForWrite(Callback):
    """At ``step``, after ModelCheckpoint submitted that step's save, wait until its background write ended:
    the next poll (step + 1) is the first that can report it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.weights = {k: v.clone() for k, v in task.state_dict().items()}
            assert trainer.checkpoint_callback._checkpointer._job.done.wait(10)


def test_async_save_that_fails_raises_at_the_next_step_boundary_and_keeps_last(tmp_path: Path, monkeypatch) -> None:
    finish = store._finish

    def failing_at_3(job, files):
        if job.target.name == "epoch=0-step=3.ckpt":
            return _disk_full_in_finish(job, files)
        return finish(job, files)

    monkeypatch.setattr(store, "_finish", failing_at_3)
    steps, at_2, at_3 = Steps(), WaitForWrite(2), WaitForWrite(3)
    task = Regression(optimizer="adamw")
    with pytest.raises(CheckpointSaveError) as info:
        async_fit(tmp_path, [at_2, at_3, steps], task=task)
    ck = tmp_path / "ck"
    assert steps.steps == [1, 2, 3] and steps.raised_at == 4  # raised at the next step boundary
    assert info.value.errno == errno.ENOSPC
    assert f"Could not write checkpoint {str(ck / 'epoch=0-step=3.ckpt')!r}: No space left on device" in str(info.value)
    assert f"the previous checkpoint {str(ck / 'epoch=0-step=2.ckpt')!r} is intact" in str(info.value)
    assert_save_error(
        info.value,
        ck / "epoch=0-step=3.ckpt",
        needed=run_tensor_bytes(steps.trainer, task),
        reason="No space left on device (ENOSPC)",
        previous=ck / "epoch=0-step=2.ckpt",
    )
    assert read_pointer(ck)[0] == "epoch=0-step=2.ckpt"
    assert sorted(os.listdir(ck)) == ["epoch=0-step=2.ckpt", "keel.claim", POINTER_NAME]  # nothing pruned or left
    for name, value in at_2.weights.items():
        assert torch.equal(weights_of(ck / "epoch=0-step=2.ckpt")[name], value), name


# ---------------------------------------------------------------------- file modes
def test_the_pointer_and_every_file_of_a_save_get_the_usual_modes(tmp_path: Path) -> None:
    mode = lambda p: os.stat(p).st_mode & 0o777  # noqa: E731
    umask = os.umask(0)
    os.umask(umask)
    for async_save in (False, True):
        folder = tmp_path / str(async_save)
        cb = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, async_save=async_save)
        Trainer(**quiet(max_steps=4, enable_checkpointing=True, callbacks=[cb])).fit(
            Regression(), loader(regression_data(), 16)
        )
        save = Path(cb.last_model_path)
        assert save.name == "epoch=0-step=4.ckpt" and sorted(os.listdir(save)) == SAVE_FILES
        assert mode(folder / POINTER_NAME) == 0o666 & ~umask
        assert {name: mode(save / name) for name in SAVE_FILES} == dict.fromkeys(SAVE_FILES, 0o666 & ~umask)
        assert mode(save) == 0o777 & ~umask, async_save


class ManualSaves(Callback):
    """``trainer.save_checkpoint(ck/manual-<step>.ckpt)`` at every step, after ModelCheckpoint's background save
    of that step was submitted: a manual save and an asynchronous one into the same folder, alternating."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        trainer.save_checkpoint(self.folder / f"manual-{trainer.global_step}.ckpt")


def test_a_manual_save_beside_background_saves_is_never_swept_away(tmp_path: Path, monkeypatch) -> None:
    """A background save's commit removes what killed saves left in the folder. It used to remove every temporary
    folder there, the manual save's still being written included (ENOENT in the middle of it). Held here so the
    background commit lands inside the manual save's write whenever the two can overlap: a manual save now waits
    for the background one (one save of a run in flight), and the sweep never touches a live save's folder."""
    committed_async = threading.Event()
    commit_folder, write_data = store.commit_folder, FileSystemWriter.write_data

    def commit_then_say(tmp, target):  # type: ignore[no-untyped-def]
        commit_folder(tmp, target)
        if threading.current_thread() is not threading.main_thread():
            committed_async.set()

    def manual_write_waits(writer, plan, planner):  # type: ignore[no-untyped-def]
        if threading.current_thread() is threading.main_thread() and "manual-" in Path(writer.path).name:
            committed_async.wait(timeout=3)  # the background save commits (and sweeps) while this one writes
            committed_async.clear()
        return write_data(writer, plan, planner)

    monkeypatch.setattr(store, "commit_folder", commit_then_say)
    monkeypatch.setattr(FileSystemWriter, "write_data", manual_write_waits)
    ck = tmp_path / "ck"
    async_fit(tmp_path, [ManualSaves(ck)], max_steps=4)
    for step in range(1, 5):
        save = ck / f"manual-{step}.ckpt"
        assert sorted(os.listdir(save)) == SAVE_FILES and loop_of(save)["global_step"] == step
    assert hidden(ck) == []  # nothing left half-written


def test_a_commit_sweeps_what_killed_saves_left_but_not_a_live_save(tmp_path: Path, monkeypatch) -> None:
    killed, live, done = (
        tmp_path / n for n in (".a.ckpt.tmp-0badf00d", ".b.ckpt.tmp-1234abcd", ".c.ckpt.tmp-5678abcd")
    )
    for folder in (killed, live, done):
        folder.mkdir()
        (folder / "x").write_bytes(b"1")
    monkeypatch.setattr(store, "_LIVE", {os.path.realpath(live)})  # a save of this process still writing
    store.commit_folder(done, tmp_path / "c.ckpt")
    assert sorted(os.listdir(tmp_path)) == [".b.ckpt.tmp-1234abcd", "c.ckpt"]
