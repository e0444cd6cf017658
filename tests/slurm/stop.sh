#!/usr/bin/env bash
# Stops the cluster tests/slurm/start.sh DIR started and removes its state (DIR/log and job outputs are kept).
# Safe to run twice, on a half-started cluster, or on a DIR that no longer exists. It ends only this cluster's
# processes: those named in its pid files, and the job processes whose environment holds SLURM_CONF=DIR/etc/slurm.conf.
set -uo pipefail

DIR="${1:?usage: stop.sh DIR}"
[ -d "$DIR" ] && DIR="$(cd "$DIR" && pwd -P)"
CONF="$DIR/etc/slurm.conf"
export SLURM_CONF="$CONF"
log() { echo "[slurm stop] $*" >&2; }

# a zombie counts as ended (the init of some containers reaps orphans late, and kill -0 succeeds on a zombie)
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
wait_gone() {  # wait_gone SECONDS PID...: 0 once none is alive
  local end=$(( $(date +%s) + $1 )) p any; shift
  while :; do
    any=; for p in "$@"; do alive "$p" && any=1; done
    [ -z "$any" ] && return 0
    [ "$(date +%s)" -ge "$end" ] && return 1
    sleep 0.2
  done
}
pid_of() { cat "$1" 2>/dev/null; }

# 1. the jobs, while the controller runs: cancelled, KillWait (+5 s) to end
if alive "$(pid_of "$DIR/run/slurmctld.pid")"; then
  jobs=$(timeout 10 squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    timeout 10 scancel $jobs 2>/dev/null
    kill_wait=$(sed -n 's/^KillWait=//p' "$CONF" 2>/dev/null)
    end=$(( $(date +%s) + ${kill_wait:-10} + 5 ))
    while [ -n "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 0.3; done
  fi
fi

# 2. the daemons, together (each takes about 2 s to end on SIGTERM); SIGKILL after 10 s
pids=()
for f in "$DIR/run/slurmd.pid" "$DIR/run/slurmctld.pid" "$DIR/munge/munged.pid"; do
  p=$(pid_of "$f") && alive "$p" && { kill -TERM "$p"; pids+=("$p"); }
done
if [ ${#pids[@]} -gt 0 ] && ! wait_gone 10 "${pids[@]}"; then
  log "daemons still running after 10 s: SIGKILL ${pids[*]}"
  kill -KILL "${pids[@]}" 2>/dev/null; wait_gone 5 "${pids[@]}"
fi

# 3. what is left of the jobs: slurmstepd (reparented to init, its command line only "slurmstepd: [3.batch]") and
#    the job's processes carry SLURM_CONF=$CONF in their environment; job processes also SLURM_JOB_ID (which leaves
#    out a test runner that only exported SLURM_CONF)
left=()
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = $$ ] && continue
  grep -qzxF "SLURM_CONF=$CONF" "$d/environ" 2>/dev/null || continue
  if grep -qz '^slurmstepd:' "$d/cmdline" 2>/dev/null || grep -qz '^SLURM_JOB_ID=' "$d/environ" 2>/dev/null; then
    alive "$p" && left+=("$p")
  fi
done
if [ ${#left[@]} -gt 0 ]; then
  log "ending leftover job processes: ${left[*]}"
  kill -TERM "${left[@]}" 2>/dev/null
  wait_gone 5 "${left[@]}" || { kill -KILL "${left[@]}" 2>/dev/null; wait_gone 5 "${left[@]}"; }
fi

# 4. the state (and the short link start.sh made for the sockets)
if [ -f "$DIR/run/shortlink" ]; then l=$(cat "$DIR/run/shortlink"); [ -L "$l" ] && rm -f "$l"; fi
[ -d "$DIR" ] && rm -rf "$DIR"/{etc,state,spool,run,munge,env.sh}
exit 0
