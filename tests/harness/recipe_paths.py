"""The checkout, the recipe's command and the sections of a docs page, for the recipe tests in one process
(tests/unit/test_recipe_config.py) and launched (tests/integration/test_recipes.py)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

COMMAND = ["python", "-m", "recipes.train"]


def _docs_section(page: str, title: str) -> str:
    text = (REPO_ROOT / "docs" / page).read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]
