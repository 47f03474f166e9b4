#!/usr/bin/env bash
# On a machine with one CUDA GPU: the gpu-marked tests and the GPU benches, each under its own time
# limit, one after the other; each one's output goes to $OUT/<name>.log (default ./gpu_checks/),
# and one summary line per check says its exit status and time. megatron-core must be importable
# (pip install, or a cp312 wheel unpacked with --target and PYTHONPATH, as bench/README.md says).
#
#   bash scripts/gpu_checks.sh --group 1       # one group: the checks of one call (<= 10 minutes)
#   bash scripts/gpu_checks.sh tests 1.3b      # some checks
#   bash scripts/gpu_checks.sh --list          # the checks, their limits and groups
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-gpu_checks}"
export PYTHONUNBUFFERED=1

# name | time limit (s) | group | command. A device session is 30 minutes of device time, a call at most
# 10: each group's limits add up to at most 570 s (one call), groups 1-3 to at most 1500 s (one session,
# with the machine's start). Group 1 is what issue 30 needs first; group 4 is for a second session;
# memory-model (issue 32: the memory model against max_memory_allocated) runs alone or with group 6.
# Groups 7 and 8 are issue 30's rest: the host overhead on CUDA (bench/host_overhead.py --device cuda: the
# C++ wrapper launching Triton kernels; its forked TP-2 part runs on the CPU only, skipped there) and the
# 1.3B rows with --torch-compile and CUDA graphs against the MFU stretch 0.55.
# Group 9 is issue 42's (context parallelism): the CP attention's flash varlen path, c ranks emulated on one
# GPU, against the CPU path, and the layout against Transformer Engine's where TE is importable.
# Group 10 is issue 44's: the cost of one cross-replica weight check (--check-weight-hash-across-dp-replicas-
# interval) on the GPU, fp32 and bf16 parameters, beside Megatron-LM's host SHA-1 of the same parameters.
CHECKS=(
  "tests|450|1|python -m pytest tests/gpu -rs -q --durations=0"
  "gpt2|280|2|python -m bench.gpu_throughput --only gpt2 --accumulate 8 --torch-compile --cuda-graph-impl local"
  "packed-llama|220|2|python -m bench.gpu_throughput --only packed-llama"
  "1.3b|280|3|python -m bench.gpu_throughput --only 1.3b --accumulate 8 --steps 8 --warmup 2"
  "profile-llama|200|3|python -m bench.gpu_profile --shape llama --micro-batch 1 --python"
  "packed-llama-compiled|280|4|python -m bench.gpu_throughput --only packed-llama --torch-compile"
  "packed-llama-graphs|250|4|python -m bench.gpu_throughput --only packed-llama --cuda-graph-impl local"
  "ablation-llama|280|6|python -m bench.gpu_ablation --shape llama --micro-batch 1 --only rope gqa-kernel"
  "memory-model|240|6|python -m bench.gpu_memory"
  "profile-gpt2|200|5|python -m bench.gpu_profile --shape gpt2 --micro-batch 8 --accumulate 8 --no-packed --python"
  "ablation|360|5|python -m bench.gpu_ablation"
  "host-overhead|420|7|python -m bench.host_overhead --device cuda --steps 6"
  "1.3b-variants|480|8|python -m bench.gpu_throughput --only 1.3b --accumulate 8 --steps 8 --warmup 2 --torch-compile --cuda-graph-impl local"
  "cp-attention|240|9|python -m pytest tests/gpu/test_gpu_cp_attention.py -rs -q --durations=0"
  "weight-hash|150|10|python -m bench.weight_hash --device cuda --params-gib 2 --rounds 3"
  "weight-hash-bf16|150|10|python -m bench.weight_hash --device cuda --params-gib 2 --rounds 3 --dtype bf16"
)
export MEGATRON_EXT_REQUIRE_GPU=1  # the gpu tests fail, not skip, if they cannot see the GPU

if [[ "${1:-}" == "--list" ]]; then
  for c in "${CHECKS[@]}"; do
    IFS='|' read -r name limit group cmd <<<"$c"
    printf '%-22s %4ss  group %s  %s\n' "$name" "$limit" "$group" "$cmd"
  done
  exit 0
fi
wanted=("$@")
if [[ "${1:-}" == "--group" ]]; then
  [[ -z "${2:-}" ]] && { echo "gpu_checks: --group needs a number (bash scripts/gpu_checks.sh --list)" >&2; exit 2; }
  wanted=()
  for c in "${CHECKS[@]}"; do
    IFS='|' read -r name limit group cmd <<<"$c"
    [[ $group == "$2" ]] && wanted+=("$name")
  done
  [[ ${#wanted[@]} == 0 ]] && { echo "gpu_checks: no group $2 (bash scripts/gpu_checks.sh --list)" >&2; exit 2; }
fi
names=" ${wanted[*]:-} "
for want in "${wanted[@]}"; do
  found=0
  for c in "${CHECKS[@]}"; do [[ "${c%%|*}" == "$want" ]] && found=1; done
  if [[ $found == 0 ]]; then
    echo "gpu_checks: no check named '$want' (bash scripts/gpu_checks.sh --list names them)" >&2
    exit 2
  fi
done
# fail fast, before any device time is spent on a check that would only fail at its import
if ! python -c "import megatron.core" 2>/dev/null; then
  echo "gpu_checks: megatron-core is not importable here (pip install -e . installs megatron-core 0.16.1; or unpack" \
       "its wheel with --target and put it on PYTHONPATH, as bench/README.md says)" >&2
  exit 3
fi
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_checks: torch sees no CUDA GPU here; the CPU runs the suite (bash scripts/test.sh)" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
status=0
for c in "${CHECKS[@]}"; do
  IFS='|' read -r name limit group cmd <<<"$c"
  [[ "$names" != "  " && "$names" != *" $name "* ]] && continue
  start=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" $cmd >"$OUT_DIR/$name.log" 2>&1
  rc=$?
  [[ $rc != 0 ]] && status=1
  echo "gpu_checks: $name rc=$rc ($((SECONDS - start)) s, limit $limit s) -> $OUT_DIR/$name.log"
done
exit $status
