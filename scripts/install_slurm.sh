#!/usr/bin/env bash
# Slurm for tests/slurm: Debian's slurm-wlm and munge (tools/slurm_local_cluster.sh runs a one-host
# cluster of two nodes with them). Installed only where we are root and apt-get works; elsewhere one
# line says why, and tests/slurm skips with the reason. SKIP_SLURM_INSTALL=1 leaves the machine as it is.
# Never fails the caller: the Slurm tests are the only ones that need it.
set -uo pipefail
export PATH="$PATH:/usr/sbin"
installed() { command -v sbatch >/dev/null 2>&1 && command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; }
if installed; then
  exit 0
fi
if [[ "${SKIP_SLURM_INSTALL:-0}" == 1 ]]; then
  echo "scripts/install_slurm.sh: SKIP_SLURM_INSTALL=1: Slurm not installed; tests/slurm will skip" >&2
  exit 0
fi
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "scripts/install_slurm.sh: not root or no apt-get: Slurm not installed; tests/slurm will skip" >&2
  exit 0
fi
log=$(mktemp /tmp/install_slurm.XXXXXX.log)
echo "installing slurm-wlm and munge for tests/slurm (apt-get; log: $log) ..." >&2
export DEBIAN_FRONTEND=noninteractive
apt_install() { timeout 900 apt-get install -y --no-install-recommends slurm-wlm munge >>"$log" 2>&1; }
# the package lists of a fresh image may be missing or stale: update once when the first try fails
if ! apt_install && ! { timeout 300 apt-get update >>"$log" 2>&1 && apt_install; }; then
  echo "scripts/install_slurm.sh: apt-get could not install slurm-wlm and munge (last lines of $log below);" \
       "tests/slurm will skip" >&2
  tail -n 5 "$log" >&2
  exit 0
fi
installed && echo "installed slurm-wlm $(dpkg-query -W -f '${Version}' slurm-wlm 2>/dev/null) and munge" >&2
exit 0
