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
.venv/bin/python -m pytest -q "$@"
