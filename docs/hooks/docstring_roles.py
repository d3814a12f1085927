"""MkDocs hook: Sphinx cross-reference roles in docstrings, rendered as plain code in the API pages.

keel's docstrings are Google style (what mkdocstrings parses) but name objects with Sphinx roles,
``:class:`~trainer.TaskModule```. Markdown renders the role's text and the code span apart
(``:class:<code>~trainer.TaskModule</code>``); this hook drops the role and, as Sphinx does for ``~``, keeps
the last dotted component only. Registered under ``hooks:`` in mkdocs.yml.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|exc|data|obj|const):<code>(~?)([^<]*)</code>")


def strip_roles(html: str) -> str:
    """``html`` with every ``:role:<code>target</code>`` replaced by ``<code>target</code>``."""

    def plain(match: re.Match[str]) -> str:
        tilde, target = match.groups()
        return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"

    return _ROLE.sub(plain, html)


def on_page_content(html: str, **kwargs: Any) -> str:
    """MkDocs event: runs on every page's HTML after it is converted from Markdown."""
    return strip_roles(html)
