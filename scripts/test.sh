#!/usr/bin/env bash
# Set up, lint, run every test. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
./scripts/ensure_nginx.sh
echo "[test] ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "[test] import contracts (pyproject.toml, [tool.importlinter])"
.venv/bin/lint-imports
echo "[test] types (mypy, [tool.mypy] in pyproject.toml)"
.venv/bin/mypy
echo "[test] pytest"
# One test worker a core (pytest-xdist), each file on one worker so that a file's servers
# start once; TEST_WORKERS=0 runs everything in this process.
.venv/bin/python -m pytest -n "${TEST_WORKERS:-auto}" --dist loadfile "$@"
