"""Structural rules from docs/design.md section 1: import direction, torch.distributed only in dist.py, parallel.py
and the checkpoint modules, the loop blind to the wrapper, file sizes, no import circle through the modules
split out of trainer.py, and a cheap `import trainer`."""

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


def test_torch_distributed_only_in_dist_parallel_and_checkpoint_modules() -> None:
    for package in ("trainer", "callbacks"):
        for path in (ROOT / package).rglob("*.py"):
            if path.parent in (ROOT / "trainer" / "distributed", ROOT / "trainer" / "checkpoint"):
                continue
            bad = {m for m in imported_modules(path) if m.startswith("torch.distributed")}
            assert not bad and "torch.distributed." not in path.read_text(), path


def test_import_trainer_is_cheap() -> None:
    code = (
        "import sys, trainer; "
        "print(sorted(m for m in ('tensorboard', 'hydra', 'tqdm', 'omegaconf') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True
    )
    # torch itself imports tqdm lazily in some builds; tensorboard and hydra must never load at import.
    loaded = eval(out.stdout.strip())
    assert "tensorboard" not in loaded and "hydra" not in loaded, loaded


def test_the_loop_never_names_a_wrapper() -> None:
    """trainer.py talks to trainer/parallel.py's Strategy; which wrapper runs is not its business."""
    text = (ROOT / "trainer" / "trainer.py").read_text()
    for name in ("DistributedDataParallel", "no_sync", "fully_shard", "FSDP", "set_requires_gradient_sync", "DTensor"):
        assert name not in text, f"trainer/trainer.py names {name}: move it behind trainer/parallel.py's Strategy"


def test_file_sizes() -> None:
    """The fit loop and the step in one file of at most 650 lines; no library file over 700."""
    assert len((ROOT / "trainer" / "trainer.py").read_text().splitlines()) <= 650
    for package in ("trainer", "callbacks"):
        for path in (ROOT / package).rglob("*.py"):
            lines = len(path.read_text().splitlines())
            assert lines <= 700, f"{path.relative_to(ROOT)} has {lines} lines; split it by responsibility"


def _import_graph() -> dict[str, set[str]]:
    """trainer's modules -> the trainer modules they import: top level, in functions and under TYPE_CHECKING."""
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): p
        for p in (ROOT / "trainer").rglob("*.py")
        if p.stem != "__init__"
    }
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for nxt in graph[node]:
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_modules_split_out_of_the_trainer_open_no_import_circle() -> None:
    """What trainer.py hands off takes its inputs as arguments: none of these modules imports the Trainer,
    directly or through another module (type-checking imports count too)."""
    graph = _import_graph()
    for name in (
        "trainer.distributed.strategy",
        "trainer.evaluation",
        "trainer.lifecycle",
        "trainer.distributed.launcher",
        "trainer.step.optim",
        "trainer.distributed.comm",
        "trainer.data.loaders",
        "trainer.step.accumulation",
    ):
        assert not _reaches(graph, name, "trainer.trainer"), f"{name} reaches trainer.trainer through its imports"
        assert not _reaches(graph, name, name), f"{name} is part of an import circle"
