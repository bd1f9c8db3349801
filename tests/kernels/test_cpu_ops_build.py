"""kernels/cpu_ops_build.py: the C++ CPU ops as one library, named by its kernels' bytes and shared
by every checkout of them, with no Python module in it; a failed build says what failed in one line."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_ops_build
from tests.support.paths import ROOT

KERNELS = ROOT / "kernels"


@pytest.fixture(scope="module")
def library() -> Path:
    if not cpu_ops_build.cpu_ops_available():
        pytest.skip(f"the C++ CPU ops are unavailable: {cpu_ops_build.cpu_ops_error()}")
    return cpu_ops_build.load_cpu_ops()


def run_python(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


def test_the_library_holds_no_python_module(library):
    """Registered with TORCH_LIBRARY and loaded with torch.ops.load_library: no pybind11 module,
    no link to torch's Python bindings."""
    data = library.read_bytes()
    assert b"PyInit_" not in data and b"libtorch_python" not in data and b"pybind11" not in data
    import torch
    assert torch.ops.kaiten_cpu.int8_x_levels(8) in (0, 63, 127)


def test_checkouts_of_the_same_kernels_share_one_build(library, tmp_path):
    """The build is named by the kernels' bytes, not the checkout's folder: a copy of kernels/ in
    another folder loads the same library without building, and a changed header is another build."""
    shutil.copytree(KERNELS, tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    load = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
            "from kernels import cpu_ops_build; print(cpu_ops_build.load_cpu_ops())")
    proc = run_python(load, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == str(library)
    assert "building" not in proc.stdout
    header = tmp_path / "kernels" / "csrc" / "quant" / "registers.h"
    header.write_text(header.read_text() + "\n// another kernel\n")
    other = run_python("from kernels import cpu_ops_build as b; "
                       "print(b.kernel_digest(b.kernel_files(), b.compile_flags(b.cpu_capability()[1]), 'c++'))",
                       tmp_path)
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.strip() not in library.parent.name


def test_a_build_killed_midway_is_finished_by_the_next_load(library, tmp_path):
    """A build that died before its end left no marker and no library: the next load builds what
    is missing (ninja keeps the objects it finished), under a lock that died with its holder."""
    cache = tmp_path / "cache"
    shutil.copytree(library.parent, cache / library.parents[1].name / library.parent.name, symlinks=True)
    built = cache / library.parents[1].name / library.parent.name
    other_venv = tmp_path / "other-venv-torch"          # the build began under another venv's torch
    other_venv.symlink_to((built / "torch").resolve(), target_is_directory=True)
    (built / "torch").unlink()
    (built / "torch").symlink_to(other_venv, target_is_directory=True)
    (built / ".kaiten-built").unlink()
    (built / cpu_ops_build.LIBRARY).unlink()
    proc = run_python("from kernels import cpu_ops_build as b; print(b.load_cpu_ops())", ROOT,
                      env={**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == str(built / cpu_ops_build.LIBRARY)
    assert (built / ".kaiten-built").exists()
    assert "[1/1]" in (built / "build.log").read_text()          # the link alone: no object compiled again
    assert "site-packages" not in (built / "build.ninja").read_text()   # no venv's path in its commands


def kernels_cli(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", "kernels"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"), **env})


def test_a_missing_compiler_is_named_in_one_line(tmp_path):
    proc = kernels_cli(tmp_path, CXX="no-such-c++")
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kaiten kernels:")]
    assert lines == ["kaiten kernels: the C++ CPU ops are not built: no C++ compiler: 'no-such-c++' is not on PATH "
                     "(apt-get install g++, or set CXX)"]


def test_a_failed_compile_says_what_failed_in_one_line(tmp_path):
    """The compiler's first error, and where the whole log is."""
    cxx = tmp_path / "broken-c++"
    cxx.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'broken 1.0'; exit 0; }\n"
                   "echo 'src/argmax_cpu.cpp:3:1: error: this compiler is broken' >&2\nexit 1\n")
    cxx.chmod(0o755)
    proc = kernels_cli(tmp_path, CXX=str(cxx))
    assert proc.returncode == 1
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("kaiten kernels:")]
    assert "the build failed: src/argmax_cpu.cpp:3:1: error: this compiler is broken (log: " in line
    log = Path(line.rsplit("(log: ", 1)[1].rstrip(")"))
    assert log.is_file() and "this compiler is broken" in log.read_text()


def test_the_line_of_a_failed_link_is_the_linkers():
    output = ("ninja: Entering directory `build'\n[7/7] c++ obj/a.o -shared -o kaiten_cpu_ops.so\n"
              "FAILED: kaiten_cpu_ops.so\nc++ obj/a.o -shared -lc10 -o kaiten_cpu_ops.so\n"
              "/usr/bin/ld: cannot find -lc10: No such file or directory\n"
              "collect2: error: ld returned 1 exit status\nninja: build stopped: subcommand failed.\n")
    assert cpu_ops_build._first_error(output) == "/usr/bin/ld: cannot find -lc10: No such file or directory"
    assert cpu_ops_build._first_error("something odd\nninja: build stopped.\n") == "ninja: build stopped."
