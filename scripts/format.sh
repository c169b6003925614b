#!/usr/bin/env bash
# Apply ruff's automatic fixes and formatting to every Python file of the repository, with the rules and versions of
# pyproject.toml ([tool.ruff]; ruff is pinned in the `test` extra, which ./scripts/setup.sh installs).
# tests/test_habits.py checks that nothing is left to do; what ruff cannot fix itself it reports there.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF=${RUFF:-.venv/bin/ruff}
paths=(src plugins tests examples benchmarks scripts)
"$RUFF" check --fix --quiet --exit-zero "${paths[@]}"
"$RUFF" format --quiet "${paths[@]}"
"$RUFF" check --quiet --exit-zero --statistics "${paths[@]}"
