"""MkDocs hook: the benchmarks (bench/: their README, scripts and results) become part of the site, so the docs' links to
them work there as they do on GitHub.

On GitHub a page links `../bench/results/<topic>/README.md` from docs/ and a results README links
`../../../docs/<page>.md`; in the site bench/ lives beside the pages, so
both prefixes are rewritten as each page is read. The link check (tests/system/test_readme_links.py)
checks the GitHub form; `mkdocs build --strict` the site's.
"""
from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
BENCH = "bench"


def on_files(files: Files, config) -> Files:
    for path in sorted((ROOT / BENCH).rglob("*")):
        if path.is_file() and path.suffix in (".md", ".json", ".png", ".py", ".sh", ".cpp"):
            files.append(File(str(path.relative_to(ROOT)), str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri.startswith(BENCH + "/"):       # ../../../docs/x.md -> ../../../x.md
        return re.sub(r"\]\(((?:\.\./)+)docs/", r"](\1", markdown)
    return markdown.replace("](../bench/", "](bench/")
