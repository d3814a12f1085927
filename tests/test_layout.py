"""Structural rules from DESIGN.md section 1: import direction, torch.distributed only in dist.py,
and a cheap `import trainer`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"trainer": {"callbacks", "recipes"}, "callbacks": {"recipes"}}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_imports_point_recipes_to_callbacks_to_trainer() -> None:
    for package, forbidden in FORBIDDEN.items():
        for path in (ROOT / package).rglob("*.py"):
            bad = {m for m in imported_modules(path) if m.split(".")[0] in forbidden}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_torch_distributed_only_in_dist_module() -> None:
    for package in ("trainer", "callbacks"):
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "trainer" / "dist.py":
                continue
            bad = {m for m in imported_modules(path) if m.startswith("torch.distributed")}
            assert not bad and "torch.distributed." not in path.read_text(), path


def test_import_trainer_is_cheap() -> None:
    code = "import sys, trainer; print(sorted(m for m in ('tensorboard', 'hydra', 'tqdm', 'omegaconf') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True)
    # torch itself imports tqdm lazily in some builds; tensorboard and hydra must never load at import.
    loaded = eval(out.stdout.strip())
    assert "tensorboard" not in loaded and "hydra" not in loaded, loaded
