"""Tests for trainer/loggers/local.py: version folders, CSV and TensorBoard output, the ``logger`` option."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from trainer.loggers import CSVLogger, Logger, TensorBoardLogger
from trainer.loggers import local as loggers_mod
from trainer.loggers import logger as logger_mod
from trainer.loggers.local import default_loggers
from trainer.loggers.logger import flatten_params


# ---------------------------------------------------------------------------------------------- versions
def test_versions_count_up_as_folders_appear(tmp_path: Path) -> None:
    seen = []
    for _ in range(3):
        logger = Logger(tmp_path, name="exp")
        logger.resolve_version()
        seen.append(logger.version)
        os.makedirs(logger.log_dir)  # resolve_version itself creates nothing
    assert seen == [0, 1, 2]
    assert sorted(os.listdir(tmp_path / "exp")) == ["version_0", "version_1", "version_2"]


def test_version_after_highest_existing_ignores_other_entries(tmp_path: Path) -> None:
    (tmp_path / "keel_logs" / "version_5").mkdir(parents=True)
    (tmp_path / "keel_logs" / "version_2").mkdir()
    (tmp_path / "keel_logs" / "version_9_old").mkdir()  # not version_<int>
    (tmp_path / "keel_logs" / "version_40").write_text("a file, not a folder")
    (tmp_path / "keel_logs" / "notes").mkdir()
    logger = Logger(tmp_path)
    logger.resolve_version()
    assert logger.version == 6
    assert logger.log_dir == os.path.join(str(tmp_path), "keel_logs", "version_6")


def test_resolve_creates_nothing_and_is_idempotent(tmp_path: Path) -> None:
    logger = Logger(tmp_path / "logs", name="exp")
    logger.resolve_version()
    assert logger.version == 0
    assert not (tmp_path / "logs").exists()
    os.makedirs(logger.log_dir)
    logger.resolve_version()  # fit then test: same folder even though version_0 now exists
    assert logger.version == 0


def test_explicit_versions_and_layout(tmp_path: Path) -> None:
    (tmp_path / "exp" / "version_7").mkdir(parents=True)
    as_int = Logger(tmp_path, name="exp", version=3)
    as_int.resolve_version()
    assert as_int.version == 3
    assert as_int.log_dir == os.path.join(str(tmp_path), "exp", "version_3")
    as_str = Logger(tmp_path, name="exp", version="baseline")
    as_str.resolve_version()
    assert as_str.log_dir == os.path.join(str(tmp_path), "exp", "baseline")
    for empty in (None, ""):
        flat = Logger(tmp_path, name=empty, version=1)
        assert flat.log_dir == os.path.join(str(tmp_path), "version_1")
    unnamed = Logger(tmp_path / "flat", name=None)
    (tmp_path / "flat" / "version_0").mkdir(parents=True)
    unnamed.resolve_version()
    assert unnamed.log_dir == os.path.join(str(tmp_path), "flat", "version_1")


def test_log_dir_before_resolution_raises(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="resolve_version"):
        _ = Logger(tmp_path).log_dir


def test_resolve_uses_rank_zero_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a non-zero rank the folder is not scanned; the broadcast values (rank 0's version and save_dir) are
    taken."""
    (tmp_path / "keel_logs" / "version_0").mkdir(parents=True)
    sent = []
    monkeypatch.setattr(loggers_mod.comm, "get_rank", lambda: 1)

    def fake_broadcast(obj: object, src: int = 0) -> object:
        sent.append(obj)
        return 4, str(tmp_path / "rank0")  # rank 0's pick and folder

    monkeypatch.setattr(loggers_mod.comm, "broadcast_object", fake_broadcast)
    logger = Logger(tmp_path)
    logger.resolve_version()
    assert sent == [(None, str(tmp_path))] and logger.version == 4
    assert logger.log_dir == str(tmp_path / "rank0" / "keel_logs" / "version_4")
    logger.resolve_version()
    assert len(sent) == 1  # resolved: no second collective


