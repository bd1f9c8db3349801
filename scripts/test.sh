#!/usr/bin/env bash
# Sets up .venv with the test extras (and redis-server, chromium, prometheus) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest "$@"
