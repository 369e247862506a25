#!/usr/bin/env bash
# Set up a virtual environment in .venv with arithinterp and its test dependencies.
# torch is pinned first so pip takes the CPU build on this machine instead of a multi-GB CUDA one;
# the package itself only asks for a torch range.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev]"
