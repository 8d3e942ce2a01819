#!/usr/bin/env bash
# Client to sidecar vs Redis INCR, side by side (issue 4; results in BENCHMARKS.md).
#
#   bash benches/client_vs_redis.sh
#
# One tallyd (`tally daemon`, no data_dir) and one redis-server (no RDB, no AOF) on loopback,
# plus, for the durable row, a second tallyd with a data_dir (a lane-log write() per batch,
# and an fdatasync per collection before its lanes are gossiped) and a second redis-server
# with AOF and `appendfsync no` (a write() per event-loop turn, no fsync: both acknowledge
# from the page cache). Each setting runs
# `redis-benchmark -t incr` and the tally load generator (`benches/client_load.rs`) with
# the same connections C, pipeline P and request count N, tally and Redis alternating,
# REPEATS times; then prints Markdown tables of every run and the medians. A third tally
# run per setting, `client_load --raw`, drives the same tallyd without tally-client (frames
# encoded once, blocking sockets), to tell the sidecar's cost from the client library's;
# `client_load --raw --redis` drives the plain Redis the same way, so that one load
# generator, with one clock, also times both servers. At (a) both are driven once more by
# `client_load --raw --poll`, which polls its socket rather than blocking on it: its vCPU
# never idles, so the round trip leaves out the load generator's wake-up (tens of
# microseconds on a VM) and times the servers'.
# A fourth, `client_load --batch`, drives it with tally-client in redis-benchmark's shape:
# each connection sends its P requests as one `Pipeline` and waits for all P answers.
# Two more, `client_load --op incr-id`, send every increment under a new request id, to
# both tallyds: what the sidecar's memory of ids costs, and with a data_dir its answer log
# (`node/src/answerlog.rs`), against the plain increments of the same run.
#
# Settings: (a) C=1, P=1, N=N_A; (a1) the same with every server and load generator on
# CPU PIN_CPU alone (see `place` in benches/redis_side.sh); (b) C=50, P=16, N=N_B.
# Environment overrides: REPEATS (3), N_A (200000), N_B (2000000), PIN_CPU (the CPU that
# takes the disk's interrupts, else 0), and the ports REDIS_PORT (6399), REDIS_AOF_PORT
# (6400), TALLY_PORT (17100), TALLY_LOG_PORT (17110). About fifteen minutes once built, on 2
# cores.
#
# The load generator and the server share the machine's cores, as redis-benchmark and
# redis-server do: the same for both sides, so read ratios within one run.
#
# Installs redis-server and redis-tools from apt if they are missing (needs root).
# Kills everything it started when it exits.
set -euo pipefail

cd "$(dirname "$0")/.."

REPEATS=${REPEATS:-3}
N_A=${N_A:-200000}
N_B=${N_B:-2000000}
# Not tallyd's default ports: a demo or a test elsewhere on the machine may hold those.
REDIS_PORT=${REDIS_PORT:-6399}
REDIS_AOF_PORT=${REDIS_AOF_PORT:-6400}
TALLY_PORT=${TALLY_PORT:-17100}   # its gossip and http ports are this -99 and +100
TALLY_LOG_PORT=${TALLY_LOG_PORT:-17110}

say() { echo "client_vs_redis: $*" >&2; }
# shellcheck source=benches/redis_side.sh
source benches/redis_side.sh  # the working directory is the repository root (above)
PIN_CPU=${PIN_CPU:-$(disk_cpu)}
check_pin_cpu "$PIN_CPU"

pids=()
work=$(mktemp -d -t tally-vs-redis.XXXXXX)
trap 'stop_started "$work"' EXIT
trap 'exit 130' INT TERM

# --- Redis -------------------------------------------------------------------------------

install_redis

# --- Build -------------------------------------------------------------------------------

build_tally_and_load_generator

# --- Servers -----------------------------------------------------------------------------