# ---------------------------------------------------------------------------------------------- CSV
def _read_csv(path: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_csv_header_is_union_and_rows_align(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="exp")
    logger.resolve_version()
    logger.log_metrics({"loss": 1.5}, step=1)
    logger.log_metrics({"loss": 1.25, "lr": 0.1}, step=2)
    logger.log_metrics({"val/acc": 0.75}, step=3)
    logger.log_metrics({"loss": 1.0, "lr": 0.05}, step=4)
    logger.finalize("success")
    header, rows = _read_csv(os.path.join(logger.log_dir, "metrics.csv"))
    assert header == ["step", "loss", "lr", "val/acc"]
    assert rows == [
        {"step": "1", "loss": "1.5", "lr": "", "val/acc": ""},
        {"step": "2", "loss": "1.25", "lr": "0.1", "val/acc": ""},
        {"step": "3", "loss": "", "lr": "", "val/acc": "0.75"},
        {"step": "4", "loss": "1.0", "lr": "0.05", "val/acc": ""},
    ]
    assert not os.path.exists(os.path.join(logger.log_dir, "metrics.csv.tmp"))


def test_csv_reopens_after_finalize_and_extends_existing_file(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, version=0)
    logger.log_metrics({"a": 1.0}, step=1)
    logger.finalize("success")
    logger.finalize("success")  # twice is fine
    logger.log_metrics({"a": 2.0}, step=2)  # reopens
    logger.finalize("success")
    # A new logger on the same folder (resume with a fixed version) appends and widens.
    again = CSVLogger(tmp_path, version=0)
    again.log_metrics({"a": 3.0, "b": 4.0}, step=3)
    again.finalize("success")
    header, rows = _read_csv(os.path.join(logger.log_dir, "metrics.csv"))
    assert header == ["step", "a", "b"]
    assert [(r["step"], r["a"], r["b"]) for r in rows] == [("1", "1.0", ""), ("2", "2.0", ""), ("3", "3.0", "4.0")]


def test_csv_hparams_yaml(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    logger = CSVLogger(tmp_path)
    logger.resolve_version()
    logger.log_hyperparams({"lr": 0.001, "model": {"depth": 4, "act": "gelu"}, "path": Path("/data"), "none": None})
    logger.log_hyperparams(OmegaConf.create({"seed": 7, "ref": "${seed}"}))  # merged, interpolation resolved
    loaded = OmegaConf.to_container(OmegaConf.load(os.path.join(logger.log_dir, "hparams.yaml")))
    assert loaded == {
        "lr": 0.001,
        "model": {"depth": 4, "act": "gelu"},
        "path": "/data",
        "none": None,
        "seed": 7,
        "ref": 7,
    }


def test_log_without_resolve_in_single_process_resolves(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"x": 1.0}, step=0)
    assert logger.version == 0
    assert os.path.exists(os.path.join(str(tmp_path), "keel_logs", "version_0", "metrics.csv"))


# ---------------------------------------------------------------------------------------------- TensorBoard
def test_flatten_params() -> None:
    flat = flatten_params({"opt": {"lr": 0.1, "betas": [0.9, 0.99]}, "name": "x", "flag": True, "none": None})
    assert flat == {"opt/lr": 0.1, "opt/betas": "[0.9, 0.99]", "name": "x", "flag": True, "none": "None"}


def test_tensorboard_scalars_and_hparams_round_trip(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb")
    logger.resolve_version()
    assert not (tmp_path / "tb").exists()  # writer is lazy
    values = {1: 0.5, 2: 0.25, 3: 0.125 + 1e-3}
    for step, value in values.items():
        logger.log_metrics({"train/loss": value, "epoch": 0.0}, step=step)
    logger.log_hyperparams({"lr": 3e-4, "model": {"depth": 2}, "callbacks": ["A", "B"], "amp": False})
    logger.finalize("success")
    logger.finalize("success")
    logger.log_metrics({"train/loss": 0.0625}, step=4)  # reopens after finalize
    logger.finalize("success")

    # The reopened writer starts a second events file. Each file is read on its own, in the order they were written:
    # a folder reader orders files by name, where the writer's counter ("...9" then "...10", in a process that made
    # many writers) can sort the newer first, and the reader then skips the older as stale.
    files = sorted(Path(logger.log_dir).glob("events.out.tfevents*"), key=lambda f: (f.stat().st_mtime_ns, f.name))
    assert len(files) == 2
    accs = [EventAccumulator(str(f)) for f in files]
    for one in accs:
        one.Reload()
    events = [e for one in accs if "train/loss" in one.Tags()["scalars"] for e in one.Scalars("train/loss")]
    assert [e.step for e in events] == [1, 2, 3, 4]
    assert [e.value for e in events] == pytest.approx([*values.values(), 0.0625], rel=1e-6)
    acc = accs[0]  # the hyperparameters went to the first file
    hparams_tags = acc.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(hparams_tags)

    from tensorboard.plugins.hparams import plugin_data_pb2

    data = plugin_data_pb2.HParamsPluginData.FromString(hparams_tags["_hparams_/session_start_info"])
    hp = data.session_start_info.hparams
    assert hp["lr"].number_value == pytest.approx(3e-4)
    assert hp["model/depth"].number_value == 2
    assert hp["callbacks"].string_value == "['A', 'B']"
    assert "hparams" in "".join(acc.Tags().get("tensors", []))  # the text summary


# ---------------------------------------------------------------------------------------------- option
def test_default_loggers_option_kinds(tmp_path: Path) -> None:
    (default,) = default_loggers(True, str(tmp_path))
    assert isinstance(default, TensorBoardLogger)
    assert (default.save_dir, default.name, default.version) == (str(tmp_path), "keel_logs", None)
    assert default_loggers(False, str(tmp_path)) == []
    assert default_loggers(None, str(tmp_path)) == []
    csv_logger = CSVLogger(tmp_path)
    assert default_loggers(csv_logger, None) == [csv_logger]
    pair = [CSVLogger(tmp_path), TensorBoardLogger(tmp_path)]
    assert default_loggers(pair, None) == pair
    assert default_loggers(tuple(pair), None) == pair


def test_default_loggers_uses_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (default,) = default_loggers(True, None)
    assert default.save_dir == str(tmp_path)


def test_default_loggers_falls_back_to_csv_without_tensorboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loggers_mod, "_tensorboard_available", lambda: False)
    monkeypatch.setattr(loggers_mod, "_warned_no_tensorboard", False)
    with pytest.warns(UserWarning, match="tensorboard is not installed"):
        (first,) = default_loggers(True, str(tmp_path))
    assert type(first) is CSVLogger
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (second,) = default_loggers(True, str(tmp_path))  # warned once only
    assert type(second) is CSVLogger


@pytest.mark.parametrize("bad", ["tensorboard", 1, [CSVLogger("x"), "csv"], object()])
def test_default_loggers_rejects_other_values(bad: object) -> None:
    with pytest.raises(ValueError) as info:
        default_loggers(bad, None)
    message = str(info.value)
    assert "logger=" in message and repr(bad) in message
    assert "True, False, a trainer.loggers.Logger or a list of them" in message


def test_jobs_starting_together_claim_different_run_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two SLURM jobs of one sweep start at the same moment: both saw no version_N yet.
    for name in ("TORCHELASTIC_RUN_ID", "SUBMITIT_LOCAL_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    first, second = Logger(tmp_path), Logger(tmp_path)
    monkeypatch.setattr(second, "_next_version", lambda: 0)  # looked before the first one created version_0
    monkeypatch.setenv("SLURM_JOB_ID", "11")
    first.resolve_version()
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    second.resolve_version()
    assert (first.version, second.version) == (0, 1)
    root = tmp_path / "keel_logs"
    assert [(root / f"version_{n}" / logger_mod.RUN_ID_MARKER).read_text() for n in (0, 1)] == [
        "slurm:11.batch",
        "slurm:12.batch",
    ]
    requeued = Logger(tmp_path)  # job 12 again (a requeue): its own folder back
    requeued.resolve_version()
    assert requeued.version == 1


def test_submitit_local_jobs_have_their_own_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "5")  # submitit_local started inside an allocation
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "4242")
    assert logger_mod.run_identity().startswith("submitit-local:") and logger_mod.run_identity().endswith(":4242")


def test_two_loggers_of_one_trainer_share_the_run_directory_a_continued_fit_picks(tmp_path) -> None:
    """fit(ckpt_path="last") creates (or continues) a version folder with its first logger; the second logger of the
    same Trainer joins it instead of seeing the folder just made and taking the next one."""
    from models import Regression, loader, quiet, regression_data

    from trainer import Trainer
    from trainer.loggers import CSVLogger

    for _ in range(2):  # each Trainer of this process is a run of its own, with both its loggers in one folder
        loggers = [CSVLogger(tmp_path, name="run"), CSVLogger(tmp_path, name="run")]
        trainer = Trainer(**quiet(max_steps=2, logger=loggers, enable_checkpointing=True))
        trainer.fit(Regression(), loader(regression_data(16), batch_size=4), ckpt_path="last")
        assert loggers[0].log_dir == loggers[1].log_dir
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")) == [
        "version_0",
        "version_1",
    ]
