#!/usr/bin/env bash
# Format every Python file of the repository with the rules of pyproject.toml ([tool.ruff]; ruff is pinned in the
# `test` extra, which ./scripts/setup.sh installs): ruff's automatic fixes (import order, pyupgrade, unused imports,
# stale noqa), ruff format, then scripts/wrap_long_lines.py for the comments, docstrings and string literals that
# ruff format leaves over 120 columns, and ruff format again. tests/test_habits.py checks that nothing is left to do;
# what no tool can fix is printed at the end, for a person.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
paths=(src plugins tests examples benchmarks scripts)
ruff() { "$PYTHON" -m ruff "$@"; }
ruff check --fix --silent --exit-zero "${paths[@]}"
"$PYTHON" scripts/wrap_long_lines.py --comments-only "${paths[@]}" >/dev/null || true
ruff format --quiet "${paths[@]}"
for _ in 1 2; do  # ruff format may indent a wrapped line further: wrap again what it pushed over
  "$PYTHON" scripts/wrap_long_lines.py "${paths[@]}" >/dev/null || true
  ruff format --quiet "${paths[@]}"
done
ruff check --fix --quiet "${paths[@]}" || echo "format.sh: the findings above need a person (see CONTRIBUTING.md)"
