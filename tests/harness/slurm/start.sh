#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for keel's SLURM tests and for trying keel's SLURM path.
#
#   sudo tests/harness/slurm/start.sh          # install (Debian/Ubuntu: slurmctld slurmd slurm-client munge) if
#                                              # missing, configure, start munged + slurmctld + slurmd, wait for idle
#   export SLURM_CONF=/tmp/keel-slurm/slurm.conf   # then srun / sbatch / squeue talk to it
#   sudo tests/harness/slurm/start.sh stop     # cancel its jobs, stop the three daemons it started
#   tests/harness/slurm/start.sh status        # exit 0 when the node answers and is usable
#
# Everything (config, munge key and socket, state, spool, logs) lives under KEEL_SLURM_DIR (default
# /tmp/keel-slurm); nothing in /etc is changed and a system munged/slurm is left alone. The node is
# "localhost" (NodeAddr 127.0.0.1) with this machine's CPUs: select/cons_tres with CR_CPU, so one task
# takes one CPU; proctrack/linuxproc and task/none, so no cgroups are needed (containers, laptops).
# Ports: KEEL_SLURM_CTLD_PORT (6817) and KEEL_SLURM_SLURMD_PORT (6818), on 127.0.0.1 only.
# Options: --no-install (fail instead of installing packages). Idempotent: a running cluster is reused.
set -euo pipefail

DIR="${KEEL_SLURM_DIR:-/tmp/keel-slurm}"
CONF="$DIR/slurm.conf"
CTLD_PORT="${KEEL_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${KEEL_SLURM_SLURMD_PORT:-6818}"
NODE=localhost
WAIT_S="${KEEL_SLURM_WAIT_S:-60}"
export SLURM_CONF="$CONF"

say() { echo "keel-slurm: $*" >&2; }

usable() {  # the controller answers and the node takes jobs
    local state
    [ -f "$CONF" ] && command -v sinfo >/dev/null || return 1
    state="$(timeout 10 sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n1)" || return 1
    case "$state" in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}

install_packages() {
    local missing=()
    for cmd in munged slurmctld slurmd sinfo; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "${NO_INSTALL:-0}" = 1 ]; then
        say "not installed: ${missing[*]} (run: sudo tests/harness/slurm/start.sh)"; return 1
    fi
    command -v apt-get >/dev/null || { say "missing ${missing[*]} and no apt-get: install SLURM and munge"; return 1; }
    say "installing slurmctld slurmd slurm-client munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    timeout 600 apt-get update -q >/dev/null
    timeout 900 apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

# A pid from one of our pid files, only if that process still runs the named daemon.
our_pid() {
    local file="$1" name="$2" pid
    [ -f "$file" ] || return 1
    pid="$(tr -dc 0-9 <"$file")"
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$name" \
        && echo "$pid"
}

write_conf() {
    local cpus; cpus="$(nproc)"
    cat >"$CONF" <<EOF
# Written by tests/harness/slurm/start.sh: a one-node cluster for keel's tests. Regenerated on every start.
ClusterName=keel
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job becomes eligible again cred_expire + 1 s later (default 120 s).
AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
# Look at pending jobs every 2 s (default 60 s / 30 s): a requeued job starts as soon as it is eligible.
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
ReturnToService=2
# Short waits: SIGTERM -> SIGKILL after 10 s at a time limit or scancel; finished jobs stay visible 5 min.
KillWait=10
MinJobAge=300
SlurmctldTimeout=60
SlurmdTimeout=60
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
    if usable; then say "reusing the running cluster ($CONF)"; return 0; fi
    install_packages
    if [ "$(id -u)" != 0 ]; then say "slurmd and munged must run as root: sudo $0"; return 1; fi
    # munge/ holds the socket (every user's srun/sbatch connects to it); secret/ the key, root only.
    mkdir -p "$DIR"/{munge,secret,state,spool,log}
    chmod 0755 "$DIR" "$DIR/munge"; chmod 0700 "$DIR/secret"
    if [ ! -s "$DIR/secret/munge.key" ]; then
        dd if=/dev/urandom of="$DIR/secret/munge.key" bs=1024 count=1 status=none
        chmod 0400 "$DIR/secret/munge.key"
    fi
    write_conf
    if ! our_pid "$DIR/munge/munged.pid" munged >/dev/null; then
        # --force: the socket lives under /tmp, whose sticky world-writable bit munged would refuse.
        munged --force --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/secret/munge.key" \
            --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
            --seed-file="$DIR/secret/munged.seed"
    fi
    # Stale controller/node daemons from an earlier start (a crashed one) are replaced.
    local pid
    for daemon in slurmd slurmctld; do
        if pid="$(our_pid "$DIR/$daemon.pid" "$daemon")"; then kill "$pid" 2>/dev/null || true; sleep 1; fi
    done
    slurmctld -f "$CONF"
    # The state folder keeps job ids counting up across starts (a new job never takes the id, hence the
    # run directory, of an old one), but jobs left in it by a start that was never stopped are stale:
    # cancel them before the node comes up, so that none runs (or is requeued) again.
    local deadline=$((SECONDS + WAIT_S)) jobs=""
    until jobs="$(timeout 10 squeue -h -o %i 2>/dev/null)"; do
        if [ $SECONDS -ge $deadline ]; then say "slurmctld does not answer"; tail -n 15 "$DIR/log/slurmctld.log" >&2; return 1; fi
        sleep 0.5
    done
    if [ -n "$jobs" ]; then
        say "cancelling jobs left from an earlier start: $(echo $jobs)"
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs || true
    fi
    slurmd -f "$CONF" -N "$NODE"
    until usable; do
        if [ $SECONDS -ge $deadline ]; then
            say "the node did not become idle within ${WAIT_S}s; last log lines:"
            tail -n 15 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
            return 1
        fi
        sleep 1
    done
    say "running: $(sinfo -h -N -o '%N %T %c CPUs') ; export SLURM_CONF=$CONF"
}

stop() {
    if [ -f "$CONF" ] && command -v squeue >/dev/null; then
        # Our private cluster: its jobs end with it (a later start must not revive them).
        local jobs; jobs="$(timeout 10 squeue -h -o %i 2>/dev/null || true)"
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086
            timeout 10 scancel --full $jobs 2>/dev/null || true
            local deadline=$((SECONDS + 20))
            while [ -n "$(timeout 10 squeue -h -o %i 2>/dev/null || true)" ] && [ $SECONDS -lt $deadline ]; do sleep 1; done
        fi
    fi
    local pid
    for entry in "slurmd:$DIR/slurmd.pid" "slurmctld:$DIR/slurmctld.pid" "munged:$DIR/munge/munged.pid"; do
        if pid="$(our_pid "${entry#*:}" "${entry%%:*}")"; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do [ -d "/proc/$pid" ] || break; sleep 0.2; done
            [ -d "/proc/$pid" ] && kill -9 "$pid" 2>/dev/null || true
            say "stopped ${entry%%:*} ($pid)"
        fi
    done
}

NO_INSTALL=0
ACTION=start
for arg in "$@"; do
    case "$arg" in
        start|stop|status) ACTION="$arg" ;;
        --no-install) NO_INSTALL=1 ;;
        *) say "unknown argument $arg (start | stop | status, --no-install)"; exit 2 ;;
    esac
done
case "$ACTION" in
    start) start ;;
    stop) stop ;;
    status) usable ;;
esac
