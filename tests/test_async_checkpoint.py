"""Async checkpoint saves (ModelCheckpoint(async_save=True), trainer/checkpoint/async_save.py), failed saves
(disk full, no permission: the error names the file, bytes needed and free, and the intact previous
checkpoint) and the ``last`` pointer's file mode."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, python, torchrun
from models import Regression, loader, quiet, regression_data
from torch import nn

from trainer import Callback, Trainer
from trainer.checkpoint import files as checkpoint_io
from trainer.checkpoint import state as ckpt_module
from trainer.checkpoint.async_save import AsyncCheckpointer, CpuStager, stage_to_cpu
from trainer.checkpoint.files import (
    POINTER_NAME,
    CheckpointIO,
    CheckpointSaveError,
    read_pointer,
    tensor_bytes,
    write_pointer,
)
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.distributed.preemption import PREEMPTED_EXIT_CODE

SCRIPT = REPO_ROOT / "tests" / "scripts" / "async_fit.py"
SYNC_SCRIPT = REPO_ROOT / "tests" / "scripts" / "resume_fit.py"


def result(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def assert_same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == 14
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name
    for key, state in a["optimizer"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"][key][name]), (key, name)


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


def test_commit_waits_for_the_ready_predicate() -> None:
    checkpointer, commits, all_ranks_done = AsyncCheckpointer(), [], threading.Event()
    checkpointer.submit(lambda: None, lambda staged: None, lambda: commits.append(1), ready=all_ranks_done.is_set)
    checkpointer._job.done.wait(10)
    assert not checkpointer.poll() and checkpointer.in_flight and not commits  # written, but not ready
    threading.Timer(0.2, all_ranks_done.set).start()
    assert checkpointer.wait() and commits == [1]


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


def test_stage_to_cpu_is_a_copy_later_steps_cannot_change() -> None:
    weight = torch.arange(6.0).reshape(2, 3)
    state = {
        "model": OrderedDict(a=weight, tied=weight),
        "opt": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "loop": {"global_step": 3},
        "names": ("x", 1),
    }
    staged = stage_to_cpu(state)
    weight.add_(100.0)
    state["opt"]["state"][0]["step"].add_(1)
    state["opt"]["param_groups"][0]["lr"] = 9.0
    assert torch.equal(staged["model"]["a"], torch.arange(6.0).reshape(2, 3))
    assert staged["model"]["a"] is staged["model"]["tied"]  # one tensor seen twice is cloned once
    assert isinstance(staged["model"], OrderedDict) and staged["names"] == ("x", 1)
    assert staged["opt"]["state"][0]["step"].item() == 3.0 and staged["opt"]["param_groups"][0]["lr"] == 0.1


def test_the_stager_reuses_the_previous_copys_buffers() -> None:
    stager, weight = CpuStager(), torch.ones(4, 3)
    first = stager.stage({"w": weight, "b": [torch.zeros(2)]})
    weight.mul_(5.0)
    second = stager.stage({"w": weight, "b": [torch.zeros(2)], "new": torch.ones(7)})
    assert second["w"] is first["w"] and second["b"][0] is first["b"][0]  # no fresh allocation
    assert torch.equal(second["w"], torch.full((4, 3), 5.0)) and second["w"] is not weight
    assert torch.equal(second["new"], torch.ones(7))


# ---------------------------------------------------------------------- in one process
class SlowWrites:
    """CheckpointIO.save on the worker thread waits ``delay`` seconds first and counts concurrent writes."""

    def __init__(self, monkeypatch, delay: float) -> None:
        self.delay, self.active, self.most, self.lock = delay, 0, 0, threading.Lock()
        original = CheckpointIO.save

        def save(io, state, path, *, is_writer):
            with self.lock:
                self.active += 1
                self.most = max(self.most, self.active)
            try:
                if threading.current_thread() is not threading.main_thread():
                    time.sleep(self.delay)
                return original(io, state, path, is_writer=is_writer)
            finally:
                with self.lock:
                    self.active -= 1

        monkeypatch.setattr(CheckpointIO, "save", save)


def async_fit(
    tmp_path: Path, callbacks=(), *, max_steps: int = 8, **ckpt_kwargs
) -> tuple[Trainer, ModelCheckpoint, Regression]:
    cb = ModelCheckpoint(dirpath=tmp_path / "ck", async_save=True, **{"every_n_train_steps": 1, **ckpt_kwargs})
    trainer = Trainer(**quiet(max_steps=max_steps, enable_checkpointing=True, callbacks=[cb, *callbacks], seed=0))
    task = Regression(optimizer="adamw")
    trainer.fit(task, loader(regression_data(), 16))
    return trainer, cb, task


def test_end_of_fit_waits_and_async_keeps_the_same_files_as_sync(tmp_path: Path, monkeypatch) -> None:
    slow = SlowWrites(monkeypatch, 0.15)
    trainer, cb, task = async_fit(tmp_path / "a", save_top_k=2)
    assert not cb._checkpointer.in_flight and slow.most == 1
    assert read_pointer(tmp_path / "a" / "ck")[0] == "epoch=1-step=8.ckpt"  # committed before fit returned
    state = CheckpointIO().load(tmp_path / "a" / "ck" / "epoch=1-step=8.ckpt")
    for name, value in task.state_dict().items():
        assert torch.equal(state["state_dict"][name], value)
    sync_cb = ModelCheckpoint(dirpath=tmp_path / "s" / "ck", every_n_train_steps=1, save_top_k=2)
    Trainer(**quiet(max_steps=8, enable_checkpointing=True, callbacks=[sync_cb], seed=0)).fit(
        Regression(optimizer="adamw"), loader(regression_data(), 16)
    )
    assert sorted(os.listdir(tmp_path / "a" / "ck")) == sorted(os.listdir(tmp_path / "s" / "ck"))
    assert read_pointer(tmp_path / "a" / "ck") == read_pointer(tmp_path / "s" / "ck")
    assert Path(cb.best_model_path).name == Path(sync_cb.best_model_path).name
    assert len(cb._checkpointer.history) == 8


class Gate(Callback):
    """The write of step 3's checkpoint is held until step 4; records `last` at every step boundary."""

    def __init__(self, monkeypatch) -> None:
        self.release, self.pointer, self.weights_at_3 = threading.Event(), {}, None
        original = CheckpointIO.save

        def save(io, state, path, *, is_writer):
            if "step=3." in os.fspath(path):
                assert threading.current_thread() is not threading.main_thread()
                self.release.wait(10)
            return original(io, state, path, is_writer=is_writer)

        monkeypatch.setattr(CheckpointIO, "save", save)

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        step, cb = trainer.global_step, trainer.checkpoint_callback
        if step == 3:
            self.weights_at_3 = {k: v.clone() for k, v in task.state_dict().items()}
        if step == 4:
            self.release.set()
            cb._checkpointer._job.done.wait(10)  # written and committed now; reported done at step 5's poll
        self.pointer[step] = (read_pointer(cb.dirpath) or [None])[0], cb._checkpointer.in_flight
        if step == 5:  # before step 6's save prunes it
            self.saved_3 = CheckpointIO().load(Path(cb.dirpath) / "epoch=0-step=3.ckpt")["state_dict"]