# Refuse to start if another process answers on a port: the runs would measure it.
for port in "$REDIS_PORT" "$REDIS_AOF_PORT" "$TALLY_PORT" "$TALLY_LOG_PORT"; do
    if port_taken "$port"; then
        say "127.0.0.1:$port is already in use; set REDIS_PORT, REDIS_AOF_PORT, TALLY_PORT or TALLY_LOG_PORT"
        exit 1
    fi
done

redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize no --dir "$work" >"$work/redis.log" 2>&1 &
pids+=($!)
mkdir -p "$work/aof"
# No automatic rewrite: a (b) round appends about 80 MB, past the 64 MB at which Redis
# would fork to rewrite the file mid-run, on these 2 cores (found in review, session 28).
redis-server --port "$REDIS_AOF_PORT" --bind 127.0.0.1 --save '' --appendonly yes \
    --appendfsync no --auto-aof-rewrite-percentage 0 --daemonize no --dir "$work/aof" \
    >"$work/redis-aof.log" 2>&1 &
pids+=($!)

"$work/tally" certs --out "$work/certs" --nodes 1 >/dev/null

# start_tallyd NAME CLIENT_PORT GOSSIP_PORT HTTP_PORT [DATA_DIR]
start_tallyd() {
    local name=$1 client=$2 gossip=$3 http=$4 data_dir=${5:-}
    local config="$work/$name.toml"
    {
        echo "node_id = 1"
        echo "listen_gossip = \"127.0.0.1:$gossip\""
        echo "listen_client = \"127.0.0.1:$client\""
        echo "listen_http = \"127.0.0.1:$http\""
        if [ -n "$data_dir" ]; then echo "data_dir = \"$data_dir\""; fi
        echo "tls = { ca = \"$work/certs/ca.pem\", cert = \"$work/certs/node-1.pem\", key = \"$work/certs/node-1.key\" }"
        echo "[[rules]]"
        echo "name = \"bench\""
        echo "limit = 1000000000"
        echo "window_secs = 3600"
    } >"$config"
    "$work/tally" daemon --config "$config" >"$work/$name.log" 2>&1 &
    pids+=($!)
}
start_tallyd tallyd "$TALLY_PORT" $((TALLY_PORT - 99)) $((TALLY_PORT + 100))
mkdir -p "$work/data"
start_tallyd tallyd-log "$TALLY_LOG_PORT" $((TALLY_LOG_PORT - 99)) $((TALLY_LOG_PORT + 100)) "$work/data"

ports=("$REDIS_PORT" "$REDIS_AOF_PORT" "$TALLY_PORT" "$TALLY_LOG_PORT")
for i in "${!ports[@]}"; do
    wait_port "${ports[$i]}" "${pids[$i]}"
done
say "servers up: redis :$REDIS_PORT, redis AOF :$REDIS_AOF_PORT, tallyd :$TALLY_PORT, tallyd data_dir :$TALLY_LOG_PORT"

# --- Runs --------------------------------------------------------------------------------

results="$work/results.tsv" # setting run side ops_per_sec p50_us p99_us

# run_tally SIDE PORT SETTING RUN C P N [FLAGS: --raw [--redis] [--poll], --batch, --op ...]
run_tally() {
    local line
    line=$(on_cpu "$cpu" "$work/client_load" --endpoint "127.0.0.1:$2" --connections "$5" --pipeline "$6" --requests "$7" ${8:-})
    echo "$line" >&2
    echo "$line" | awk -v setting="$3" -v run="$4" -v side="$1" '{
        for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
        printf "%s\t%s\t%s\t%s\t%s\t%s\n", setting, run, side, v["ops_per_sec"], v["p50_us"], v["p99_us"]
    }' >>"$results"
}

