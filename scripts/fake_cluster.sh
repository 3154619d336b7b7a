#!/usr/bin/env bash
# fake_cluster.sh — N "hosts" on this machine, for testing multi-host Helios jobs (needs root).
#
#   scripts/fake_cluster.sh up N [--rate R] [--prefix P] [--mtu M] [--hostnames a,b,...]
#   scripts/fake_cluster.sh exec I CMD...        # run CMD inside host I (its net, UTS and mount namespaces)
#   scripts/fake_cluster.sh rsh [--prefix P] HOST CMD...   # ssh-like: run the shell command CMD in the
#                                                # host named HOST (name or address), clean environment
#   scripts/fake_cluster.sh addr I               # host I's address
#   scripts/fake_cluster.sh status
#   scripts/fake_cluster.sh down [--prefix P]    # remove whatever of the cluster exists (idempotent)
#
# Each host I (0 <= I < N, N = 1..16) is
#   * a network namespace  P-hI  whose eth0 has the address 10.77.0.(I+1)/24, with lo up;
#   * a holder process (`sleep infinity`) started in that namespace under
#     `unshare --mount --uts`: its UTS namespace has the hostname P-hI (or the I-th of
#     --hostnames), its mount namespace has a private tmpfs on /dev/shm (and /sys of the
#     network namespace, from `ip netns exec`), and its own /etc/hosts naming every host of the
#     cluster (as a cluster's DNS would: schedulers and mpirun name hosts, not addresses).
#     Ranks of host I run in all three namespaces through
#     `nsenter --target <holder pid> --net --uts --mount` (what `exec` does).
# `rsh HOST CMD...` is what ssh is to a real cluster, so Open MPI's mpirun can start its
# daemons on the hosts: `mpirun --mca plm_rsh_agent "scripts/fake_cluster.sh rsh --prefix P"`.
# It runs `sh -c "CMD..."` (the words joined, as ssh does) inside the host whose name or
# address is HOST, with a login's environment (HOME, USER, LOGNAME, SHELL, a default PATH)
# and nothing else, so what a job needs on the other hosts must be passed as over ssh (-x).
# The hosts' eth0 are veth links to ports p0..p(N-1) of a bridge br0 that lives in a
# namespace of its own, P-sw: nothing of the root namespace's network config is touched.
# With --rate R (a tc rate: 1gbit, 200mbit, ...), both directions of every link are shaped
# by a token bucket, `tc qdisc add dev ... root tbf rate R burst B latency 100ms` (on the
# host's eth0 and on its bridge port), so each host sends and receives at most R.  netem is
# not needed (bandwidth, not latency, is shaped).
#
# State (holder pids, addresses, names, the hosts file) is kept in /run/helios-fake-cluster/P/;
# `down` kills the holders it recorded, then deletes every namespace named P-*, so it also
# cleans up after an `up` that failed half way.  Prefix default: hfc.  tests/cluster_fixture.py drives this
# script with a unique prefix per test and always calls `down` (in a finally).
set -euo pipefail

PREFIX=hfc
die() { echo "fake_cluster.sh: $*" >&2; exit 2; }

state_dir() { echo "/run/helios-fake-cluster/$PREFIX"; }

down() {
    local d; d=$(state_dir)
    if [[ -d $d ]]; then
        for f in "$d"/holder-*; do
            [[ -e $f ]] || continue
            local pid; pid=$(cat "$f")
            # Only our holder: a sleep whose environment carries our marker.
            if [[ -r /proc/$pid/environ ]] && tr '\0' '\n' < "/proc/$pid/environ" | grep -qx "HELIOS_FAKE_CLUSTER=$PREFIX"; then
                kill -KILL "$pid" 2>/dev/null || true
            fi
        done
        rm -rf "$d"
    fi
    local ns
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^${PREFIX}-(h[0-9]+|sw)$" || true); do
        # Processes still inside (ranks a test left behind) go first.
        for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns delete "$ns" 2>/dev/null || true
    done
}

