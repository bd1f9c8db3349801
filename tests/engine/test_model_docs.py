"""The supported-models table (docs/models.md) says what the family table and the engine's
registry hold, row for row."""
from __future__ import annotations

from engine_worker.model.registry import ARCHITECTURES, model_class
from shared.model_families import FAMILIES, supported_architectures
from tests.support.paths import ROOT


def table_rows() -> list[list[str]]:
    lines = (ROOT / "docs" / "models.md").read_text().split("## Supported families", 1)[1].splitlines()
    rows = [line.strip().strip("|").split("|") for line in lines if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]        # the header row aside


def test_the_table_lists_every_family_as_the_family_table_does():
    rows = table_rows()
    assert [r[0] for r in rows] == [f.name for f in FAMILIES]
    for row, family in zip(rows, FAMILIES):
        assert row[1] == ", ".join(f"`{a}`" for a in family.architectures), family.name
        assert row[2] == ", ".join(f"`{a}`" for a in family.gguf_architectures), family.name
        assert row[3] == ", ".join(family.examples), family.name
        assert row[4] == family.sliding_window and row[5] == family.notes, family.name


def test_the_registry_runs_every_supported_architecture():
    assert sorted(ARCHITECTURES) == supported_architectures()
    for arch in ARCHITECTURES:
        assert model_class(arch).__name__ == arch
