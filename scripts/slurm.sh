#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the tests and for trying the
# sbatch/srun workflow without a cluster: munge, slurmctld and slurmd, all
# local, configured in a folder of their own (SLURM_CONF points there), no
# cgroups, no accounting database.
#
# Usage (as root; Debian's slurm-wlm and munge installed, as .ci/run does):
#   scripts/slurm.sh check
#       exits 0 when Slurm can run here (the daemons exist and we are root),
#       else prints why and exits 1 (the tests skip then)
#   scripts/slurm.sh up DIR
#       starts the daemons with their state and configuration in DIR and
#       waits until the node takes jobs; prints `export SLURM_CONF=...`
#   scripts/slurm.sh down DIR
#       stops the daemons started with DIR and every job step left
#
# The node says it has 8 CPUs whatever the machine has (SlurmdParameters=
# config_overrides), so that `srun -n 4` runs on a 2-core machine; jobs
# share the cores as mpirun's --oversubscribe lets them.
set -euo pipefail

die() { echo "slurm: $*" >&2; exit 2; }

# shellcheck source=scripts/slurm_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_common.sh"

check() {
    local missing=()
    for tool in munged slurmctld slurmd srun sinfo scancel; do
        command -v "$tool" > /dev/null || missing+=("$tool")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "not installed: ${missing[*]} (apt-get install -y slurm-wlm munge)"
        return 1
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "not root: the daemons need root here"
        return 1
    fi
    return 0
}

up() {
    local dir=$1
    mkdir -p "$dir"/{spool,state,log,munge}
    dir=$(cd "$dir" && pwd)
    local host
    host=$(hostname -s)
    {
        echo "ClusterName=candledp"
        echo "SlurmctldHost=$host(127.0.0.1)"
        slurm_common_settings "$dir"
        cat <<EOF
SlurmctldPort=6917
SlurmdPort=6918
SlurmdSpoolDir=$dir/spool
SlurmdPidFile=$dir/slurmd.pid
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
EOF
    } > "$dir/slurm.conf"
    slurm_start_munged "$dir"
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -c
    slurmd -c
    local waited=0
    until sinfo -h -o %T 2>/dev/null | grep -q idle; do
        sleep 1
        waited=$((waited + 1))
        if [ "$waited" -ge 60 ]; then
            tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
            die "the node did not become idle within 60 s"
        fi
    done
    echo "export SLURM_CONF=$dir/slurm.conf"
}

down() {
    local dir=$1
    export SLURM_CONF="$dir/slurm.conf"
    # Every job of this cluster ends first (its steps' slurmstepd with
    # it): only this cluster's, whatever else runs on the machine.
    scancel --full --quiet --partition local 2> /dev/null || true
    local waited=0
    while [ -n "$(squeue -h 2> /dev/null)" ] && [ "$waited" -lt 30 ]; do
        sleep 1
        waited=$((waited + 1))
    done
    for pidfile in slurmd.pid slurmctld.pid munge/munged.pid; do
        if [ -f "$dir/$pidfile" ]; then
            kill "$(cat "$dir/$pidfile")" 2> /dev/null || true
        fi
    done
}

case "${1:-}" in
    check) check ;;
    up) [ $# -eq 2 ] || die "usage: $0 up DIR"; check > /dev/null || die "$(check)"; up "$2" ;;
    down) [ $# -eq 2 ] || die "usage: $0 down DIR"; down "$2" ;;
    *) die "usage: $0 check | up DIR | down DIR" ;;
esac
