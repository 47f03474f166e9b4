#!/usr/bin/env bash
# Install the framework. On a machine without CUDA, torch's CPU build goes first: a bare torch
# requirement with no torch installed would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install --quiet "torch>=2.6"
  else
    python -m pip install --quiet torch==2.13.0
  fi
fi
python -m pip install --quiet -e ".[${1:-test}]"
