# Shared by the scripts that run tallyd beside Redis (client_vs_redis.sh, exact_vs_redis.sh,
# idle_vs_redis.sh): source it after defining `say`; its functions use the script's `work`
# and `pids` when they are called. Functions, and the two variables `place` keeps; it
# starts nothing itself.

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

# The one-CPU settings (named with a trailing 1, as `a1`) run every server and the load
# generator on one CPU alone, tally's side and Redis's alike. On the 2-vCPU VM of session
# 42, a round trip between processes on different vCPUs took 55 to 75 us where on one CPU
# it took 6 to 9 (most likely the wait for the hypervisor to wake a halted vCPU: the
# guest's halt polling is off there); on one CPU the processes hand the CPU to each other,
# so the round trip is mostly the software's own cost. See BENCHMARKS.md, "Run 64".

# The CPUs this script may use, to give back what `place` took.
cpus_allowed=$(awk '$1 == "Cpus_allowed_list:" { print $2 }' /proc/$$/status)
pinned=

# place CPU PID...: moves every thread of each PID to CPU; an empty CPU gives the threads
# back every CPU the script may use (nothing to do if nothing was placed). A thread that
# ends meanwhile (a blocking-pool thread idle long enough) is skipped.
place() {
    local cpu=$1 pid task
    shift
    if [ -z "$cpu" ] && [ -z "$pinned" ]; then
        return
    fi
    pinned=$cpu
    for pid in "$@"; do
        for task in /proc/"$pid"/task/*; do
            if ! taskset -pc "${cpu:-$cpus_allowed}" "${task##*/}" >/dev/null 2>&1 && [ -d "$task" ]; then
                say "could not move thread ${task##*/} of process $pid to CPU ${cpu:-$cpus_allowed}"
                exit 1
            fi
        done
    done
}

# on_cpu CPU COMMAND...: runs COMMAND on CPU alone; an empty CPU runs it anywhere.
on_cpu() {
    local cpu=$1
    shift
    if [ -n "$cpu" ]; then
        taskset -c "$cpu" "$@"
    else
        "$@"
    fi
}

# disk_cpu: the CPU that took the most of the disks' completion interrupts since boot
# (virtio-blk's `-req.N` queues, virtio-scsi's `-request`, NVMe's queues), or 0 if no
# line names one. A process waiting for a sync on another CPU than the one its
# completion interrupt lands on waits for that CPU to wake it too: on the VM of session
# 42, a preallocated sync read 178 to 190 us at p50 on the other CPU against 119 to 121
# us on this one.
disk_cpu() {
    awk 'NR == 1 { for (i = 1; i <= NF; i++) cpu[i] = substr($i, 4); ncpu = NF; next }
        /-req\.|-request|nvme/ { for (i = 1; i <= ncpu; i++) n[cpu[i]] += $(i + 1) }
        END { best = 0; for (c in n) if (n[c] > n[best]) best = c; print best }' /proc/interrupts
}

# check_pin_cpu CPU: exits unless CPU is one this script may run a process on.
check_pin_cpu() {
    if ! taskset -c "$1" true 2>/dev/null; then
        say "PIN_CPU=$1 is not a CPU this script may use ($cpus_allowed)"
        exit 1
    fi
}
