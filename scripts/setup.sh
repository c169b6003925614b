#!/usr/bin/env bash
# Create .venv and install vlmreg, its bundled family plugins and the test tools; on a fresh clone, from scratch.
# CPU torch 2.13.0 is installed first and pinned: an unpinned torch would pull a CUDA build (GBs).
# The installs are skipped when .venv is current: .venv/.setup-stamp holds a hash of what they depend on
# (pyproject.toml, every plugins/*/pyproject.toml, this script), written only after they succeed.
# Prints one line either way.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.setup-stamp
inputs=(pyproject.toml plugins/*/pyproject.toml scripts/setup.sh)

digest() {  # names and contents of the files the installs depend on
  local file
  for file in "${inputs[@]}"; do printf '%s\n' "$file"; cat "$file"; done | {
    if command -v sha256sum >/dev/null; then sha256sum; else shasum -a 256; fi
  } | cut -d' ' -f1
}

want=$(digest)
plugin_count=$(( ${#inputs[@]} - 2 ))
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup.sh: .venv is current (pyproject.toml, the $plugin_count plugins' and this script unchanged since its install): skipping the installs"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  why="no .venv yet"
  "$PYTHON" -m venv .venv
elif [ -f "$STAMP" ]; then
  why=".venv is out of date (a pyproject.toml or this script changed)"
else
  why=".venv has no install stamp"
fi
printf 'setup.sh: %s: installing CPU torch 2.13.0, vlmreg[test] and %d plugins into .venv (1-2 minutes)... ' "$why" "$plugin_count"
rm -f "$STAMP"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() { .venv/bin/python -m pip install --quiet "$@"; }
.venv/bin/python -c "import torch" 2>/dev/null || pip_install "torch==2.13.0"
plugins=()
for dir in plugins/*/; do plugins+=(-e "$dir"); done
pip_install "torch==2.13.0" -e ".[test]" "${plugins[@]}"
.venv/bin/python -c "import torch, vlmreg; print(f'done: vlmreg {vlmreg.__version__}, torch {torch.__version__}')"
echo "$want" > "$STAMP"
