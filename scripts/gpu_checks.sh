#!/usr/bin/env bash
# On a machine with one CUDA GPU: the gpu-marked tests and the GPU benches, each under its own time
# limit, one after the other; each one's output goes to $OUT/<name>.log (default ./gpu_checks/),
# and one summary line per check says its exit status and time. megatron-core must be importable
# (pip install, or a cp312 wheel unpacked with --target and PYTHONPATH, as bench/README.md says).
#
#   bash scripts/gpu_checks.sh                 # every check, in the order below
#   bash scripts/gpu_checks.sh tests 1.3b      # some of them
#   bash scripts/gpu_checks.sh --list          # the checks and their commands
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-gpu_checks}"
export PYTHONUNBUFFERED=1

# name | time limit (s) | command, in the order of what issue 12 still needs measured. The limits add
# up to more than one 30-minute device session: run them a few per call, e.g.
#   call 1: tests profile-llama     call 2: 1.3b packed-llama     call 3: ablation-llama gpt2
CHECKS=(
  "tests|420|python -m pytest tests/gpu -rs -q"
  "profile-llama|300|python -m bench.gpu_profile --shape llama --micro-batch 1 --python"
  "1.3b|300|python -m bench.gpu_throughput --only 1.3b --accumulate 8 --steps 8 --warmup 2"
  "packed-llama|300|python -m bench.gpu_throughput --only packed-llama"
  "ablation-llama|300|python -m bench.gpu_ablation --shape llama --micro-batch 1 --only rope gqa-kernel"
  "gpt2|300|python -m bench.gpu_throughput --only gpt2 packed-gpt2 --accumulate 8"
  "profile-gpt2|300|python -m bench.gpu_profile --shape gpt2 --micro-batch 8 --accumulate 8 --no-packed --python"
  "ablation|360|python -m bench.gpu_ablation"
)
export MEGATRON_EXT_REQUIRE_GPU=1  # the gpu tests fail, not skip, if they cannot see the GPU

if [[ "${1:-}" == "--list" ]]; then
  for c in "${CHECKS[@]}"; do IFS='|' read -r name limit cmd <<<"$c"; printf '%-14s %4ss  %s\n' "$name" "$limit" "$cmd"; done
  exit 0
fi
names=" ${*:-} "
for want in "$@"; do
  found=0
  for c in "${CHECKS[@]}"; do [[ "${c%%|*}" == "$want" ]] && found=1; done
  if [[ $found == 0 ]]; then
    echo "gpu_checks: no check named '$want' (bash scripts/gpu_checks.sh --list names them)" >&2
    exit 2
  fi
done
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_checks: torch sees no CUDA GPU here; the CPU runs the suite (bash scripts/test.sh)" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
status=0
for c in "${CHECKS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$c"
  [[ "$names" != "  " && "$names" != *" $name "* ]] && continue
  start=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" $cmd >"$OUT_DIR/$name.log" 2>&1
  rc=$?
  [[ $rc != 0 ]] && status=1
  echo "gpu_checks: $name rc=$rc ($((SECONDS - start)) s, limit $limit s) -> $OUT_DIR/$name.log"
done
exit $status
