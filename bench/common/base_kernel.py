"""One kernel source of the C++ extension as it is at another git revision, built alone and loaded
beside the working tree's extension, so a kernel change is timed against its base in one process
(kernel_ab.py, attention_ab.py): on a shared 2-core host the same unchanged kernel measured in two
processes minutes apart differed by up to 1.7x (Zen 3, 2026-11-28).

The revision's kernels/csrc is read with `git archive`; the source's ops are registered under
kaiten_ab_<source name> instead of kaiten_cpu, and it is built with the extension's own flags for
this machine's ISA (kernels/cpu_ops_build.cpu_capability, OPT_FLAGS), the headers beside it as in
the checkout, once per source, headers, flags and compiler (~/.cache/kaiten/kernel_ab, named and
staged as the extension's own build is: kernel_digest, stage_files).
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
from pathlib import Path

import torch

from kernels.cpu_ops_build import OPT_FLAGS, cpu_capability, kernel_digest, stage_files

ROOT = Path(__file__).resolve().parents[2]
CSRC = "kernels/csrc"
BUILDS = Path.home() / ".cache" / "kaiten" / "kernel_ab"


def base_ops(rev: str, source: str, tag: str = ""):
    """The ops of `rev`'s kernels/csrc/<source> (e.g. quant_linear_cpu.cpp), as a torch.ops namespace
    (kaiten_ab_<source name><tag>: a distinct tag for each revision loaded in one process)."""
    tree = subprocess.run(["git", "-C", str(ROOT), "archive", rev, CSRC], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    path = f"{CSRC}/{source}"
    if path not in files:
        raise SystemExit(f"{rev} has no {path}")
    text = files[path].decode()
    namespace = f"kaiten_ab_{Path(source).stem}{tag}"
    renamed = re.sub(r"TORCH_LIBRARY_(FRAGMENT|IMPL)\(kaiten_cpu\b", rf"TORCH_LIBRARY_\1({namespace}", text)
    if renamed == text:
        raise SystemExit(f"{rev}:{path} registers no kaiten_cpu ops to rename")
    build_files = {str(Path(name).relative_to(CSRC)): data for name, data in sorted(files.items()) if name.endswith(".h")}
    build_files[source] = renamed.encode()
    cap, cflags = cpu_capability()
    name = f"{namespace}_{cap}_{kernel_digest(build_files, cflags, os.environ.get('CXX', 'c++'))}"
    build = BUILDS / name
    stage_files(build, build_files)
    from torch.utils import cpp_extension
    cpp_extension.load(name=name, sources=[str(build / source)], extra_cflags=[*OPT_FLAGS, *cflags],
                       extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace)
