"""A model directory's weight files: which safetensors hold weights, and what they hold."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open



def weight_files(model_dir: str | Path) -> list[Path]:
    """The model's *.safetensors weight files (Kaiten's quantized sidecar, shared.gguf_quant's
    QUANTIZED_FILE, is not named as one)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def count_tensors(files: list[Path]) -> int:
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            total += len(f.keys())
    return total


def tensors(files: list[Path]) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """(name, file, tensor) of every tensor in `files`, read one at a time."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, path, f.get_tensor(name)


def stored_in_bf16(model_dir: str | Path) -> bool:
    """Whether every matrix in the model's weight files is stored in bf16."""
    dtypes = set()
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            dtypes |= {f.get_slice(name).get_dtype() for name in f.keys() if len(f.get_slice(name).get_shape()) == 2}
    return dtypes == {"BF16"}
