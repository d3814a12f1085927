"""Structural rules of the code base (docs/design.md, "Layers"), read from the formatted source.

- imports point recipes -> callbacks -> trainer, never backwards;
- ``torch.distributed`` appears only in ``trainer/distributed/``, ``trainer/checkpoint/`` and the memory planner's
  fake process group (``trainer/memory/``);
- the loop (``trainer/trainer.py``) never names a wrapper;
- ``trainer/`` is at most two levels deep and every folder says in its ``__init__`` docstring what lives there and
  what it may import (sizes are not capped: ruff's complexity rule and the formatter shape the code, pyproject.toml);
- no import cycle at run time, and counted with type-only imports (``TYPE_CHECKING``) only the callback API forms
  one;
- no subpackage reaches the core's ``trainer.py`` at run time, except the memory planner's public face, which
  builds a Trainer to host a task's hooks and so sits above the loop;
- ``import trainer`` stays cheap.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "trainer"
FORBIDDEN = {"trainer": {"callbacks", "recipes"}, "callbacks": {"recipes"}}


def library_files() -> list[Path]:
    return sorted(p for package in ("trainer", "callbacks") for p in (ROOT / package).rglob("*.py"))


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


def test_torch_distributed_only_in_the_distributed_checkpoint_and_memory_packages() -> None:
    allowed = (TRAINER / "distributed", TRAINER / "checkpoint", TRAINER / "memory")
    for path in library_files():
        if path.parent in allowed:
            continue
        bad = {m for m in imported_modules(path) if m.startswith("torch.distributed")}
        assert not bad and "torch.distributed." not in path.read_text(), (
            f"{path.relative_to(ROOT)} uses torch.distributed: go through trainer.distributed.comm"
        )


def test_import_trainer_is_cheap() -> None:
    """``import trainer`` and what a script imports from it up front (the loggers, W&B's and MLflow's included,
    and the progress bar) load none of the integrations: each is imported when first used (docs/design.md
    section 11). Nor DCP (0.6 s, DTensor with it): trainer/checkpoint/dcp_io.py is imported on the first save or
    load. Nor dynamo (1.3 s): looking for a ``torch.compile``'d task (trainer/compat.py) does not import it. The one
    import check of the suite: a fresh interpreter, through tests/harness/launch.py's ``import_check`` (allowed in
    tests/unit/, tests/conftest.py)."""
    from launch import import_check

    integrations = (
        "tensorboard",
        "torch.utils.tensorboard",
        "hydra",
        "omegaconf",
        "wandb",
        "mlflow",
        "torch.distributed.checkpoint",
        "trainer.checkpoint.dcp_io",
        "torch._dynamo",
    )
    code = (
        "import sys, torch, trainer, trainer.loggers, trainer.observability.progress; "
        "from trainer.loggers import CSVLogger, TensorBoardLogger, WandbLogger, MLFlowLogger; "
        "from trainer.compat import unwrap_compiled; unwrap_compiled(torch.nn.Linear(1, 1)); "
        f"print(sorted(m for m in {integrations!r} if m in sys.modules))"
    )
    loaded = ast.literal_eval(import_check(code).stdout.strip())
    # tqdm is not checked: torch itself imports it in some builds.
    assert not loaded, loaded


def test_the_loop_never_names_a_wrapper() -> None:
    """trainer.py talks to trainer.distributed.strategy's Strategy; which wrapper runs is not its business."""
    text = (TRAINER / "trainer.py").read_text()
    for name in ("DistributedDataParallel", "no_sync", "fully_shard", "FSDP", "set_requires_gradient_sync", "DTensor"):
        assert name not in text, f"trainer/trainer.py names {name}: move it behind trainer.distributed.strategy"


