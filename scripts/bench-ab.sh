#!/usr/bin/env bash
# A/B of proxy example binaries in one sitting (BENCHMARKS.md 5d and 7c):
#
#   scripts/bench-ab.sh ROUNDS NAME=BINARY NAME=BINARY...
#
# e.g. two builds of the example, one a worktree of an older commit:
#   scripts/bench-ab.sh 10 before=/tmp/proxy-bd04444 now=target/release/examples/proxy
#
# Starts nginx (one worker, 127.0.0.1, a free port) answering POST /v1/chat/completions with
# part 4's fixed 230-byte chat completion (`application/json`, with a `usage` object), and
# every binary on one tokio worker in front of it (`--backend node-a=URL,slots=4096 --overflow
# overcommit --probe-interval 0`). After 2 s of warm-up each, ROUNDS rounds, the binaries in
# an order rotated each round: `wrk -t1 -c32 -d5s` (requests/s; the proxy's CPU over the run
# from /proc/PID/stat) then `wrk -t1 -c1 -d4s` (p50), with part 4's bench.lua (a 130-byte chat
# body with X-Session-Id, 1,024 sessions). Prints each run with the load average before it,
# then per binary the medians, and against the first binary the median of the rounds' ratios.
# Every run is bounded in time; everything it starts is stopped when it ends.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/bench-common.sh"

