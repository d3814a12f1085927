"""Run directories and checkpoints on object storage, in one process, over fsspec's in-memory filesystem.

``memory://`` is a real fsspec filesystem with object-store semantics (prefixes, no rename keel relies on), so the
commit protocol of trainer/checkpoint/store.py is checked here quickly: resume equals the uninterrupted run, a save
without its manifest does not exist, a re-save of a name keeps the old one until its manifest switches, pruning
removes the manifest first, and a URL is never a local folder name. tests/integration/test_s3.py runs the same paths
against a real S3 server, with several ranks and crashes.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import fsspec
import pytest
import torch
from models import Regression, loader, quiet, regression_data

from trainer import Trainer, storage
from trainer.checkpoint.claim import CLAIM_FILE
from trainer.checkpoint.files import CorruptCheckpointError
from trainer.checkpoint.hf import export_weights
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.checkpoint.reader import committed, resolve_last
from trainer.checkpoint.store import MANIFEST_FILE
from trainer.loggers import CSVLogger
from trainer.storage import RemotePath, location


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KEEL_MIRROR_DIR", str(tmp_path / "mirrors"))
    monkeypatch.setattr(storage, "_MIRRORS", {})
    monkeypatch.setattr(storage, "_DOWNLOADED", set())
    return tmp_path


@pytest.fixture
def bucket(request: pytest.FixtureRequest):
    """A fresh prefix of the in-memory object store, removed afterwards."""
    url = f"memory://keel-test/{request.node.name.replace('[', '-').replace(']', '')}"
    fs = fsspec.filesystem("memory")
    yield url
    if fs.exists(url):
        fs.rm(url, recursive=True)


def assert_no_url_folder(root: Path) -> None:
    assert not any(":" in p.name for p in root.rglob("*")), sorted(root.rglob("*"))


def objects(url: str) -> list[str]:
    prefix = fsspec.filesystem("memory")._strip_protocol(url) + "/"
    return sorted(k[len(prefix) :] for k in fsspec.filesystem("memory").find(url))


def fit(url: str, steps: int, ckpt_path: str | None = None, **checkpoint) -> tuple[Regression, ModelCheckpoint]:
    options = dict(dirpath=url, every_n_train_steps=2, save_top_k=2) | checkpoint
    callback = ModelCheckpoint(**options)
    task = Regression(optimizer="adamw")
    Trainer(**quiet(max_steps=steps, callbacks=[callback])).fit(
        task, loader(regression_data(), 16), ckpt_path=ckpt_path
    )
    return task, callback


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# ---------------------------------------------------------------------- where a path or URL goes
def test_paths_and_urls(in_tmp: Path) -> None:
    assert location(f"file://{in_tmp}/runs", "x") == f"{in_tmp}/runs"
    assert location("file://localhost/tmp/a%20b", "x") == "/tmp/a b"
    assert location("~/runs", "x") == os.path.expanduser("~/runs")
    assert location(Path("rel/dir"), "x") == "rel/dir"
    assert location("memory://bucket/run/", "x") == "memory://bucket/run"
    with pytest.raises(ValueError, match="names another host"):
        location("file://otherhost/tmp", "x")
    with pytest.raises(ValueError, match="names no bucket"):
        location("memory://", "x")
    assert storage.join("s3://b/run", "checkpoints", "last") == "s3://b/run/checkpoints/last"
    assert str(RemotePath("s3://b/run/x.ckpt").parent) == "s3://b/run" and RemotePath("s3://b/x.ckpt").suffix == ".ckpt"


def _missing(package: str) -> bool:
    return importlib.util.find_spec(package) is None


@pytest.mark.skipif(not _missing("gcsfs"), reason="gcsfs is installed here")
@pytest.mark.parametrize(
    "build,what",
    [
        (lambda: Trainer(default_root_dir="gs://bucket/run"), r"Trainer\(default_root_dir=\.\.\.\)"),
        (lambda: ModelCheckpoint(dirpath="gs://bucket/run"), r"ModelCheckpoint\(dirpath=\.\.\.\)"),
        (lambda: CSVLogger("gs://bucket/logs"), r"CSVLogger\(save_dir=\.\.\.\)"),
        (lambda: export_weights("gs://bucket/run/epoch=0.ckpt", "w.pt"), r"export_weights\(ckpt_path\)"),
    ],
)
def test_a_url_without_an_installed_filesystem_is_refused_naming_what_to_install(
    build, what: str, in_tmp: Path
) -> None:
    with pytest.raises(ValueError, match=what + r".*no filesystem for gs:// is installed.*pip install gcsfs"):
        build()
    assert_no_url_folder(in_tmp)


def test_mlflow_on_object_storage_needs_a_tracking_uri(in_tmp: Path) -> None:
    from trainer.loggers import MLFlowLogger

    with pytest.raises(ValueError, match=r"MLFlowLogger\(save_dir='memory://bucket/runs'\) needs tracking_uri="):
        MLFlowLogger(save_dir="memory://bucket/runs")
    assert MLFlowLogger(save_dir="memory://bucket/runs", tracking_uri="http://127.0.0.1:1").save_dir.startswith(
        "memory"
    )
    assert_no_url_folder(in_tmp)


def test_a_url_ckpt_path_of_an_unknown_scheme_is_refused_before_anything_is_read(in_tmp: Path) -> None:
    trainer = Trainer(**quiet(max_steps=1))
    with pytest.raises(ValueError, match=r"ckpt_path: 'nosuchscheme://bucket/run/last' is a nosuchscheme:// URL"):
        trainer.fit(Regression(), loader(regression_data(), 16), ckpt_path="nosuchscheme://bucket/run/last")
    assert_no_url_folder(in_tmp)


# ---------------------------------------------------------------------- the commit protocol
@pytest.mark.parametrize("async_save", [False, True])
def test_resume_from_object_storage_equals_the_uninterrupted_run(bucket: str, async_save: bool, in_tmp: Path) -> None:
    full, _ = fit(bucket + "/full", 8, async_save=async_save)
    fit(bucket + "/resumed", 4, async_save=async_save)
    resumed, callback = fit(bucket + "/resumed", 8, ckpt_path="last", async_save=async_save)
    assert same_weights(full, resumed)
    names = objects(bucket + "/resumed")
    top = ("last", CLAIM_FILE)  # the pointer, and the run's claim on the folder
    assert "last" in names and all(n.count("/") == 2 or n in top or n.endswith(MANIFEST_FILE) for n in names), names
    export_weights(callback.best_model_path, bucket + "/weights.pt")  # reads from the store, writes to it
    weights = torch.load(fsspec.open(bucket + "/weights.pt").open(), weights_only=True)
    expected = resumed.state_dict()
    assert sorted(weights) == sorted(expected) and all(torch.equal(weights[k], v) for k, v in expected.items())
    assert_no_url_folder(in_tmp)


def test_a_save_without_its_manifest_does_not_exist(bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    fit(bucket, 4)
    saves = committed(bucket)
    assert saves == ["epoch=0-step=4.ckpt", "epoch=0-step=2.ckpt"]
    fsspec.filesystem("memory").rm_file(f"{bucket}/{saves[0]}/{MANIFEST_FILE}")  # a save killed before its marker
    with caplog.at_level(logging.WARNING):
        assert resolve_last(bucket) == [f"{bucket}/epoch=0-step=2.ckpt"]
    assert "missing or was never committed" in caplog.text
    _, callback = fit(bucket, 6, ckpt_path="last")
    assert callback._last_path.endswith("epoch=1-step=6.ckpt")


def test_a_re_save_of_a_name_keeps_the_old_one_until_its_manifest_switches(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fit(bucket, 2, filename="latest", save_top_k=1)
    before = objects(bucket)
    from trainer.checkpoint import store

    def fail(*args, **kwargs):
        raise OSError(5, "the store went away")

    monkeypatch.setattr(store, "manifest_body", fail)  # every object of the re-save written, the marker not
    with pytest.raises(OSError, match="the store went away|Could not write checkpoint"):
        fit(bucket, 4, ckpt_path="last", filename="latest", save_top_k=1)
    monkeypatch.undo()
    assert set(before) <= set(objects(bucket)), "the committed save was touched"
    assert resolve_last(bucket) == [f"{bucket}/latest.ckpt"]
    task, _ = fit(bucket, 4, ckpt_path="last", filename="latest", save_top_k=1)  # loads the old one, saves anew
    manifests = [n for n in objects(bucket) if n.endswith(MANIFEST_FILE)]
    assert manifests == ["latest.ckpt/keel.json"]
    assert len({n.split("/")[1] for n in objects(bucket) if n.startswith("latest.ckpt/") and n.count("/") == 2}) == 1
    reference, _ = fit(bucket + "-ref", 4, filename="latest", save_top_k=1)
    assert same_weights(task, reference)


def test_pruning_removes_the_manifest_first(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: RemotePath) -> None:
        raise PermissionError(13, "delete refused")

    monkeypatch.setattr(RemotePath, "rmtree", refuse)
    fit(bucket, 6, save_top_k=1)  # each save prunes the one before; the deletes of their data fail
    names = objects(bucket)
    assert [n for n in names if n.endswith(MANIFEST_FILE)] == ["epoch=1-step=6.ckpt/keel.json"], names
    assert any(n.startswith("epoch=0-step=2.ckpt/") for n in names)  # data left behind, but never a candidate
    assert committed(bucket) == ["epoch=1-step=6.ckpt"]


def test_a_damaged_object_is_refused_and_last_falls_back(bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    fit(bucket, 4)
    fs = fsspec.filesystem("memory")
    newest = f"{bucket}/epoch=0-step=4.ckpt"
    data = next(p for p in fs.find(newest) if p.endswith(".distcp"))
    blob = bytearray(fs.cat_file(data))
    blob[len(blob) // 2] ^= 0xFF
    fs.pipe_file(data, bytes(blob))
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp is corrupt or from another save"):
        fit(bucket, 6, ckpt_path=newest)
    with caplog.at_level(logging.WARNING):
        _, callback = fit(bucket, 6, ckpt_path="last")
    assert "Falling back to the next candidate" in caplog.text and callback._last_path.endswith("step=6.ckpt")


# ---------------------------------------------------------------------- the run directory
def test_a_run_directory_on_object_storage_holds_the_logs_and_continues_after_a_restart(
    bucket: str, in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")  # a restart of the same job finds its run directory again

    def run(steps: int, ckpt_path: str | None) -> Trainer:
        trainer = Trainer(
            **quiet(max_steps=steps, default_root_dir=bucket, logger=CSVLogger(bucket), log_every_n_steps=1)
            | {"callbacks": [ModelCheckpoint(every_n_train_steps=2)]}
        )
        trainer.fit(Regression(), loader(regression_data(), 16), ckpt_path=ckpt_path)
        return trainer

    first = run(4, None)
    assert first.log_dir == f"{bucket}/keel_logs/version_0"
    names = objects(first.log_dir)
    assert {"metrics.csv", "hparams.yaml", ".keel_run_id", "checkpoints/last"} <= set(names), names
    monkeypatch.setattr(storage, "_MIRRORS", {})  # another node: a fresh process, its own empty mirror
    monkeypatch.setattr(storage, "_DOWNLOADED", set())
    monkeypatch.setenv("KEEL_MIRROR_DIR", str(in_tmp / "other-node"))
    second = run(6, "last")
    assert second.log_dir == first.log_dir and second.global_step == 6
    rows = fsspec.filesystem("memory").cat_file(f"{first.log_dir}/metrics.csv").decode().splitlines()
    steps = [int(row.split(",")[0]) for row in rows[1:]]
    assert steps == list(range(6)), rows  # the first run's rows kept, the second's appended
    assert_no_url_folder(in_tmp)


def test_a_wait_for_a_save_that_does_not_finish_warns_and_never_waits_silently(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    from trainer.checkpoint import async_save

    monkeypatch.setattr(async_save, "STILL_WRITING_S", 0.05)
    release = threading.Event()
    checkpointer = async_save.AsyncCheckpointer()
    checkpointer.submit(lambda: None, lambda staged: release.wait(10), what="s3://bucket/ck/epoch=0-step=2.ckpt")
    threading.Timer(0.3, release.set).start()
    with caplog.at_level(logging.WARNING):
        assert checkpointer.wait()
    warnings = [r.getMessage() for r in caplog.records if "still writing after" in r.getMessage()]
    assert warnings and "s3://bucket/ck/epoch=0-step=2.ckpt" in warnings[0] and "watchdog_timeout" in warnings[0]


def test_a_store_failing_while_a_save_is_verified_is_an_error_never_a_fallback_to_an_older_save(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout reading the newest save is not damage: falling back to the save before it would silently drop
    the progress in between, so the resume stops instead and names the store's error."""
    from trainer.checkpoint.files import CheckpointError

    fit(bucket, 4)
    real_open = RemotePath.open

    def flaky(self: RemotePath, mode: str = "rb"):
        if "step=4" in self.url and self.url.endswith(".distcp"):
            raise TimeoutError("Read timeout on endpoint URL")
        return real_open(self, mode)

    monkeypatch.setattr(RemotePath, "open", flaky)
    with pytest.raises(
        CheckpointError, match=r"could not be verified: __0_0\.distcp could not be read from the store"
    ) as info:
        fit(bucket, 6, ckpt_path="last")
    assert not isinstance(info.value, CorruptCheckpointError)


