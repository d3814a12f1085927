"""MkDocs hook: the generated tables of the documentation, so that they cannot drift from the code.

Registered under ``hooks:`` in mkdocs.yml. A page holding one of the markers below gets it replaced when the
site is built:

* ``<!-- trainer-options-table -->`` (docs/options.md): one row per :class:`trainer.options.TrainerOptions`
  field, with its name, type, default and the description from the ``Attributes:`` section of the class
  docstring. A field without a description, or a description of no field, fails the build.
* ``<!-- trainer-config-types -->`` (docs/configuration.md): ``recipes.trainer_schema.options_table()``, the
  config type of every ``trainer.<key>``.

tests/unit/test_docs.py imports this file and checks the same functions without building the site.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OPTIONS_MARKER = "<!-- trainer-options-table -->"
CONFIG_TYPES_MARKER = "<!-- trainer-config-types -->"
_ENTRY = re.compile(r"^    (\w+): (.*)$")
_CONTINUATION = re.compile(r"^ {8,}(\S.*)$")
_CODE_SPAN = re.compile(r"(``.+?``|`[^`]+`)")


def _import_root() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def _trainer_options() -> Any:
    _import_root()
    from trainer.options import TrainerOptions

    return TrainerOptions


def parse_attributes(docstring: str) -> dict[str, str]:
    """The ``Attributes:`` section of a Google-style docstring: ``{name: description}``, in order.

    Entries are ``name: text`` indented by 4 spaces under the header; lines indented by 8 or more continue the
    entry before them. The section ends at the first line that is neither (a blank line, the next section).
    """
    lines = inspect.cleandoc(docstring).splitlines()
    try:
        start = lines.index("Attributes:") + 1
    except ValueError:
        return {}
    entries: dict[str, str] = {}
    name = None
    for line in lines[start:]:
        entry, continuation = _ENTRY.match(line), _CONTINUATION.match(line)
        if entry:
            name = entry.group(1)
            if name in entries:
                raise ValueError(f"Attributes: {name!r} is described twice")
            entries[name] = entry.group(2).strip()
        elif continuation and name is not None:
            entries[name] += " " + continuation.group(1).strip()
        else:
            break
    return entries


def option_descriptions() -> dict[str, str]:
    """Every TrainerOptions field with its description; raises ``ValueError`` naming what is missing or extra."""
    options = _trainer_options()
    described = parse_attributes(options.__doc__ or "")
    fields = [f.name for f in dataclasses.fields(options)]
    missing = [name for name in fields if name not in described]
    unknown = [name for name in described if name not in fields]
    if missing or unknown:
        raise ValueError(
            "trainer/options.py: the TrainerOptions docstring's Attributes section must describe every field "
            f"exactly once; missing: {missing}, not a field: {unknown}"
        )
    return {name: described[name] for name in fields}


def _cell(text: str) -> str:
    """``text`` safe in a Markdown table cell: pipes outside code spans escaped."""
    parts = _CODE_SPAN.split(text)
    return "".join(part if i % 2 else part.replace("|", "\\|") for i, part in enumerate(parts))


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:  # pragma: no cover - every option has a default
        return "(required)"
    return f"`{value!r}`"


def options_table() -> str:
    """The Markdown table of every Trainer option: name, type, default, description."""
    options = _trainer_options()
    descriptions = option_descriptions()
    rows = ["| option | type | default | description |", "|---|---|---|---|"]
    for field in dataclasses.fields(options):
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        rows.append(
            f'| <span id="{field.name}"></span>`{field.name}` | `{kind}` | {_default(field)} | '
            f"{_cell(descriptions[field.name])} |"
        )
    return "\n".join(rows)


def config_types_table() -> str:
    """``recipes.trainer_schema.options_table()``: the config type of every ``trainer.<key>``."""
    _import_root()
    from recipes.trainer_schema import options_table as config_table

    return config_table()


def render(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generated table."""
    if OPTIONS_MARKER in markdown:
        markdown = markdown.replace(OPTIONS_MARKER, options_table())
    if CONFIG_TYPES_MARKER in markdown:
        markdown = markdown.replace(CONFIG_TYPES_MARKER, config_types_table())
    return markdown


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs event: runs on every page's Markdown before it is converted."""
    return render(markdown)
