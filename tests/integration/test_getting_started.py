"""docs/getting-started.md, run as a new user would: its script on one process, again (resume), with more epochs,
as a fresh run, and under torchrun on 2 processes. Each output line and file the page shows is checked here, and
each fragment checked here is on the page, so the two cannot drift apart."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from launch import REPO_ROOT, captured, torchrun

PAGE = REPO_ROOT / "docs" / "getting-started.md"


def page() -> str:
    return PAGE.read_text()


def script(tmp_path: Path, *, epochs: int = 3, ckpt_path: str = '"last"') -> Path:
    code = page().split("```python", 1)[1].split("```", 1)[0]
    code = code.replace("max_epochs=3", f"max_epochs={epochs}").replace('ckpt_path="last"', f"ckpt_path={ckpt_path}")
    path = tmp_path / "train.py"
    path.write_text(code)
    return path


def run(tmp_path: Path, **variant: object) -> subprocess.CompletedProcess[str]:
    """``python train.py`` in ``tmp_path``, stdout and stderr apart (the page says where the log lines go)."""
    proc = captured([str(script(tmp_path, **variant))], cwd=tmp_path, env={"PYTHONPATH": str(REPO_ROOT)})  # type: ignore[arg-type]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def shown(fragment: str, output: str) -> None:
    """``fragment`` is on the page and in the program's output."""
    assert fragment in page(), f"the page no longer shows {fragment!r}"
    assert fragment in output, f"{fragment!r} not in the output:\n{output}"


# What the first run prints, as the page shows it (numbers that vary by machine left out).
FIRST_RUN = (
    "INFO Trainer options: max_epochs=3, default_root_dir='outputs'",
    "INFO Seed 0 for fit, from seed_everything (PL_GLOBAL_SEED).\n",
    "INFO ckpt_path='last': no checkpoint saved yet; starting from scratch.",
    "INFO Classifier: 1,348 parameters (1,348 trainable), 0.01 MB.",
    "INFO epoch 1 step 50/84 | train/loss=1.375 data_wait=",
    "INFO Time budget of fit: 84 steps in ",
    "============================== keel run summary ==============================",
    "best checkpoint  - (no monitored checkpoint)",
    "trained          84 steps, 3 epochs; ",
    "metrics          as last logged",
    "  train/loss                     1.375",
    "  val/acc                        0.2422",
)
RUN_DIR_FILES = (
    "hparams.yaml",
    "checkpoints/epoch=2-step=84.ckpt",
    "checkpoints/last",
    "efficiency.json",
    "goodput.jsonl",
)


def test_the_page_on_one_process_then_resumed_then_longer_then_fresh(tmp_path: Path) -> None:
    first = run(tmp_path)
    assert first.stdout == ""  # every line is a log line, on standard error
    assert "[rank " not in first.stderr and "INFO trainer." not in first.stderr  # one process: no rank, no module
    assert first.stderr.count("Seed ") == 1
    for fragment in FIRST_RUN:
        shown(fragment, first.stderr)
    run_dir = tmp_path / "outputs" / "keel_logs" / "version_0"
    for kind in ("run dir", "tensorboard"):
        assert f"{kind:<16} {run_dir}\n" in first.stderr
    assert f"last checkpoint  {run_dir}/checkpoints/epoch=2-step=84.ckpt\n" in first.stderr
    assert "loss=" not in first.stderr.replace("train/loss=", "")  # the task shows its loss: no second `loss`
    for name in RUN_DIR_FILES:
        shown(name.split("/")[-1], "\n".join(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")))
    assert any(p.name.startswith("events.out.tfevents") for p in run_dir.iterdir())

    again = run(tmp_path).stderr
    for fragment in (
        "Continuing the run in outputs/keel_logs/version_0 (fit with ckpt_path='last').",
        "Resumed at global step 84, epoch 3, from outputs/keel_logs/version_0/checkpoints/epoch=2-step=84.ckpt.",
        "Nothing left to train: the run already reached max_epochs=3 at step 84. Raise max_epochs to train on, or "
        "pass ckpt_path=None (ckpt_path=null on a Hydra command line) or a new default_root_dir for a fresh run.",
    ):
        shown(fragment, again)

    longer = run(tmp_path, epochs=5).stderr
    assert "Raise `max_epochs` to 5 and it trains epochs 3 and 4 in the same run directory" in page()
    assert "Resumed at global step 84, epoch 3" in longer and "trained          140 steps, 5 epochs" in longer
    assert f"run dir          {run_dir}\n" in longer
    assert len(list(run_dir.glob("events.out.tfevents*"))) == 3  # the loggers continued the run directory

    fresh = run(tmp_path, ckpt_path="None").stderr
    assert "`ckpt_path=None` (the default) always starts a new run directory, `version_1`" in page()
    assert "version_1" in fresh and "Resumed" not in fresh and "trained          84 steps, 3 epochs" in fresh


def test_the_page_under_torchrun_on_two_processes(tmp_path: Path) -> None:
    command = "torchrun --standalone --nproc-per-node 2 train.py"
    assert command in page()
    result = torchrun(script(tmp_path), nproc=2, cwd=tmp_path, timeout=240).check()
    shown("(42 steps for 3 epochs)", page())
    assert "trained          42 steps, 3 epochs" in result.stdout
    assert result.stdout.count("keel run summary") == 1  # rank 0 prints; every rank wrote its part of the save
    save = tmp_path / "outputs" / "keel_logs" / "version_0" / "checkpoints" / "epoch=2-step=42.ckpt"
    assert sorted(p.name for p in save.glob("__*_0.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert re.search(r"Process group: backend=gloo world_size=2", result.stdout)
