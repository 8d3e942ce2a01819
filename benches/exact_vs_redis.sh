#!/usr/bin/env bash
# Exact checks through the region vs Redis INCR with appendfsync always, side by side
# (issue 5; results in BENCHMARKS.md).
#
#   bash benches/exact_vs_redis.sh
#
# Starts on loopback a region tallyd (node 1, `role = "region"`, its data_dir on the disk
# under WORK_ROOT), an edge tallyd (node 2, `region = { node = 1, ... }`), both with one
# exact rule `quota` (limit 10^12, window 3600 s), and a redis-server with `--appendonly yes
# --appendfsync always` whose AOF is in the same directory. Then, for each setting, the
# sides alternate, REPEATS times:
#
#   tally-edge    client_load --op check --rule quota against the edge's client port:
#                 application -> edge -> region over QUIC -> group commit + fdatasync -> back
#                 (P tasks per connection; with EDGE_CLIENT=batch, `--batch`: each
#                 connection sends its P checks as one tally-client Pipeline)
#   tally-region  client_load --region: the region protocol straight to the region over one
#                 QUIC connection, as an edge speaks it (with node 3's certificate, so the
#                 running edge keeps its own connection to the region)
#   tally-local   client_load --op check --rule quota against the region's own client port:
#                 an application at the region -> region tallyd -> group commit + fdatasync
#                 -> back, no QUIC (the same load generator and EDGE_CLIENT as tally-edge)
#   redis         redis-benchmark -t incr at the same C, P and N
#
# and, as controls, the same three tally sides against a second region and edge pair whose
# region keeps its log on a tmpfs (TMPFS_ROOT, /dev/shm), where fdatasync returns at once:
# tally-edge-tmpfs, tally-region-tmpfs and tally-local-tmpfs are the same path with the disk's sync taken out
# (set TMPFS_ROOT= to skip them).
#
# Every request of every side is one durable increment of one key (subject `counter`;
# redis-benchmark's `counter:__rand_int__` without -r). Before and after the runs, the
# disk's sync latency: `client_load --fsync-probe` (8 bytes, then 16 KiB, + fdatasync, one
# at a time, in the same directory: appended to a file that grows, as Redis's AOF is, and
# written into the region log's allocation ahead, as the region's groups are). Around every run it reads the
# CPU time of each process (/proc/<pid>/stat; the load generator's from this shell's
# waited-for children) and the region's `tally_region_log_records_total` and
# `tally_region_log_syncs_total` from its /metrics, for records per sync (the group
# commit's size).
#
# Settings: (a) C=1, P=1, N=N_A; (a1) the same with every server and load generator on CPU
# PIN_CPU alone (see `place` in benches/redis_side.sh); (b) C=50, P=16, N=N_B; (c) C=50,
# P=64, N=N_C. Environment overrides: REPEATS (3), N_A (5000), N_B (200000), N_C (200000),
# SETTINGS ("a a1 b c"), PIN_CPU (the CPU that takes the disk's interrupts, else 0),
# PORT_BASE (18000: QUIC +1, +2, +11, +12; client +101, +102, +111, +112; http +201,
# +202, +211, +212; redis +300), WORK_ROOT (target/bench-exact; must not be a tmpfs),
# TMPFS_ROOT (/dev/shm), EDGE_CLIENT (tasks, or batch). About three and a half minutes once
# built, on 2 cores. Every run's figures are also left in WORK_ROOT/last-results.tsv (which
# does not record EDGE_CLIENT; the printed tables do).
#
# Installs redis-server and redis-tools from apt if they are missing (needs root).
# Kills everything it started, and removes its directories, when it exits.
set -euo pipefail

cd "$(dirname "$0")/.."

REPEATS=${REPEATS:-3}
N_A=${N_A:-5000}
N_B=${N_B:-200000}
N_C=${N_C:-200000}
SETTINGS=${SETTINGS:-a a1 b c}
PORT_BASE=${PORT_BASE:-18000}
WORK_ROOT=${WORK_ROOT:-target/bench-exact}
TMPFS_ROOT=${TMPFS_ROOT-/dev/shm}
EDGE_CLIENT=${EDGE_CLIENT:-tasks}
case $EDGE_CLIENT in
tasks) edge_flags=() ;;
batch) edge_flags=(--batch) ;;
*) echo "exact_vs_redis: EDGE_CLIENT is tasks or batch, not $EDGE_CLIENT" >&2; exit 1 ;;
esac
REDIS_PORT=$((PORT_BASE + 300))

