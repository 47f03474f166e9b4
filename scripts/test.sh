#!/usr/bin/env bash
# Install everything, then run the whole test suite (unit + forked gloo worlds + torchrun).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
export OMP_NUM_THREADS=1
# Lint and format check first (seconds): a finding or an unformatted file fails the run before the
# suite starts (configuration: ruff.toml; `ruff format .` formats the tree).
python -m ruff check .
python -m ruff format --check .
python -m pytest tests -q "$@"
