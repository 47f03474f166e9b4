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
# A worker's marker says "finished" (it trained to the end) or "stopped <iteration>" (a signal or
# --exit-duration-in-mins/--exit-interval ended it early, after its checkpoint): all markers and one
# "stopped" exits STOPPED_EXIT_CODE (0 by default, as before; launch/slurm.sbatch sets 75 to requeue).
#
# Exit codes: 0 finished (or stopped cleanly, above); 2 a user error; 1 the run diverged, or the same
# failure recurred (a restart would repeat it); 75 (EX_TEMPFAIL) ended retryably: a crash that no
# worker called final and no restart is left for, so a new start from the newest complete
# checkpoint in --save may get past it (launch/slurm.sbatch requeues the job on 75).
#
# Automatic restart: MAX_RESTARTS (0: none, as before) more torchrun runs after a failed one,
# each resuming from the newest complete checkpoint in --save (megatron_ext/restart.py: the
# workers load --save on a restart). torchrun's own --max-restarts cannot tell a crash from a user
# error, so this script decides, from the markers of that attempt only (a fresh directory per
# attempt). No restart after a worker left rank<R>.noretry (a user error, exit 2, or a diverged
# run, exit 1: this script exits with that code, also when MAX_RESTARTS is 0), after this script
# was sent SIGTERM/SIGINT, or when the same failure (torchrun's exit code at the same iteration:
# the highest a local rank started, from rank<R>.iteration) happened SAME_FAILURE_LIMIT (2) times
# in a row. Each decision is one line on stderr starting with "launch/torchrun.sh:", also the final
# "exit 2: a worker stopped on a user error ..." without MAX_RESTARTS (read from the markers, not
# from torchrun's output, whose failure summary stays as it is for every failure). Several
# nodes: each node's launcher decides alone, and they meet again in the rendezvous (RDZV_ID with
# ".restart<K>" added).
set -uo pipefail

NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
NODE_RANK=${NODE_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
SAME_FAILURE_LIMIT=2
RETRYABLE_EXIT_CODE=75
STOPPED_EXIT_CODE=${STOPPED_EXIT_CODE:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# require_count NAME MIN MAX WHAT: NAME's value is a whole decimal number from MIN to MAX (leading
# zeros dropped), else one error line naming it and exit 2. Digits are counted before any arithmetic:
# bash's wraps at 2^63 (MAX_RESTARTS=18446744073709551616 was 0).
require_count() {
    local name=$1 min=$2 max=$3 what=$4 value=${!1}
    if [[ "$value" =~ ^0*([0-9]{1,18})$ ]] && (( 10#${BASH_REMATCH[1]} >= min && 10#${BASH_REMATCH[1]} <= max )); then
        printf -v "$name" '%d' "$((10#${BASH_REMATCH[1]}))"
        return
    fi
    echo "error: $name=$value is not a whole number from $min to $max: give $what" >&2
    exit 2
}
require_count STOPPED_EXIT_CODE 0 255 "an exit code (0, the default: a run stopped cleanly before its end exits 0)"
require_count MAX_RESTARTS 0 1000000000 "how many times to restart after a failure, e.g. MAX_RESTARTS=3 (0, the default: never)"
require_count NNODES 1 1048576 "the number of nodes, e.g. NNODES=2 (1, the default)"
require_count NODE_RANK 0 $((NNODES - 1)) "this node's index, 0 to NNODES - 1 (0, the default)"
if ! [[ "$NPROC_PER_NODE" =~ ^(auto|cpu|gpu|xpu)$ ]]; then
    require_count NPROC_PER_NODE 1 1048576 "the processes per node, one per GPU, e.g. NPROC_PER_NODE=8 (the default)"
fi
[[ -n "${MASTER_PORT:-}" ]] && require_count MASTER_PORT 1 65535 "a free TCP port on MASTER_ADDR (29500, the default)"
require_count OMP_NUM_THREADS 1 1048576 "CPU threads per process (1, the default)"
# Megatron-LM's setting: one hardware queue per GPU, so the TP/sequence-parallel communication
# kernels megatron-core issues before a GEMM start before it (its TP linear layers warn otherwise)
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# How long torchrun lets workers finish after a SIGTERM before it SIGKILLs them: the last step and
# the checkpoint saved before exiting (--exit-signal-handler). torchrun's default, 30 s, killed
# saves of large models; 110 s fits inside the 120 s launch/slurm.sbatch signals before its limit.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}
require_count TORCH_ELASTIC_SHUTDOWN_TIMEOUT 0 1000000000 "the seconds torchrun lets workers finish after a SIGTERM (110, the default)"
TRAIN_SCRIPT=${TRAIN_SCRIPT:-"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/pretrain_gpt.py"}

args=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --node-rank "$NODE_RANK")
rdzv_args=()
if [[ "$NNODES" == 1 && -z "${MASTER_ADDR:-}" ]]; then
    args+=(--standalone)
elif [[ -n "${MASTER_ADDR:-}" ]]; then
    args+=(--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT:-29500}")
    rdzv_args=(--rdzv-id "${RDZV_ID:-megatron_ext}")
else
    echo "error: NNODES=$NNODES needs MASTER_ADDR (the rendezvous host, e.g. the first node)" >&2
    exit 2
fi

marker_root=$(mktemp -d "${TMPDIR:-/tmp}/megatron_ext_exit.XXXXXX") || exit 1
trap 'rm -rf "$marker_root"' EXIT
export MEGATRON_EXT_MAX_RESTARTS=$MAX_RESTARTS
stopping=0

# One torchrun run (attempt $1, then the worker's arguments) with its own marker directory; sets rc.
run_attempt() {
    local n=$1
    shift
    MEGATRON_EXT_EXIT_MARKER_DIR="$marker_root/attempt$n"
    mkdir "$MEGATRON_EXT_EXIT_MARKER_DIR" || exit 1
    export MEGATRON_EXT_EXIT_MARKER_DIR MEGATRON_EXT_RESTART_ATTEMPT=$n
    local rdzv=("${rdzv_args[@]}")
    if (( n > 0 )); then
        export MEGATRON_EXT_RESUME_FROM_SAVE=1
        (( ${#rdzv[@]} )) && rdzv[1]="${rdzv[1]}.restart$n"
    fi
    # A command started with `&` by a script (no job control) gets SIGINT and SIGQUIT ignored, and
    # torchrun sets its own handlers only when it starts its workers: the SIGINT forwarded below (Ctrl-C)
    # did nothing before, e.g. while it waited in the rendezvous for the other nodes. Restore them.
    # torchrun copies the root cause's error file (a worker's error, pretrain_gpt.py writes it) to
    # its own, and without one logs an "E ... no error file defined for parent" line after a failure
    ( trap - INT QUIT
      export TORCHELASTIC_ERROR_FILE=${TORCHELASTIC_ERROR_FILE:-"$MEGATRON_EXT_EXIT_MARKER_DIR/torchrun_error.json"}
      exec torchrun "${args[@]}" "${rdzv[@]}" "$TRAIN_SCRIPT" "$@" ) &
    pid=$!
    (( stopping )) && kill -TERM "$pid" 2>/dev/null  # a signal between attempts, before pid was this one
    # A trapped signal interrupts `wait`: wait again until torchrun is gone, then read its status
    # (bash remembers it, so the last `wait` also covers torchrun exiting during the trap).
    while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done
    wait "$pid"
    rc=$?
}

pid=
trap 'stopping=1; [[ -n "$pid" ]] && kill -TERM "$pid" 2>/dev/null' TERM
trap 'stopping=1; [[ -n "$pid" ]] && kill -INT "$pid" 2>/dev/null' INT
shopt -s nullglob
attempt=0 last_failure= same=0
while true; do
    run_attempt "$attempt" "$@"
    dir=$MEGATRON_EXT_EXIT_MARKER_DIR
    markers=("$dir"/rank*.ok)
    if [[ "$NPROC_PER_NODE" =~ ^[0-9]+$ ]] && (( ${#markers[@]} == NPROC_PER_NODE )); then
        stopped=$(grep -l '^stopped' "${markers[@]}" 2>/dev/null | head -n 1)
        [[ -n "$stopped" ]] && exit "$STOPPED_EXIT_CODE"
        exit 0
    fi
    no_retry=("$dir"/rank*.noretry)
    if (( ${#no_retry[@]} )); then  # the worker's own code (torchrun reports 1 for any failure)
        read -r code reason < "${no_retry[0]}"
        if (( MAX_RESTARTS )); then
            echo "launch/torchrun.sh: not restarting: a worker stopped on $reason, which a restart would repeat" >&2
        else  # the last line, after torchrun's failure summary (whose root cause names the error)
            echo "launch/torchrun.sh: exit ${code:-$rc}: a worker stopped on $reason" >&2
        fi
        exit "${code:-$rc}"
    fi
    (( rc == 0 )) && exit 0
    if (( MAX_RESTARTS == 0 && ! stopping )); then
        exit "$RETRYABLE_EXIT_CODE"  # a crash no worker called final: a new start may get past it
    fi
    if (( stopping )); then
        echo "launch/torchrun.sh: not restarting: this launcher was asked to stop (SIGTERM/SIGINT)" >&2
        exit "$rc"
    fi
    iteration=
    for f in "$dir"/rank*.iteration; do
        read -r it < "$f" || continue
        [[ "$it" =~ ^[0-9]+$ ]] && (( it > ${iteration:-0} )) && iteration=$it
    done
    where=${iteration:+"at iteration $iteration"}
    where=${where:-"before its first iteration"}
    failure="torchrun exit code $rc $where"
    if [[ "$failure" == "$last_failure" ]]; then same=$((same + 1)); else same=1; fi
    last_failure=$failure
    if (( same >= SAME_FAILURE_LIMIT )); then
        echo "launch/torchrun.sh: not restarting: the same failure ($failure) happened $same times in a row" >&2
        exit "$rc"
    fi
    if (( attempt >= MAX_RESTARTS )); then
        echo "launch/torchrun.sh: not restarting: $failure, and MAX_RESTARTS=$MAX_RESTARTS restarts are used up" \
             "(exit $RETRYABLE_EXIT_CODE: a new start from the newest complete checkpoint may get past it)" >&2
        exit "$RETRYABLE_EXIT_CODE"
    fi
    attempt=$((attempt + 1))
    echo "launch/torchrun.sh: $failure; restart $attempt of $MAX_RESTARTS, from the newest complete checkpoint" \
         "in --save" >&2
done
