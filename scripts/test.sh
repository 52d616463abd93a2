#!/usr/bin/env bash
# The README's test command: install into ./.venv if needed, then run the whole suite on CPU.
# Exits non-zero on any failure (and on "no tests collected").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest "$@"
