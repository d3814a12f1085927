"""A URL is never a local folder name: every place a path enters keel refuses one it cannot write to, when the object
is built (before: Trainer(default_root_dir="s3://bucket/run") wrote ./s3:/bucket/run and the checkpoints died with
the node). file:// URLs are local paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from models import Regression, loader, quiet, regression_data

from trainer import Trainer
from trainer.checkpoint.model_checkpoint import ModelCheckpoint
from trainer.checkpoint.reader import export_weights
from trainer.loggers import CSVLogger, TensorBoardLogger
from trainer.storage import local_path

URL = "s3://bucket/run"


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def assert_no_url_folder(root: Path) -> None:
    assert not any(":" in p.name for p in root.rglob("*")), sorted(root.rglob("*"))


@pytest.mark.parametrize(
    "build,what",
    [
        (lambda: Trainer(default_root_dir=URL), r"Trainer\(default_root_dir=\.\.\.\)"),
        (lambda: ModelCheckpoint(dirpath=URL), r"ModelCheckpoint\(dirpath=\.\.\.\)"),
        (lambda: CSVLogger(URL), r"CSVLogger\(save_dir=\.\.\.\)"),
        (lambda: TensorBoardLogger("gs://bucket/logs"), r"TensorBoardLogger\(save_dir=\.\.\.\)"),
        (lambda: export_weights(URL + "/epoch=0.ckpt", "w.pt"), r"export_weights\(ckpt_path\)"),
    ],
)
def test_a_url_is_refused_where_the_object_is_built(build, what: str, in_tmp: Path) -> None:
    with pytest.raises(ValueError, match=what + r".*:// URL, and keel writes only to filesystem paths"):
        build()
    assert_no_url_folder(in_tmp)


def test_a_url_ckpt_path_and_save_path_are_refused_before_anything_is_read_or_written(in_tmp: Path) -> None:
    trainer = Trainer(**quiet(max_steps=1))
    with pytest.raises(ValueError, match=r"ckpt_path: 's3://bucket/run/last.ckpt' is a s3:// URL"):
        trainer.fit(Regression(), loader(regression_data(), 16), ckpt_path=URL + "/last.ckpt")
    trainer = Trainer(**quiet(max_steps=1))
    trainer.fit(Regression(), loader(regression_data(), 16))
    with pytest.raises(ValueError, match=r"save_checkpoint\(path\)"):
        trainer.save_checkpoint(URL + "/x.ckpt")
    assert_no_url_folder(in_tmp)


def test_file_urls_and_paths_are_local(in_tmp: Path) -> None:
    assert local_path(f"file://{in_tmp}/runs", "x") == f"{in_tmp}/runs"
    assert local_path("file://localhost/tmp/a%20b", "x") == "/tmp/a b"
    assert local_path("~/runs", "x") == os.path.expanduser("~/runs")
    assert local_path(Path("rel/dir"), "x") == "rel/dir"
    with pytest.raises(ValueError, match="names another host"):
        local_path("file://otherhost/tmp", "x")
    trainer = Trainer(**quiet(max_steps=1, logger=True, default_root_dir=f"file://{in_tmp}/root"))
    trainer.fit(Regression(), loader(regression_data(), 16))
    assert (in_tmp / "root" / "keel_logs" / "version_0").is_dir()
    assert_no_url_folder(in_tmp)