# run_redis SIDE PORT SETTING RUN C P N
run_redis() {
    local line
    # --csv: "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
    line=$(on_cpu "$cpu" redis-benchmark -h 127.0.0.1 -p "$2" -t incr -n "$7" -c "$5" -P "$6" --csv | grep '^"INCR"')
    echo "$1 connections=$5 pipeline=$6 requests=$7 $line" >&2
    echo "$line" | tr -d '"' | awk -F, -v setting="$3" -v run="$4" -v side="$1" '{
        printf "%s\t%s\t%s\t%.0f\t%.1f\t%.1f\n", setting, run, side, $2, $5 * 1000, $7 * 1000
    }' >>"$results"
}

# Each side of one setting and run: tally's rows, then Redis's.
tally_sides() {
    run_tally tally "$TALLY_PORT" "$@"
    run_tally tally-log "$TALLY_LOG_PORT" "$@"
    run_tally tally-raw "$TALLY_PORT" "$@" --raw
    if [ "$1" = a ]; then run_tally tally-raw-poll "$TALLY_PORT" "$@" "--raw --poll"; fi
    run_tally tally-batch "$TALLY_PORT" "$@" --batch
    run_tally tally-named "$TALLY_PORT" "$@" "--op incr-id"
    run_tally tally-log-named "$TALLY_LOG_PORT" "$@" "--op incr-id"
}
redis_sides() {
    run_redis redis "$REDIS_PORT" "$@"
    run_redis redis-aof "$REDIS_AOF_PORT" "$@"
    run_tally redis-raw "$REDIS_PORT" "$@" "--raw --redis"
    if [ "$1" = a ]; then run_tally redis-raw-poll "$REDIS_PORT" "$@" "--raw --redis --poll"; fi
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
settings=("a 1 1 $N_A" "a1 1 1 $N_A $PIN_CPU" "b 50 16 $N_B")
for run in $(seq "$REPEATS"); do
    for setting in "${settings[@]}"; do
        read -r name c p n cpu <<<"$setting"
        place "$cpu" "${pids[@]}"
        say "run $run, setting ($name): C=$c P=$p N=$n${cpu:+, on CPU $cpu alone}"
        # Odd runs measure tally first, even runs Redis first, so that a drift during a
        # run does not fall on one side every time.
        if ((run % 2)); then
            tally_sides "$name" "$run" "$c" "$p" "$n"
            redis_sides "$name" "$run" "$c" "$p" "$n"
        else
            redis_sides "$name" "$run" "$c" "$p" "$n"
            tally_sides "$name" "$run" "$c" "$p" "$n"
        fi
    done
done

# --- Tables ------------------------------------------------------------------------------

# table TALLY_SIDE REDIS_SIDE: one row per setting and run, then the medians (of each
# column; the ratios in that row are the medians of the runs' ratios).
table() {
    awk -F'\t' -v ts="$1" -v rs="$2" -v na="$N_A" -v nb="$N_B" -v cpu="$PIN_CPU" '
        function median(list,   n, a, i, j, t) {
            n = split(list, a, " ")
            for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] + 0 > a[j] + 0; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
            return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
        }
        function row(label, to, ro, oratio, tp, rp, pratio, t9, r9) {
            printf "| %s | %.0f | %.0f | %.2fx | %.1f | %.1f | %.2fx | %.1f | %.1f |\n", label, to, ro, oratio, tp, rp, pratio, t9, r9
        }
        { key = $1 SUBSEP $2; if ($3 == ts) { t[key] = $4; tp[key] = $5; t9[key] = $6 } if ($3 == rs) { r[key] = $4; rp[key] = $5; r9[key] = $6 }
          if (!($1 in seen)) { seen[$1] = 1; order[++ns] = $1 } if ($2 > runs) runs = $2 }
        END {
            printf "| setting | run | %s ops/s | %s ops/s | ops ratio | %s p50 us | %s p50 us | p50 ratio | %s p99 us | %s p99 us |\n", ts, rs, ts, rs, ts, rs
            print "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
            for (s = 1; s <= ns; s++) {
                name = order[s]
                # A side run at some settings only (the polling ones, at (a)) has no row at
                # the others; one side without the other is a bug of this script.
                has_t = (name SUBSEP 1) in t; has_r = (name SUBSEP 1) in r
                if (!has_t && !has_r) continue
                if (!has_t || !has_r) { print "table: " ts " and " rs " were not both run at (" name ")" > "/dev/stderr"; exit 1 }
                label = name == "a" ? "(a) C=1 P=1 N=" na : name == "a1" ? "(a1) C=1 P=1 N=" na ", on CPU " cpu : "(b) C=50 P=16 N=" nb
                lt = lr = lo = ltp = lrp = lp = lt9 = lr9 = ""
                for (i = 1; i <= runs; i++) {
                    key = name SUBSEP i
                    row(label " | " i, t[key], r[key], t[key] / r[key], tp[key], rp[key], tp[key] / rp[key], t9[key], r9[key])
                    lt = lt " " t[key]; lr = lr " " r[key]; lo = lo " " t[key] / r[key]
                    ltp = ltp " " tp[key]; lrp = lrp " " rp[key]; lp = lp " " tp[key] / rp[key]
                    lt9 = lt9 " " t9[key]; lr9 = lr9 " " r9[key]
                }
                row(label " | **median**", median(lt), median(lr), median(lo), median(ltp), median(lrp), median(lp), median(lt9), median(lr9))
            }
        }' "$results"
}

