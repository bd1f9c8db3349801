"""Every relative link and every #anchor in the README, the docs and the benchmark results resolves.

A link's file must exist; a link into a Markdown file with a #fragment (or a bare #fragment within a
page) must name a heading of that file, slugified as GitHub slugifies it (the docs site is built with
the same slugs: mkdocs.yml), or an explicit `<a id="...">`. Links in code blocks and code spans are not
links and are not checked; http(s) and mailto links are left to the reader.
"""
from __future__ import annotations

import re
import unicodedata
from functools import cache
from pathlib import Path

import pytest

from tests.support.paths import ROOT

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_TARGET = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]+)\"", re.I)
HTML_ID = re.compile(r"<[a-z]+\b[^>]*?\b(?:id|name)=\"([^\"]+)\"", re.I)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def pages() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "bench" / "results").rglob("*.md"))]
    return [p for p in found if p.exists()]


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks, their code spans blanked."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("    "):
            out.append(CODE_SPAN.sub("", line))
    return out


def heading_text(markdown: str) -> str:
    """A heading's text as rendered: links to their text, markup and HTML tags dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("`", "").replace("**", "").replace("__", "")


def github_slug(text: str) -> str:
    """GitHub's heading anchors (github-slugger): lower case, punctuation dropped, spaces to hyphens."""
    text = unicodedata.normalize("NFC", heading_text(text)).strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    text = page.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    found.update(HTML_ID.findall(text))
    return frozenset(found)


def links(page: Path) -> list[str]:
    out = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        out += INLINE_LINK.findall(line) + HTML_TARGET.findall(line)
        m = REF_DEF.match(line)
        if m:
            out.append(m.group(1))
    return [t for t in out if not re.match(r"[a-z][a-z0-9+.-]*:", t)]   # http:, https:, mailto: ...


def broken(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no heading or id {fragment!r} in {dest.name}")
    return bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    bad = broken(page)
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_checker_sees_links_and_anchors(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("# Run it: `kaiten serve`\n\n## Several models and LoRA adapters\n\n"
                    "[ok](#run-it-kaiten-serve) [ok](#several-models-and-lora-adapters) [bad](#nope)\n"
                    "[file](missing.md) <a id=\"x\"></a>[ok](#x) `[code](not-a-link.md)`\n\n"
                    "```\n[fenced](not-a-link-either.md)\n```\n", encoding="utf-8")
    assert sorted(broken(page)) == ["#nope: no heading or id 'nope' in page.md", "missing.md: no such file"]
    assert github_slug("Redis Sentinel: no single Redis") == "redis-sentinel-no-single-redis"
    assert github_slug("The API, field by field") == "the-api-field-by-field"
