# Shared by the scripts that run tallyd beside Redis (client_vs_redis.sh, exact_vs_redis.sh,
# idle_vs_redis.sh): source it after defining `say`; its functions use the script's `work`
# and `pids` when they are called. Functions only; it runs nothing itself.

# stop_started PATH...: kills every process in the array `pids` (what the script started),
# waits for each, then removes the PATHs. For the script's EXIT trap.
stop_started() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$@"
}

# Installs redis-server and redis-tools from apt if either command is missing.
install_redis() {
    if command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null; then
        return
    fi
    say "installing redis-server and redis-tools from apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends redis-server redis-tools >/dev/null ||
        { apt-get update >/dev/null && apt-get install -y --no-install-recommends redis-server redis-tools >/dev/null; }
}

# Builds `tally` and the client_load bench, and copies both into $work (`$work/tally`,
# `$work/client_load`), so that a rebuild in the workspace while a run goes on cannot swap
# a binary under it.
build_tally_and_load_generator() {
    say "building tally and the load generator"
    cargo build --release -p tally >&2
    # The bench's own artifact: the build also lists the `tally` binary, which benches may run.
    local bench_exe
    bench_exe=$(cargo bench --bench client_load --no-run --message-format=json |
        grep '"kind":\["bench"\],[^}]*"name":"client_load"' |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
    if [ -z "$bench_exe" ] || [ ! -x "$bench_exe" ]; then
        say "could not find the client_load bench binary"
        exit 1
    fi
    cp target/release/tally "$work/tally"
    cp "$bench_exe" "$work/client_load"
}

# Succeeds if something answers on 127.0.0.1:PORT (TCP).
port_taken() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# wait_port PORT PID: until something accepts on 127.0.0.1:PORT, at most 10 s, while the
# server PID is still running; otherwise shows the servers' logs and exits.
wait_port() {
    for _ in $(seq 100); do
        if ! kill -0 "$2" 2>/dev/null; then
            break
        fi
        if port_taken "$1"; then
            return 0
        fi
        sleep 0.1
    done
    say "the server for 127.0.0.1:$1 did not come up; its log:"
    tail -n 5 "$work"/*.log >&2
    exit 1
}