# The data_dir tallyd and the AOF Redis serve the same runs: their CPU (utime + stime, not
# the kernel's journal threads) and the lane log's syncs tell what durability costs each.
hz=$(getconf CLK_TCK)
cpu_of() { awk -v hz="$hz" '{ printf "%.2f", ($14 + $15) / hz }' "/proc/$1/stat"; }
syncs=$(curl -s "http://127.0.0.1:$((TALLY_LOG_PORT + 100))/metrics" \
    | awk '$1 == "tally_lane_log_syncs_total" { print $2 }')

echo
echo "nproc $(nproc); load average before $load_before, after $(cut -d' ' -f1-3 /proc/loadavg);" \
    "$(redis-server --version | cut -d' ' -f1-3)"
echo "CPU seconds over every run: tallyd with a data_dir $(cpu_of "${pids[3]}"), redis with AOF" \
    "$(cpu_of "${pids[1]}"); lane-log syncs: ${syncs:-none counted}"
echo
echo "tally (no data_dir) vs redis (no persistence); ratios are tally / redis, medians per column:"
echo
table tally redis
echo
echo "tally (data_dir: lane-log write per batch, a sync per collection before gossip) vs redis (AOF, appendfsync no):"
echo
table tally-log redis-aof
echo
echo "the sidecar alone: tallyd (no data_dir) driven by client_load --raw (pre-encoded frames," \
    "blocking sockets, no tally-client) vs redis (no persistence) driven by redis-benchmark:"
echo
table tally-raw redis
echo
echo "one load generator for both servers: tallyd (no data_dir) and redis (no persistence), each" \
    "driven by client_load --raw (with --redis: INCR in RESP), timed by the same clock:"
echo
table tally-raw redis-raw
echo
echo "one polling load generator for both servers, at (a): as above, with client_load --raw" \
    "--poll, whose vCPU never idles while it waits (the servers' round trip without the load" \
    "generator's wake-up):"
echo
table tally-raw-poll redis-raw-poll
echo
echo "tally-client in pipelines: tallyd (no data_dir) driven by client_load --batch (each" \
    "connection sends its P requests as one Pipeline and waits for all P answers; each" \
    "request timed to the pipeline's last answer) vs redis (no persistence):"
echo
table tally-batch redis
echo
echo "named increments (client_load --op incr-id: a new request id each) vs plain ones, tallyd" \
    "without a data_dir (ids in memory); ratios are named / plain:"
echo
table tally-named tally
echo
echo "named vs plain increments, tallyd with a data_dir (ids in memory and in its answer log):"
echo
table tally-log-named tally-log
