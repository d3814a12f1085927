"""Streaming data resumes exactly: a stateful stream's position is saved per rank in every checkpoint and restored,
so the samples each rank trains on across a crash or a SIGKILL equal the uninterrupted run's, and the weights are
bit-identical (tests/harness/scripts/stream_fit.py, launched). The stream's position in one process:
tests/unit/test_stream_positions.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, python, spawn_ranks, torchrun
from torch.utils.data import DataLoader

from trainer.data.streams import adapt_stream, not_stateful_reason

SCRIPT = REPO_ROOT / "tests" / "harness" / "scripts" / "stream_fit.py"
torchdata = pytest.importorskip("torchdata.stateful_dataloader")


def effective(out: Path, rank: int = 0) -> list[tuple[int, list[int]]]:
    """The samples the final weights were trained on, batch by batch: for every (epoch, batch) the record of the
    last attempt that trained it (a batch trained after the last checkpoint of a killed attempt was retrained)."""
    rows: dict[tuple[int, int], tuple[int, list[int]]] = {}
    for line in (out / f"trained_rank{rank}.jsonl").read_text().splitlines():
        row = json.loads(line)
        key = (row["epoch"], row["batch_idx"])
        if key not in rows or row["attempt"] >= rows[key][0]:
            rows[key] = (row["attempt"], row["ids"])
    return [(key[0], rows[key][1]) for key in sorted(rows)]


def final(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


def assert_same_run(a: Path, b: Path, ranks: int = 1, steps: int = 48) -> None:
    for rank in range(ranks):
        seq_a, seq_b = effective(a, rank), effective(b, rank)
        assert seq_a == seq_b, f"rank {rank}: the trained samples differ"
        for epoch in (0, 1):  # each epoch: this rank's share of the 96 samples, each once
            seen = [i for e, ids in seq_a if e == epoch for i in ids]
            assert len(seen) == len(set(seen)) == 96 // ranks
        wa, wb = final(a, rank), final(b, rank)
        assert wa["step"] == wb["step"] == steps
        for name in wa["weights"]:
            assert torch.equal(wa["weights"][name], wb["weights"][name]), name


def fit(root: Path, *args: str, timeout: float = 180):
    return python(SCRIPT, str(root / "out"), "--ckpt-dir", str(root / "ck"), *args, timeout=timeout)


# The wrapped loader (with 2 workers) is the SIGKILL test's scenario below, so here it is a slow variant.
@pytest.mark.parametrize("loader,workers", [pytest.param("iterable", 0, marks=pytest.mark.slow), ("torchdata", 2)])
def test_crash_mid_epoch_resumes_the_stream_exactly(tmp_path: Path, loader: str, workers: int) -> None:
    """A plain DataLoader over a stateful IterableDataset (keel wraps it into a StatefulDataLoader), and the user's
    own StatefulDataLoader: crash at step 17 of 24 in epoch 0, resume from `last`, equal to the uninterrupted fit."""
    common = ("--loader", loader, "--workers", str(workers))
    fit(tmp_path / "ref", *common).check()
    crashed = fit(tmp_path / "run", *common, "--crash-at", "17")
    assert crashed.returncode != 0 and "simulated crash at step 17" in crashed.stdout
    resumed = fit(tmp_path / "run", *common, "--resumed")
    resumed.check()
    assert "epoch restarts" not in resumed.stdout
    assert_same_run(tmp_path / "ref" / "out", tmp_path / "run" / "out")


def test_the_global_batch_and_the_step_clock_run_on_a_stream(tmp_path: Path) -> None:
    """global_batch_size=8 over micro-batches of 4: two micro-batches per optimizer step, 12 steps per epoch; a
    crash after step 5 (mid-window boundaries are steps) resumes exactly."""
    common = ("--loader", "iterable", "--global-batch-size", "8")
    fit(tmp_path / "ref", *common).check()
    crashed = fit(tmp_path / "run", *common, "--crash-at", "5")
    assert crashed.returncode != 0 and "simulated crash at step 5" in crashed.stdout
    fit(tmp_path / "run", *common, "--resumed").check()
    assert_same_run(tmp_path / "ref" / "out", tmp_path / "run" / "out", steps=24)


def test_sigkill_two_ranks_two_workers_resumes_exactly(tmp_path: Path) -> None:
    """Under torchrun --max-restarts, SIGKILL of rank 1 at step 30 (mid-epoch 1) at 2 ranks x 2 workers: each rank's
    trained samples equal the uninterrupted run's, none repeated or skipped, and the weights are bit-identical."""
    common = ["--loader", "iterable", "--workers", "2"]
    ref = tmp_path / "ref"
    spawn_ranks(SCRIPT, str(ref / "out"), "--ckpt-dir", str(ref / "ck"), *common, nproc=2, timeout=240).check()
    run = tmp_path / "run"
    result = torchrun(
        SCRIPT,
        str(run / "out"),
        "--ckpt-dir",
        str(run / "ck"),
        *common,
        "--kill-at",
        "18",
        nproc=2,
        max_restarts=1,
        timeout=300,
    )
    result.check()
    attempts = {json.loads(line)["attempt"] for line in (run / "out" / "trained_rank1.jsonl").read_text().splitlines()}
    assert attempts == {0, 1}  # the kill happened and the run restarted
    assert_same_run(ref / "out", run / "out", ranks=2, steps=24)


