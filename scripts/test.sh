#!/usr/bin/env bash
# Install everything, then run the whole test suite (unit + forked gloo worlds + torchrun).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
# Slurm for tests/slurm (Debian's slurm-wlm + munge, about a minute) where we are root and apt-get
# works; elsewhere those tests skip with the reason. SKIP_SLURM_INSTALL=1 leaves the machine as it is.
bash scripts/install_slurm.sh
export OMP_NUM_THREADS=1
# Lint and format check first (seconds): a finding or an unformatted file fails the run before the
# suite starts (configuration: ruff.toml; `ruff format .` formats the tree).
python -m ruff check .
python -m ruff format --check .
python -m pytest tests -q "$@"
