"""compiled_forward.region_layers: how many consecutive layers a compiled region holds."""
from __future__ import annotations

import pytest

from engine_worker.model import compiled_forward
from engine_worker.model.compiled_forward import region_layers


def pattern(period: int, full_at: int):
    """A region's structure as graph_signature sees it: which of its layers are full-attention ones
    in a model whose every period-th layer (from full_at) is."""
    return lambda start, size: tuple((start + i) % period == full_at for i in range(size))


def uniform(start, size):
    return size


@pytest.mark.parametrize("layers, signature_of, expected", [
    (30, uniform, 15),              # SmolLM2: two regions, one graph
    (18, pattern(6, 5), 6),         # Gemma 3 270M: 5 sliding layers then a full one; 9 would be two structures
    (16, uniform, 8),
    (28, uniform, 14),
    (26, pattern(6, 5), 15),        # no equal split of one structure: 15 and a shorter last region
    (2, uniform, 2),                # a tiny model: one region
    (31, uniform, 15),              # a prime: 15, 15 and 1
])
def test_regions_are_equal_and_of_one_structure(layers, signature_of, expected):
    assert region_layers(layers, signature_of) == expected


def test_a_region_a_layer(monkeypatch):
    monkeypatch.setattr(compiled_forward, "REGION_LAYERS", 1)
    assert region_layers(30, uniform) == 1
