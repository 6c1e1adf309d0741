#!/usr/bin/env bash
# A one-host Slurm for tests and the local demo: munge + slurmctld + slurmd, all state in DIR.
#
#   deploy/slurm/local-slurm.sh start|stop|status|env [DIR]      (DIR defaults to /tmp/fedsched-slurm)
#
# start   writes DIR/slurm.conf and DIR/gres.conf for this host, creates a munge key in DIR
#         (the system's /etc/munge is not touched), starts munged, slurmctld and slurmd with pid
#         files and logs in DIR, and waits until `sinfo` shows the node idle. Idempotent: when the
#         three daemons of DIR already run it only waits for the node.
# stop    stops the daemons started from DIR (SIGTERM, then SIGKILL after a deadline). Idempotent.
# status  exit 0 and "up" when all three daemons of DIR run and the node answers, else exit 1.
# env     prints `export SLURM_CONF=DIR/slurm.conf` (clients find this cluster through it).
#
# Clients must use SLURM_CONF=DIR/slurm.conf (printed by start/env). Facts this relies on
# (Debian slurm-wlm 22.05, see DESIGN.md section 6): slurmd reports the machine's real CPUs and no
# GPUs, so SlurmdParameters=config_overrides lets the node declare more; GPU GRES need
# AutoDetect=off and File= pointing at files (here DIR/dev/nvidiaN, plain files); without File=
# the node registers 0 GPUs and is drained. There is no slurmdbd: AccountingStorageType is
# accounting_storage/none (so `sacct` answers "accounting storage is disabled"), and finished
# jobs are recorded by jobcomp/filetxt in DIR/jobcomp.log and kept by slurmctld for MinJobAge
# seconds, during which `scontrol show job --json` / `squeue --json` report them.
#
# Settings (environment):
#   FEDSCHED_SLURM_CTLD_PORT  slurmctld port (default 6817)
#   FEDSCHED_SLURMD_PORT      slurmd port (default 6818)
#   FEDSCHED_SLURM_NODE       node name (default fsnode1)
#   FEDSCHED_SLURM_CPUS       CPUs the node declares (default 16)
#   FEDSCHED_SLURM_MEMORY_MB  memory the node declares, MiB (default 65536)
#   FEDSCHED_SLURM_GPUS       GPU GRES "type:count,..." (default "a100:4,t4:2")
#   FEDSCHED_SLURM_PARTITION  partition name (default gpu)
#   FEDSCHED_SLURM_MIN_JOB_AGE seconds slurmctld keeps a finished job (default 600)
#   FEDSCHED_SLURM_TIMEOUT    seconds to wait for the node to be idle (default 60)
#   FEDSCHED_SLURM_SCHED_PARAMS SchedulerParameters (default: schedule on every event, no
#                             batching delay, look at 1000 jobs; 200 trivial jobs complete at
#                             ~7/s on 2 cores with Slurm's defaults, ~25/s with these)
set -euo pipefail

usage() { echo "usage: $0 start|stop|status|env [DIR]" >&2; exit 2; }
STARTING=0
die() {
  echo "local-slurm: $*" >&2
  # a failed start leaves nothing running (logs stay in DIR for the reader)
  if [ "$STARTING" -eq 1 ]; then STARTING=0; do_stop >/dev/null 2>&1 || true; fi
  exit 1
}

cmd="${1:-}"; [ -n "$cmd" ] || usage
DIR="${2:-/tmp/fedsched-slurm}"
CTLD_PORT="${FEDSCHED_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${FEDSCHED_SLURMD_PORT:-6818}"
NODE="${FEDSCHED_SLURM_NODE:-fsnode1}"
CPUS="${FEDSCHED_SLURM_CPUS:-16}"
MEMORY_MB="${FEDSCHED_SLURM_MEMORY_MB:-65536}"
GPUS="${FEDSCHED_SLURM_GPUS:-a100:4,t4:2}"
PARTITION="${FEDSCHED_SLURM_PARTITION:-gpu}"
MIN_JOB_AGE="${FEDSCHED_SLURM_MIN_JOB_AGE:-600}"
TIMEOUT="${FEDSCHED_SLURM_TIMEOUT:-60}"
SCHED_PARAMS="${FEDSCHED_SLURM_SCHED_PARAMS:-sched_min_interval=0,batch_sched_delay=0,default_queue_depth=1000}"
HOST="$(hostname -s)"

