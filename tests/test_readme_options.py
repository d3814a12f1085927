"""README's option reference against the code: every ``TrainerOptions`` field has a row in "Trainer
options", and the config-type table of "Configuration and recipes" is the one the schema generates."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from recipes.trainer_schema import options_table
from trainer.options import TrainerOptions

README = Path(__file__).resolve().parent.parent / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_every_trainer_option_has_a_row_in_the_options_table() -> None:
    rows = [line for line in _section("Trainer options").splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    missing = [f.name for f in dataclasses.fields(TrainerOptions) if f.name not in documented]
    assert not missing, f"README 'Trainer options' has no row for {missing}"
    unknown = sorted(documented - {f.name for f in dataclasses.fields(TrainerOptions)})
    assert not unknown, f"README 'Trainer options' documents options that do not exist: {unknown}"


def test_config_type_table_is_the_generated_one() -> None:
    section = _section("Configuration and recipes")
    match = re.search(r"<!-- trainer-config-types:begin -->\n(.*?)\n<!-- trainer-config-types:end -->", section, re.S)
    assert match, "README 'Configuration and recipes' lost its trainer-config-types table markers"
    assert match.group(1) == options_table(), (
        "README's config-type table is stale; replace it with recipes.trainer_schema.options_table():\n"
        + options_table()
    )


def test_configuration_section_comes_right_before_launching() -> None:
    titles = re.findall(r"^## (.+)$", README.read_text(), re.M)
    assert titles[titles.index("Configuration and recipes") + 1] == "Launching"
