#!/usr/bin/env bash
# A simulated cluster on one host: N "machines", each a network namespace
# with its own hostname (a UTS namespace: node1, node2, ...), joined by veth
# pairs on a bridge, with addresses that exist only inside the namespaces
# (10.213.7.K/24; the host side has none, so no traffic leaves the
# namespaces and the loopback). `mpirun` runs inside machine 1 and starts
# its daemons in the others through a launch agent that enters their
# namespace (in place of ssh); the ranks talk over TCP only (`--mca btl
# tcp,self`: no shared memory between "machines").
#
# Usage (as root):
#   scripts/netcluster.sh check
#       exits 0 when network namespaces can be made here, else prints why
#       and exits 1 (the tests skip then)
#   scripts/netcluster.sh bandwidth [MIB]
#       the link's speed: MIB (default 1024) MiB sent over TCP from machine
#       1 to machine 2, in GB/s (python3; the veth's own speed, as this
#       kernel has no traffic shaping)
#   scripts/netcluster.sh run [--machines N] [--per-machine P]
#           [--cut M (--cut-after SECONDS [--restore-after T] | --cut-when GLOB)]
#           [--mca NAME VALUE]... [--export VAR]... [--wait-empty S]
#           [--block] [--link-bytes FILE] [--supervise [--slurm]] -- PROGRAM ARGS...
#       runs PROGRAM as N*P ranks, P per machine (rank r on machine
#       r % N + 1; with --block, machine m holds ranks (m-1)*P..m*P-1, as a
#       DeviceMesh expects: neighbouring ranks on one machine), and exits
#       with mpirun's status; --link-bytes FILE writes each machine's bytes
#       sent and received on its link over the run, one line per machine
#       ("machine N tx BYTES rx BYTES"); with --cut, machine M's
#       link goes down SECONDS after the start (a network partition), and
#       with --restore-after T comes back T seconds after the start; with
#       --cut-when GLOB, as soon as a path matching GLOB exists (polled
#       every 0.1 s; for example a training state of a given step, so that
#       the cut falls at the same point of the run on a fast machine and a
#       slow one);
#       --export passes an environment variable, if set, to every rank
#       (mpirun -x);
#       --wait-empty S: after mpirun, how long the machines' processes may
#       take to end before the teardown reports them and kills them (10)
#       --supervise: runs PROGRAM itself on machine 1, not under mpirun, for
#       a program that starts mpirun itself (an elastic supervisor, such as
#       `train_lm --hosts 10.213.7.1:P,10.213.7.2:P`: machine N is
#       10.213.7.N); the cluster's mpirun settings (launch agent, TCP on
#       the cluster's network, running as root) are in its environment
#       (OMPI_MCA_*), and NETCLUSTER_HOSTS lists the machines as
#       ADDRESS:P,...
#       --slurm: with --supervise, a Slurm cluster of the machines first
#       (munge; slurmctld on machine 1; a slurmd on every machine, named
#       node1..nodeN, PER_MACHINE CPUs each), SLURM_CONF in PROGRAM's
#       environment: PROGRAM runs srun or sbatch itself; the daemons are
#       stopped after it
#
# Everything it creates (namespaces, links, the bridge, the agent and
# hostfile, every process left in a namespace) is removed on exit, also on
# failure and on Ctrl-C.
set -euo pipefail

NET=10.213.7
TAG="cdpn$$"            # unique per run: two runs never share a cluster
BRIDGE="${TAG}br"
WORK=$(mktemp -d /tmp/candle-dp-netcluster.XXXXXX)
AGENT="$WORK/agent"
HOSTS="$WORK/hosts"
MACHINES=2
PER_MACHINE=1
CUT=""
CUT_AFTER=""
CUT_WHEN=""
RESTORE_AFTER=""
WAIT_EMPTY=10
MAP_BY=node
LINK_BYTES=""
SUPERVISE=""
SLURM=""
MCA=()

die() { echo "netcluster: $*" >&2; exit 2; }

# shellcheck source=scripts/slurm_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_common.sh"

ns() { echo "${TAG}m$1"; }

# The processes still running in the namespaces.
leftovers() {
    local n
    for n in $(seq 1 "$MACHINES"); do
        ip netns pids "$(ns "$n")" 2>/dev/null | sed "s/^/machine $n: pid /" || true
    done
}