need() {
  local missing=()
  for b in munged slurmctld slurmd sinfo scontrol; do
    command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing+=("$b")
  done
  [ ${#missing[@]} -eq 0 ] || die "missing binaries: ${missing[*]} (apt-get install slurm-wlm munge)"
  [ "$(id -u)" -eq 0 ] || die "must run as root (slurmd launches jobs as their submitting user)"
}
PATH="$PATH:/usr/sbin:/sbin"

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
  mkdir -p "$DIR"/{munge,state,spool,log,dev,out}
  chmod 700 "$DIR/munge"
  local gres_decl="" i=0 t n line
  : > "$DIR/gres.conf.new"
  echo "AutoDetect=off" >> "$DIR/gres.conf.new"
  IFS=',' read -ra parts <<< "$GPUS"
  for part in "${parts[@]}"; do
    t="${part%%:*}"; n="${part##*:}"
    [[ "$t" =~ ^[a-z0-9_]+$ && "$n" =~ ^[0-9]+$ ]] || die "bad FEDSCHED_SLURM_GPUS entry '$part' (want type:count)"
    local first=$i last=$((i + n - 1))
    for ((k = first; k <= last; k++)); do touch "$DIR/dev/nvidia$k"; done
    if [ "$first" -eq "$last" ]; then files="$DIR/dev/nvidia$first"; else files="$DIR/dev/nvidia[$first-$last]"; fi
    echo "NodeName=$NODE Name=gpu Type=$t File=$files" >> "$DIR/gres.conf.new"
    gres_decl="${gres_decl:+$gres_decl,}gpu:$t:$n"
    i=$((last + 1))
  done
  mv "$DIR/gres.conf.new" "$DIR/gres.conf"
  cat > "$DIR/slurm.conf.new" <<CONF
# Written by deploy/slurm/local-slurm.sh for a one-host test/demo cluster. Do not edit: rewritten on start.
ClusterName=fedsched-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/slurmd-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log
MinJobAge=$MIN_JOB_AGE
MailProg=/bin/true
DefMemPerCPU=$((MEMORY_MB / CPUS))
MaxJobCount=100000
SchedulerParameters=$SCHED_PARAMS
KillWait=2
OverTimeLimit=0
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=10
PluginDir=/usr/lib/x86_64-linux-gnu/slurm-wlm
NodeName=$NODE NodeHostname=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEMORY_MB Gres=$gres_decl State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  mv "$DIR/slurm.conf.new" "$DIR/slurm.conf"
}

start_munge() {
  pid_alive "$DIR/munged.pid" && return 0
  if [ ! -s "$DIR/munge/munge.key" ]; then
    (umask 077; dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1 count=1024 status=none)
  fi
  chmod 600 "$DIR/munge/munge.key"
  rm -f "$DIR/munge/munge.socket.2" "$DIR/munge/munge.socket.2.lock"
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket.2" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/munge/munged.seed" \
    || die "munged failed to start; see $DIR/log/munged.log"
}

wait_for() {  # wait_for DESCRIPTION COMMAND...: poll until COMMAND succeeds or TIMEOUT passes
  local what="$1"; shift
  local deadline=$((SECONDS + TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.2
  done
}

node_idle() {
  local state
  state="$(SLURM_CONF="$DIR/slurm.conf" sinfo -h -n "$NODE" -o '%T' 2>/dev/null | head -1)"
  [ "$state" = "idle" ]
}

do_start() {
  need
  STARTING=1
  if pid_alive "$DIR/munged.pid" && pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid"; then
    wait_for "node idle" node_idle || die "daemons run but node $NODE is not idle: $(SLURM_CONF="$DIR/slurm.conf" sinfo -h -N -o '%N %T %E' 2>&1)"
    echo "local-slurm: already up in $DIR"
    echo "export SLURM_CONF=$DIR/slurm.conf"
    return 0
  fi
  write_conf
  start_munge
  export SLURM_CONF="$DIR/slurm.conf"
  if ! pid_alive "$DIR/slurmctld.pid"; then
    # -i: ignore unreadable state files from an earlier run of another version
    slurmctld -i -f "$DIR/slurm.conf" || die "slurmctld failed to start; see $DIR/log/slurmctld.log"
  fi
  wait_for "slurmctld" scontrol ping \
    || die "slurmctld does not answer on port $CTLD_PORT; see $DIR/log/slurmctld.log: $(tail -3 "$DIR/log/slurmctld.log" 2>/dev/null)"
  if ! pid_alive "$DIR/slurmd.pid"; then
    slurmd -f "$DIR/slurm.conf" -N "$NODE" || die "slurmd failed to start; see $DIR/log/slurmd-$NODE.log"
  fi
  if ! wait_for "node idle" node_idle; then
    die "node $NODE not idle after ${TIMEOUT}s: $(sinfo -h -N -o '%N %T %E' 2>&1); see $DIR/log/"
  fi
  STARTING=0
  echo "local-slurm: up in $DIR (node $NODE, gres $GPUS, ctld port $CTLD_PORT)"
  echo "export SLURM_CONF=$DIR/slurm.conf"
}

stop_pidfile() {  # stop_pidfile FILE NAME
  local f="$1" pid
  [ -s "$f" ] || return 0
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 15))
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "local-slurm: $2 ($pid) ignored SIGTERM, sending SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$f"
}

do_stop() {
  [ -d "$DIR" ] || { echo "local-slurm: nothing in $DIR"; return 0; }
  # slurmd first (it kills its job steps), then the controller and munge together (~2 s each).
  stop_pidfile "$DIR/slurmd.pid" slurmd
  stop_pidfile "$DIR/slurmctld.pid" slurmctld &
  stop_pidfile "$DIR/munged.pid" munged &
  wait
  echo "local-slurm: stopped ($DIR)"
}

do_status() {
  local ok=1
  for d in munged slurmctld slurmd; do
    if pid_alive "$DIR/$d.pid"; then echo "$d: running (pid $(cat "$DIR/$d.pid"))"; else echo "$d: not running"; ok=0; fi
  done
  if [ $ok -eq 1 ] && SLURM_CONF="$DIR/slurm.conf" sinfo -h -N -o '%N %T %G' 2>/dev/null; then
    echo "up"; return 0
  fi
  echo "down"; return 1
}

case "$cmd" in
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  env) echo "export SLURM_CONF=$DIR/slurm.conf" ;;
  *) usage ;;
esac
