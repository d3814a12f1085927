"""Checkpoints and run directories on a real S3 server (SeaweedFS on 127.0.0.1, tests/harness/s3server.py).

Every strategy and both save modes on ``s3://``: SIGKILLs under ``torchrun --max-restarts`` (mid-upload included) end
bit-identical to the uninterrupted run; FSDP's async saves on the store reshard to one process and export; the elastic
node-loss scenario runs with its checkpoints and logs on the store; the store failing mid-save, a hanging store, a
missing bucket and wrong or missing credentials; and no secret ever lands in a file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, elastic_agents, python, spawn_ranks, torchrun
from models import Regression, loader, quiet, regression_data

from trainer import Callback, Trainer, storage
from trainer.checkpoint.files import CheckpointError, CheckpointSaveError
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.checkpoint.reader import committed, load_weights, resolve_last
from trainer.loggers import CSVLogger

SCRIPTS = REPO_ROOT / "tests" / "harness" / "scripts"


@pytest.fixture
def s3(s3_server, monkeypatch: pytest.MonkeyPatch):
    """The session's server, reachable from this process and its children through the standard variables only."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    storage._filesystem.cache_clear()
    yield s3_server
    storage._filesystem.cache_clear()


def fs(server):
    return server.filesystem()


# ---------------------------------------------------------------------- crashes under torchrun
def _rank_weights(out: Path, rank: int) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


@pytest.fixture(scope="module")
def ddp_reference(resume_fit_two_ranks: Path) -> list[dict]:
    """resume_fit.py's uninterrupted 2-rank run, checkpoints on local disk (tests/conftest.py)."""
    return [_rank_weights(resume_fit_two_ranks, r) for r in (0, 1)]


@pytest.mark.parametrize(
    "fault",
    [
        ["--kill-mid-upload-at", "8", "--kill-rank", "0"],
        pytest.param(["--kill-at", "3", "--kill-rank", "1"], marks=pytest.mark.slow),
    ],
    ids=["rank0-mid-upload", "rank1-between-saves"],
)
def test_ddp_sigkill_with_checkpoints_on_s3_restarts_and_ends_bit_identical(
    s3, tmp_path: Path, ddp_reference: list[dict], fault: list[str]
) -> None:
    ck = s3.url(s3.bucket("ddp"), "run", "checkpoints")
    result = torchrun(
        SCRIPTS / "resume_fit.py",
        str(tmp_path / "out"),
        "--ckpt-dir",
        ck,
        *fault,
        nproc=2,
        max_restarts=2,
        timeout=240,
        env=s3.env(),
    ).check()
    assert "Resumed at global step" in result.stdout
    for rank in (0, 1):
        run, ref = _rank_weights(tmp_path / "out", rank), ddp_reference[rank]
        assert run["step"] == ref["step"] == 14
        assert all(torch.equal(run["weights"][k], v) for k, v in ref["weights"].items())
    names = committed(ck)
    assert len(names) == 1 and names[0].endswith("step=14.ckpt")
    objects = fs(s3).find(ck.removeprefix("s3://"))
    assert not (Path(tmp_path) / "s3:").exists() and not (REPO_ROOT / "s3:").exists()
    assert all(o.endswith(("/last", "/keel.json", "/keel.claim")) or o.count("/") >= 5 for o in objects), objects


# A variant: async saves on the store surviving a crash are test_fsdp_async_saves_on_s3_survive_a_sigkill_..., and
# async equal to sync is test_async_checkpoint's test_async_fit_equals_sync_and_resumes_exactly_after_a_crash.
@pytest.mark.slow
def test_ddp_async_saves_on_s3_resume_after_a_crash_and_equal_the_sync_run(
    s3, tmp_path: Path, ddp_reference: list[dict]
) -> None:
    """async_fit.py is resume_fit.py's fit with ModelCheckpoint(async_save=True): 2 ranks crash at step 4 with a
    save in flight to the bucket, resume from it, and end equal to the local synchronous reference."""
    ck = s3.url(s3.bucket("ddpasync"), "checkpoints")
    args = [str(tmp_path / "out"), "--ckpt-dir", ck]
    first = spawn_ranks(SCRIPTS / "async_fit.py", *args, "--crash-at", "4", nproc=2, timeout=180, env=s3.env())
    assert first.returncode != 0
    assert committed(ck) == ["epoch=1-step=4.ckpt"]  # the exception waited for the save in flight
    second = spawn_ranks(SCRIPTS / "async_fit.py", *args, "--resumed", nproc=2, timeout=180, env=s3.env()).check()
    assert "Resumed at global step 4" in second.stdout
    for rank in (0, 1):
        run, ref = _rank_weights(tmp_path / "out", rank), ddp_reference[rank]
        assert run["step"] == ref["step"] == 14
        assert all(torch.equal(run["weights"][k], v) for k, v in ref["weights"].items())


