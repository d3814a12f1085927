"""The documentation site as built (``mkdocs build --strict``, what CI runs): the home page links every page, no
page shows a table's rows as a paragraph of text, and the API reference shows user documentation only (no source
paths, no maintainer notes, no private base classes)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from launch import REPO_ROOT

pytest.importorskip("mkdocs", reason="the docs extra is not installed")

SOURCE_PATH = re.compile(r"\b(?:trainer|callbacks|recipes|tests|benchmarks)/[\w/]+\.py\b")


def _nav(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav(value)]
    return []


def _text(page: Path) -> str:
    """The words of a built page's article, tags dropped."""
    body = page.read_text()
    body = body[body.find("<article") : body.find("</article>")]
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body)))


def test_the_built_site_links_every_page_from_home_and_its_api_pages_are_for_users(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr

    home = (site / "index.html").read_text()
    home_article = home[home.find("<article") : home.find("</article>")]
    hrefs = set(re.findall(r'href="([^"#]*)', home_article))
    pages = [p for p in _nav(yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())["nav"]) if p != "index.md"]
    missing = [page for page in pages if page.removesuffix(".md") + "/" not in hrefs]
    assert not missing, f"the built home page does not link {missing}"
    assert home_article.find("getting-started/") < home_article.find("concepts/")

    for page in sorted(site.rglob("index.html")):  # a table split by a blank line renders its rows as text
        paragraphs = re.findall(r"<p>(.*?)</p>", page.read_text(), re.S)
        rows = [p for p in paragraphs if re.match(r"\s*\|", html.unescape(re.sub(r"<[^>]+>", "", p)))]
        assert not rows, f"{page.relative_to(site)} shows table rows as text: {rows[0][:200]}"

    for page in sorted((site / "api").glob("*/index.html")):
        text = _text(page)
        where = page.parent.name
        assert not SOURCE_PATH.search(text), f"api/{where} shows a source path: {SOURCE_PATH.search(text)}"
        assert "Attributes below" not in text and "docs/" not in text, f"api/{where} shows a maintainer note"
        assert "Bases:" not in text, f"api/{where} shows base classes"