def test_pointer_swaps_once_the_file_is_durable_and_the_file_holds_the_state_of_its_step(
    tmp_path: Path, monkeypatch
) -> None:
    gate = Gate(monkeypatch)
    async_fit(tmp_path, [gate], every_n_train_steps=3, max_steps=7)
    assert gate.pointer[3] == (None, True)  # step 3's save is still being written: no pointer yet
    assert gate.pointer[4] == ("epoch=0-step=3.ckpt", True)  # durable, then committed by the writer thread
    assert gate.pointer[5] == ("epoch=0-step=3.ckpt", False)  # reported done by step 5's poll
    for name, value in gate.weights_at_3.items():  # steps 4 and 5 ran meanwhile; the file holds step 3
        assert torch.equal(gate.saved_3[name], value), name
    assert read_pointer(tmp_path / "ck")[0] == "epoch=1-step=6.ckpt"


class RaiseAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"boom at step {self.step}")


def test_an_exception_waits_for_the_save_in_flight(tmp_path: Path, monkeypatch) -> None:
    SlowWrites(monkeypatch, 0.3)
    with pytest.raises(RuntimeError, match="boom at step 3"):
        async_fit(tmp_path, [RaiseAt(3)])
    assert read_pointer(tmp_path / "ck")[0] == "epoch=0-step=3.ckpt"
    CheckpointIO().load(tmp_path / "ck" / "epoch=0-step=3.ckpt")
    assert not list((tmp_path / "ck").glob(".*.tmp"))


class NanAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(task.parameters())[0, 0] = float("nan")


def test_non_finite_weights_are_never_written_in_the_background_either(tmp_path: Path) -> None:
    with pytest.raises(FloatingPointError, match=r"Refusing to write checkpoint .*step=3\.ckpt' at step 3"):
        cb = ModelCheckpoint(dirpath=tmp_path / "ck", async_save=True, every_n_train_steps=1)
        Trainer(**quiet(max_steps=5, enable_checkpointing=True, callbacks=[NanAt(3), cb], seed=0)).fit(
            Regression(optimizer="adamw"), loader(regression_data(), 16)
        )
    assert read_pointer(tmp_path / "ck")[0] == "epoch=0-step=2.ckpt"
    assert sorted(os.listdir(tmp_path / "ck")) == ["epoch=0-step=2.ckpt", POINTER_NAME]


def test_async_save_option_is_checked() -> None:
    with pytest.raises(ValueError, match="async_save"):
        ModelCheckpoint(async_save="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- exact resume (subprocesses)


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sync_ref")
    python(SYNC_SCRIPT, str(root / "out"), "--ckpt-dir", str(root / "ck"), timeout=120).check()
    return result(root / "out")


@pytest.mark.multiprocess
def test_async_fit_equals_sync_and_resumes_exactly_after_a_crash(tmp_path: Path, sync_reference: dict) -> None:
    python(
        SCRIPT, str(tmp_path / "ref"), "--ckpt-dir", str(tmp_path / "ref_ck"), "--slow-write", "0.05", timeout=120
    ).check()
    assert_same(result(tmp_path / "ref"), sync_reference)  # saving in the background changes nothing
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck"), "--slow-write", "0.2"]
    first = python(SCRIPT, *args, "--crash-at", "9", timeout=120)
    assert first.returncode != 0 and "simulated crash at step 9" in first.stdout
    assert read_pointer(tmp_path / "ck")[0] == "epoch=1-step=9.ckpt"  # the exception waited for the save in flight
    python(SCRIPT, *args, "--resumed", timeout=120).check()
    assert_same(result(tmp_path / "out"), sync_reference)


@pytest.mark.multiprocess
def test_sigkill_during_a_background_write_keeps_the_previous_last(tmp_path: Path, sync_reference: dict) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck")]
    first = python(SCRIPT, *args, "--block-write-at", "5", timeout=120)
    assert first.returncode == -9, first.tail()
    ck = tmp_path / "ck"
    assert read_pointer(ck)[0] == "epoch=0-step=4.ckpt"
    assert not (ck / "epoch=0-step=5.ckpt").exists() and list(ck.glob(".epoch=0-step=5.ckpt.*.tmp"))  # temp name only
    CheckpointIO().load(ck / "epoch=0-step=4.ckpt")
    second = python(SCRIPT, *args, "--resumed", timeout=120).check()
    assert "Resumed at global step 4" in second.stdout
    assert_same(result(tmp_path / "out"), sync_reference)


@pytest.mark.multiprocess
def test_preemption_waits_then_saves_synchronously_and_resumes_exactly(tmp_path: Path, sync_reference: dict) -> None:
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck"), "--slow-write", "0.3"]
    first = python(SCRIPT, *args, "--sigterm-at", "5", timeout=120)
    assert first.returncode == PREEMPTED_EXIT_CODE, first.tail()
    names = read_pointer(tmp_path / "ck")
    assert names[:2] == ["epoch=0-step=5-preempted.ckpt", "epoch=0-step=5.ckpt"]  # the async one committed first
    python(SCRIPT, *args, "--resumed", timeout=120).check()
    assert_same(result(tmp_path / "out"), sync_reference)


@pytest.mark.multiprocess
def test_two_rank_async_resume_equals_uninterrupted(tmp_path: Path) -> None:
    torchrun(SCRIPT, str(tmp_path / "ref"), "--ckpt-dir", str(tmp_path / "ref_ck"), nproc=2, timeout=180).check()
    reference = [result(tmp_path / "ref", r) for r in (0, 1)]
    assert_same(reference[0], reference[1])
    sync = tmp_path / "sync"
    torchrun(SYNC_SCRIPT, str(sync / "out"), "--ckpt-dir", str(sync / "ck"), nproc=2, timeout=180).check()
    assert_same(result(sync / "out"), reference[0])  # async DDP == sync DDP
    args = [str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ck"), "--slow-write", "0.2"]
    first = torchrun(SCRIPT, *args, "--crash-at", "4", nproc=2, timeout=180)
    assert first.returncode != 0
    assert read_pointer(tmp_path / "ck")[0] == "epoch=1-step=4.ckpt"
    torchrun(SCRIPT, *args, "--resumed", nproc=2, timeout=180).check()
    for rank in (0, 1):
        assert_same(result(tmp_path / "out", rank), reference[rank])


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


def assert_save_error(exc: CheckpointSaveError, path: Path, *, needed: int, reason: str, previous: Path | None) -> None:
    text = str(exc)
    assert isinstance(exc, OSError)
    assert f"Could not write checkpoint {str(path)!r}: {reason}" in text
    assert f"({needed:,} bytes of tensors)" in text and " free in " in text
    if previous is not None:
        assert f"the previous checkpoint {str(previous)!r} is intact" in text
    shown = "".join(traceback.format_exception(exc))
    assert shown.rstrip().splitlines()[-1].endswith(text)  # the last line of the traceback says it all
    assert "enforce fail" not in shown  # torch's follow-up error is not shown
    assert not list(path.parent.glob(".*.tmp")) if path.parent.exists() else True  # no temp file left


def test_disk_full_on_a_real_small_filesystem(small_disk: Path) -> None:
    io = CheckpointIO()
    io.save({"w": torch.zeros(1000)}, small_disk / "a.ckpt", is_writer=True)
    write_pointer(small_disk / "a.ckpt")
    with pytest.raises(CheckpointSaveError) as info:
        io.save({"w": torch.zeros(2**19)}, small_disk / "b.ckpt", is_writer=True)  # 2 MiB on a 1 MiB disk
    assert info.value.errno == errno.ENOSPC
    assert_save_error(
        info.value,
        small_disk / "b.ckpt",
        needed=2**21,
        reason="No space left on device (ENOSPC)",
        previous=small_disk / "a.ckpt",
    )
    assert "2.0 MiB" in str(info.value)
    assert sorted(os.listdir(small_disk)) == ["a.ckpt", POINTER_NAME]
    assert torch.equal(torch.load(small_disk / "a.ckpt", weights_only=True)["w"], torch.zeros(1000))
    assert read_pointer(small_disk) == ["a.ckpt"]


class Wide(Regression):
    """About 600 KB of weights + AdamW state: one checkpoint fits on a 1 MiB disk, two do not."""

    def __init__(self) -> None:
        super().__init__(optimizer="adamw")
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 6000), nn.Tanh(), nn.Linear(6000, 1))


