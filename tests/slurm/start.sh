#!/usr/bin/env bash
# Starts a throw-away one-node Slurm cluster on localhost: munged, slurmctld and slurmd, all under DIR.
#
#   tests/slurm/start.sh DIR        # then: export SLURM_CONF=DIR/etc/slurm.conf (also written to DIR/env.sh)
#   tests/slurm/stop.sh DIR
#
# Needs root and the Debian packages slurmctld slurmd slurm-client munge (tests/slurm/install.sh). Returns once
# the node is idle (about 1 s); on failure prints the daemons' last log lines and exits 1.
# SLURM_KILL_WAIT: seconds from SIGTERM to SIGKILL when Slurm ends a job (default 10).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${1:?usage: start.sh DIR}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd -P)"
CONF="$DIR/etc/slurm.conf"
export SLURM_CONF="$CONF"   # the clients (sinfo below) find the cluster through it: there is no /etc/slurm/slurm.conf

log() { echo "[slurm start] $*" >&2; }
die() {
  log "error: $*"
  for f in "$DIR"/log/*.log "$DIR"/munge/munged.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 20 "$f" >&2; }; done
  exit 1
}
[ "$(id -u)" = 0 ] || die "must run as root (the cluster runs as SlurmUser=root)"
for b in munged slurmctld slurmd sbatch scontrol sinfo; do
  command -v "$b" >/dev/null || die "$b not found: run tests/slurm/install.sh"
done
[ ! -e "$DIR/run" ] || "$HERE/stop.sh" "$DIR"   # what a crashed earlier start left

mkdir -p "$DIR"/{etc,state,spool,log,run}
# munged checks that every folder above its socket is searchable by all ("Socket is inaccessible"); pytest's
# /tmp/pytest-of-root is 0700, hence 0755 here and --force below (all clients are root)
install -d -m 0755 "$DIR/munge"

# Unix socket paths are limited to 108 bytes, and slurmstepd makes SPOOL/<node>_<job>.<step> ones: a long DIR (as
# pytest's tmp_path) fails every launch ("Unix socket path ... is too long"). The sockets then go through a short link.
SDIR="$DIR"
if [ ${#DIR} -gt 40 ]; then
  SDIR="/tmp/slurm-$(printf %s "$DIR" | md5sum | cut -c1-8)"
  ln -sfn "$DIR" "$SDIR"
  echo "$SDIR" > "$DIR/run/shortlink"
fi

# the first two free ports from 16817 (a connection that succeeds means the port is taken)
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
CTLD_PORT=16817; while ! port_free $CTLD_PORT; do CTLD_PORT=$((CTLD_PORT + 1)); done
SLURMD_PORT=$((CTLD_PORT + 1)); while ! port_free $SLURMD_PORT; do SLURMD_PORT=$((SLURMD_PORT + 1)); done

# the node's hardware as slurmd sees it ("CPUs=2 Boards=1 ... RealMemory=24105"): a line that does not match it
# would drain the node
NODEHW="$(env -u SLURM_CONF slurmd -C | head -n 1 | sed -E 's/^NodeName=[^ ]+ //')"
[ -n "$NODEHW" ] || die "slurmd -C printed nothing"

sed -e "s|@DIR@|$DIR|g" -e "s|@SDIR@|$SDIR|g" -e "s|@NODEHW@|$NODEHW|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
    -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" -e "s|@KILL_WAIT@|${SLURM_KILL_WAIT:-10}|g" \
    "$HERE/slurm.conf.template" > "$CONF"
printf "Name=gpu File=/dev/null\nName=gpu File=/dev/zero\n" > "$DIR/etc/gres.conf"   # the template's GPUs (stand-in device files)
: > "$DIR/etc/plugstack.conf"                     # rather than /etc/slurm/plugstack.conf

dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$DIR/munge/munge.key"
munged --force --key-file="$DIR/munge/munge.key" --socket="$SDIR/munge/munge.sock" \
       --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
       --seed-file="$DIR/munge/munged.seed" || die "munged did not start"

# the daemons put themselves in the background; -i: no saved state
slurmctld -f "$CONF" -i || die "slurmctld did not start"
slurmd -f "$CONF" -N localhost || die "slurmd did not start"

deadline=$(( $(date +%s) + 30 ))
until [ "$(sinfo -h -N -o %t 2>/dev/null | head -n 1)" = idle ]; do
  [ "$(date +%s)" -lt "$deadline" ] || die "the node is not idle after 30 s: $(sinfo -h -N -o %t 2>&1 | head -n 1)"
  sleep 0.2
done
echo "export SLURM_CONF=$CONF" > "$DIR/env.sh"
log "up: $CONF (ports $CTLD_PORT, $SLURMD_PORT)"