say() { echo "exact_vs_redis: $*" >&2; }
# shellcheck source=benches/redis_side.sh
source benches/redis_side.sh  # the working directory is the repository root (above)
PIN_CPU=${PIN_CPU:-$(disk_cpu)}
check_pin_cpu "$PIN_CPU"

mkdir -p "$WORK_ROOT"
if [ "$(stat -f -c %T "$WORK_ROOT")" = tmpfs ]; then
    say "$WORK_ROOT is on a tmpfs, where fdatasync costs nothing; set WORK_ROOT to a real disk"
    exit 1
fi
work=$(mktemp -d "$(realpath "$WORK_ROOT")/run.XXXXXX")
shm=
if [ -n "$TMPFS_ROOT" ]; then
    if [ "$(stat -f -c %T "$TMPFS_ROOT" 2>/dev/null)" = tmpfs ]; then
        shm=$(mktemp -d "$TMPFS_ROOT/tally-exact.XXXXXX")
    else
        say "$TMPFS_ROOT is not a tmpfs: no tmpfs controls"
    fi
fi

pids=()
trap 'stop_started "$work" ${shm:+"$shm"}' EXIT
trap 'exit 130' INT TERM

# --- Redis -------------------------------------------------------------------------------

install_redis

# --- Build -------------------------------------------------------------------------------

build_tally_and_load_generator

# --- Servers -----------------------------------------------------------------------------

# Pair 0: the region's log on the disk; pair 1 (the control): on the tmpfs.
pairs=0
if [ -n "$shm" ]; then pairs="0 1"; fi
for pair in $pairs; do
    for port in $((PORT_BASE + 10 * pair + 101)) $((PORT_BASE + 10 * pair + 102)) \
        $((PORT_BASE + 10 * pair + 201)) $((PORT_BASE + 10 * pair + 202)); do
        if port_taken "$port"; then
            say "127.0.0.1:$port is already in use; set PORT_BASE"
            exit 1
        fi
    done
done
if port_taken "$REDIS_PORT"; then
    say "127.0.0.1:$REDIS_PORT is already in use; set PORT_BASE"
    exit 1
fi

"$work/tally" certs --out "$work/certs" --nodes 1,2,3 >/dev/null

# write_config FILE ID ROLE_LINE QUIC CLIENT HTTP DATA_DIR PEER_ID PEER_QUIC
write_config() {
    local file=$1 id=$2 role=$3 quic=$4 client=$5 http=$6 data=$7 peer=$8 peer_quic=$9
    {
        echo "$role"
        echo "node_id = $id"
        echo "listen_gossip = \"127.0.0.1:$quic\""
        echo "listen_client = \"127.0.0.1:$client\""
        echo "listen_http = \"127.0.0.1:$http\""
        echo "data_dir = \"$data\""
        # An exact rule's limit must be within the lane rate (the region's count of a key
        # goes to its peers in its own lane).
        echo "lane_rate_max_per_sec = 1000000000000"
        echo "seeds = [{ node = $peer, addr = \"127.0.0.1:$peer_quic\" }]"
        echo "tls = { ca = \"$work/certs/ca.pem\", cert = \"$work/certs/node-$id.pem\", key = \"$work/certs/node-$id.key\" }"
        echo "[[rules]]"
        echo "name = \"quota\""
        echo "limit = 1000000000000"
        echo "window_secs = 3600"
        echo "mode = \"exact\""
        echo "region_timeout_ms = 2000"
    } >"$file"
}

# Per pair: the region's and the edge's pids, the region's QUIC, HTTP and client ports, the
# edge's client port.
declare -A region_pid edge_pid region_quic region_http region_client edge_client
for pair in $pairs; do
    base=$((PORT_BASE + 10 * pair))
    region_quic[$pair]=$((base + 1))
    region_http[$pair]=$((base + 201))
    region_client[$pair]=$((base + 101))
    edge_client[$pair]=$((base + 102))
    if [ "$pair" = 0 ]; then data=$work; else data=$shm; fi
    write_config "$work/region-$pair.toml" 1 'role = "region"' $((base + 1)) $((base + 101)) \
        $((base + 201)) "$data/region" 2 $((base + 2))
    write_config "$work/edge-$pair.toml" 2 "region = { node = 1, addr = \"127.0.0.1:$((base + 1))\" }" \
        $((base + 2)) $((base + 102)) $((base + 202)) "$work/edge-$pair" 1 $((base + 1))
    "$work/tally" daemon --config "$work/region-$pair.toml" --new-ledger >"$work/region-$pair.log" 2>&1 &
    region_pid[$pair]=$!
    pids+=("$!")
    "$work/tally" daemon --config "$work/edge-$pair.toml" >"$work/edge-$pair.log" 2>&1 &
    edge_pid[$pair]=$!
    pids+=("$!")
