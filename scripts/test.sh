#!/usr/bin/env bash
# Install everything, then run the whole test suite (unit + forked gloo worlds + torchrun).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
export OMP_NUM_THREADS=1
# Lint first (seconds): a finding fails the run before the suite starts (configuration: ruff.toml).
python -m ruff check .
python -m pytest tests -q "$@"
