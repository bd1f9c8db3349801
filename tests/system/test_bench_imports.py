"""Every benchmark script imports (without running its main), so a refactor of the helpers it uses
cannot break it unnoticed; and bench/README.md lists every script."""
from __future__ import annotations

import contextlib
import importlib
import io

import pytest

from tests.support.paths import ROOT

BENCH = ROOT / "bench"
SCRIPTS = sorted(p for p in BENCH.rglob("*.py") if "results" not in p.parts)


def module_name(path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_the_script_imports_without_running(script):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module = importlib.import_module(module_name(script))
    assert module.__file__ == str(script)
    assert out.getvalue() == "", f"{script.name} printed at import: it runs work outside main()"
    if script.parent.name != "common":
        assert callable(getattr(module, "main", None)), f"{script.name} has no main()"


def test_the_bench_readme_lists_every_script():
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    others = [p for p in BENCH.rglob("*") if p.suffix in (".sh", ".cpp") and "results" not in p.parts]
    missing = [str(p.relative_to(BENCH)) for p in [*SCRIPTS, *others] if f"`{p.relative_to(BENCH)}`" not in readme]
    assert not missing, "bench/README.md does not list: " + ", ".join(missing)
