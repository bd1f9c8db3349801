"""Paged attention kernels behind one interface (see kernels/interface.py)."""
from kernels.interface import AttentionBackend, AttentionMetadata, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
