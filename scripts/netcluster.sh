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
#           [--cut M --cut-after SECONDS [--restore-after T]]
#           [--mca NAME VALUE]... [--export VAR]... [--wait-empty S]
#           [--block] [--link-bytes FILE] [--supervise] -- PROGRAM ARGS...
#       runs PROGRAM as N*P ranks, P per machine (rank r on machine
#       r % N + 1; with --block, machine m holds ranks (m-1)*P..m*P-1, as a
#       DeviceMesh expects: neighbouring ranks on one machine), and exits
#       with mpirun's status; --link-bytes FILE writes each machine's bytes
#       sent and received on its link over the run, one line per machine
#       ("machine N tx BYTES rx BYTES"); with --cut, machine M's
#       link goes down SECONDS after the start (a network partition), and
#       with --restore-after T comes back T seconds after the start;
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
RESTORE_AFTER=""
WAIT_EMPTY=10
MAP_BY=node
LINK_BYTES=""
SUPERVISE=""
MCA=()

die() { echo "netcluster: $*" >&2; exit 2; }

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

run() {
    [ $# -gt 0 ] || die "no program given (… run [options] -- PROGRAM ARGS)"
    up
    local np=$((MACHINES * PER_MACHINE))
    local cutter=""
    local restorer=""
    if [ -n "$CUT" ]; then
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
            NETCLUSTER_HOSTS="$hosts" \
            sh -c 'hostname node1; exec "$@"' sh "$@" || status=$?
    else
        ip netns exec "$(ns 1)" unshare --uts sh -c 'hostname node1; exec "$@"' sh \
            mpirun --allow-run-as-root --oversubscribe --hostfile "$HOSTS" --map-by "$MAP_BY" -np "$np" \
            --mca plm_rsh_agent "$AGENT" --mca btl tcp,self \
            --mca btl_tcp_if_include "$NET.0/24" --mca oob_tcp_if_include "$NET.0/24" \
            "${MCA[@]}" "$@" || status=$?
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
                --restore-after) RESTORE_AFTER=$2; shift 2 ;;
                --mca) MCA+=(--mca "$2" "$3"); shift 3 ;;
                --export) if [ -n "${!2+set}" ]; then MCA+=(-x "$2"); fi; shift 2 ;;
                --wait-empty) WAIT_EMPTY=$2; shift 2 ;;
                --block) MAP_BY=slot; shift ;;
                --supervise) SUPERVISE=1; shift ;;
                --link-bytes) LINK_BYTES=$2; shift 2 ;;
                --) shift; break ;;
                *) die "unknown option $1" ;;
            esac
        done
        [[ "$MACHINES" =~ ^[1-9][0-9]?$ ]] || die "--machines must be 1-99"
        [[ "$PER_MACHINE" =~ ^[1-9][0-9]*$ ]] || die "--per-machine must be a positive number"
        if [ -n "$CUT" ]; then
            [[ "$CUT" =~ ^[0-9]+$ ]] && [ "$CUT" -ge 1 ] && [ "$CUT" -le "$MACHINES" ] ||
                die "--cut must name a machine, 1-$MACHINES"
            [ -n "$CUT_AFTER" ] || die "--cut needs --cut-after SECONDS"
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