def test_a_stream_without_state_warns_once_and_restarts_its_epoch(tmp_path: Path) -> None:
    """A plain IterableDataset saves no position: one warning at fit start says what a resume does and how to
    make it exact; the resume restarts the epoch (with a warning), never silently misreads."""
    first = fit(tmp_path, "--loader", "plain", "--crash-at", "5")
    assert "saves no position, so a resume starts the epoch again" in first.stdout
    assert first.stdout.count("saves no position") == 1
    resumed = fit(tmp_path, "--loader", "plain", "--resumed")
    resumed.check()
    assert "the epoch restarts from its first batch" in resumed.stdout


def test_a_save_with_a_stream_is_refused_for_a_loader_that_is_not_one(tmp_path: Path) -> None:
    crashed = fit(tmp_path, "--loader", "iterable", "--crash-at", "5")
    assert crashed.returncode != 0
    refused = fit(tmp_path, "--loader", "plain", "--resumed")
    assert refused.returncode != 0
    assert "was saved while training from a stream (StatefulDataLoader over Numbers)" in refused.stdout


def test_uneven_streams_follow_uneven_batches(tmp_path: Path) -> None:
    """Rank 1's stream yields one batch fewer each epoch: "truncate" stops both ranks there with one warning per
    fit naming the counts (it used to drop the other rank's batch silently); "error" raises on every rank."""
    args = ("--loader", "iterable", "--short-rank1", "4")
    truncated = launch(tmp_path / "t", tmp_path / "t", *args)
    truncated.check()
    assert truncated.stdout.count("The training loader ran out on 1 of 2 ranks while 1 still had data") == 1
    assert final(tmp_path / "t" / "out")["step"] == 2 * 11
    failed = launch(tmp_path / "e", tmp_path / "e", *args, "--uneven", "error")
    assert failed.returncode != 0 and "uneven_batches='truncate'" in failed.stdout


datasets = pytest.importorskip("datasets")


def prepare(work: Path, loader: str) -> None:
    python(SCRIPT, "-", "--ckpt-dir", "-", "--loader", loader, "--prepare", "--data", str(work), timeout=180).check()


def launch(root: Path, work: Path, *args: str, nproc: int = 2, max_restarts: int = 0, timeout: float = 300):
    """Run the script with its output in ``root`` and its checkpoints in ``work``; the data is in ``work``'s parent
    (what :func:`prepare` wrote into the test's folder)."""
    out, ck = str(root / "out"), str(work / "ck")
    args = (*args, "--data", str(root.parent))
    if nproc == 1:
        return python(SCRIPT, out, "--ckpt-dir", ck, *args, timeout=timeout)
    if max_restarts == 0:  # no agent needed: the ranks alone (tests/harness/launch.py's spawn_ranks)
        return spawn_ranks(SCRIPT, out, "--ckpt-dir", ck, *args, nproc=nproc, timeout=timeout)
    return torchrun(SCRIPT, out, "--ckpt-dir", ck, *args, nproc=nproc, max_restarts=max_restarts, timeout=timeout)


