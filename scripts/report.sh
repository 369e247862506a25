#!/usr/bin/env bash
# Set everything up, then run the main job on the default zoo model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/arithinterp report "$@"
