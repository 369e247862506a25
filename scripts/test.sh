#!/usr/bin/env bash
# Set everything up, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Keep compiled bytecode (git ignores __pycache__): every test process and the processes they start (notebook
# kernels, sweep workers, CLI runs) then reads the package, the tests and the pytest plugins' assertion-rewritten
# modules compiled once, instead of compiling them from source each time where the environment turns caching off.
unset PYTHONDONTWRITEBYTECODE
# Lint first, then type-check beside the tests (both configured in pyproject.toml; basedpyright ships its own
# Node, so this runs offline). The type check takes half a minute of one core, which the tests leave idle
# while they wait on the processes they start (notebook kernels, benchmark children, a browser), so it runs
# alongside them; its report is printed after theirs, and either failing fails the command.
.venv/bin/ruff check .
types=$(mktemp)
trap 'rm -f "$types"' EXIT
.venv/bin/basedpyright > "$types" 2>&1 &
checking=$!
# Every test, spread over the machine's cores (pytest-xdist: two workers on a 2-core machine; pass -n 0 to run
# them in one process). `pytest -m "not slow"` is the quick loop while developing (README, "Developing").
status=0
.venv/bin/python -m pytest -q -n auto --dist worksteal "$@" || status=$?
typed=0
wait "$checking" || typed=$?
echo "basedpyright:"
cat "$types"
[ "$typed" = 0 ] || status=1
exit "$status"