def test_fsdp_async_saves_on_s3_survive_a_sigkill_reshard_to_one_process_and_export(s3, tmp_path: Path) -> None:
    script = SCRIPTS / "fsdp_fit.py"
    local = tmp_path / "ref_ck"
    spawn_ranks(script, str(tmp_path / "ref"), "--strategy", "fsdp", "--ckpt-dir", str(local), "--async-save", nproc=2,
             timeout=240).check()  # fmt: skip
    reference = torch.load(tmp_path / "ref" / "rank0.pt", weights_only=False)
    ck = s3.url(s3.bucket("fsdp"), "checkpoints")
    torchrun(script, str(tmp_path / "killed"), "--strategy", "fsdp", "--ckpt-dir", ck, "--kill-at", "4", "--async-save",
             nproc=2, timeout=300, max_restarts=1, env=s3.env()).check()  # fmt: skip
    resumed = torch.load(tmp_path / "killed" / "rank0.pt", weights_only=False)
    assert resumed["global_step"] == reference["global_step"] == 6
    assert all(torch.equal(resumed["weights"][k], v) for k, v in reference["weights"].items())  # bit for bit
    last = resumed["last"]
    assert last.startswith(ck + "/")
    files = {o.rsplit("/", 1)[1] for o in fs(s3).find(last.removeprefix("s3://"))}
    assert {"keel.json", ".metadata", "keel.pt", "__0_0.distcp", "__1_0.distcp"} <= files, files
    exported = s3.url(last.removeprefix("s3://").split("/", 1)[0], "weights.pt")
    code = f"from trainer.checkpoint.hf import export_weights; export_weights({last!r}, {exported!r})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | s3.env(),
    )
    assert done.returncode == 0, done.stderr
    with fs(s3).open(exported.removeprefix("s3://"), "rb") as handle:
        weights = torch.load(handle, weights_only=True)
    assert all(torch.equal(weights[k], v) for k, v in reference["weights"].items())
    # Saved at 2 ranks, resumed in one process from the store (DCP reshards): epoch 2 at 1 rank.
    python(script, str(tmp_path / "one"), "--strategy", "fsdp", "--ckpt-dir", ck, "--epochs", "3", timeout=180,
           env=s3.env()).check()  # fmt: skip
    one = torch.load(tmp_path / "one" / "rank0.pt", weights_only=False)
    assert one["global_step"] == 12 and one["world_size"] == 1


# A variant: node loss is test_elastic's test_with_the_store_outside_the_job_any_node_may_die (the survivor finds
# `last`), resuming from the store after a kill is test_ddp_sigkill_with_checkpoints_on_s3_..., and the run directory
# on the store is test_a_run_directory_on_s3_holds_logs_config_and_checkpoints_and_no_secret.
@pytest.mark.slow
def test_elastic_node_loss_with_checkpoints_and_logs_on_s3_only(s3, tmp_path: Path) -> None:
    """test_elastic's node-loss scenario, with the checkpoints and the CSV log on the store: the agents share no
    local folder for them (the survivor becomes rank 0 and must find `last` there)."""
    import test_elastic as elastic

    script = SCRIPTS / "elastic_fit.py"
    ref_root = tmp_path / "ref"
    python(script, *elastic.script_args(ref_root), timeout=120).check()
    bucket = s3.bucket("elastic")
    ck, logs = s3.url(bucket, "ck"), s3.url(bucket, "logs")
    agents = elastic_agents(
        script,
        str(tmp_path / "out"),
        "--ckpt-dir",
        ck,
        "--log-dir",
        logs,
        "--die-at",
        "6",
        "--die-node",
        "1",
        max_restarts=2,
        rdzv_conf=elastic.RDZV,
        env=elastic.AGENT_ENV | s3.env(),
        timeout=150,
    )
    survivor, lost = agents
    assert lost.returncode == -9, lost.tail()
    survivor.check()
    assert "Resumed at global step 5" in survivor.stdout
    (tmp_path / "logs" / "version_0").mkdir(parents=True)
    fs(s3).get(f"{bucket}/logs/version_0/metrics.csv", str(tmp_path / "logs" / "version_0" / "metrics.csv"))
    elastic.assert_same_run(tmp_path, (ref_root, elastic.load(ref_root)), ranks=1, resumed_at=5)


