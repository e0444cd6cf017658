#!/usr/bin/env bash
# Installs what tests/slurm/start.sh needs, on Debian/Ubuntu, as root: slurmctld, slurmd, the Slurm clients and
# munge (8 packages, 3.5 MB on Debian 12; without --no-install-recommends, 43 packages). Does nothing when they are
# installed already. Exit code 0: installed; anything else: apt-get's own.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
if have slurmctld && have slurmd && have sbatch && have munged; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
slurmd -V
