#!/usr/bin/env bash
# Thin torchrun launcher: launch/torchrun.sh [pretrain_gpt.py args...]
#
#   NNODES (1)  NPROC_PER_NODE (8)  NODE_RANK (0)  MASTER_ADDR  MASTER_PORT (29500)
#   RDZV_ID (megatron_ext)  TRAIN_SCRIPT (pretrain_gpt.py beside this directory)
#
# One node with no MASTER_ADDR: --standalone. Otherwise c10d rendezvous at MASTER_ADDR:MASTER_PORT
# (ranks are then numbered by rendezvous order: GROUP_RANK, not NODE_RANK, names the node).
#
# Exit status. After a SIGTERM/SIGINT, torchrun's own exit code is non-zero even when the
# workers shut down cleanly (e.g. saved a checkpoint on preemption). Contract with the workers:
# this script exports MEGATRON_EXT_EXIT_MARKER_DIR, a fresh node-local directory, and a worker
# that finishes cleanly writes "$MEGATRON_EXT_EXIT_MARKER_DIR/rank<RANK>.ok". If all
# NPROC_PER_NODE local workers left a marker the script exits 0, else with torchrun's code.
set -uo pipefail

NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
NODE_RANK=${NODE_RANK:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Megatron-LM's setting: one hardware queue per GPU, so the TP/sequence-parallel communication
# kernels megatron-core issues before a GEMM start before it (its TP linear layers warn otherwise)
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# How long torchrun lets workers finish after a SIGTERM before it SIGKILLs them: the last step and
# the checkpoint saved before exiting (--exit-signal-handler). torchrun's default, 30 s, killed
# saves of large models; 110 s fits inside the 120 s launch/slurm.sbatch signals before its limit.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}
TRAIN_SCRIPT=${TRAIN_SCRIPT:-"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/pretrain_gpt.py"}

args=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --node-rank "$NODE_RANK")
if [[ "$NNODES" == 1 && -z "${MASTER_ADDR:-}" ]]; then
    args+=(--standalone)
elif [[ -n "${MASTER_ADDR:-}" ]]; then
    args+=(--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT:-29500}"
           --rdzv-id "${RDZV_ID:-megatron_ext}")
else
    echo "error: NNODES=$NNODES needs MASTER_ADDR (the rendezvous host, e.g. the first node)" >&2
    exit 2
fi

MEGATRON_EXT_EXIT_MARKER_DIR=$(mktemp -d "${TMPDIR:-/tmp}/megatron_ext_exit.XXXXXX") || exit 1
export MEGATRON_EXT_EXIT_MARKER_DIR
trap 'rm -rf "$MEGATRON_EXT_EXIT_MARKER_DIR"' EXIT

# A command started with `&` by a script (no job control) gets SIGINT and SIGQUIT ignored, and
# torchrun sets its own handlers only when it starts its workers: the SIGINT forwarded below (Ctrl-C)
# did nothing before, e.g. while it waited in the rendezvous for the other nodes. Restore them.
( trap - INT QUIT; exec torchrun "${args[@]}" "$TRAIN_SCRIPT" "$@" ) &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null' TERM
trap 'kill -INT "$pid" 2>/dev/null' INT
# A trapped signal interrupts `wait`: wait again until torchrun is gone, then read its status
# (bash remembers it, so the last `wait` also covers torchrun exiting during the trap).
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done
wait "$pid"
rc=$?

shopt -s nullglob
markers=("$MEGATRON_EXT_EXIT_MARKER_DIR"/rank*.ok)
if [[ "$NPROC_PER_NODE" =~ ^[0-9]+$ ]] && (( ${#markers[@]} == NPROC_PER_NODE )); then
    exit 0
fi
exit "$rc"
