#!/usr/bin/env bash
# Quickstart command 2: install what is missing, then run the test suite.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
.venv/bin/ruff check .   # lint first: pyflakes + pycodestyle (config in pyproject.toml)
# .venv/bin/pytest, not `python -m pytest`: -m would put the checkout root on sys.path,
# where the folder profile/ would shadow the standard library module of that name.
exec .venv/bin/pytest -q "$@"
