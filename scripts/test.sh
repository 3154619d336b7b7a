#!/usr/bin/env bash
# Quickstart command 2: install what is missing, then run the test suite.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
.venv/bin/ruff check .   # lint first: pyflakes + pycodestyle (config in pyproject.toml)
exec .venv/bin/python -m pytest -q "$@"
