#!/usr/bin/env bash
# A real one-node SLURM on the local host, for kdrun's `slurm` tests and for trying launcher=slurm.
#
#   scripts/setup/slurm_localhost.sh start [DIR]   # prints: export SLURM_CONF=DIR/slurm.conf
#   scripts/setup/slurm_localhost.sh stop  [DIR]   # cancels the jobs, ends their steps and the daemons `start` started
#   scripts/setup/slurm_localhost.sh status [DIR]
#
# As root on Debian/Ubuntu: installs slurm-wlm and munge from the distribution's packages when
# absent, writes a one-node configuration under DIR (default /tmp/kdrun-slurm: controller and
# node on this host, proctrack/linuxproc, task/none, no accounting, a `debug` partition with
# every core and most of the memory), starts munged (as the munge user, unless one already runs),
# slurmctld and slurmd, and waits until `sinfo` shows the node idle. Nothing outside DIR is
# changed except the packages and munge's key/socket directories the packages own.
# Exit status: 0 ready, 1 failed (the daemons' logs are in DIR), 3 cannot run here (not root,
# not Debian, packages unavailable): tests skip on 3.
case "${1:-}" in -h|--help) sed -n "2,/^[^#]/{/^#/s/^# \{0,1\}//p}" "$0"; exit 0 ;; esac
set -euo pipefail

cmd=${1:-}
DIR=${2:-${KDRUN_SLURM_DIR:-/tmp/kdrun-slurm}}
CONF="$DIR/slurm.conf"

cannot() { echo "slurm_localhost: cannot run here: $*" >&2; exit 3; }
fail() { echo "slurm_localhost: $*" >&2; for f in "$DIR"/*.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -20 "$f" >&2; }; done; exit 1; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return 0
  [ "$(id -u)" = 0 ] || cannot "slurm-wlm/munge are not installed and this is not root"
  command -v apt-get >/dev/null || cannot "no apt-get (not Debian/Ubuntu)"
  echo "slurm_localhost: installing slurm-wlm and munge (apt-get)" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) >"${TMPDIR:-/tmp}/slurm_localhost-apt.log" 2>&1 \
    || cannot "apt-get install slurm-wlm munge failed (see ${TMPDIR:-/tmp}/slurm_localhost-apt.log)"
}

start_munge() {
  if munge -n </dev/null >/dev/null 2>&1; then return 0; fi  # a munged is already serving this host
  [ -s /etc/munge/munge.key ] || { mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
      || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  runuser -u munge -- /usr/sbin/munged --pid-file="/run/munge/kdrun-munged.pid" \
    || fail "munged did not start"
  cp /run/munge/kdrun-munged.pid "$DIR/munged.pid"
  for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && return 0; sleep 0.1; done
  fail "munged does not answer"
}

write_conf() {
  local host node mem
  host=$(hostname -s)
  # The node's real CPUs and memory as slurmd sees them; leave 1 GiB to the system.
  node=$(slurmd -C | head -1 | sed -E 's/RealMemory=[0-9]+//')
  mem=$(( $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) - 1024 ))
  mkdir -p "$DIR/state" "$DIR/spool"
  cat >"$CONF" <<EOF
# Written by kdrun's scripts/setup/slurm_localhost.sh: one node, controller and node on $host.
ClusterName=kdrun-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
# A requeued job waits for the backfill scheduler's next pass (30 s by default); each second here.
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldPort=${KDRUN_SLURMCTLD_PORT:-6817}
SlurmdPort=${KDRUN_SLURMD_PORT:-6818}
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=30
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
$node RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  # slurm-wlm 22.05 also reads cgroup.conf when present; none is needed with these plugins.
}

wait_idle() {
  for _ in $(seq 120); do
    if SLURM_CONF="$CONF" sinfo -h -o '%T' 2>/dev/null | grep -qx idle; then return 0; fi
    sleep 0.5
  done
  fail "the node did not become idle: $(SLURM_CONF="$CONF" sinfo -h 2>&1 || true)"
}

start() {
  install_packages
  [ "$(id -u)" = 0 ] || cannot "the daemons need root (slurmd runs jobs as their users)"
  mkdir -p "$DIR"
  if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid"; then
    wait_idle; echo "export SLURM_CONF=$CONF"; return 0
  fi
  start_munge
  rm -rf "$DIR/state" "$DIR/spool"  # jobs of an earlier cluster in DIR are not ours to recover
  write_conf
  export SLURM_CONF="$CONF"
  /usr/sbin/slurmctld -i -f "$CONF" || fail "slurmctld did not start"
  /usr/sbin/slurmd -f "$CONF" || fail "slurmd did not start"
  wait_idle
  echo "export SLURM_CONF=$CONF"
}

# The job steps of this cluster: each slurmstepd whose environment names $CONF (slurmd passes its
# own on), printed with everything running under it (batch script, srun, tasks), children first.
steps() {
  local p
  for p in /proc/[0-9]*; do
    [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] || continue
    tr '\0' '\n' 2>/dev/null <"$p/environ" | grep -qxF "SLURM_CONF=$CONF" || continue
    under "${p#/proc/}"; echo "${p#/proc/}"
  done
}
under() { local c; for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do under "$c"; echo "$c"; done; }

# Cancel every job and wait (up to KillWait and a margin) until squeue lists none and no step is
# left; kill what is still there after that.
end_jobs() {
  if alive "$DIR/slurmctld.pid"; then
    local ids; ids=$(SLURM_CONF="$CONF" squeue -h -o %A 2>/dev/null | sort -u || true)
    [ -z "$ids" ] || SLURM_CONF="$CONF" scancel $ids 2>/dev/null || true
    for _ in $(seq 450); do
      [ -z "$(SLURM_CONF="$CONF" squeue -h -o %A 2>/dev/null)" ] && [ -z "$(steps)" ] && return 0
      sleep 0.1
    done
  fi
  local left; left=$(steps)
  [ -z "$left" ] || { echo "slurm_localhost: killing job processes still running: $left" >&2; kill -9 $left 2>/dev/null || true; }
}

stop() {
  end_jobs
  for d in slurmd slurmctld munged; do
    local pidf="$DIR/$d.pid"
    if alive "$pidf"; then
      kill "$(cat "$pidf")" 2>/dev/null || true
      for _ in $(seq 50); do alive "$pidf" || break; sleep 0.1; done
      alive "$pidf" && kill -9 "$(cat "$pidf")" 2>/dev/null || true
    fi
    rm -f "$pidf"
  done
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  status) SLURM_CONF="$CONF" sinfo ;;
  *) echo "usage: $0 start|stop|status [DIR]" >&2; exit 2 ;;
esac