def test_packages_are_at_most_two_levels_and_say_what_they_hold() -> None:
    for folder in [TRAINER, *(p for p in TRAINER.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        depth = len(folder.relative_to(TRAINER).parts)
        assert depth <= 1, f"{folder.relative_to(ROOT)} is nested deeper than trainer/<package>/"
        init = folder / "__init__.py"
        assert init.is_file(), f"{folder.relative_to(ROOT)} has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(ROOT)} has no docstring saying what lives there"
        if folder != TRAINER:
            assert "May import" in doc, f"{init.relative_to(ROOT)} does not say what the package may import"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(child) for child in ast.walk(node))
    return inside


def _import_graph(*, run_time_only: bool) -> dict[str, set[str]]:
    """trainer's modules -> the trainer modules they import (top level and in functions)."""
    modules = {_module_name(p): p for p in TRAINER.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree) if run_time_only else set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
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


def _is_package(name: str) -> bool:
    return (ROOT / name.replace(".", "/")).is_dir()


def test_no_import_cycle_at_run_time() -> None:
    """Package ``__init__`` files only name their public API, so they are left out of the cycle search."""
    graph = {
        name: {t for t in targets if not _is_package(t)}
        for name, targets in _import_graph(run_time_only=True).items()
        if not _is_package(name)
    }
    for name in graph:
        assert not _reaches(graph, name, name), f"{name} is part of an import cycle at run time"


# Counted with type-only imports, the one cycle is the callback API: the Trainer (and its attributes), TaskModule
# and Callback name each other, and so do the loops that call hooks with the Trainer (hooks, lifecycle,
# evaluation) and the built-in callbacks. Everything else is typed against what it uses (protocols such as
# trainer.distributed.strategy.ModelHooks, trainer.data.loaders.LoaderSource), or gets the pieces it reads.
CALLBACK_API = {
    "trainer.trainer",
    "trainer.attributes",
    "trainer.module",
    "trainer.callback",
    "trainer.hooks",
    "trainer.lifecycle",
    "trainer.evaluation",
    "trainer.checkpoint.model_checkpoint",
    "trainer.observability.progress",
    "trainer.memory.callback",
}


def test_the_import_cycle_counted_with_type_only_imports_is_the_callback_api() -> None:
    graph = {
        name: {t for t in targets if not _is_package(t)}
        for name, targets in _import_graph(run_time_only=False).items()
        if not _is_package(name)
    }
    cyclic = {name for name in graph if _reaches(graph, name, name)}
    assert cyclic <= CALLBACK_API, f"outside the callback API, on an import cycle: {sorted(cyclic - CALLBACK_API)}"


# The memory planner's public face builds a Trainer (the host of the task's hooks): it sits above the loop, which
# imports only trainer.memory.callback, inside a function, when memory_plan is on (trainer/memory/__init__.py).
ABOVE_THE_LOOP = {"trainer.memory", "trainer.memory.plan", "trainer.memory.__main__"}


def test_subpackages_never_import_the_loop_at_run_time() -> None:
    """What trainer.py hands off takes the Trainer as an argument; subpackages name it only under TYPE_CHECKING."""
    graph = _import_graph(run_time_only=True)
    for name in graph:
        if name not in ABOVE_THE_LOOP and (name.count(".") >= 2 or (name != "trainer" and _is_package(name))):
            assert not _reaches(graph, name, "trainer.trainer"), f"{name} reaches trainer.trainer at run time"


def _declared_imports(package: Path) -> set[str]:
    """The keel modules named in the ``May import:`` paragraph of a package's ``__init__`` docstring."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    paragraph = doc[doc.index("May import") :].split("\n\n")[0]
    return set(re.findall(r":mod:`~?(trainer[\w.]*)`", paragraph))


def test_packages_import_at_run_time_only_what_their_docstring_declares() -> None:
    """Run-time imports of keel modules stay inside what each package says it may import; imports under
    TYPE_CHECKING (the Trainer, the TaskModule as types) are free."""
    graph = _import_graph(run_time_only=True)
    for package in sorted(p for p in TRAINER.iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
        own, allowed = f"trainer.{package.name}", _declared_imports(package)
        for name, targets in graph.items():
            if name != own and not name.startswith(own + "."):
                continue
            for target in sorted(t for t in targets if not _is_package(t)):  # `from pkg import module` names both
                inside = target == own or target.startswith(own + ".")
                declared = any(target == a or target.startswith(a + ".") for a in allowed)
                assert inside or declared, (
                    f"{name} imports {target} at run time, which trainer/{package.name}/__init__.py does not list "
                    "under 'May import'"
                )
