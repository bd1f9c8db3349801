"""The docs site builds with `mkdocs build --strict` (every page, link and anchor, the benchmark
results included), and docs/configuration.md is what docs/gen_config.py generates from the code."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.support.paths import ROOT

sys.path.insert(0, str(ROOT / "docs"))
import gen_config  # noqa: E402


def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for page in ("index.html", "configuration/index.html", "bench/results/peer_llamacpp/index.html"):
        assert (tmp_path / "site" / page).exists(), page


def test_the_configuration_page_is_generated_from_the_code():
    assert (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8") == gen_config.render(), \
        "docs/configuration.md is stale: run .venv/bin/python docs/gen_config.py"


def test_every_variable_the_code_reads_is_on_the_configuration_page():
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    sources = [p for part in ("engine_worker", "gateway", "shared", "tokenizer_service", "kernels")
               for p in (ROOT / part).rglob("*.py")]
    names = {n for p in sources for n in re.findall(r"\bKAITEN_[A-Z0-9_]*[A-Z0-9]\b", p.read_text(encoding="utf-8"))}
    missing = sorted(n for n in names - gen_config.UNREAD_VARIABLES if f"`{n}`" not in page and f"{n}," not in page
                     and f", {n}`" not in page)
    assert not missing, f"not on docs/configuration.md: {missing} (add them to docs/gen_config.py)"