done
mkdir -p "$work/redis"
# No automatic rewrite: a fork mid-run on these 2 cores would slow Redis's side alone.
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly yes \
    --appendfsync always --auto-aof-rewrite-percentage 0 --daemonize no --dir "$work/redis" \
    >"$work/redis.log" 2>&1 &
redis_pid=$!
pids+=("$redis_pid")

for pair in $pairs; do
    wait_port "${region_http[$pair]}" "${region_pid[$pair]}"
    wait_port "${edge_client[$pair]}" "${edge_pid[$pair]}"
    wait_port "${region_client[$pair]}" "${region_pid[$pair]}"
    # Ready when an exact check through the edge is answered by the region.
    for i in $(seq 50); do
        if "$work/client_load" --endpoint "127.0.0.1:${edge_client[$pair]}" --op check \
            --rule quota --requests 10 >/dev/null 2>&1; then
            break
        fi
        if [ "$i" = 50 ]; then
            say "no exact check got through the edge in 10 s; the logs:"
            tail -n 5 "$work"/*.log >&2
            exit 1
        fi
        sleep 0.2
    done
done
wait_port "$REDIS_PORT" "$redis_pid"
say "up: region on disk (pid ${region_pid[0]}), edge (pid ${edge_pid[0]})," \
    "${shm:+region on tmpfs (pid ${region_pid[1]}), edge (pid ${edge_pid[1]}),}" \
    "redis (pid $redis_pid); data in $work${shm:+ and $shm}"

# --- Measurements ------------------------------------------------------------------------

hz=$(getconf CLK_TCK)
# CPU seconds of a running process, and of this shell's waited-for children.
cpu_of() { awk -v hz="$hz" '{ printf "%.2f", ($14 + $15) / hz }' "/proc/$1/stat"; }
cpu_children() { awk -v hz="$hz" '{ printf "%.2f", ($16 + $17) / hz }' "/proc/$$/stat"; }
now_s() { date +%s.%N; }
minus() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a - b }'; }
# region_metric PAIR NAME: the region's counter NAME (without _total) from its /metrics.
region_metric() {
    curl -s "http://127.0.0.1:${region_http[$1]}/metrics" | awk -v m="$2_total" '$1 == m { print $2 }'
}

fsync_probe() {
    "$work/client_load" --fsync-probe "$work/region/fsync.probe" --requests 5000
}
fsync_before=$(fsync_probe)
say "disk: $(echo "$fsync_before" | paste -sd' ')"

results="$work/results.tsv"
# setting run side ops p50 p99 wall_s requests gen_cpu edge_cpu region_cpu redis_cpu records
# syncs load1

# measure SETTING RUN SIDE PAIR REQUESTS COMMAND...: runs COMMAND (which prints one line
# with ops_per_sec, p50_us and p99_us), with the CPU and the counters of pair PAIR's region
# around it.
measure() {
    local setting=$1 run=$2 side=$3 pair=$4 requests=$5
    shift 5
    local g0 e0 r0 d0 rec0 syn0 t0 line t1 g1 e1 r1 d1 rec1 syn1 load
    load=$(cut -d' ' -f1 /proc/loadavg)
    local edge=${edge_pid[$pair]} region=${region_pid[$pair]}
    rec0=$(region_metric "$pair" tally_region_log_records)
    syn0=$(region_metric "$pair" tally_region_log_syncs)
    g0=$(cpu_children) e0=$(cpu_of "$edge") r0=$(cpu_of "$region") d0=$(cpu_of "$redis_pid")
    t0=$(now_s)
    line=$("$@")
    t1=$(now_s)
    g1=$(cpu_children) e1=$(cpu_of "$edge") r1=$(cpu_of "$region") d1=$(cpu_of "$redis_pid")
    rec1=$(region_metric "$pair" tally_region_log_records)
    syn1=$(region_metric "$pair" tally_region_log_syncs)
    echo "$side $line" >&2
    echo "$line" | awk -v setting="$setting" -v run="$run" -v side="$side" -v n="$requests" \
        -v wall="$(minus "$t1" "$t0")" -v gen="$(minus "$g1" "$g0")" \
        -v edge="$(minus "$e1" "$e0")" -v region="$(minus "$r1" "$r0")" \
        -v redis="$(minus "$d1" "$d0")" -v rec="$((rec1 - rec0))" -v syn="$((syn1 - syn0))" -v load="$load" '{
        for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
        printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", setting, run, side,
            v["ops_per_sec"], v["p50_us"], v["p99_us"], wall, n, gen, edge, region, redis, rec, syn, load
    }' >>"$results"
}

# redis_line C P N: redis-benchmark's INCR figures as a client_load-shaped line.
redis_line() {
    # --csv: "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
    on_cpu "$cpu" redis-benchmark -h 127.0.0.1 -p "$REDIS_PORT" -t incr -n "$3" -c "$1" -P "$2" --csv |
        grep '^"INCR"' | tr -d '"' |
        awk -F, '{ printf "redis ops_per_sec=%.0f p50_us=%.1f p99_us=%.1f\n", $2, $5 * 1000, $7 * 1000 }'
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
started=$(now_s)
for run in $(seq "$REPEATS"); do
    for name in $SETTINGS; do
        case $name in
        a) c=1 p=1 n=$N_A cpu= ;;
        a1) c=1 p=1 n=$N_A cpu=$PIN_CPU ;;
        b) c=50 p=16 n=$N_B cpu= ;;
        c) c=50 p=64 n=$N_C cpu= ;;
        *) say "unknown setting $name"; exit 1 ;;
        esac
        place "$cpu" "${pids[@]}"
        # client_load runs a tenth of N unrecorded first; its CPU covers both phases.
        tally_n=$((n + (n / 10 > 0 ? n / 10 : 1)))
        say "run $run, setting ($name): C=$c P=$p N=$n${cpu:+, on CPU $cpu alone}"
        # Redis first in even runs, after the disk pair's tally rows in odd ones, so that a
        # drift during a run does not fall on one side every time.
        if ((run % 2 == 0)); then
            measure "$name" "$run" redis 0 "$n" redis_line "$c" "$p" "$n"
        fi
        for pair in $pairs; do
            if [ "$pair" = 0 ]; then suffix=; else suffix=-tmpfs; fi
            measure "$name" "$run" "tally-edge$suffix" "$pair" "$tally_n" on_cpu "$cpu" "$work/client_load" \
                --endpoint "127.0.0.1:${edge_client[$pair]}" --op check --rule quota \
                --connections "$c" --pipeline "$p" --requests "$n" "${edge_flags[@]}"
            measure "$name" "$run" "tally-region$suffix" "$pair" "$tally_n" on_cpu "$cpu" "$work/client_load" \
                --region "127.0.0.1:${region_quic[$pair]}" --certs "$work/certs" --node 3 \
                --rule quota --connections "$c" --pipeline "$p" --requests "$n"
            measure "$name" "$run" "tally-local$suffix" "$pair" "$tally_n" on_cpu "$cpu" "$work/client_load" \
                --endpoint "127.0.0.1:${region_client[$pair]}" --op check --rule quota \
                --connections "$c" --pipeline "$p" --requests "$n" "${edge_flags[@]}"
            if [ "$pair" = 0 ] && ((run % 2)); then
                measure "$name" "$run" redis 0 "$n" redis_line "$c" "$p" "$n"
            fi
        done
    done
done
finished=$(now_s)
fsync_after=$(fsync_probe)
say "disk: $(echo "$fsync_after" | paste -sd' ')"
cp "$results" "$WORK_ROOT/last-results.tsv"
region_rss=$(awk '$1 == "VmRSS:" { printf "%.0f", $2 / 1024 }' "/proc/${region_pid[0]}/status")
region_log=$(du -m "$work/region/region.log" | cut -f1)
region_records=$(region_metric 0 tally_region_log_records)

# --- Tables ------------------------------------------------------------------------------

label() {
    case $1 in
    a) echo "(a) C=1 P=1 N=$N_A" ;;
    a1) echo "(a1) C=1 P=1 N=$N_A, on CPU $PIN_CPU" ;;
    b) echo "(b) C=50 P=16 N=$N_B" ;;
    c) echo "(c) C=50 P=64 N=$N_C" ;;
    esac
}

awk_lib='
    function median(list,   n, a, i, j, t) {
        n = split(list, a, " ")
        for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] + 0 > a[j] + 0; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
        return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    function add(name, value) { list[name] = list[name] " " value }
'

echo
echo "nproc $(nproc); load average before $load_before, after $(cut -d' ' -f1-3 /proc/loadavg);" \
    "runs took $(minus "$finished" "$started" | cut -d. -f1) s; $(redis-server --version | cut -d' ' -f1-3);" \
    "data on $(df --output=source,fstype "$work" | tail -n 1 | tr -s ' ')"
echo "load average (1 min) at the start of each run: $(cut -f15 "$results" | sort -n | sed -n '1p;$p' | paste -sd' ' | sed 's/ / to /');" \
    "region on disk at the end: $region_records records, region.log $region_log MB, RSS $region_rss MB"
echo
echo "disk sync latency (a write of 8 bytes or 16 KiB + fdatasync, one at a time, in the" \
    "data directory; append: to a file that grows, as Redis's AOF; preallocated: through" \
    "the region log into its zeros allocated and synced ahead, as the region's groups):"
echo
echo "| when | sync | bytes | syncs/s | p50 us | p99 us |"
echo "|---|---|---:|---:|---:|---:|"
for probe in "before:$fsync_before" "after:$fsync_after"; do
    echo "${probe#*:}" | awk -v when="${probe%%:*}" '{
        for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
        printf "| %s | %s | %s | %s | %s | %s |\n", when, v["mode"], v["bytes"], v["ops_per_sec"], v["p50_us"], v["p99_us"] }'
done

echo
echo "exact checks (tally-edge: through the edge, load generator EDGE_CLIENT=$EDGE_CLIENT;" \
    "tally-region: at the region directly) vs redis" \
    "INCR with appendfsync always; ratios are tally / redis; median rows are the medians of" \
    "each column:"
echo
echo "| setting | run | edge ops/s | region ops/s | redis ops/s | edge / redis | region / redis | edge p50 us | region p50 us | redis p50 us | edge p99 us | region p99 us | redis p99 us |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for name in $SETTINGS; do
    awk -F'\t' -v name="$name" -v label="$(label "$name")" "$awk_lib"'
        function row(run, eo, ro, do_, er, rr, ep, rp, dp, e9, r9, d9) {
            printf "| %s | %s | %.0f | %.0f | %.0f | %.2fx | %.2fx | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n",
                label, run, eo, ro, do_, er, rr, ep, rp, dp, e9, r9, d9
        }
        $1 == name { o[$2, $3] = $4; p50[$2, $3] = $5; p99[$2, $3] = $6; if ($2 > runs) runs = $2 }
        END {
            for (i = 1; i <= runs; i++) {
                er = o[i, "tally-edge"] / o[i, "redis"]; rr = o[i, "tally-region"] / o[i, "redis"]
                row(i, o[i, "tally-edge"], o[i, "tally-region"], o[i, "redis"], er, rr,
                    p50[i, "tally-edge"], p50[i, "tally-region"], p50[i, "redis"],
                    p99[i, "tally-edge"], p99[i, "tally-region"], p99[i, "redis"])
                add("eo", o[i, "tally-edge"]); add("ro", o[i, "tally-region"]); add("do", o[i, "redis"])
                add("er", er); add("rr", rr)
                add("ep", p50[i, "tally-edge"]); add("rp", p50[i, "tally-region"]); add("dp", p50[i, "redis"])
                add("e9", p99[i, "tally-edge"]); add("r9", p99[i, "tally-region"]); add("d9", p99[i, "redis"])
            }
            row("**median**", median(list["eo"]), median(list["ro"]), median(list["do"]),
                median(list["er"]), median(list["rr"]), median(list["ep"]), median(list["rp"]),
                median(list["dp"]), median(list["e9"]), median(list["r9"]), median(list["d9"]))
        }' "$results"
done

echo
echo "exact checks by the region's own clients (tally-local: the edge's load generator" \
    "against the region's client port) vs redis INCR with appendfsync always; ratios are" \
    "tally / redis; median rows are the medians of each column:"
echo
echo "| setting | run | local ops/s | redis ops/s | local / redis | local p50 us | redis p50 us | p50 local / redis | local p99 us | redis p99 us |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
for name in $SETTINGS; do
    awk -F'\t' -v name="$name" -v label="$(label "$name")" "$awk_lib"'
        function row(run, lo, do_, lr, lp, dp, pr, l9, d9) {
            printf "| %s | %s | %.0f | %.0f | %.2fx | %.1f | %.1f | %.2fx | %.1f | %.1f |\n",
                label, run, lo, do_, lr, lp, dp, pr, l9, d9
        }
        $1 == name { o[$2, $3] = $4; p50[$2, $3] = $5; p99[$2, $3] = $6; if ($2 > runs) runs = $2 }
        END {
            for (i = 1; i <= runs; i++) {
                lr = o[i, "tally-local"] / o[i, "redis"]; pr = p50[i, "tally-local"] / p50[i, "redis"]
                row(i, o[i, "tally-local"], o[i, "redis"], lr, p50[i, "tally-local"], p50[i, "redis"],
                    pr, p99[i, "tally-local"], p99[i, "redis"])
                add("lo", o[i, "tally-local"]); add("do", o[i, "redis"]); add("lr", lr)
                add("lp", p50[i, "tally-local"]); add("dp", p50[i, "redis"]); add("pr", pr)
                add("l9", p99[i, "tally-local"]); add("d9", p99[i, "redis"])
            }
            row("**median**", median(list["lo"]), median(list["do"]), median(list["lr"]),
                median(list["lp"]), median(list["dp"]), median(list["pr"]), median(list["l9"]),
                median(list["d9"]))
        }' "$results"
done

if [ -n "$shm" ]; then
    echo
    echo "the disk's sync taken out: the same sides against the pair whose region logs to a" \
        "tmpfs; medians over the runs (the added p50 is the median of the runs' differences):"
    echo
    echo "| setting | side | disk ops/s | tmpfs ops/s | disk / tmpfs | disk p50 us | tmpfs p50 us | p50 added by the disk us | disk p99 us | tmpfs p99 us |"
    echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    for name in $SETTINGS; do
        for side in tally-edge tally-region tally-local; do
            awk -F'\t' -v name="$name" -v side="$side" -v label="$(label "$name")" "$awk_lib"'
                $1 == name && $3 == side { o[$2] = $4; p50[$2] = $5; p99[$2] = $6; if ($2 > runs) runs = $2 }
                $1 == name && $3 == side "-tmpfs" { to[$2] = $4; tp50[$2] = $5; tp99[$2] = $6 }
                END {
                    for (i = 1; i <= runs; i++) {
                        add("o", o[i]); add("to", to[i]); add("r", o[i] / to[i])
                        add("p", p50[i]); add("tp", tp50[i]); add("d", p50[i] - tp50[i])
                        add("p9", p99[i]); add("tp9", tp99[i])
                    }
                    printf "| %s | %s | %.0f | %.0f | %.2fx | %.1f | %.1f | %.1f | %.1f | %.1f |\n", label, side,
                        median(list["o"]), median(list["to"]), median(list["r"]), median(list["p"]),
                        median(list["tp"]), median(list["d"]), median(list["p9"]), median(list["tp9"])
                }' "$results"
        done
    done
fi

echo
echo "group commit and CPU, medians over the runs: records per sync and syncs per second are" \
    "the region's counters over the run (warm-up included); CPU is us per request (warm-up" \
    "included) and, in brackets, the share of one core over the run's wall time (start-up" \
    "included):"
echo
echo "| setting | side | records per sync | syncs/s | load generator | edge tallyd | region tallyd | redis-server |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
for name in $SETTINGS; do
    for side in tally-edge tally-region tally-local redis \
        ${shm:+tally-edge-tmpfs tally-region-tmpfs tally-local-tmpfs}; do
        awk -F'\t' -v name="$name" -v side="$side" -v label="$(label "$name")" "$awk_lib"'
            function cell(cpu_list, share_list) {
                return sprintf("%.2f (%.0f%%)", median(cpu_list), median(share_list))
            }
            $1 == name && $3 == side {
                if ($14 > 0) { add("rps", $13 / $14); add("sps", $14 / $7) } else { add("rps", 0); add("sps", 0) }
                add("g", $9 * 1e6 / $8); add("gs", 100 * $9 / $7)
                add("e", $10 * 1e6 / $8); add("es", 100 * $10 / $7)
                add("r", $11 * 1e6 / $8); add("rs", 100 * $11 / $7)
                add("d", $12 * 1e6 / $8); add("ds", 100 * $12 / $7)
            }
            END {
                rps = side == "redis" ? "-" : sprintf("%.1f", median(list["rps"]))
                sps = side == "redis" ? "-" : sprintf("%.0f", median(list["sps"]))
                printf "| %s | %s | %s | %s | %s | %s | %s | %s |\n", label, side, rps, sps,
                    cell(list["g"], list["gs"]), cell(list["e"], list["es"]),
                    cell(list["r"], list["rs"]), cell(list["d"], list["ds"])
            }' "$results"
    done
done
