"""The documentation against the code, without building the site (CI runs ``mkdocs build --strict`` apart).

- every ``TrainerOptions`` field has a description in the code (the ``Attributes:`` section of its docstring),
  and the options table that docs/hooks/options_page.py generates for docs/options.md lists every field;
- the config-type table of docs/configuration.md is ``recipes.trainer_schema.options_table()``;
- README.md stays short and keeps the two quickstart commands verbatim (CI runs the second);
- every page under docs/ is in mkdocs.yml's nav, and every nav entry exists;
- neither README nor the docs cite a file outside the repository.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from recipes.trainer_schema import options_table as config_types_table
from trainer.options import TrainerOptions

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"
SETUP_CFG = ROOT / "setup.cfg"
HOOK = DOCS / "hooks" / "options_page.py"
MAX_README_LINES = 250
QUICKSTART = (
    'pip install -c requirements/cpu.txt ".[recipes]" && python -m recipes.train',
    "pip install --no-deps -r requirements/dev.txt -e . && python -m pytest -q",
)
FIELDS = [f.name for f in dataclasses.fields(TrainerOptions)]


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("keel_docs_options_page", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_trainer_option_is_described_in_the_code() -> None:
    descriptions = _hook().option_descriptions()  # raises naming the missing or unknown entries
    assert list(descriptions) == FIELDS
    empty = [name for name, text in descriptions.items() if len(text) < 10]
    assert not empty, f"TrainerOptions docstring: descriptions too short to say anything: {empty}"


def test_attributes_parser_rejects_a_missing_or_unknown_entry() -> None:
    hook = _hook()
    doc = "Summary.\n\n    Attributes:\n        a: first\n            continued.\n        b: second\n"
    assert hook.parse_attributes(doc) == {"a": "first continued.", "b": "second"}
    assert hook.parse_attributes("No attributes section.") == {}


def test_generated_options_table_lists_every_field_once() -> None:
    table = _hook().options_table()
    rows = [line for line in table.splitlines()[2:] if line.startswith("| ")]
    names = [match.group(1) for row in rows if (match := re.search(r"`(\w+)`", row.split(" | ")[0]))]
    assert len(names) == len(rows), rows
    assert names == FIELDS
    descriptions = _hook().option_descriptions()
    for field, row in zip(dataclasses.fields(TrainerOptions), rows):
        assert row.startswith(f'| <span id="{field.name}"></span>`{field.name}` | `'), row
        assert row.endswith(" |") and descriptions[field.name].split("``")[0] in row, row


def test_options_page_holds_the_generated_table() -> None:
    hook = _hook()
    page = (DOCS / "options.md").read_text()
    assert hook.OPTIONS_MARKER in page, "docs/options.md lost its trainer-options-table marker"
    rendered = hook.render(page)
    assert hook.OPTIONS_MARKER not in rendered and hook.options_table() in rendered


def test_config_type_table_is_the_generated_one() -> None:
    hook = _hook()
    page = (DOCS / "configuration.md").read_text()
    assert hook.CONFIG_TYPES_MARKER in page, "docs/configuration.md lost its trainer-config-types marker"
    assert config_types_table() in hook.render(page)


def test_readme_is_short_and_keeps_the_quickstart_commands() -> None:
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/"
    for command in QUICKSTART:
        assert command in text.splitlines(), f"README.md lost the quickstart command {command!r}"
    flat = " ".join(text.split())
    assert "**With a GPU**, install the torch build for your platform first" in flat, "README lost the GPU advice"


def test_ci_runs_readme_development_commands_and_they_hold_the_quickstart_test_command() -> None:
    spec = importlib.util.spec_from_file_location("keel_ci_readme_commands", ROOT / ".ci" / "readme_commands.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    commands = [line.split("  #")[0].strip() for line in module.development_commands(README.read_text())]
    install, test = QUICKSTART[1].split(" && ")
    assert install in commands and test in commands, f"README's Development block lost {QUICKSTART[1]!r}: {commands}"
    assert commands.index(install) == 0 and commands[-1] == test, commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python .ci/readme_commands.py" in ci, ".ci/run no longer runs README's Development commands"
    # Nothing besides README's commands installs or tests: an `uninstall` or another pip line in .ci/run is drift.
    own = [line.strip() for line in ci.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in own if "uninstall" in line or "pytest" in line or "pip install -c" in line]


def test_readme_has_no_dated_measurements() -> None:
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", README.read_text())
    assert not dates, f"README.md holds dated measurements {dates}: they belong in benchmarks/results/"


def _nav_pages(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def test_every_docs_page_is_in_the_nav() -> None:
    config = yaml.safe_load(MKDOCS_YML.read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "hooks" not in p.parts)
    missing = [page for page in pages if page not in nav]
    assert not missing, f"docs pages missing from mkdocs.yml's nav: {missing}"
    absent = [page for page in nav if not (DOCS / page).is_file() and page != "design.md"]
    assert not absent, f"mkdocs.yml's nav names pages that do not exist: {absent}"
    assert len(nav) == len(set(nav)), "a page is listed twice in mkdocs.yml's nav"
    assert "design.md" in nav
    assert "docs/hooks/options_page.py" in config["hooks"]


def test_no_reference_outside_the_repository() -> None:
    """No tracked file cites a design note or a path outside the checkout (the project stands on its own)."""
    needles = ("DESIGN" + ".md", "../" + "shared", "/" + "work/")  # spelled in parts so this file passes itself
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True, timeout=60)
    for name in tracked.stdout.splitlines():
        path = ROOT / name
        if (
            path.suffix not in {".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".sh", ".txt", ".in"}
            or not path.is_file()
        ):
            continue
        text = path.read_text()
        for needle in needles:
            assert needle not in text, f"{name} cites {needle!r}, outside the repository"


def test_the_home_page_links_every_page_and_every_extra_and_getting_started_first() -> None:
    index = (DOCS / "index.md").read_text()
    nav = _nav_pages(yaml.safe_load(MKDOCS_YML.read_text())["nav"])
    linked = set(re.findall(r"\]\(([\w/-]+\.md)(?:#[\w-]+)?\)", index))
    assert not [page for page in nav if page != "index.md" and page not in linked], "pages the home page leaves out"
    first_link = re.search(r"\]\(([\w/-]+\.md)", index)
    assert first_link is not None and first_link.group(1) == "getting-started.md"
    extras = re.findall(
        r"^(\w+) =$", SETUP_CFG.read_text().split("[options.extras_require]", 1)[1].split("\n[", 1)[0], re.M
    )
    assert extras and [extra for extra in extras if f"`.[{extra}]`" not in index] == []


def test_getting_started_runs_readme_example() -> None:
    """The page's task is README's example, word for word: the tests that run one (tests/integration/
    test_getting_started.py, test_repeatable.py) cover both."""
    page = (DOCS / "getting-started.md").read_text().split("```python", 1)[1].split("```", 1)[0]
    readme = README.read_text().split("## Example", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    assert page == readme