teardown() {
    local n p left
    # munged runs outside the namespaces (its socket is a file they share).
    if [ -f "$WORK/slurm/munge/munged.pid" ]; then
        kill "$(cat "$WORK/slurm/munge/munged.pid")" 2>/dev/null || true
    fi
    left=$(leftovers)
    if [ -n "$left" ]; then
        echo "netcluster: processes still running at teardown (killed now):" >&2
        echo "$left" | while read -r line; do
            pid=${line##* }
            echo "  $line $(tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null | cut -c1-120)" >&2
        done
    fi
    for n in $(seq 1 "$MACHINES"); do
        for p in $(ip netns pids "$(ns "$n")" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    done
    for n in $(seq 1 "$MACHINES"); do
        ip link del "${TAG}v$n" 2>/dev/null || true
        ip netns del "$(ns "$n")" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -rf "$WORK"
}

check() {
    if [ "$(id -u)" -ne 0 ]; then echo "netcluster: needs root (network namespaces)"; return 1; fi
    command -v ip >/dev/null || { echo "netcluster: no \`ip\` (iproute2)"; return 1; }
    command -v unshare >/dev/null || { echo "netcluster: no \`unshare\` (util-linux)"; return 1; }
    command -v mpirun >/dev/null || { echo "netcluster: no \`mpirun\` (Open MPI)"; return 1; }
    local probe="${TAG}probe"
    if ! ip netns add "$probe" 2>/dev/null; then
        echo "netcluster: cannot create a network namespace here"
        return 1
    fi
    ip netns del "$probe"
    if ! ip link add "${TAG}pb" type bridge 2>/dev/null; then
        echo "netcluster: cannot create a bridge here"
        return 1
    fi
    ip link del "${TAG}pb"
    return 0
}

up() {
    ip link add "$BRIDGE" type bridge
    ip link set "$BRIDGE" up
    local n
    for n in $(seq 1 "$MACHINES"); do
        ip netns add "$(ns "$n")"
        ip link add "${TAG}v$n" type veth peer name eth0 netns "$(ns "$n")"
        ip link set "${TAG}v$n" master "$BRIDGE"
        ip link set "${TAG}v$n" up
        ip netns exec "$(ns "$n")" ip addr add "$NET.$n/24" dev eth0
        ip netns exec "$(ns "$n")" ip link set eth0 up
        ip netns exec "$(ns "$n")" ip link set lo up
        echo "$NET.$n slots=$PER_MACHINE" >>"$HOSTS"
    done
    # The launch agent: mpirun calls it as it would call ssh
    # (`agent [options] HOST COMMAND...`); it runs COMMAND on that machine.
    cat >"$AGENT" <<AGENT
#!/usr/bin/env bash
while [[ "\$1" == -* ]]; do shift; done
host=\$1; shift
n=\${host##*.}
exec ip netns exec ${TAG}m\$n unshare --uts sh -c "hostname node\$n; \$*"
AGENT
    chmod +x "$AGENT"
}

# A Slurm cluster of the machines: munge (its socket a file every
# namespace sees), slurmctld on machine 1, slurmd nodeN on machine N.
slurm_up() {
    local dir="$WORK/slurm" n
    mkdir -p "$dir"/{state,log,munge}
    # munged runs as munge: it must reach its folder (mktemp's is 0700).
    chmod 711 "$WORK" "$dir"
    # Each node's own spool and temporary folders (PMIx makes its step's
    # folder under TmpFS: one /tmp for every node would clash).
    for n in $(seq 1 "$MACHINES"); do
        mkdir -p "$dir/spool-node$n" "$dir/tmp-node$n"
    done
    {
        echo "ClusterName=netcluster"
        echo "SlurmctldHost=node1($NET.1)"
        slurm_common_settings "$dir"
        cat <<EOF
SlurmdTimeout=10
MessageTimeout=5
SlurmdSpoolDir=$dir/spool-%n
TmpFS=$dir/tmp-%n
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmdLogFile=$dir/log/slurmd-%n.log
EOF
        for n in $(seq 1 "$MACHINES"); do
            echo "NodeName=node$n NodeHostname=node$n NodeAddr=$NET.$n CPUs=$PER_MACHINE State=UNKNOWN"
        done
        echo "PartitionName=cluster Nodes=node[1-$MACHINES] Default=YES MaxTime=INFINITE State=UP"
    } > "$dir/slurm.conf"
    slurm_start_munged "$dir"
    export SLURM_CONF="$dir/slurm.conf"
    # nsenter, not `ip netns exec`, which mounts a /sys of its own without
    # the cgroup file system slurmd looks for.
    nsenter --net="/var/run/netns/$(ns 1)" unshare --uts sh -c 'hostname node1; exec slurmctld -c' ||
        die "slurmctld did not start: $(tail -n 5 "$dir"/log/slurmctld.log 2>&1)"
    for n in $(seq 1 "$MACHINES"); do
        nsenter --net="/var/run/netns/$(ns "$n")" unshare --uts \
            sh -c "hostname node$n; exec slurmd -c -N node$n" ||
            die "slurmd node$n did not start: $(tail -n 5 "$dir/log/slurmd-node$n.log" 2>&1)"
    done
    local waited=0
    until [ "$(ip netns exec "$(ns 1)" sinfo -h -o '%T %D' 2>/dev/null | awk '$1 == "idle" {print $2}')" = "$MACHINES" ]; do
        sleep 1
        waited=$((waited + 1))
        if [ "$waited" -ge 60 ]; then
            tail -n 20 "$dir"/log/*.log >&2 || true
            die "the Slurm nodes did not become idle within 60 s"
        fi
    done
}

slurm_down() {
    local dir="$WORK/slurm" f
    ip netns exec "$(ns 1)" scancel --full --quiet 2>/dev/null || true
    for f in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid "$dir"/munge/munged.pid; do
        if [ -f "$f" ]; then kill "$(cat "$f")" 2>/dev/null || true; fi
    done
}

run() {
    [ $# -gt 0 ] || die "no program given (… run [options] -- PROGRAM ARGS)"
    up
    if [ -n "$SLURM" ]; then
        slurm_up
    fi
    local np=$((MACHINES * PER_MACHINE))
    local cutter=""
    local restorer=""
    if [ -n "$CUT_WHEN" ]; then
        (
            start=$SECONDS
            until compgen -G "$CUT_WHEN" >/dev/null; do sleep 0.1; done
            ip link set "${TAG}v$CUT" down
            echo "netcluster: machine $CUT cut off at +$((SECONDS - start))s, when $(compgen -G "$CUT_WHEN" | head -n 1) appeared" >&2
        ) &
        cutter=$!
    elif [ -n "$CUT" ]; then
        (sleep "$CUT_AFTER"; ip link set "${TAG}v$CUT" down; echo "netcluster: machine $CUT cut off at +${CUT_AFTER}s" >&2) &
        cutter=$!
        if [ -n "$RESTORE_AFTER" ]; then
            (sleep "$RESTORE_AFTER"; ip link set "${TAG}v$CUT" up; echo "netcluster: machine $CUT back at +${RESTORE_AFTER}s" >&2) &
            restorer=$!
        fi
    fi
    local status=0
    if [ -n "$SUPERVISE" ]; then
        local hosts
        hosts=$(seq 1 "$MACHINES" | sed "s/^/$NET./; s/\$/:$PER_MACHINE/" | paste -sd,)
        ip netns exec "$(ns 1)" unshare --uts env \
            OMPI_MCA_plm_rsh_agent="$AGENT" OMPI_MCA_btl=tcp,self \
            OMPI_MCA_btl_tcp_if_include="$NET.0/24" OMPI_MCA_oob_tcp_if_include="$NET.0/24" \
            OMPI_MCA_rmaps_base_oversubscribe=1 \
            OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
            NETCLUSTER_HOSTS="$hosts" ${SLURM:+SLURM_CONF="$WORK/slurm/slurm.conf"} \
            sh -c 'hostname node1; exec "$@"' sh "$@" &
        # In the background, so that a TERM or INT reaches the trap (and
        # the teardown) at once: bash runs traps only between commands.
        wait $! || status=$?
        if [ -n "$SLURM" ]; then
            slurm_down
        fi
    else
        ip netns exec "$(ns 1)" unshare --uts sh -c 'hostname node1; exec "$@"' sh \
            mpirun --allow-run-as-root --oversubscribe --hostfile "$HOSTS" --map-by "$MAP_BY" -np "$np" \
            --mca plm_rsh_agent "$AGENT" --mca btl tcp,self \
            --mca btl_tcp_if_include "$NET.0/24" --mca oob_tcp_if_include "$NET.0/24" \
            "${MCA[@]}" "$@" &
        wait $! || status=$?
    fi
    for p in $cutter $restorer; do kill "$p" 2>/dev/null || true; done
    if [ -n "$LINK_BYTES" ]; then
        : >"$LINK_BYTES"
        for n in $(seq 1 "$MACHINES"); do
            local stats=/sys/class/net/eth0/statistics
            echo "machine $n tx $(ip netns exec "$(ns "$n")" cat $stats/tx_bytes) rx $(ip netns exec "$(ns "$n")" cat $stats/rx_bytes)" >>"$LINK_BYTES"
        done
    fi
    # A machine's processes may end after mpirun (a cut-off rank ends on
    # its own timeout): give them WAIT_EMPTY seconds before the teardown
    # reports and kills what is left.
    local waited=0
    while [ -n "$(leftovers)" ] && [ "$waited" -lt $((WAIT_EMPTY * 10)) ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    return "$status"
}

bandwidth() {
    local mib=${1:-1024}
    up
    local port=5201
    ip netns exec "$(ns 2)" python3 -c '
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); c, _ = s.accept()
n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
print(n)' "$port" >"$WORK/received" &
    local receiver=$!
    sleep 0.5
    ip netns exec "$(ns 1)" python3 -c '
import socket, sys, time
mib, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
c = socket.create_connection((host, port)); block = b"x" * (1 << 20)
start = time.perf_counter()
for _ in range(mib): c.sendall(block)
c.shutdown(socket.SHUT_WR); c.recv(1)
took = time.perf_counter() - start
print(f"{mib} MiB from machine 1 to machine 2 in {took:.3f} s: {mib * 1048576 / took / 1e9:.2f} GB/s")' "$mib" "$NET.2" "$port"
    wait "$receiver"
}

command=${1:-}
[ -n "$command" ] || die "usage: $0 check | run [options] -- PROGRAM ARGS..."
shift
case "$command" in
    check)
        check
        ;;
    bandwidth)
        trap teardown EXIT
        bandwidth "$@"
        ;;
    run)
        while [ $# -gt 0 ]; do
            case "$1" in
                --machines) MACHINES=$2; shift 2 ;;
                --per-machine) PER_MACHINE=$2; shift 2 ;;
                --cut) CUT=$2; shift 2 ;;
                --cut-after) CUT_AFTER=$2; shift 2 ;;
                --cut-when) CUT_WHEN=$2; shift 2 ;;
                --restore-after) RESTORE_AFTER=$2; shift 2 ;;
                --mca) MCA+=(--mca "$2" "$3"); shift 3 ;;
                --export) if [ -n "${!2+set}" ]; then MCA+=(-x "$2"); fi; shift 2 ;;
                --wait-empty) WAIT_EMPTY=$2; shift 2 ;;
                --block) MAP_BY=slot; shift ;;
                --supervise) SUPERVISE=1; shift ;;
                --slurm) SLURM=1; shift ;;
                --link-bytes) LINK_BYTES=$2; shift 2 ;;
                --) shift; break ;;
                *) die "unknown option $1" ;;
            esac
        done
        [[ "$MACHINES" =~ ^[1-9][0-9]?$ ]] || die "--machines must be 1-99"
        [[ "$PER_MACHINE" =~ ^[1-9][0-9]*$ ]] || die "--per-machine must be a positive number"
        if [ -n "$SLURM" ] && [ -z "$SUPERVISE" ]; then
            die "--slurm needs --supervise (the program starts srun itself)"
        fi
        if [ -n "$CUT" ]; then
            [[ "$CUT" =~ ^[0-9]+$ ]] && [ "$CUT" -ge 1 ] && [ "$CUT" -le "$MACHINES" ] ||
                die "--cut must name a machine, 1-$MACHINES"
            [ -n "$CUT_AFTER" ] || [ -n "$CUT_WHEN" ] || die "--cut needs --cut-after SECONDS or --cut-when GLOB"
            [ -z "$CUT_AFTER" ] || [ -z "$CUT_WHEN" ] || die "--cut takes --cut-after or --cut-when, not both"
            [ -z "$RESTORE_AFTER" ] || [ -n "$CUT_AFTER" ] || die "--restore-after goes with --cut-after"
        fi
        trap teardown EXIT
        trap 'exit 130' INT
        trap 'exit 143' TERM
        run "$@"
        ;;
    *)
        die "unknown command $command (check | run)"
        ;;
esac
