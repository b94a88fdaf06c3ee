#!/usr/bin/env bash
# Nodes emulated on one machine, with links whose bandwidth is real: one network namespace per node,
# a veth pair between every two nodes, each direction shaped by `tc tbf` to RATE. Inside a node, traffic
# goes over its own loopback, unshaped. Node K (1-based) is reached at 127.0.K.1, the first address of
# its loopback (so PyTorch's ranks bind it with GLOO_SOCKET_IFNAME=lo); nothing outside
# 127.0.0.0/8 is used, and nothing outside the namespaces is touched. Needs root, `ip` and `tc`.
#
#   scripts/shaped-links.sh up NAME NODES RATE    # RATE as tc takes it (1gbit, 10gbit), or 0: unshaped
#   scripts/shaped-links.sh exec NAME K CMD...    # run CMD on node K
#   scripts/shaped-links.sh cut NAME K            # node K's links drop every packet, silently
#   scripts/shaped-links.sh mend NAME K RATE      # and carry RATE again
#   scripts/shaped-links.sh down NAME             # remove the namespaces (and their links)
#   scripts/shaped-links.sh check                 # can this kernel do it? (exit 0 if so)
set -euo pipefail

ns() { echo "$1-n$2"; }
nodes() { ip netns list | awk '{print $1}' | grep -E "^$1-n[0-9]+$" | sed "s/^$1-n//" | sort -n; }

up() {
  local name=$1 n=$2 rate=$3
  for k in $(seq 1 "$n"); do
    ip netns add "$(ns "$name" "$k")"
    local x="ip -n $(ns "$name" "$k")"
    # the node's address first on its loopback: the address Gloo binds for GLOO_SOCKET_IFNAME=lo, as
    # PyTorch's ranks are told (tch-dist's take TCH_DIST_HOSTNAME)
    $x link set lo up
    $x addr flush dev lo
    $x addr add "127.0.$k.1/32" dev lo
    $x addr add 127.0.0.1/8 dev lo
    ip netns exec "$(ns "$name" "$k")" sysctl -qw net.ipv4.conf.all.route_localnet=1
  done
  for i in $(seq 1 "$n"); do
    for j in $(seq $((i + 1)) "$n"); do
      ip link add "to$j" netns "$(ns "$name" "$i")" type veth peer name "to$i" netns "$(ns "$name" "$j")"
      for pair in "$i $j" "$j $i"; do
        set -- $pair
        local a=$1 b=$2 x="ip netns exec $(ns "$name" "$1")"
        $x sysctl -qw "net.ipv4.conf.to$b.route_localnet=1"
        $x ip link set "to$b" up
        $x ip route add "127.0.$b.1/32" dev "to$b" src "127.0.$a.1"
        shape "to$b" "$(ns "$name" "$a")" "$rate"
      done
    done
  done
}

# "10gbit" -> bits per second
tc_bits() {
  local v=$1 num unit
  num=${v%%[a-zA-Z]*}
  unit=${v#"$num"}
  case "$unit" in
    gbit) echo $((num * 1000000000)) ;;
    mbit) echo $((num * 1000000)) ;;
    kbit) echo $((num * 1000)) ;;
    bit | "") echo "$num" ;;
    *) echo "shaped-links: rate $v: use Nkbit, Nmbit or Ngbit" >&2; exit 2 ;;
  esac
}

# A cut link stays up (a link taken down would send a node's packets to its own loopback, refused at
# once) with a queue of no room: every packet is dropped, silently, as on a severed cable.
shape() {
  local dev=$1 ns=$2 rate=$3
  if [ "$rate" = 0 ]; then
    tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
  elif [ "$rate" = cut ]; then
    tc -n "$ns" qdisc replace dev "$dev" root pfifo limit 0
  else
    local burst=$(( $(tc_bits "$rate") / 8 / 1000 ))
    # a bucket of about 1 ms at the rate, at least 128 KiB (segmentation offload sends 64 KiB at once)
    [ "$burst" -lt 131072 ] && burst=131072
    tc -n "$ns" qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 50ms
  fi
}

links() {
  local name=$1 k=$2 rate=$3
  for j in $(nodes "$name"); do
    [ "$j" = "$k" ] && continue
    shape "to$j" "$(ns "$name" "$k")" "$rate"
    shape "to$k" "$(ns "$name" "$j")" "$rate"
  done
}

down() {
  for k in $(nodes "$1"); do
    ip netns pids "$(ns "$1" "$k")" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$(ns "$1" "$k")"
  done
}

check() {
  CHECK_NAME="tdx-check-$$"
  trap 'down "$CHECK_NAME" 2>/dev/null || true' EXIT
  up "$CHECK_NAME" 2 1gbit >/dev/null 2>&1
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) [ $# -eq 3 ] || { echo "usage: $0 up NAME NODES RATE" >&2; exit 2; }
      trap 'down "$1" 2>/dev/null || true' ERR
      up "$@" ;;
  exec) name=$1 k=$2; shift 2; exec ip netns exec "$(ns "$name" "$k")" "$@" ;;
  cut) links "$1" "$2" cut ;;
  mend) [ $# -eq 3 ] || { echo "usage: $0 mend NAME K RATE" >&2; exit 2; }
        links "$1" "$2" "$3" ;;
  down) down "$1" ;;
  check) check ;;
  *) sed -n '2,12p' "$0" >&2; exit 2 ;;
esac