# At least one round: none would print no figure at all, and exit 0.
if (($# < 3)) || [[ ! $1 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 ROUNDS NAME=BINARY NAME=BINARY... (ROUNDS: 1 or more)" >&2
    exit 2
fi
ROUNDS=$1
shift
export PATH="$PATH:/usr/sbin"
for tool in wrk nginx python3 curl; do
    command -v "$tool" >/dev/null || {
        echo "bench-ab: $tool is needed (scripts/bench-proxy.sh installs wrk and nginx)" >&2
        exit 2
    }
done

WORK=$(mktemp -d)
PIDS=()
WRK_PID=
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for p in "${PIDS[@]}" $WRK_PID; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if ((rc)); then echo "bench-ab: failed (exit $rc); logs in $WORK" >&2; else rm -rf "$WORK"; fi
    exit "$rc"
}
trap cleanup EXIT
# Without these, Ctrl-C or SIGTERM reached the EXIT trap with status 0: it took the run for
# a success and removed its logs.
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { # URL PID LOG: until URL answers, while PID runs (30 s at most)
    local deadline=$((SECONDS + 30))
    while ((SECONDS < deadline)); do
        kill -0 "$2" 2>/dev/null || { echo "bench-ab: the server for $1 exited (log $3)" >&2; return 1; }
        curl -s -m 2 -o /dev/null -X POST "$1/v1/chat/completions" && return 0
        sleep 0.5
    done
    echo "bench-ab: $1 did not answer within 30 s (log $3)" >&2
    return 1
}
# ticks PID: its utime + stime in clock ticks, fields 14 and 15 of /proc/PID/stat counted
# after the command name, which may hold spaces (a binary named `my proxy`); fails once the
# process has exited (a zombie included).
ticks() {
    local stat f
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    read -r -a f <<<"${stat##*) }"
    [[ ${f[0]} != Z ]] || return 1
    echo $((f[11] + f[12]))
}
# proxy_ticks I R: ticks of binary I, in round R; fails the run, naming the binary and showing
# the end of its log, once it has exited.
proxy_ticks() {
    ticks "${PROXY_PIDS[$1]}" && return 0
    echo "bench-ab: ${NAMES[$1]} (${BINS[$1]}) exited in round $2; the end of its log" \
        "$WORK/proxy-${NAMES[$1]}.log:" >&2
    tail -n 5 "$WORK/proxy-${NAMES[$1]}.log" >&2
    exit 1
}
# wrk_failed I R OUT: wrk against binary I failed in round R: names the binary if it exited,
# else shows wrk's output OUT; fails the run either way.
wrk_failed() {
    proxy_ticks "$1" "$2" >/dev/null
    echo "bench-ab: wrk failed against ${NAMES[$1]} in round $2; its output:" >&2
    cat "$3" >&2
    exit 1
}
# run_wrk OUT WRK-ARGS...: wrk, its output into OUT, as a child of this shell that it waits
# for: a signal to the script ends the wait at once, and the EXIT trap stops wrk.
run_wrk() {
    local out=$1 rc=0
    shift
    wrk "$@" >"$out" 2>&1 &
    WRK_PID=$!
    wait "$WRK_PID" || rc=$?
    WRK_PID=
    return "$rc"
}

NGINX_PORT=$(free_port)
write_nginx_conf "$WORK/nginx" "$NGINX_PORT"
nginx -e "$WORK/nginx/error.log" -c "$WORK/nginx/nginx.conf" -p "$WORK/nginx" >"$WORK/nginx.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$NGINX_PORT" "$!" "$WORK/nginx.log"

write_bench_lua "$WORK/bench.lua" 1024

NAMES=() BINS=() PROXY_PIDS=() URLS=()
for arg in "$@"; do
    name=${arg%%=*} bin=${arg#*=}
    [[ -x $bin ]] || { echo "bench-ab: $bin is not an executable" >&2; exit 2; }
    port=$(free_port)
    TOKIO_WORKER_THREADS=1 "$bin" --listen "127.0.0.1:$port" \
        --backend "node-a=http://127.0.0.1:$NGINX_PORT,slots=4096" --overflow overcommit \
        --probe-interval 0 >"$WORK/proxy-$name.log" 2>&1 &
    PIDS+=($!) PROXY_PIDS+=($!) NAMES+=("$name") BINS+=("$bin") URLS+=("http://127.0.0.1:$port")
    wait_http "http://127.0.0.1:$port" "$!" "$WORK/proxy-$name.log"
done
for url in "${URLS[@]}"; do
    wrk -t1 -c32 -d2s -s "$WORK/bench.lua" "$url/v1/chat/completions" >/dev/null
done

n=${#NAMES[@]}
# In this shell, not a pipeline's subshell, so that a signal stops the rounds at once.
for ((r = 0; r < ROUNDS; r++)); do
    for ((k = 0; k < n; k++)); do
        i=$(((k + r) % n))
        load=$(cut -d' ' -f1 /proc/loadavg)
        t0=$(proxy_ticks "$i" "$r")
        # A binary that exits mid-run fails wrk (it cannot connect) or the ticks after it: both
        # name the binary.
        run_wrk "$WORK/wrk-c32.txt" -t1 -c32 -d5s -s "$WORK/bench.lua" \
            "${URLS[$i]}/v1/chat/completions" || wrk_failed "$i" "$r" "$WORK/wrk-c32.txt"
        t1=$(proxy_ticks "$i" "$r")
        run_wrk "$WORK/wrk-c1.txt" -t1 -c1 -d4s -s "$WORK/bench.lua" \
            "${URLS[$i]}/v1/chat/completions" || wrk_failed "$i" "$r" "$WORK/wrk-c1.txt"
        proxy_ticks "$i" "$r" >/dev/null
        c32=$(grep '^RESULT' "$WORK/wrk-c32.txt")
        c1=$(grep '^RESULT' "$WORK/wrk-c1.txt")
        echo "round=$r name=${NAMES[$i]} load=$load ticks=$((t1 - t0)) c32 $c32 c1 $c1" |
            tee -a "$WORK/runs.txt"
    done
done

python3 - "$WORK/runs.txt" "$(getconf CLK_TCK)" "${NAMES[0]}" <<'EOF'
import collections, re, statistics as st, sys
path, tck, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runs = collections.defaultdict(dict)
for line in open(path):
    head, rest = line.split(" c32 ")
    c32, c1 = rest.split(" c1 ")
    h = dict(re.findall(r"(\w+)=(\S+)", head))
    a = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", c32)}
    b = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", c1)}
    runs[h["name"]][int(h["round"])] = {
        "rps": a["requests"] / (a["duration_us"] / 1e6),
        "cpu": int(h["ticks"]) / tck / a["requests"] * 1e6,
        "p50": b["p50_us"],
        "bad": a["errors"] + a["non2xx"] + b["errors"] + b["non2xx"],
    }
def med(xs):
    return st.median(xs), min(xs), max(xs)
print()
for name, rs in runs.items():
    rps, cpu, p50 = (med([r[f] for r in rs.values()]) for f in ("rps", "cpu", "p50"))
    bad = sum(r["bad"] for r in rs.values())
    print(f"{name}: {len(rs)} rounds; 32 connections {rps[0]:,.0f} requests/s ({rps[1]:,.0f} to "
          f"{rps[2]:,.0f}), CPU {cpu[0]:.1f} us a request; 1 connection p50 {p50[0]:.0f} us "
          f"({p50[1]} to {p50[2]}); failed or non-2xx: {bad}")
for name, rs in runs.items():
    if name == base:
        continue
    both = [k for k in rs if k in runs[base]]
    for f, what in (("rps", "requests/s"), ("cpu", "CPU a request"), ("p50", "p50")):
        m = med([rs[k][f] / runs[base][k][f] for k in both])
        print(f"{name} / {base}, {what}: median of the rounds' ratios {m[0]:.3f} ({m[1]:.3f} to {m[2]:.3f})")
EOF
