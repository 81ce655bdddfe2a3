#!/usr/bin/env bash
# A real single-node SLURM on this machine, for testing the SLURM profile (CI runs it; root only).
#
#     scripts/slurm_local.sh start    # write /etc/slurm/slurm.conf, start munged, slurmctld, slurmd; wait for an idle node
#     scripts/slurm_local.sh stop     # stop the three daemons by the PIDs `start` recorded
#     scripts/slurm_local.sh status   # sinfo, or exit 1 when it is not running
#
# Needs Debian's munge, slurmctld, slurmd and slurm-client (SLURM 22.05); no systemd. The node
# claims VLGRPO_SLURM_CPUS CPUs (default 32) and VLGRPO_SLURM_MEM_MB of memory (default 256 GiB),
# more than the machine may have (slurm.conf wins; memory is not a consumed resource), so that jobs
# with profiles/slurm's requests fit and a validation runs beside a training segment as on a
# cluster; and VLGRPO_SLURM_GPUS fake GPUs (default 2): character devices with /dev/null's numbers,
# listed as Gres=gpu:N, so jobs that ask for GPUs are scheduled and get CUDA_VISIBLE_DEVICES.
# slurm.conf must live at /etc/slurm/slurm.conf: the executor plugin clears SLURM_* variables
# (SLURM_CONF too) before its srun. No accounting (no slurmdbd): `sacct` fails here, so status
# queries must use squeue (`--slurm-status-command squeue`, see profiles/slurm/config.yaml).
# Runtime state (PIDs, logs, spool) lives in VLGRPO_SLURM_DIR (default /tmp/vlgrpo-slurm).
set -euo pipefail

STATE=${VLGRPO_SLURM_DIR:-/tmp/vlgrpo-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by vlgrpo scripts/slurm_local.sh"
CPUS=${VLGRPO_SLURM_CPUS:-32}
GPUS=${VLGRPO_SLURM_GPUS:-2}
MEM_MB=${VLGRPO_SLURM_MEM_MB:-262144}
DAEMONS=(slurmd slurmctld munged)  # stop order

die() { echo "slurm_local: $*" >&2; exit 1; }

write_conf() {
    if [[ -e $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; refusing to replace a real cluster's config"
    fi
    local host
    host=$(hostname -s)
    mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d"
    for ((i = 0; i < GPUS; i++)); do
        [[ -c /dev/vlgrpo_fakegpu$i ]] || mknod /dev/vlgrpo_fakegpu$i c 1 3
    done
    cat > "$CONF" <<EOF
$MARK
ClusterName=vlgrpo-ci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid.conf
SlurmdPidFile=$STATE/slurmd.pid.conf
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# squeue answers for finished jobs this long (the plugin's status queries rely on it)
MinJobAge=600
KillWait=10
SchedulerParameters=sched_interval=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    if ((GPUS > 0)); then
        echo "Name=gpu File=/dev/vlgrpo_fakegpu[0-$((GPUS - 1))]" > /etc/slurm/gres.conf
    else
        : > /etc/slurm/gres.conf
    fi
}

# Start a daemon in the foreground of a background job in its own session (setsid and setpriv
# exec, so $! is the daemon itself): its PID is ours to stop, and no signal to our caller reaches it.
launch() {
    local name=$1
    shift
    setsid "$@" < /dev/null > "$STATE/$name.out" 2>&1 &
    echo $! > "$STATE/$name.pid"
}

alive() { [[ -f $STATE/$1.pid ]] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }

start() {
    [[ $(id -u) == 0 ]] || die "must run as root (it writes $CONF and starts daemons)"
    for d in "${DAEMONS[@]}"; do
        alive "$d" && die "$d is already running (pid $(cat "$STATE/$d.pid")); run '$0 stop' first"
    done
    write_conf
    install -d -o munge -g munge -m 0755 /run/munge
    launch munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground
    for _ in $(seq 50); do [[ -S /run/munge/munge.socket.2 ]] && break; sleep 0.1; done
    [[ -S /run/munge/munge.socket.2 ]] || die "munged did not start: $(cat "$STATE/munged.out")"
    launch slurmctld /usr/sbin/slurmctld -D -c -i
    launch slurmd /usr/sbin/slurmd -D
    for _ in $(seq 60); do
        if [[ $(sinfo -h -N -o %T 2>/dev/null) == idle ]]; then
            sinfo -N -o "%N %T %c %m %G"
            return 0
        fi
        sleep 1
    done
    sinfo -N -l >&2 || true
    tail -n 20 "$STATE"/slurmctld.log "$STATE"/slurmd.log >&2 || true
    stop
    die "the node did not become idle within 60 s"
}

stop() {
    local d pid
    for d in "${DAEMONS[@]}"; do
        [[ -f $STATE/$d.pid ]] || continue
        pid=$(cat "$STATE/$d.pid")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid"
            for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
            wait "$pid" 2>/dev/null || true
        fi
        rm -f "$STATE/$d.pid"
    done
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) sinfo -N -o "%N %T %c %m %G" ;;
    *) die "usage: $0 start|stop|status" ;;
esac
