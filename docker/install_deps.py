"""Image build step: pyproject.toml's dependencies (torch is already in) and those of $EXTRAS."""
import os
import subprocess
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
pip = [sys.executable, "-m", "pip", "install"]
subprocess.check_call(pip + [d for d in project["dependencies"] if not d.startswith("torch")])
extras = [d for e in filter(None, os.environ.get("EXTRAS", "").split(","))
          for d in project["optional-dependencies"][e]]
if extras:   # flash-attn compiles against the installed torch, so no build isolation
    subprocess.check_call(pip + ["setuptools", "wheel", "packaging", "ninja", "psutil"])
    subprocess.check_call(pip + ["--no-build-isolation", *extras])
