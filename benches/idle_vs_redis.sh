#!/usr/bin/env bash
# What an idle sidecar costs, beside an idle Redis (results in BENCHMARKS.md).
#
#   bash benches/idle_vs_redis.sh
#
# A fleet of edge sidecars is idle most of the time, so what one costs with no traffic
# is paid everywhere. On loopback, all at once: a lone tallyd (default settings, one rule,
# no peers), two tallyd joined as peers (default gossip intervals), and redis-server
# (default `hz 10`, no persistence) as the peer. After SETTLE_SECS (5) unmeasured, it
# reads for IDLE_SECS (30), per process, summed over its threads: CPU time (utime + stime
# from /proc/<pid>/stat) and wake-ups (context switches from /proc/<pid>/task/*/status:
# each time a thread slept and was woken, or was preempted). No client connects.
#
# BASELINE=path/to/tally adds a lone tallyd run from that binary, for a before-and-after
# in the same run.
#
# Installs redis-server and redis-tools from apt if they are missing (needs root).
# Kills everything it started when it exits.
set -euo pipefail

cd "$(dirname "$0")/.."

SETTLE_SECS=${SETTLE_SECS:-5}
IDLE_SECS=${IDLE_SECS:-30}
BASELINE=${BASELINE:-}
REDIS_PORT=${REDIS_PORT:-6401}
# Apart from the ports of client_vs_redis.sh and exact_vs_redis.sh.
BASE_PORT=${BASE_PORT:-17400} # tallyd n uses BASE_PORT + 10n (client), +1 (gossip), +2 (http)

say() { echo "idle_vs_redis: $*" >&2; }
# shellcheck source=benches/redis_side.sh
source benches/redis_side.sh

pids=()
work=$(mktemp -d -t tally-idle.XXXXXX)
trap 'stop_started "$work"' EXIT
trap 'exit 130' INT TERM

install_redis
say "building tally"
cargo build --release -p tally >&2
cp target/release/tally "$work/tally"
if [ -n "$BASELINE" ]; then
    cp "$BASELINE" "$work/tally-baseline"
fi
"$work/tally" certs --out "$work/certs" --nodes 1,2,3,4 >/dev/null

# Refuse to start if another process answers on a port: the runs would measure it.
for port in "$REDIS_PORT" $(for n in 1 2 3 4; do seq $((BASE_PORT + 10 * n)) $((BASE_PORT + 10 * n + 2)); done); do
    if port_taken "$port"; then
        say "127.0.0.1:$port is already in use; set BASE_PORT or REDIS_PORT"
        exit 1
    fi
done

# start_tallyd BINARY N [PEER]: node N, seeded with node PEER if given.
start_tallyd() {
    local binary=$1 n=$2 peer=${3:-}
    local client=$((BASE_PORT + 10 * n)) config="$work/node-$n.toml"
    {
        echo "node_id = $n"
        echo "listen_client = \"127.0.0.1:$client\""
        echo "listen_gossip = \"127.0.0.1:$((client + 1))\""
        echo "listen_http = \"127.0.0.1:$((client + 2))\""
        if [ -n "$peer" ]; then
            echo "seeds = [{ node = $peer, addr = \"127.0.0.1:$((BASE_PORT + 10 * peer + 1))\" }]"
        fi
        echo "tls = { ca = \"$work/certs/ca.pem\", cert = \"$work/certs/node-$n.pem\", key = \"$work/certs/node-$n.key\" }"
        echo "[[rules]]"
        echo "name = \"idle\""
        echo "limit = 100"
        echo "window_secs = 60"
    } >"$config"
    "$binary" daemon --config "$config" >"$work/node-$n.log" 2>&1 &
    pids+=($!)
    wait_port "$client" "$!"
}

names=()
watched=()
start_tallyd "$work/tally" 1
names+=("tallyd, alone")
watched+=("${pids[-1]}")
start_tallyd "$work/tally" 2 3
start_tallyd "$work/tally" 3 2
names+=("tallyd, one of a joined pair" "tallyd, the other of the pair")
watched+=("${pids[-2]}" "${pids[-1]}")
if [ -n "$BASELINE" ]; then
    start_tallyd "$work/tally-baseline" 4
    names+=("tallyd from BASELINE, alone")
    watched+=("${pids[-1]}")
fi
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize no --dir "$work" >"$work/redis.log" 2>&1 &
pids+=($!)
wait_port "$REDIS_PORT" "$!"
names+=("redis-server (hz 10)")
watched+=("${pids[-1]}")

# cpu_ticks PID: utime + stime of every thread, in clock ticks.
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
# wakeups PID: context switches of every thread so far. A thread that ends between two
# readings takes its count with it; the idle servers here start none.
wakeups() {
    cat /proc/"$1"/task/*/status 2>/dev/null | awk '/ctxt_switches/ { n += $2 } END { print n }'
}

say "servers up; settling for ${SETTLE_SECS}s, then measuring ${IDLE_SECS}s"
sleep "$SETTLE_SECS"
declare -a cpu0 wake0
for i in "${!watched[@]}"; do
    cpu0[i]=$(cpu_ticks "${watched[i]}")
    wake0[i]=$(wakeups "${watched[i]}")
done
sleep "$IDLE_SECS"
hz=$(getconf CLK_TCK)
echo "| process | CPU ms per s | wake-ups per s |"
echo "|---|---:|---:|"
for i in "${!watched[@]}"; do
    cpu=$(($(cpu_ticks "${watched[i]}") - cpu0[i]))
    wake=$(($(wakeups "${watched[i]}") - wake0[i]))
    awk -v name="${names[i]}" -v cpu="$cpu" -v hz="$hz" -v wake="$wake" -v secs="$IDLE_SECS" \
        'BEGIN { printf "| %s | %.2f | %.1f |\n", name, cpu * 1000 / hz / secs, wake / secs }'
done
