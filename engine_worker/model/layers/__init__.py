"""The layers every model family is built from: norms, rotary embeddings, attention, gated MLPs."""