class StoreDown:
    """The in-memory store stops answering once the newest save was verified: every request for an object of
    ``bucket`` fails as botocore's does when the endpoint is gone, from the first read of an object whose name ends
    with ``at`` (None: right after the verification) onward, as when the campaign killed the server between the
    verification and the reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, bucket: str, at: str | None) -> None:
        from fsspec.implementations.memory import MemoryFileSystem

        from trainer.checkpoint import reader

        botocore = pytest.importorskip("botocore.exceptions")
        self.error, self.at, self.verified, self.down = botocore.EndpointConnectionError, at, False, False
        self.key = MemoryFileSystem._strip_protocol(bucket)
        verify = reader.verify

        def verifying(*args, **kwargs):
            problems = verify(*args, **kwargs)
            self.verified, self.down = True, self.down or at is None
            return problems

        monkeypatch.setattr(reader, "verify", verifying)
        for name in ("cat_file", "_open", "info", "ls"):
            monkeypatch.setattr(MemoryFileSystem, name, self.failing(getattr(MemoryFileSystem, name)))

    def failing(self, method):
        def call(fs, path, *args, **kwargs):
            key = fs._strip_protocol(path)
            if self.verified and key.startswith(self.key):
                self.down = self.down or (self.at is not None and key.endswith(self.at))
                if self.down:
                    raise self.error(endpoint_url="http://127.0.0.1:8333")
            return method(fs, path, *args, **kwargs)

        return call


def assert_stopped_for_the_store(exc: BaseException, save: str, caplog: pytest.LogCaptureFixture) -> None:
    from trainer.checkpoint.files import CheckpointError

    assert isinstance(exc, CheckpointError) and not isinstance(exc, CorruptCheckpointError), repr(exc)
    text = str(exc)
    assert f"{save}' could not be verified: " in text and "Could not connect to the endpoint URL" in text, text
    assert "run again once the store answers" in text, text
    assert "Falling back" not in caplog.text  # never an older save


@pytest.mark.parametrize("at", [None, "keel.pt", ".distcp"], ids=["metadata", "keel.pt", "data"])
def test_the_store_failing_after_a_save_is_verified_stops_the_resume_and_never_falls_back(
    bucket: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, at: str | None
) -> None:
    """Verified, then the store stops answering at the read of .metadata, of keel.pt, or of the data under DCP: that
    is not damage, so `last` neither falls back to the step-2 save (nor meets the store down again there, with a
    bare botocore traceback); the resume stops with keel's error naming the newest save."""
    fit(bucket, 4)
    StoreDown(monkeypatch, bucket, at)
    with caplog.at_level(logging.WARNING), pytest.raises(Exception) as info:
        fit(bucket, 6, ckpt_path="last")
    assert_stopped_for_the_store(info.value, f"{bucket}/epoch=0-step=4.ckpt", caplog)


