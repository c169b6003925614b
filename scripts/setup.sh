#!/usr/bin/env bash
# Create .venv and install vlmreg, its bundled family plugins and the test tools, from scratch.
# CPU torch 2.13.0 is installed first and pinned: an unpinned torch would pull a CUDA build (GBs).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() { .venv/bin/python -m pip install --quiet "$@"; }
.venv/bin/python -c "import torch" 2>/dev/null || pip_install "torch==2.13.0"
plugins=()
for dir in plugins/*/; do plugins+=(-e "$dir"); done
pip_install "torch==2.13.0" -e ".[test]" "${plugins[@]}"
.venv/bin/python -c "import torch, vlmreg; print(f'vlmreg {vlmreg.__version__} ready in .venv (torch {torch.__version__})')"
