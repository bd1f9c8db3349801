"""A model directory's fingerprint: its config and its weights, as the KV store names a model.

Every file of the directory counts by name, size and content; a large file by samples of its
content (its first and last MiB and 16 slices between), so a multi-GiB GGUF is fingerprinted in
milliseconds. Two directories with equal files anywhere have equal fingerprints.
"""
from __future__ import annotations

import os
from hashlib import blake2b
from pathlib import Path

WHOLE_FILE_BYTES = 4 * 2**20      # read whole below this
EDGE_BYTES = 2**20
SLICES, SLICE_BYTES = 16, 64 * 1024


def _file_digest(path: Path, h) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            h.update(f.read())
            return
        offsets = [0, size - EDGE_BYTES] + [size * (i + 1) // (SLICES + 1) for i in range(SLICES)]
        for offset in offsets:
            f.seek(offset)
            h.update(f.read(EDGE_BYTES if offset in (0, size - EDGE_BYTES) else SLICE_BYTES))


def model_fingerprint(model_dir: str | os.PathLike, *extra: str) -> str:
    """Hex digest of the directory's files (not its subdirectories) and of `extra` (how they are
    served: dtype, quantization)."""
    h = blake2b(digest_size=16)
    for path in sorted(p for p in Path(model_dir).iterdir() if p.is_file()):
        _file_digest(path, h)
    for item in extra:
        h.update(f"\0{item}".encode())
    return h.hexdigest()
