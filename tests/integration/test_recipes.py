"""The recipes run end to end with pinned losses: ``python -m recipes.train`` launched in a subprocess, exactly as a
user would, with the run directory in a temporary folder; a crash resumed exactly, a bad option named, a sweep, the
docs' own task. The 2-process cases are in tests/integration/test_recipes_dist.py; the config (every YAML, the
override grammar of docs/configuration.md, the schema, the saved config) in one process in
tests/unit/test_recipe_config.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
from launch import captured
from recipe_paths import COMMAND, REPO_ROOT, _docs_section

pytest.importorskip("sklearn", reason="the digits recipe needs scikit-learn (pip install -e '.[dev]')")

from omegaconf import OmegaConf

from recipes.config_callback import K_CONFIG

HARNESS_DIR = REPO_ROOT / "tests" / "harness"  # recipe_faults

# The digits recipe after 5 optimizer steps with trainer.seed=0 and data.split_seed=0 (see
# test_digits_recipe_end_to_end): the cosine schedule spans the run's 5 steps (the Trainer's
# estimated_stepping_batches). Observed on CPU with torch 2.13 and the sampler's order 2 (a hash of seed and
# epoch); identical with 1 or 2 threads.
# The summary prints 4 significant digits: a value in [1, 10) is within half a unit of the 4th digit.
SHOWN = 5e-4
PINNED_TRAIN_LOSS = 2.242983  # train/loss of step 5 (log_every_n_steps=1)
PINNED_VAL_LOSS = 2.218751  # val/loss over the first 2 validation batches after step 5

# The charlm recipe (+experiment=charlm: bf16-mixed, clipping, the accumulation schedule) shrunk to a
# 1-layer, 32-wide model (lr 0.01) on a generated corpus (independent of the Python installation), 4
# optimizer steps of which the last two accumulate 2 micro-batches. bf16 kernels may round differently on other
# CPUs, hence the looser tolerance.
PINNED_CHARLM_TRAIN_LOSS = 4.09764
PINNED_CHARLM_VAL_LOSS = 3.84117
CHARLM_TOLERANCE = 2e-3


# ---------------------------------------------------------------------------------------------- end to end
def _run(
    args: list[str], cwd: Path, timeout: float = 180, env: dict[str, str] | None = None, pythonpath: list[Path] = ()
) -> subprocess.CompletedProcess[str]:
    full_env = dict(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO_ROOT), *map(str, pythonpath), os.environ.get("PYTHONPATH")])
    )
    hydra = [name for name in os.environ if name.startswith("HYDRA_")]
    return captured(["-m", "recipes.train", *args], cwd=cwd, env=full_env, unset=hydra, timeout=timeout)


def _summary(stdout: str) -> tuple[dict[str, str], dict[str, float]]:
    """``(fields, metrics)`` parsed from the summary block that recipes.train prints."""
    block = stdout[stdout.index("keel run summary") :]
    fields = dict(re.findall(r"^(run dir|tensorboard|csv|best checkpoint|last checkpoint)\s+(\S+)", block, re.M))
    metrics = {name: float(value) for name, value in re.findall(r"^  (\S+)\s+(-?[0-9.]+(?:e[-+]?\d+)?)$", block, re.M)}
    return fields, metrics


E2E_ARGS = ["trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "trainer.log_every_n_steps=1"]


def test_digits_recipe_end_to_end(tmp_path: Path) -> None:
    proc = _run(["trainer.max_steps=5", *E2E_ARGS, f"output_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fields, metrics = _summary(proc.stdout)
    assert metrics["train/loss"] == pytest.approx(PINNED_TRAIN_LOSS, abs=SHOWN), proc.stdout
    assert metrics["val/loss"] == pytest.approx(PINNED_VAL_LOSS, abs=SHOWN), proc.stdout
    assert {"val/acc", "test/acc", "test/loss"} <= set(metrics)
    run_dir = tmp_path / "digits" / "version_0"
    assert Path(fields["run dir"]) == run_dir
    assert Path(fields["tensorboard"]) == run_dir
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir))
    for key in ("best checkpoint", "last checkpoint"):  # committed save folders
        ckpt = Path(fields[key])
        assert (ckpt / "keel.json").is_file() and ckpt.parent == run_dir / "checkpoints", fields
    config = (run_dir / "config.yaml").read_text()
    assert config.startswith("# python -m recipes.train trainer.max_steps=5")
    import torch

    saved = torch.load(Path(fields["last checkpoint"]) / "keel.pt", weights_only=True)[K_CONFIG]
    assert saved["trainer"]["max_steps"] == 5 and saved["task"]["_target_"] == "recipes.digits.DigitsCNN"
    assert OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")) == saved
    # Hydra wrote nothing of its own and stayed in the launch directory.
    assert sorted(os.listdir(tmp_path)) == ["digits"]


def test_digits_recipe_resumes_exactly_after_a_crash_and_reports_the_changed_config(tmp_path: Path) -> None:
    """A run SIGKILLed after step 4 (last checkpoint: step 3), run again with the same run dir and a
    slightly different command line, ends as a 5-step run in one go; the differences are listed."""
    # Saves every 3 steps; no metric to monitor before the first validation (at the end of the run).
    checkpoints = [
        "callbacks.checkpoint.every_n_train_steps=3",
        "callbacks.checkpoint.monitor=null",
        "callbacks.checkpoint.filename='{epoch}-{step}'",
    ]
    common = [
        *E2E_ARGS,
        *checkpoints,
        "trainer.max_steps=5",
        "logger.version=0",
        "test=false",
        f"output_dir={tmp_path}",
    ]
    first = _run(
        [*common, "+callbacks.killer._target_=recipe_faults.KillAtStep"],
        cwd=tmp_path,
        env={"KEEL_TEST_KILL_AT_STEP": "4"},
        pythonpath=[HARNESS_DIR],
    )
    assert first.returncode == -9, first.stdout + first.stderr
    second = _run([*common, "callbacks.progress.refresh_rate=7"], cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Resumed at global step 3" in second.stderr
    warning = second.stderr[second.stderr.index("config differs") :]
    assert "callbacks.killer._target_: 'recipe_faults.KillAtStep' -> '<absent>'" in warning
    assert "callbacks.progress.refresh_rate: 5 -> 7" in warning
    fields, metrics = _summary(second.stdout)
    run_dir = tmp_path / "digits" / "version_0"
    assert Path(fields["run dir"]) == run_dir and os.listdir(tmp_path / "digits") == ["version_0"]
    assert metrics["train/loss"] == pytest.approx(PINNED_TRAIN_LOSS, abs=SHOWN), second.stdout
    assert metrics["val/loss"] == pytest.approx(PINNED_VAL_LOSS, abs=SHOWN), second.stdout
    # config.yaml is the resumed run's; the first run's is kept next to it.
    assert "refresh_rate: 7" in (run_dir / "config.yaml").read_text()
    assert "recipe_faults.KillAtStep" in (run_dir / "config.1.yaml").read_text()


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.max_epoch=3", ["'trainer.max_epoch'", "Did you mean trainer.max_epochs?", "Valid trainer options"]),
        ("trainer.max_epochs=abc", ["trainer.max_epochs", "'abc'", "takes int or null"]),
    ],
    ids=["typo", "wrong-type"],
)
def test_bad_option_fails_naming_the_key(override: str, expected: list[str], tmp_path: Path) -> None:
    proc = _run([override, f"output_dir={tmp_path}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert all(text in proc.stderr for text in expected), proc.stderr
    assert "Traceback" not in proc.stderr
    assert os.listdir(tmp_path) == []  # refused before anything was created


def test_multirun_sweep_makes_one_run_per_value(tmp_path: Path) -> None:
    proc = _run(
        [
            "-m",
            "trainer.precision=32,bf16-mixed",
            "trainer.max_steps=2",
            "trainer.limit_val_batches=1",
            "trainer.num_sanity_val_steps=0",
            "test=false",
            "logger=csv",
            f"output_dir={tmp_path}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("keel run summary") == 2
    root = tmp_path / "digits"
    assert sorted(p.name for p in root.glob("version_*")) == ["version_0", "version_1"]
    precisions = [OmegaConf.load(root / f"version_{i}" / "config.yaml").trainer.precision for i in (0, 1)]
    assert precisions == ["32", "bf16-mixed"]
    assert all((root / f"version_{i}" / "metrics.csv").is_file() for i in (0, 1))
    # The sweep ends with a table of its runs: what differs between them and their final metrics.
    table = proc.stdout[proc.stdout.index("keel sweep: 2 runs") :].splitlines()
    assert table[1] == "| run | overrides | run dir | val/acc | val/loss |", table  # 2 steps: no train/loss logged
    for i, precision in enumerate(("32", "bf16-mixed")):
        assert table[3 + i].startswith(f"| {i} | trainer.precision={precision} | {root / f'version_{i}'} | "), table
    # Each run's config.yaml records a command that, run as written, continues that run (not the newest one).
    first = (root / "version_0" / "config.yaml").read_text().splitlines()[0]
    assert first.startswith("# python -m recipes.train ") and first.endswith(" logger.version=0"), first
    again = _run(shlex.split(first[2:])[3:], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"Resumed at global step 2, epoch 0, from {root / 'version_0' / 'checkpoints'}" in again.stderr, again.stderr
    assert "config differs" not in again.stderr and not (root / "version_0" / "config.1.yaml").exists()
    assert "Nothing left to train: the run already reached max_steps=2 at step 2." in again.stderr
    assert sorted(p.name for p in root.glob("version_*")) == ["version_0", "version_1"]


def _charlm_corpus(folder: Path) -> Path:
    """A few deterministic Python-like files, so the pinned losses do not depend on the stdlib's version."""
    folder.mkdir()
    lines = [f"def f_{i}(x, y={i % 7}):\n    return x * {i} + y  # {i % 13}\n\n" for i in range(3000)]
    for k in range(6):
        (folder / f"m{k}.py").write_text("".join(lines[k * 500 : (k + 1) * 500]))
    return folder


