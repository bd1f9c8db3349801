"""The extension's kernel tests run again in another ISA build (KAITEN_CPU_ISA), in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys


def assert_passes_in_isa_build(test_file: str, isa: str) -> None:
    """`test_file`'s tests, all but those named other_isa, pass in the `isa` build, none skipped."""
    env = {**os.environ, "KAITEN_CPU_ISA": isa}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", test_file, "-k", "not other_isa"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "skipped" not in out.stdout, out.stdout[-3000:]
