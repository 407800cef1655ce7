#!/usr/bin/env bash
# Runs an MPI program with each rank in its own network namespace ("host"),
# joined by veth pairs to a bridge, so that Open MPI's TCP transport carries
# every byte across a real network stack. The 10.213.77.0/24 addresses exist
# only inside these namespaces and this script's bridge, which it removes.
#
# usage: netns_hosts.sh NRANKS PROGRAM [ARGS...]
# Exit 77 (skipped) with the reason when the machine forbids namespaces.
set -uo pipefail
n=${1:?ranks}; shift
prog=$(readlink -f "${1:?program}"); shift

skip() { echo "SKIP: $*"; exit 77; }
[[ $(id -u) -eq 0 ]] || skip "network namespaces need root"
command -v ip >/dev/null || skip "iproute2 (ip) is not installed"
command -v mpirun >/dev/null || skip "mpirun is not installed"

tag="gs$$"
bridge="${tag}br"
cleanup() {
  for ((i = 0; i < n; i++)); do
    ip netns del "${tag}h$i" 2>/dev/null
    ip link del "${tag}v$i" 2>/dev/null
  done
  ip link del "$bridge" 2>/dev/null
}
trap cleanup EXIT

ip link add "$bridge" type bridge 2>/dev/null || skip "cannot create a bridge (no CAP_NET_ADMIN?)"
ip link set "$bridge" up
# The launcher stays in this namespace; its PMIx server must be reachable
# from the hosts, so the bridge gets an address and PMIx listens on it.
ip addr add 10.213.77.1/24 dev "$bridge"
export PMIX_MCA_ptl_tcp_remote_connections=1
export PMIX_MCA_ptl_tcp_if_include=10.213.77.0/24
for ((i = 0; i < n; i++)); do
  ns="${tag}h$i"
  ip netns add "$ns" || skip "cannot create network namespaces here"
  ip link add "${tag}v$i" type veth peer name eth0 netns "$ns" || skip "cannot create veth pairs"
  ip link set "${tag}v$i" master "$bridge" up
  ip -n "$ns" addr add "10.213.77.$((i + 10))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
done

# One MPMD slot per rank, each started inside its host's namespace. Shared
# memory between ranks is switched off (btl tcp,self), so nothing takes a
# short cut around the network.
app=()
for ((i = 0; i < n; i++)); do
  ((i)) && app+=(":")
  app+=(-np 1 ip netns exec "${tag}h$i" "$prog" "$@")
done
echo "ranks on hosts 10.213.77.10..$((n + 9)), one network namespace each"
mpirun --allow-run-as-root --oversubscribe \
  --mca btl tcp,self --mca btl_tcp_if_include 10.213.77.0/24 \
  --mca oob_tcp_if_include 10.213.77.0/24 \
  --mca pml ob1 \
  "${app[@]}"