def test_async_save_on_a_full_disk_fails_the_fit_naming_the_file(small_disk: Path, tmp_path: Path) -> None:
    cb = ModelCheckpoint(dirpath=small_disk, every_n_train_steps=1, async_save=True)
    trainer = Trainer(
        **quiet(max_steps=4, enable_checkpointing=True, callbacks=[cb], seed=0, default_root_dir=str(tmp_path / "run"))
    )
    with pytest.raises(CheckpointSaveError) as info:
        trainer.fit(Wide(), loader(regression_data(), 16))
    assert info.value.errno == errno.ENOSPC
    first = small_disk / "epoch=0-step=1.ckpt"
    assert_save_error(
        info.value,
        small_disk / "epoch=0-step=2.ckpt",
        needed=tensor_bytes(CheckpointIO().load(first)),  # same shapes at every step
        reason="No space left on device (ENOSPC)",
        previous=first,
    )
    assert read_pointer(small_disk) == ["epoch=0-step=1.ckpt"]
    assert sorted(os.listdir(small_disk)) == ["epoch=0-step=1.ckpt", POINTER_NAME]
    resumed = Trainer(
        **quiet(
            max_steps=1,
            enable_checkpointing=True,
            seed=0,
            callbacks=[ModelCheckpoint(dirpath=small_disk, every_n_train_steps=100)],
        )
    )
    resumed.fit(Wide(), loader(regression_data(), 16), ckpt_path="last")  # `last` still loads
    assert resumed.global_step == 1


