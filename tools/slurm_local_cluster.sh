#!/usr/bin/env bash
# A throw-away Slurm cluster on this host, to run launch/slurm.sbatch under a real Slurm:
# munged, slurmctld and two slurmd ("nodes" n1 and n2, both this host, 4 CPUs each), every file
# under DIR, nothing in /etc. Needs root (slurmd) and Debian's slurm-wlm + munge (22.05 tested):
#
#   apt-get install -y --no-install-recommends slurm-wlm munge
#   tools/slurm_local_cluster.sh start /tmp/slurm      # prints: export SLURM_CONF=/tmp/slurm/slurm.conf
#   export SLURM_CONF=/tmp/slurm/slurm.conf
#   NPROC_PER_NODE=4 sbatch --nodes 2 --cpus-per-task 4 --gpus-per-node 0 launch/slurm.sbatch \
#       --config configs/default.yaml
#   tools/slurm_local_cluster.sh stop /tmp/slurm
#
# The nodes' NodeAddr is 127.0.0.1 and their names resolve nowhere, as on clusters whose node
# names are not host names: launch/slurm.sbatch must use the NodeAddr. AuthInfo's cred_expire=10:
# Slurm holds a requeued job for cred_expire + 1 s before it may start again (default 120 s, as on
# most clusters) and sched_interval=5 lets the main scheduling loop see it eligible within 5 s (default
# 60 s): together they keep tests/slurm's requeue test about two minutes shorter. Exit status 3 when Slurm
# or munge is not installed or we are not root (tests/slurm skips with that message).
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [[ -z "$cmd" || -z "$dir" ]]; then
    echo "usage: $0 start|stop DIR" >&2
    exit 2
fi

stop() {
    for f in "$dir"/slurmd-n*.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
        [[ -f "$f" ]] && kill "$(cat "$f")" 2>/dev/null || true
    done
    sleep 1
    for f in "$dir"/slurmd-n*.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
        [[ -f "$f" ]] && kill -9 "$(cat "$f")" 2>/dev/null || true
    done
}

if [[ "$cmd" == stop ]]; then
    stop
    exit 0
fi
[[ "$cmd" == start ]] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }

for tool in slurmctld slurmd munged sbatch scontrol; do
    if ! command -v "$tool" >/dev/null 2>&1 && [[ ! -x "/usr/sbin/$tool" ]]; then
        echo "Slurm not installed: $tool not found (apt-get install slurm-wlm munge)" >&2
        exit 3
    fi
done
if [[ $(id -u) != 0 ]]; then
    echo "a local Slurm cluster needs root (slurmd runs jobs as their user)" >&2
    exit 3
fi
export PATH="$PATH:/usr/sbin"

mkdir -p "$dir/state" "$dir/spool"
dir=$(cd "$dir" && pwd)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ctld_port=$(free_port); n1_port=$(free_port); n2_port=$(free_port)

head -c 1024 /dev/urandom > "$dir/munge.key"
chmod 400 "$dir/munge.key"
munged -f --key-file="$dir/munge.key" --socket="$dir/munge.sock" --pid-file="$dir/munged.pid" \
    --log-file="$dir/munged.log" --seed-file="$dir/munge.seed"

host=$(hostname)
cat > "$dir/slurm.conf" <<EOF
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.sock,cred_expire=10
CredType=cred/munge
SlurmctldPort=$ctld_port
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmdSpoolDir=$dir/spool/%n
StateSaveLocation=$dir/state
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=30
MinJobAge=600
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$n1_port CPUs=4 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$n2_port CPUs=4 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF"
sleep 1
slurmd -f "$SLURM_CONF" -N n1
slurmd -f "$SLURM_CONF" -N n2

for _ in $(seq 60); do
    if [[ $(sinfo -h -o '%T' 2>/dev/null | sort -u) == idle ]]; then
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.5
done
echo "the local Slurm cluster did not come up; logs in $dir:" >&2
tail -n 5 "$dir"/*.log >&2 || true
stop
exit 1
