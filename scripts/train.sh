#!/usr/bin/env bash
# Quickstart command 1: install what is missing, then train the default GPT on the
# default device.  Extra arguments go to helios-train (see helios-train --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/helios-train "$@"
