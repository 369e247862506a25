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
# The installs take seconds even when there is nothing to do, so they are skipped when nothing they depend on
# changed since the last set-up that finished here: the same pyproject.toml and this script (their hash is kept
# in .venv/.arithinterp-setup), and arithinterp still installed, editable, from this checkout at the version its
# source gives. Delete that file to install again.
stamp=.venv/.arithinterp-setup
check() {  # prints "<hash of pyproject.toml and this script> <1 if the editable install is current, else 0>"
  .venv/bin/python -I - "$PWD" <<'PY'
import hashlib, json, re, sys
from importlib import metadata
from pathlib import Path

root = Path(sys.argv[1])
digest = hashlib.sha256(b"".join((root / name).read_bytes() for name in ("pyproject.toml", "scripts/setup.sh")))
try:
    dist = metadata.distribution("arithinterp")
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    source = re.search(r'__version__ = "([^"]+)"', (root / "arithinterp" / "_version.py").read_text())
    current = (source is not None and dist.version == source.group(1) and url.get("url") == root.as_uri()
               and url.get("dir_info", {}).get("editable", False))
except metadata.PackageNotFoundError:
    current = False
print(digest.hexdigest(), int(current))
PY
}
read -r digest current <<< "$(check)"
if [ "$current" != 1 ] || [ "$(cat "$stamp" 2>/dev/null)" != "$digest" ]; then
  rm -f "$stamp"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[dev]"
  echo "$digest" > "$stamp"
fi
# The report's browser test drives Debian's Chromium (Playwright never downloads a browser here).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
