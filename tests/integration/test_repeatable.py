"""Repeatable by default: two runs of README's example end bit-identical on CPU, with the task built before or
after the Trainer; a task whose weights were drawn before any seed is named, with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import REPO_ROOT, python

FIT = 'trainer.fit(Classifier(), train_dataloaders=train, val_dataloaders=val, ckpt_path="last")'


def readme_example() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    return text.split("## Example", 1)[1].split("```python", 1)[1].split("```", 1)[0]


def variant(tmp_path: Path, name: str, *, task_first: bool, seeded: bool = True) -> Path:
    """README's example as a file, one epoch, saving the final weights; the task built where asked."""
    code = readme_example()
    assert FIT in code and "seed_everything(0)" in code
    trainer_line = next(line for line in code.splitlines() if "trainer = Trainer(" in line)
    quiet = trainer_line.replace("max_epochs=3", "max_epochs=1, enable_progress_bar=False, logger=False")
    code = code.replace(trainer_line, quiet)
    fit = "trainer.fit(task, train_dataloaders=train, val_dataloaders=val)\n    torch.save(task.state_dict(), OUT)"
    if task_first:
        code = code.replace(quiet, "    task = Classifier()\n" + quiet).replace(FIT, fit)
    else:
        code = code.replace(FIT, "task = Classifier()\n    " + fit)
    if not seeded:
        code = code.replace("    seed_everything(0)", "    pass  # no seed_everything")
    script = tmp_path / f"{name}.py"
    script.write_text(code.replace('if __name__ == "__main__":', f"OUT = {str(tmp_path / name)!r}\n\nif True:"))
    return script


@pytest.mark.parametrize("task_first", [False, True], ids=["task after the Trainer", "task before the Trainer"])
def test_two_runs_of_the_readme_example_end_bit_identical(tmp_path: Path, task_first: bool) -> None:
    script = variant(tmp_path, "run", task_first=task_first)
    ends = []
    for run in ("a", "b"):
        python(script, timeout=120, cwd=tmp_path).check()
        ends.append(torch.load(tmp_path / "run", weights_only=True))
        (tmp_path / "run").rename(tmp_path / run)
    for key, value in ends[0].items():
        assert torch.equal(value, ends[1][key]), key


def test_a_task_drawn_before_any_seed_is_named_with_the_fix(tmp_path: Path) -> None:
    script = variant(tmp_path, "unseeded", task_first=True, seeded=False)
    result = python(script, timeout=120, cwd=tmp_path).check()
    assert "Classifier's weights were drawn before any seed was set" in result.stdout
    assert "Build the task after Trainer(...), or call seed_everything(0) first." in result.stdout
    after = variant(tmp_path, "after", task_first=False, seeded=False)
    assert "drawn before any seed" not in python(after, timeout=120, cwd=tmp_path).check().stdout