def test_the_store_failing_during_a_fallback_from_a_damaged_save_stops_the_resume(
    bucket: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest save is damaged (a flipped bit): `last` falls back, and the store stops answering as the older save
    is read: keel's error naming that save, never a bare botocore traceback, never a fallback further back."""
    from trainer.checkpoint import reader

    fit(bucket, 6, save_top_k=3)
    fs = fsspec.filesystem("memory")
    data = next(p for p in fs.find(f"{bucket}/epoch=1-step=6.ckpt") if p.endswith(".distcp"))
    blob = bytearray(fs.cat_file(data))
    blob[len(blob) // 2] ^= 0xFF
    fs.pipe_file(data, bytes(blob))
    down = StoreDown(monkeypatch, bucket, None)
    down.verified = True  # the store answers until the fallback begins
    locate, located = reader.save_folder, []

    def second_candidate_finds_the_store_down(path):
        located.append(path)
        down.down = len(located) > 1
        return locate(path)

    monkeypatch.setattr(reader, "save_folder", second_candidate_finds_the_store_down)
    with caplog.at_level(logging.WARNING), pytest.raises(Exception) as info:
        fit(bucket, 8, ckpt_path="last")
    assert "Falling back to the next candidate" in caplog.text  # from the damaged save, as before
    caplog.clear()
    assert_stopped_for_the_store(info.value, f"{bucket}/epoch=0-step=4.ckpt", caplog)


def test_the_store_failing_as_an_explicit_save_is_claimed_refuses_the_fit_and_keeps_the_folders_claim(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fit(ckpt_path=<a save>) reads the folder's manifests (its saves, and the run that wrote the save it
    continues). A connection refused there (an OSError, as aiohttp's are) is the store's failure: the fit stops
    with keel's error (a bare ConnectionRefusedError before), and the folder's claim is untouched."""
    from fsspec.implementations.memory import MemoryFileSystem

    from trainer.checkpoint import claim
    from trainer.checkpoint.files import CheckpointError

    fit(bucket, 4)
    before = claim.read(bucket)
    cat = MemoryFileSystem.cat_file

    def refused(fs, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if path.endswith("keel.json"):
            raise ConnectionRefusedError(111, "Connection refused")
        return cat(fs, path, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", refused)
    with pytest.raises(CheckpointError, match="Connection refused") as info:
        fit(bucket, 6, ckpt_path=f"{bucket}/epoch=0-step=4.ckpt")
    assert not isinstance(info.value, CorruptCheckpointError)
    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat)
    assert claim.read(bucket) == before