def test_hugging_face_stream_is_split_once_and_resumes_exactly(tmp_path: Path) -> None:
    """A `load_dataset("json", ..., streaming=True)` stream of 4 shards in a plain DataLoader on 2 ranks: keel splits
    it by shard (each epoch every sample once over both ranks, nothing twice), and a crash mid-epoch 1 resumes equal
    to the uninterrupted run. The same save resumed at 1 rank is refused with the reason by default, and restarts
    the epoch with a warning under stream_reshard='restart_epoch'."""
    work = tmp_path
    prepare(work, "hf")
    common = ("--loader", "hf", "--workers", "0")
    ref = launch(work / "ref", work / "ref", *common)
    ref.check()
    assert "Splitting the Hugging Face stream over 2 ranks by shard" in ref.stdout
    for epoch in (0, 1):
        seen = [i for r in (0, 1) for e, ids in effective(work / "ref" / "out", r) if e == epoch for i in ids]
        assert sorted(seen) == list(range(96))
    run = work / "run"
    crashed = launch(run, run, *common, "--crash-at", "18")
    assert crashed.returncode != 0
    shutil.copytree(run / "ck", work / "mid" / "ck")  # the mid-epoch save, for the 1-rank resumes below
    launch(run, run, *common, "--resumed").check()
    assert_same_run(work / "ref" / "out", run / "out", ranks=2, steps=24)

    refused = launch(work / "one", work / "mid", *common, "--resumed", nproc=1)
    assert refused.returncode != 0
    assert "saved mid-epoch at world size 2" in refused.stdout and "stream_reshard='restart_epoch'" in refused.stdout
    again = launch(work / "one", work / "mid", *common, "--resumed", "--stream-reshard", "restart_epoch", nproc=1)
    again.check()
    assert "epoch 1 starts again (stream_reshard='restart_epoch')" in again.stdout


def test_a_stream_the_user_already_split_is_not_split_again(tmp_path: Path) -> None:
    prepare(tmp_path, "hf")
    result = launch(tmp_path / "run", tmp_path / "run", "--loader", "hf-split", "--epochs", "1")
    result.check()
    assert "already split by node" in result.stdout and "Splitting the Hugging Face stream" not in result.stdout


litdata = pytest.importorskip("litdata")


def test_litdata_resumes_exactly_and_at_another_world_size_loses_nothing(tmp_path: Path) -> None:
    """LitData's StreamingDataLoader on 2 ranks: keel and LitData agree on the ranks (the dataset is built before
    the process group), a crash mid-epoch 1 resumes exactly, and the same save resumed at 1 rank trains every
    remaining sample of the epoch once (LitData re-splits its own position; the order may differ)."""
    prepare(tmp_path, "litdata")
    in_a_plain_loader = DataLoader(litdata.StreamingDataset(str(tmp_path / "litdata")), batch_size=4)
    assert adapt_stream(in_a_plain_loader, num_replicas=1, rank=0) is None
    assert "use litdata.StreamingDataLoader" in (not_stateful_reason(in_a_plain_loader) or "")
    common = ("--loader", "litdata", "--workers", "2")
    ref = launch(tmp_path / "ref", tmp_path / "ref", *common)
    ref.check()
    for epoch in (0, 1):
        seen = [i for r in (0, 1) for e, ids in effective(tmp_path / "ref" / "out", r) if e == epoch for i in ids]
        assert sorted(seen) == list(range(96))
    run = tmp_path / "run"
    crashed = launch(run, run, *common, "--crash-at", "18")
    assert crashed.returncode != 0
    before = [i for r in (0, 1) for e, ids in effective(run / "out", r) if e == 1 for i in ids]
    shutil.copytree(run / "ck", tmp_path / "one" / "ck")  # the mid-epoch save, for the 1-rank resume below
    launch(run, run, *common, "--resumed").check()
    assert_same_run(tmp_path / "ref" / "out", run / "out", ranks=2, steps=24)

    launch(tmp_path / "one-resumed", tmp_path / "one", *common, "--resumed", nproc=1).check()
    assert len(before) == (18 - 12) * 4 * 2  # the 6 steps of epoch 1 both ranks trained before the crash
    after = [i for e, ids in effective(tmp_path / "one-resumed" / "out") if e == 1 for i in ids]
    assert sorted(before + after) == list(range(96))
