#!/usr/bin/env bash
# Install everything, then run the embedded default job: TP2 x PP2 x VPP2 x DP2 on 8 CPU (gloo)
# processes, a small GPT on the corpus shipped in data/default. Extra flags go to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh logging
NPROC_PER_NODE=8 bash launch/torchrun.sh --config configs/default.yaml "$@"
