#!/usr/bin/env bash
# Set everything up, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Lint and type-check first (both configured in pyproject.toml); basedpyright ships its own Node, so this
# runs offline.
.venv/bin/ruff check .
.venv/bin/basedpyright
# Every test, spread over the machine's cores (pytest-xdist: two workers on a 2-core machine; pass -n 0 to run
# them in one process). `pytest -m "not slow"` is the quick loop while developing (README, "Developing").
.venv/bin/python -m pytest -q -n auto --dist worksteal "$@"
