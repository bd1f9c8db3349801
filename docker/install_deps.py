"""Image build step: one image's dependencies, pinned in pyproject.toml.

    python install_deps.py slim     the gateway, the tokenizer service and model conversion: no torch,
                                    no xgrammar (grammars compile in the engine), no ninja
    python install_deps.py engine   the rest of the dependencies (torch is already in) and those of
                                    $EXTRAS; with ENGINE_DEVICE=cpu without triton, which xgrammar
                                    pulls in but only uses on CUDA (its CPU bitmask kernel needs none)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

ENGINE_ONLY = {"torch", "xgrammar", "ninja"}


def name(requirement: str) -> str:
    return re.split(r"[\s=<>!~\[;]", requirement, maxsplit=1)[0].lower()


def requirements(role: str, project: dict, extras: str = "") -> list[str]:
    deps = [d for d in project["dependencies"] if name(d) != "torch"]
    if role == "slim":
        return [d for d in deps if name(d) not in ENGINE_ONLY]
    if role != "engine":
        raise SystemExit(f"unknown role {role!r} (slim | engine)")
    return deps


def main(role: str) -> None:
    with open("pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    pip = [sys.executable, "-m", "pip", "install"]
    subprocess.check_call(pip + requirements(role, project))
    if role != "engine":
        return
    extras = [d for e in filter(None, os.environ.get("EXTRAS", "").split(","))
              for d in project["optional-dependencies"][e]]
    if extras:   # flash-attn compiles against the installed torch, so no build isolation
        subprocess.check_call(pip + ["setuptools", "wheel", "packaging", "ninja", "psutil"])
        subprocess.check_call(pip + ["--no-build-isolation", *extras])
    if os.environ.get("ENGINE_DEVICE", "cpu") == "cpu":
        subprocess.check_call([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "triton"])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "engine")