up() {
    local n=$1; shift
    local rate="" mtu=1500 names=""
    while [[ $# -gt 0 ]]; do
        case $1 in
            --rate) rate=$2; shift 2 ;;
            --mtu) mtu=$2; shift 2 ;;
            --hostnames) names=$2; shift 2 ;;
            *) die "unknown option $1" ;;
        esac
    done
    [[ $n =~ ^[0-9]+$ ]] && (( n >= 1 && n <= 16 )) || die "N must be 1..16, got $n"
    [[ $(id -u) == 0 ]] || die "needs root (network namespaces, tmpfs mounts)"
    ip netns list >/dev/null 2>&1 || die "ip netns is not available"
    local d; d=$(state_dir)
    [[ -e $d ]] && die "a cluster with prefix $PREFIX exists; run: $0 down --prefix $PREFIX"
    mkdir -p "$d"
    trap 'echo "fake_cluster.sh: up failed; tearing down" >&2; down' ERR
    local sw=$PREFIX-sw
    ip netns add "$sw"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 mtu "$mtu" up
    IFS=, read -r -a hn <<< "$names"
    local i
    printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' > "$d/hosts"
    for ((i = 0; i < n; i++)); do
        echo "${hn[$i]:-$PREFIX-h$i}" > "$d/name-$i"
        printf '10.77.0.%d\t%s\n' $((i + 1)) "$(cat "$d/name-$i")" >> "$d/hosts"
    done
    for ((i = 0; i < n; i++)); do
        local h=$PREFIX-h$i addr=10.77.0.$((i + 1))
        ip netns add "$h"
        ip -n "$h" link set lo up
        # Both ends are created inside their namespaces: no name ever exists in the root namespace.
        ip -n "$sw" link add "p$i" mtu "$mtu" type veth peer name eth0 netns "$h"
        ip -n "$sw" link set "p$i" master br0 up
        ip -n "$h" link set eth0 mtu "$mtu" up
        ip -n "$h" addr add "$addr/24" dev eth0
        if [[ -n $rate ]]; then
            # burst: at least one 4 ms tick of traffic and a jumbo frame; latency bounds the queue.
            tc -n "$h" qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 100ms
            tc -n "$sw" qdisc add dev "p$i" root tbf rate "$rate" burst 256kb latency 100ms
        fi
        local name; name=$(cat "$d/name-$i")
        # The holder: own UTS and mount namespaces inside the network namespace, /dev/shm private,
        # /etc/hosts the cluster's (a bind mount: the file itself is the state directory's).
        HELIOS_FAKE_CLUSTER=$PREFIX ip netns exec "$h" unshare --mount --uts --propagation private \
            sh -c "hostname '$name' && mount -t tmpfs -o mode=1777,size=1g tmpfs /dev/shm && mount --bind '$d/hosts' /etc/hosts && echo ok > '$d/ready-$i' && exec sleep infinity" \
            >/dev/null 2>&1 &
        echo $! > "$d/holder-$i"
        echo "$addr" > "$d/addr-$i"
    done
    for ((i = 0; i < n; i++)); do
        local t=0
        until [[ -e $d/ready-$i ]]; do
            sleep 0.02; t=$((t + 1))
            (( t < 500 )) || die "host $i did not start"
        done
    done
    echo "$n" > "$d/n"
    trap - ERR
    for ((i = 0; i < n; i++)); do echo "host $i: pid $(cat "$d/holder-$i") addr $(cat "$d/addr-$i")"; done
}

holder() {
    local f; f=$(state_dir)/holder-$1
    [[ -e $f ]] || die "no host $1 in cluster $PREFIX"
    cat "$f"
}

# The index of the host named $1 (its name or its address).
host_index() {
    local d f; d=$(state_dir)
    for f in "$d"/name-* "$d"/addr-*; do
        [[ -e $f && $(cat "$f") == "$1" ]] && { echo "${f##*-}"; return; }
    done
    die "no host named $1 in cluster $PREFIX"
}

# ssh for the cluster: the words of the command joined into one shell command line (as ssh
# does), run inside the host with a fresh login environment, not the caller's.
rsh() {
    local i; i=$(host_index "$1"); shift
    local path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin user; user=$(id -un)
    exec nsenter --target "$(holder "$i")" --net --uts --mount \
        env -i HOME="$(getent passwd "$user" | cut -d: -f6)" USER="$user" LOGNAME="$user" SHELL=/bin/sh PATH="$path" \
        sh -c "$*"
}

cmd=${1:-}; shift || true
args=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --prefix) PREFIX=$2; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
    [[ ($cmd == exec || $cmd == rsh) && ${#args[@]} -ge 1 ]] && break
done
[[ $PREFIX =~ ^[a-z][a-z0-9]{0,9}$ ]] || die "prefix must be 1-10 lowercase letters/digits, starting with a letter"
case $cmd in
    up) [[ ${#args[@]} -ge 1 ]] || die "usage: $0 up N [--rate R] [--prefix P]"; up "${args[@]}" ;;
    down) down ;;
    exec)
        [[ ${#args[@]} -ge 1 && $# -ge 1 ]] || die "usage: $0 exec I CMD..."
        exec nsenter --target "$(holder "${args[0]}")" --net --uts --mount "$@" ;;
    rsh)
        [[ ${#args[@]} -ge 1 && $# -ge 1 ]] || die "usage: $0 rsh [--prefix P] HOST CMD..."
        rsh "${args[0]}" "$@" ;;
    addr) cat "$(state_dir)/addr-${args[0]}" ;;
    status)
        ip netns list | grep -E "^${PREFIX}-" || echo "no namespaces with prefix $PREFIX"
        ls "$(state_dir)" 2>/dev/null || true ;;
    *) sed -n '2,36p' "$0"; exit 2 ;;
esac
