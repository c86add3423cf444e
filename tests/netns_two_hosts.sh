#!/usr/bin/env bash
# The 2x4 example as two hosts of 4 ranks each: two network namespaces joined by a veth pair with private
# addresses that this test creates (and removes), the rendezvous on the first host's address. The losses must
# equal those of the same job on one host. Needs root and iproute2; otherwise it says so and skips (exit 77).
set -euo pipefail
bin=$1 config=$2
steps=3
if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null; then
  echo "SKIPPED: needs root and iproute2 (ip netns) to create two test hosts"; exit 77
fi
suffix=$$
host0=smp${suffix}a host1=smp${suffix}b link0=smpv${suffix}a link1=smpv${suffix}b
# 10.<a>.<b>.0/24 from the pid, so that concurrent runs of this test do not collide.
subnet="10.$((200 + suffix % 50)).$((suffix / 50 % 250))"
addr0=$subnet.1 addr1=$subnet.2
work=$(mktemp -d)
cleanup() {
  ip netns del "$host0" 2>/dev/null || true
  ip netns del "$host1" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
if ! ip netns add "$host0" 2>"$work/err"; then
  echo "SKIPPED: cannot create network namespaces here: $(cat "$work/err")"; exit 77
fi
ip netns add "$host1"
ip link add "$link0" type veth peer name "$link1"
ip link set "$link0" netns "$host0"
ip link set "$link1" netns "$host1"
ip -n "$host0" addr add "$addr0/24" dev "$link0"
ip -n "$host1" addr add "$addr1/24" dev "$link1"
for host in "$host0" "$host1"; do ip -n "$host" link set lo up; done
ip -n "$host0" link set "$link0" up
ip -n "$host1" link set "$link1" up

export OMP_NUM_THREADS=1
port=29500
launch() {  # host node_rank
  timeout -k 5 240 ip netns exec "$1" "$bin/smprun" -n 4 --nodes 2 --node-rank "$2" --master-addr "$addr0" \
    --master-port "$port" --job-id "netns$suffix" -- "$bin/hybrid_2x4" --config "$config" --steps "$steps"
}
launch "$host0" 0 >"$work/host0.log" 2>&1 &
first=$!
launch "$host1" 1 >"$work/host1.log" 2>&1 || { echo "host 1 failed:"; cat "$work/host1.log"; exit 1; }
wait "$first" || { echo "host 0 failed:"; cat "$work/host0.log"; exit 1; }
timeout -k 5 240 "$bin/smprun" -n 8 -- "$bin/hybrid_2x4" --config "$config" --steps "$steps" >"$work/one.log" 2>&1 ||
  { echo "single-host run failed:"; cat "$work/one.log"; exit 1; }

grep -o 'step [0-9]* loss [0-9.]*' "$work/host0.log" >"$work/two_hosts.losses"
grep -o 'step [0-9]* loss [0-9.]*' "$work/one.log" >"$work/one_host.losses"
echo "two hosts ($addr0, $addr1):"; cat "$work/two_hosts.losses"
echo "one host:"; cat "$work/one_host.losses"
[ "$(wc -l <"$work/two_hosts.losses")" -eq "$steps" ] || { echo "expected $steps step lines"; cat "$work/host0.log"; exit 1; }
# Both runs print 6 decimals; the reduction order is the same, so the lines must agree exactly.
diff "$work/two_hosts.losses" "$work/one_host.losses"
echo "two-host run matches the one-host run"
