"""The README's, docs/' and the benchmark results' links to files in the repository resolve."""
from __future__ import annotations

import re

from tests.support.paths import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page) -> list[str]:
    return [t.split("#")[0] for t in LINK.findall(page.read_text()) if not re.match(r"(https?|mailto):|#", t)]


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("bench/results/**/*.md"))]
    checked = {page: relative_links(page) for page in pages}
    assert len(checked[ROOT / "README.md"]) > 100
    missing = [f"{page.relative_to(ROOT)}: {t}" for page, links in checked.items() for t in links
               if not (page.parent / t).exists()]
    assert not missing, "links to missing files:\n" + "\n".join(missing)
