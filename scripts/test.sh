#!/usr/bin/env bash
# Quickstart command 2: install what is missing, then run the test suite.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
.venv/bin/ruff check .   # lint first: pyflakes + pycodestyle (config in pyproject.toml)
# Byte-compile the checkout's Python once (a fresh clone has none; edited files are redone).  The
# suite starts ~1,300 Python processes (workers, ranks, launchers, benchmarks), and where
# PYTHONDONTWRITEBYTECODE is set none of them writes what it compiled, so each one compiled every
# Helios module it imported from source: +0.5 CPU-s a process (importing helios.train: 0.9
# against 0.4 CPU-s); tests/test_train_dist.py took 74 CPU-s against 52.  compileall writes the
# files whatever that variable says; up to date, it costs 0.5-0.8 s.  A file that does not compile is
# named here and the tests still run (pytest reports it where a test imports it).
.venv/bin/python -m compileall -q -x '(^|/)(\.venv|build|\.git)(/|$)' . \
    || echo "test.sh: the files above do not compile; running the tests anyway" >&2
# Warm the kernel caches first: on a fresh machine (CI's clone) every rank of every multi-rank test
# would otherwise build the same pipelines from unfrozen SPIR-V (HELIOS_SPECIALIZE=sync freezes them
# now, once).  Measured on tests/test_train_dist.py with empty caches: 55.1 s and 81 CPU-s without,
# 7.7 + 41.2 s and 68 CPU-s with it; with warm caches it costs 0.9 s.
warm=$(mktemp -d)
HELIOS_SPECIALIZE=sync LP_NUM_THREADS=1 .venv/bin/python -m helios.train --config nano --steps 2 --batch-size 8 \
    --block-size 16 --no-progress --eval-every 0 --sample-tokens 4 --ckpt-every 0 --out "$warm" >/dev/null \
    || echo "test.sh: warming the kernel caches failed; the tests will say why" >&2
rm -rf "$warm"
# .venv/bin/pytest, not `python -m pytest`: -m would put the checkout root on sys.path,
# where the folder profile/ would shadow the standard library module of that name.
# --durations=20: the 20 slowest tests, printed at the end of every run (CI's log too), so a test
# that grows past its share of the 12-minute budget shows up where it is paid for.
# -n 2: two workers, one per core, each taking the next test as it finishes one; a multi-rank test
# on one worker runs beside whatever the other runs (as in every run measured so far).  `-n 0` after
# it: one process (a debugger, or reading one test's output in order).
exec .venv/bin/pytest -q --durations=20 -n 2 "$@"
