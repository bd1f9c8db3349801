"""One module per model family, each built from engine_worker/model/layers (registry.py lists them)."""