# ---------------------------------------------------------------------- faults, in one process
class _At(Callback):
    """Calls ``action(trainer)`` after optimizer step ``step``."""

    def __init__(self, actions: dict[int, object]) -> None:
        self.actions = actions

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        action = self.actions.get(trainer.global_step) if trainer.optimizer_stepped else None
        if action is not None:
            action(trainer)  # type: ignore[operator]


def _fit(ck: str, steps: int, *callbacks: Callback, ckpt_path: str | None = None, **checkpoint) -> Trainer:
    options = dict(dirpath=ck, every_n_train_steps=2, save_top_k=2) | checkpoint
    trainer = Trainer(**quiet(max_steps=steps, callbacks=[*callbacks, ModelCheckpoint(**options)]))
    trainer.fit(Regression(optimizer="adamw"), loader(regression_data(), 16), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def own_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A server of this test's own, to stop, kill or pause; short timeouts and one retry, so a dead server
    fails a request in seconds."""
    from s3server import S3Server

    server = S3Server.start(tmp_path / "weed")
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs retries on its own too, with a backoff
    storage._filesystem.cache_clear()
    yield server
    server.kill()
    storage._filesystem.cache_clear()


# The synchronous save is a slow variant: the async one fails the same way, from the writer thread.
@pytest.mark.parametrize("async_save", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_store_dying_mid_run_fails_that_save_naming_the_url_and_keeps_the_last_one(
    own_server, tmp_path: Path, async_save: bool
) -> None:
    ck = own_server.url(own_server.bucket("faults"), "ck")

    def kill(trainer: Trainer) -> None:
        trainer.checkpoint_callback._checkpointer.wait()  # step 2's save committed (async: it may be in flight)
        own_server.kill()

    with pytest.raises(CheckpointSaveError) as failure:
        _fit(ck, 8, _At({3: kill}), async_save=async_save)
    text = str(failure.value)
    assert ck + "/epoch=0-step=4.ckpt" in text and "Nothing was committed" in text, text
    assert "previous checkpoint" in text or "no earlier checkpoint" in text
    # The store comes back (same data): the previous committed save is the one `last` resumes from.
    restarted = type(own_server).start(own_server.data_dir)
    try:
        for name, value in restarted.env().items():
            os.environ[name] = value
        storage._filesystem.cache_clear()
        assert resolve_last(ck)[0].endswith("epoch=0-step=2.ckpt")
        load_weights(resolve_last(ck)[0])
        resumed = _fit(ck, 8, ckpt_path="last", async_save=async_save)
        assert resumed.global_step == 8
        reference = _fit(str(tmp_path / "local"), 8)
        assert all(
            torch.equal(a, b) for a, b in zip(resumed.task.state_dict().values(), reference.task.state_dict().values())
        )
    finally:
        restarted.kill()


def test_a_hanging_store_does_not_block_the_loop_beyond_staging(own_server) -> None:
    """The server is frozen (SIGSTOP) just before the async save of step 5: the save stages, the loop trains
    steps 6-9 while the upload waits, and the save commits once the server answers again."""
    ck = own_server.url(own_server.bucket("slow"), "ck")
    in_flight: dict[int, bool] = {}

    def note(trainer: Trainer) -> None:
        in_flight[trainer.global_step] = trainer.checkpoint_callback._checkpointer.in_flight

    def thaw(trainer: Trainer) -> None:
        note(trainer)
        own_server.resume()

    actions = {4: lambda trainer: own_server.pause(), 6: note, 7: note, 8: note, 9: thaw}
    trainer = _fit(ck, 10, _At(actions), every_n_train_steps=5, save_top_k=-1, async_save=True)
    assert trainer.global_step == 10
    assert in_flight == {6: True, 7: True, 8: True, 9: True}, in_flight  # four steps trained, the upload stalled
    assert committed(ck) == ["epoch=2-step=10.ckpt", "epoch=1-step=5.ckpt"]


def test_a_missing_bucket_or_bad_credentials_are_refused_when_fit_starts(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def start(url: str) -> Trainer:
        trainer = Trainer(**quiet(max_steps=4, callbacks=[ModelCheckpoint(dirpath=url, every_n_train_steps=2)]))
        trainer.fit(Regression(), loader(regression_data(), 16))
        return trainer

    bucket = s3.bucket("creds")
    with pytest.raises(PermissionError, match=r"cannot write to 's3://no-such-bucket-keel/ck': the bucket does not"):
        start("s3://no-such-bucket-keel/ck")
    with pytest.raises(PermissionError, match=r"CSVLogger\(save_dir=...\): cannot write to 's3://no-such-bucket-keel"):
        Trainer(**quiet(max_steps=1, logger=CSVLogger("s3://no-such-bucket-keel/runs"))).fit(
            Regression(), loader(regression_data(), 16)
        )  # a run directory in a missing bucket: refused when the version is picked, before anything runs
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    storage._filesystem.cache_clear()
    with pytest.raises(
        PermissionError, match=r"cannot write to 's3://" + bucket + r"/ck': the credentials were refused"
    ):
        start(s3.url(bucket, "ck"))
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    storage._filesystem.cache_clear()
    with pytest.raises(PermissionError, match=r"cannot write to 's3://" + bucket + r"/ck'.*AWS_ACCESS_KEY_ID"):
        start(s3.url(bucket, "ck"))
    assert not fs(s3).find(bucket), "nothing was written"


def test_a_run_directory_on_s3_holds_logs_config_and_checkpoints_and_no_secret(s3, tmp_path: Path) -> None:
    bucket = s3.bucket("rundir")
    root = s3.url(bucket, "runs")
    env = s3.env() | {"KEEL_MIRROR_DIR": str(tmp_path / "mirror")}
    done = python(
        "recipes.train", "trainer.max_steps=6", "trainer.val_check_interval=3", f"output_dir={root}",
        "callbacks.checkpoint.every_n_train_steps=3", "test=false", "logger=tensorboard", timeout=240, env=env,
        cwd=REPO_ROOT, module=True,
    ).check()  # fmt: skip
    objects = [o.removeprefix(f"{bucket}/runs/") for o in fs(s3).find(bucket)]
    run = "digits/version_0/"
    assert {run + "hparams.yaml", run + "config.yaml", run + "checkpoints/last"} <= set(objects), objects
    assert any(o.startswith(run + "events.out.tfevents.") for o in objects), objects  # CSV: the elastic test
    assert any(o.startswith(run + "checkpoints/") and o.endswith("keel.json") for o in objects)
    secret = s3.secret_key.encode()
    for key in fs(s3).find(bucket):
        assert secret not in fs(s3).cat_file(key), key
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or secret not in path.read_bytes(), path
    assert s3.secret_key not in done.stdout


def test_a_store_that_fails_while_last_is_resolved_stops_the_resume(own_server) -> None:
    """An intact save must never look uncommitted because the store did not answer: the resume stops with keel's
    CheckpointError naming the folder, instead of resuming an older save or starting over."""
    ck = own_server.url(own_server.bucket("outage"), "ck")
    _fit(ck, 4)

    class DiesAfterSetup(ModelCheckpoint):
        def setup(self, trainer, task, stage) -> None:
            super().setup(trainer, task, stage)  # the store answered here
            own_server.kill()  # ... and not when the run's saves are listed and `last` resolved

    trainer = Trainer(**quiet(max_steps=8, callbacks=[DiesAfterSetup(dirpath=ck, every_n_train_steps=2)]))
    with pytest.raises(CheckpointError, match="could not be verified; run again once the store answers") as info:
        trainer.fit(Regression(optimizer="adamw"), loader(regression_data(), 16), ckpt_path="last")
    assert ck in str(info.value) and trainer.global_step == 0


def test_what_a_killed_save_left_in_a_bucket_is_swept_and_never_renames_a_save(s3, tmp_path: Path) -> None:
    ck = s3.url(s3.bucket("leftover"), "ck")
    _fit(ck, 2)
    leftovers = [f"{ck}/epoch=0-step=4.ckpt/0badc0de", f"{ck}/epoch=0-step=3.ckpt/0ddba11"]
    for leftover in leftovers:  # saves killed before their manifest: data, no keel.json
        fs(s3).pipe({f"{leftover}/__0_0.distcp": b"half", f"{leftover}/.metadata": b"x"})
    resumed = _fit(ck, 4, ckpt_path="last")
    assert resumed.global_step == 4
    assert committed(ck) == ["epoch=0-step=4.ckpt", "epoch=0-step=2.ckpt"]  # the name was free: no -v1
    store = fs(s3)
    store.invalidate_cache()  # (SeaweedFS keeps an emptied prefix as a folder: no object under it is what counts)
    objects = store.find(ck.removeprefix("s3://"))
    assert [o for o in objects if any(o.startswith(f"{x.removeprefix('s3://')}/") for x in leftovers)] == []
    assert not [o for o in objects if "/epoch=0-step=3.ckpt/" in o]


def test_a_claim_on_a_bucket_prefix_is_exclusive_on_the_server(s3) -> None:
    """Of two runs that read a prefix unclaimed, or holding the same stale claim, in the same instant, the store
    lets one write its claim (If-None-Match, If-Match on the ETag) and the other is refused: no run claims a prefix
    another holds."""
    from trainer.checkpoint import claim

    folder = s3.url(s3.bucket("claims"), "ck")
    held, seen = claim.read_for_replacing(folder)
    assert held is None and not seen.present
    claim.write(folder, "other-run")  # another run, between this one's read and its write
    with pytest.raises(claim.Taken):
        claim.write(folder, "this-run", seen)
    held, stale = claim.read_for_replacing(folder)
    assert held["run"] == "other-run" and stale.present and stale.tag
    claim.write(folder, "third-run", stale)  # replaces exactly the claim it read
    with pytest.raises(claim.Taken):  # the other reader of that same claim loses
        claim.write(folder, "fourth-run", stale)
    assert claim.read(folder)["run"] == "third-run"


@pytest.mark.slow  # two server starts (20 s); the same reads failing is in the default tier: tests/unit/test_storage.py
def test_the_store_killed_between_verification_and_read_stops_the_resume_and_never_falls_back(
    own_server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As the campaign did it: the newest save's manifest and checksums verify, then the server is killed before
    .metadata and keel.pt are read. That is the store's failure, not damage: the resume stops with keel's error
    naming the step-10 save (never the step-8 save, never a bare botocore traceback), and once the store is back
    `last` still resumes step 10."""
    from trainer.checkpoint import reader
    from trainer.checkpoint.files import CorruptCheckpointError

    ck = own_server.url(own_server.bucket("verified"), "ck")
    _fit(ck, 10)
    verify = reader.verify

    def killed_after(*args, **kwargs):
        problems = verify(*args, **kwargs)
        own_server.kill()  # verified; the reads that follow find no server
        return problems

    monkeypatch.setattr(reader, "verify", killed_after)
    trainer = Trainer(**quiet(max_steps=12, callbacks=[ModelCheckpoint(dirpath=ck, every_n_train_steps=2)]))
    with caplog.at_level("WARNING"), pytest.raises(CheckpointError) as info:
        trainer.fit(Regression(optimizer="adamw"), loader(regression_data(), 16), ckpt_path="last")
    text = str(info.value)
    assert not isinstance(info.value, CorruptCheckpointError), text
    assert (
        "-step=10.ckpt' could not be verified: " in text and ck in text and "run again once the store answers" in text
    )
    assert "Could not connect to the endpoint URL" in text, text
    assert "Falling back" not in caplog.text and trainer.global_step == 0
    monkeypatch.setattr(reader, "verify", verify)
    restarted = type(own_server).start(own_server.data_dir)
    try:
        for name, value in restarted.env().items():
            os.environ[name] = value
        storage._filesystem.cache_clear()
        resumed = _fit(ck, 12, ckpt_path="last")
        assert resumed.ckpt_path is not None and resumed.ckpt_path.endswith("-step=10.ckpt")
    finally:
        restarted.kill()
