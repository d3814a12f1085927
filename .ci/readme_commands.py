"""Print the commands of README.md's Development block, one a line: what `.ci/run` runs, in order.

CI runs README's own commands rather than a copy of them, so the two cannot drift apart; tests/unit/test_docs.py
checks that the block still holds the Quickstart's test command.
"""

from __future__ import annotations

import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def development_commands(text: str) -> list[str]:
    """The non-empty lines of the first ```bash block after the "## Development" heading, comments kept (bash
    reads them as comments)."""
    section = text.split("\n## Development\n", 1)
    if len(section) != 2 or "```bash\n" not in section[1]:
        raise SystemExit("README.md: no ```bash block under '## Development' (what .ci/run runs)")
    block = section[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


if __name__ == "__main__":
    sys.stdout.write("".join(line + "\n" for line in development_commands(README.read_text())))
