"""MkDocs hook: docstrings made into user documentation in the API pages.

keel's docstrings serve two readers. Maintainers read them in the code, where a note such as
``(trainer/data/global_batch.py)`` or ``(docs/design.md section 4)`` says where the rest lives; users read them on
the API pages, where a source path means nothing. On every page under ``api/`` this hook:

- renders Sphinx cross-reference roles (``:class:`~trainer.TaskModule```, which Markdown turns into
  ``:class:<code>~trainer.TaskModule</code>``) as plain code, keeping the last dotted component for ``~`` as Sphinx
  does;
- turns a reference to a documentation page (``docs/storage.md``, ``docs/design.md section 7``) into a link to
  that page;
- drops references to source files (``trainer/...py``, ``tests/...py``): a parenthesis holding only such
  references goes whole, a ``see ...`` clause inside one goes alone.

Registered under ``hooks:`` in mkdocs.yml; tests/unit/test_docs.py checks the built API pages for source paths.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|exc|data|obj|const):<code>(~?)([^<]*)</code>")
# A path into the code or the tests, as docstrings write it (optionally ``:name`` after it).
SOURCE = r"(?:trainer|callbacks|recipes|tests|benchmarks|conf)/[\w./-]*\.(?:py|yaml|sh)(?::[\w.]+)?"
_SOURCE = re.compile(SOURCE)
# A documentation page, optionally with the section(s) the docstring points at.
_DOC_PAGE = re.compile(r"docs/([\w/-]+)\.md((?: sections?)? \d+(?:(?:, | and )\d+)*)?")
_PAREN = re.compile(r" ?\(([^()]*)\)")
_SEE_SOURCE = re.compile(
    rf"(?:[;,] )?(?:see |in |read )?(?:<code>)?{SOURCE}(?:</code>)?(?: and (?:<code>)?{SOURCE}(?:</code>)?)*"
)


def strip_roles(html: str) -> str:
    """``html`` with every ``:role:<code>target</code>`` replaced by ``<code>target</code>``."""

    def plain(match: re.Match[str]) -> str:
        tilde, target = match.groups()
        return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"

    return _ROLE.sub(plain, html)


def drop_source_paths(html: str) -> str:
    """``html`` without references to source files: a parenthesis holding nothing else goes whole (with the
    space before it); a reference inside a longer parenthesis goes with its ``see``/``;``."""

    def paren(match: re.Match[str]) -> str:
        inner = match.group(1)
        if not _SOURCE.search(inner):
            return match.group(0)
        rest = _SEE_SOURCE.sub("", inner).strip(" ;,")
        if not rest or rest in ("see", "and"):
            return ""
        return f"{match.group(0)[: match.group(0).index('(')]}({rest})"

    return _SEE_SOURCE.sub("", _PAREN.sub(paren, html)) if _SOURCE.search(html) else html


def link_doc_pages(html: str, depth: int) -> str:
    """``docs/X.md`` (and ``docs/X.md section N``) as a link to that page, from a page ``depth`` folders deep."""
    up = "../" * depth

    def link(match: re.Match[str]) -> str:
        page, sections = match.group(1), match.group(2) or ""
        name = page.replace("-", " ").replace("/", " ")
        return f'<a href="{up}{page}/">{name[:1].upper()}{name[1:]}</a>{"," + sections if sections else ""}'

    return _DOC_PAGE.sub(link, html)


def on_page_content(html: str, page: Any = None, **kwargs: Any) -> str:
    """MkDocs event: runs on every page's HTML after it is converted from Markdown."""
    html = strip_roles(html)
    src = getattr(getattr(page, "file", None), "src_uri", "")
    if not src.startswith("api/"):
        return html
    depth = page.url.rstrip("/").count("/") + 1 if page.url else 1
    return link_doc_pages(drop_source_paths(html), depth)
