"""Paged attention kernels behind one interface (kernels/interface.py), picked by name
(kernels/registry.py), and the C++ CPU ops (kernels/cpu_ops_build.py)."""
from kernels.interface import AttentionBackend, AttentionMetadata
from kernels.registry import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