def test_read_only_filesystem(read_only_disk: Path) -> None:
    with pytest.raises(CheckpointSaveError) as info:
        CheckpointIO().save({"w": torch.zeros(10)}, read_only_disk / "x.ckpt", is_writer=True)
    assert info.value.errno == errno.EROFS
    assert_save_error(
        info.value, read_only_disk / "x.ckpt", needed=40, reason="Read-only file system (EROFS)", previous=None
    )
    assert "nothing was written and no earlier checkpoint was touched" in str(info.value)


def _full_disk_after(nbytes: int):
    """torch.save that writes ``nbytes`` then fails as a full disk does (no mount needed)."""

    def save(obj, handle, *args, **kwargs):
        handle.write(b"\0" * nbytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return save


def test_disk_full_simulated(tmp_path: Path, monkeypatch) -> None:
    io = CheckpointIO()
    io.save({"w": torch.zeros(4)}, tmp_path / "a.ckpt", is_writer=True)
    write_pointer(tmp_path / "a.ckpt")
    monkeypatch.setattr(ckpt_module.torch, "save", _full_disk_after(1000))
    with pytest.raises(CheckpointSaveError) as info:
        io.save(
            {"w": torch.zeros(256), "m": [torch.zeros(2, dtype=torch.float64)]}, tmp_path / "b.ckpt", is_writer=True
        )
    assert info.value.errno == errno.ENOSPC and isinstance(info.value.__cause__, OSError)
    assert_save_error(
        info.value,
        tmp_path / "b.ckpt",
        needed=256 * 4 + 16,
        reason="No space left on device (ENOSPC)",
        previous=tmp_path / "a.ckpt",
    )
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", POINTER_NAME]


def test_permission_denied_simulated(tmp_path: Path, monkeypatch) -> None:
    # Root ignores mode bits, so a chmod'ed folder proves nothing here: the refusal is simulated.
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path))

    monkeypatch.setattr(checkpoint_io.tempfile, "mkstemp", refuse)  # where CheckpointIO writes
    with pytest.raises(CheckpointSaveError) as info:
        CheckpointIO().save({"w": torch.zeros(3)}, tmp_path / "x.ckpt", is_writer=True)
    assert info.value.errno == errno.EACCES
    assert_save_error(info.value, tmp_path / "x.ckpt", needed=12, reason="Permission denied (EACCES)", previous=None)
    assert "Make the folder writable" in str(info.value)


def test_async_save_that_fails_raises_at_the_next_step_and_keeps_last(tmp_path: Path, monkeypatch) -> None:
    original = CheckpointIO.save

    def save(io, state, path, *, is_writer):
        if "step=3." in os.fspath(path):
            monkeypatch.setattr(ckpt_module.torch, "save", _full_disk_after(10))
        return original(io, state, path, is_writer=is_writer)

    monkeypatch.setattr(CheckpointIO, "save", save)
    with pytest.raises(CheckpointSaveError) as info:
        async_fit(tmp_path)
    ck = tmp_path / "ck"
    assert f"Could not write checkpoint {str(ck / 'epoch=0-step=3.ckpt')!r}: No space left on device" in str(info.value)
    assert f"the previous checkpoint {str(ck / 'epoch=0-step=2.ckpt')!r} is intact" in str(info.value)
    assert read_pointer(ck)[0] == "epoch=0-step=2.ckpt"
    assert sorted(os.listdir(ck)) == ["epoch=0-step=2.ckpt", POINTER_NAME]  # nothing pruned, no temp file


# ---------------------------------------------------------------------- the pointer's mode
def test_last_pointer_gets_the_checkpoints_file_mode(tmp_path: Path) -> None:
    for async_save in (False, True):
        folder = tmp_path / str(async_save)
        cb = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, async_save=async_save)
        Trainer(**quiet(max_steps=4, enable_checkpointing=True, callbacks=[cb])).fit(
            Regression(), loader(regression_data(), 16)
        )
        mode = lambda p: os.stat(p).st_mode & 0o777  # noqa: E731
        umask = os.umask(0)
        os.umask(umask)
        assert mode(folder / POINTER_NAME) == mode(cb.last_model_path) == 0o666 & ~umask