def test_charlm_recipe_end_to_end(tmp_path: Path) -> None:
    corpus = _charlm_corpus(tmp_path / "corpus")
    proc = _run(
        [
            "+experiment=charlm",
            f"data.root={corpus}",
            "data.max_chars=60000",
            "data.block_size=32",
            "data.batch_size=8",
            "task.n_layer=1",
            "task.n_embd=32",
            "task.lr=0.01",
            "task.sample_chars=20",
            "trainer.max_steps=4",
            *E2E_ARGS,
            "~callbacks.accumulation.scheduling",
            "+callbacks.accumulation.scheduling={step:{0:1,2:2}}",
            f"output_dir={tmp_path / 'out'}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fields, metrics = _summary(proc.stdout)
    assert metrics["train/loss"] == pytest.approx(PINNED_CHARLM_TRAIN_LOSS, abs=CHARLM_TOLERANCE), proc.stdout
    assert metrics["val/loss"] == pytest.approx(PINNED_CHARLM_VAL_LOSS, abs=CHARLM_TOLERANCE), proc.stdout
    assert {"test/loss", "test/bpc", "throughput/items_per_sec", "lr-AdamW/pg1", "lr-AdamW/pg2"} <= set(metrics)
    run_dir = tmp_path / "out" / "charlm" / "version_0"
    assert Path(fields["run dir"]) == run_dir
    assert Path(fields["best checkpoint"]).parent == run_dir / "checkpoints"
    assert "val_loss=" in Path(fields["best checkpoint"]).name
    assert "charlm sample after 4 steps" in proc.stderr


def test_charlm_streaming_recipe_trains_from_shards(tmp_path: Path) -> None:
    """data=charlm_stream: the training split written once into shards and streamed through Hugging Face
    datasets; keel adapts the stream (its position is in the checkpoint) and the run trains, validates and tests."""
    pytest.importorskip("datasets")
    pytest.importorskip("torchdata")
    corpus = _charlm_corpus(tmp_path / "corpus")
    args = [
        "+experiment=charlm",
        "data=charlm_stream",
        f"data.root={corpus}",
        "data.max_chars=60000",
        "data.block_size=32",
        "data.batch_size=8",
        "data.num_shards=4",
        "task.n_layer=1",
        "task.n_embd=32",
        "task.sample_chars=20",
        "trainer.max_steps=4",
        *E2E_ARGS,
        f"output_dir={tmp_path / 'out'}",
    ]
    proc = _run(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shards = sorted((tmp_path / "out" / "charlm_shards").glob("part-*.jsonl"))
    assert len(shards) == 4 and len({len(p.read_text().splitlines()) for p in shards}) == 1  # equal shards
    _, metrics = _summary(proc.stdout)
    assert {"train/loss", "val/loss", "test/loss"} <= set(metrics)
    best = next((tmp_path / "out" / "charlm" / "version_0" / "checkpoints").glob("*.ckpt"))
    saved = torch.load(best / "keel.pt", weights_only=True)["stream_positions"]
    assert saved[0]["kind"] == "huggingface" and saved[0]["state"] is not None  # a mid-epoch position


# ---------------------------------------------------------------------------------------------- user task
def test_docs_user_task_example_runs_with_its_callback(tmp_path: Path) -> None:
    """docs/configuration.md "Your own task": its files, written to a fresh folder, run by its command line."""
    example = _docs_section("configuration.md", "Your own task")
    files = re.findall(r"^File `([^`]+)`:\n\n```\w*\n(.*?)```", example, re.M | re.S)
    assert {"mypkg/regression.py", "myconf/experiment/regression.yaml"} <= {name for name, _ in files}
    assert "File `mypkg/__init__.py`: empty." in example
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    for name, content in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    command = next(line for line in example.splitlines() if "python -m recipes.train" in line and "#" not in line)
    words = shlex.split(command.replace("$PWD", str(tmp_path)))
    assert words[0] == f"PYTHONPATH={tmp_path}" and words[1:4] == COMMAND, command
    proc = _run(words[4:], cwd=tmp_path, pythonpath=[tmp_path])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "outputs" / "regression" / "version_0"
    assert (run_dir / "steps.txt").read_text() == "24\n"  # the custom callback ran: 3 epochs x 8 steps
    fields, metrics = _summary(proc.stdout)
    assert Path(fields["run dir"]) == run_dir and metrics["val/loss"] < 0.5, proc.stdout
    assert "mypkg.regression.WriteStepCount" in (run_dir / "config.yaml").read_text()
