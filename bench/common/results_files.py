"""Where and how a benchmark writes its results: bench/results/<script>/, as <out>.json (the whole
report) and <out>.md (its tables)."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def results_dir(script: str | Path) -> Path:
    """bench/results/<the script's name>/, the folder a benchmark's results go to by default."""
    return RESULTS / Path(script).stem


def write_results(out: str | Path, report: dict, markdown: str) -> None:
    """Writes out.json and out.md (creating out's folder) and prints the markdown."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown.rstrip("\n") + "\n")
    print(markdown)
