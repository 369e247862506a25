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
# The report's browser test drives Debian's Chromium (Playwright never downloads a browser here).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
