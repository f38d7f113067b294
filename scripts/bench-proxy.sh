#!/usr/bin/env bash
# Proxy overhead against a peer router (BENCHMARKS.md, part 4). Run by hand, never by CI.
#
#   scripts/bench-proxy.sh              # install (cached), build, measure, print the tables
#
# What it does, all on 127.0.0.1:
#   1. installs what it needs: Debian's wrk and nginx-light (apt-get), PyPI's sglang-router in a
#      venv under $TA_CACHE_DIR/bench-venv (its `smg` entry point runs the router, a Rust
#      extension, in that python process), and builds `cargo build --release --features health,dns,redis --example proxy`;
#   2. starts nginx (config in a temp dir, one worker) answering every POST
#      /v1/chat/completions with one fixed 230-byte chat completion (`return 200`), and
#      `{"status":"ok"}` on any other path (the routers' health checks);
#   3. starts every target up front, each on its own free port, and keeps them all running to
#      the end -- nginx directly; our proxy (one backend, 4096 slots, overcommit, so it never
#      queues or rejects); our proxy again on one tokio worker thread (TOKIO_WORKER_THREADS=1);
#      our proxy with --upstream per-client, on the default runtime and on one worker;
#      SGLang's router with --policy round_robin; the same with --policy cache_aware; as a
#      reference for what a lean proxy costs here, nginx itself as a reverse proxy (proxy_pass,
#      keep-alive upstream); and as the floor of a proxy built from the same HTTP parts as
#      ours, examples/passthrough.rs on one worker, once over hyper-util's pooled client and
#      once with one backend connection per client connection;
#   4. for each target in turn, warms up, then runs wrk with 32 connections and with 1
#      connection (the added latency alone), each for a fixed duration;
#   5. then $BENCH_ROUNDS alternating rounds at 1 connection: in each round every target,
#      direct included, gets one short wrk -t1 -c1 run, the order rotated by one each round, so
#      that each target's added p50 is taken against a direct run seconds away, not minutes;
#   6. prints one Markdown table per connection count: requests/s, p50 and p99 latency, each
#      as a ratio to direct; the p50 added over direct; the cores each process used during the
#      run ((utime+stime) / wall time, from /proc/PID/stat for servers and from wrk's own
#      rusage), and the router's CPU time per request; then ours as a ratio to each SGLang
#      policy, with the verdicts against the targets (>= 5x requests/s, <= 1/5 added p50);
#      then, from the rounds, each target's median p50, median added p50 (the round's p50 less
#      the same round's direct p50) and its spread, and the median router CPU per request;
#      and the per-round ratios of added p50, ours (and the references) to each SGLang policy,
#      with the verdict on their median (<= 0.20x).
#
# At the defaults it takes about 7 minutes: about 4.5 for starting the targets and measuring
# them one by one (10 x (2 s warm-up + 2 x 10 s)), then 2.5 for the rounds (5 x 10 x 3 s).
#
# Every request is a POST with a 130-byte JSON body and an X-Session-Id header; requests cycle
# through $BENCH_SESSIONS sessions (each session's body names it, so cache_aware sees distinct
# prompts). Every process the script starts is ended on exit.
#
# Environment overrides:
#   TA_CACHE_DIR     cache directory                       (~/.cache/tower-affinity)
#   BENCH_DURATION   wrk duration of each measured run     (10s)
#   BENCH_WARMUP     wrk warm-up before each target        (2s)
#   BENCH_CONNS      connection counts, in order           ("32 1")
#   BENCH_ROUNDS     alternating 1-connection rounds; 0 skips them   (5)
#   BENCH_ROUND_DURATION  wrk duration of each target in a round     (3s)
#   BENCH_SESSIONS   distinct session ids                  (1024)
#   BENCH_PIN        1: wrk and nginx on CPU 0, the router on CPU 1 (taskset); 0: no pinning (0)
#   BENCH_SGL_LOG    SGLang router --log-level            (warn: no line per request)
#   BENCH_OUT        also write the tables to this file    (none)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=bench-common.sh
. "$ROOT/scripts/bench-common.sh"
# Debian puts nginx in /usr/sbin, which a user's PATH may lack.
export PATH="$PATH:/usr/sbin:/sbin"
CACHE="${TA_CACHE_DIR:-$HOME/.cache/tower-affinity}"
VENV="$CACHE/bench-venv"
SGLANG_ROUTER_VERSION="0.3.2"
DURATION="${BENCH_DURATION:-10s}"
WARMUP="${BENCH_WARMUP:-2s}"
read -r -a CONNS <<<"${BENCH_CONNS:-32 1}"
ROUNDS="${BENCH_ROUNDS:-5}"
ROUND_DURATION="${BENCH_ROUND_DURATION:-3s}"
if [[ ! $ROUNDS =~ ^[0-9]+$ ]]; then
    echo "bench-proxy: BENCH_ROUNDS must be a whole number, not '$ROUNDS'" >&2
    exit 2
fi
SESSIONS="${BENCH_SESSIONS:-1024}"
PIN="${BENCH_PIN:-0}"
SGL_LOG="${BENCH_SGL_LOG:-warn}"
OUT="${BENCH_OUT:-}"
CLK_TCK="$(getconf CLK_TCK)"

WORK="$(mktemp -d -t bench-proxy.XXXXXX)"
PIDS=()
# The targets, in the order they are measured: name -> URL, and name -> the pids whose CPU time
# counts as the router's (space-separated; none for direct).
TARGETS=()
declare -A TARGET_URLS=() TARGET_ROUTER_PIDS=()

cleanup() {
    local rc=$?
    set +e
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        # Its direct children first (wrk under /usr/bin/time), then itself.
        pkill -TERM -P "${PIDS[i]}" 2>/dev/null
        kill -TERM "${PIDS[i]}" 2>/dev/null
    done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    if [[ $rc -ne 0 ]]; then
        echo "bench-proxy: failed (exit $rc); logs in $WORK" >&2
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log() { echo "bench-proxy: $*" >&2; }

# Runs a command to its end as a tracked child: a signal to this script interrupts the wait at
# once and the EXIT trap ends the command too.
run_fg() {
    local pid rc=0 keep=() p
    "$@" &
    pid=$!
    PIDS+=("$pid")
    wait "$pid" || rc=$?
    for p in "${PIDS[@]}"; do [[ $p == "$pid" ]] || keep+=("$p"); done
    PIDS=("${keep[@]+"${keep[@]}"}")
    return "$rc"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Command prefixes that pin to one CPU (empty without BENCH_PIN=1). Used as plain words, not
# through a function, so that `cmd &` forks the process itself and $! is its pid.
CPU0=()
CPU1=()
if [[ $PIN == 1 ]]; then
    CPU0=(taskset -c 0)
    CPU1=(taskset -c 1)
fi

# --- install ---------------------------------------------------------------------------------

install_deps() {
    local missing=()
    command -v wrk >/dev/null || missing+=(wrk)
    command -v nginx >/dev/null || missing+=(nginx-light)
    command -v curl >/dev/null || missing+=(curl)
    command -v python3 >/dev/null || missing+=(python3 python3-venv)
    # pgrep finds nginx's workers, whose CPU time counts; pkill stops wrk under /usr/bin/time.
    command -v pgrep >/dev/null && command -v pkill >/dev/null || missing+=(procps)
    [[ -x /usr/bin/time ]] || missing+=(time)
    if ((${#missing[@]})); then
        if ((EUID != 0)); then
            log "needs ${missing[*]}: run apt-get install ${missing[*]} as root, then this again"
            exit 2
        fi
        log "installing ${missing[*]} (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
        # The package's service may have started the system nginx; it is not ours and not used.
    fi
    if [[ ! -x $VENV/bin/smg ]]; then
        log "installing sglang-router==$SGLANG_ROUTER_VERSION in $VENV"
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install -q "sglang-router==$SGLANG_ROUTER_VERSION"
    fi
    log "building the proxy example (release)"
    (cd "$ROOT" && cargo build --release --features health,dns,redis --example proxy --example passthrough -q)
    # Copies, so that a rebuild in the tree during the run cannot swap the binaries under us.
    local target="${CARGO_TARGET_DIR:-$ROOT/target}"
    cp "$target/release/examples/proxy" "$WORK/proxy"
    cp "$target/release/examples/passthrough" "$WORK/passthrough"
}

# --- processes -------------------------------------------------------------------------------

wait_http() { # URL what PID LOG: until URL answers a chat completion, while PID runs (30 s)
    local url=$1 what=$2 pid=$3 log=$4 deadline=$((SECONDS + 30))
    while ((SECONDS < deadline)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            log "$what exited before answering at $url (log $log)"
            return 1
        fi
        if curl -sf -m 2 -o /dev/null -X POST -H 'content-type: application/json' \
            -H 'x-session-id: probe' \
            -d '{"model":"m","messages":[{"role":"user","content":"ping"}]}' \
            "$url/v1/chat/completions"; then
            return 0
        fi
        sleep 0.1
    done
    log "$what did not answer at $url within 30 s (log $log)"
    return 1
}

start_nginx() {
    NGINX_PORT=$(free_port)
    write_nginx_conf "$WORK/nginx" "$NGINX_PORT"
    "${CPU0[@]}" nginx -e "$WORK/nginx/error.log" -c "$WORK/nginx/nginx.conf" -p "$WORK/nginx" \
        >"$WORK/nginx.log" 2>&1 &
    NGINX_PID=$!
    PIDS+=("$NGINX_PID")
    BACKEND="http://127.0.0.1:$NGINX_PORT"
    wait_http "$BACKEND" nginx "$NGINX_PID" "$WORK/nginx.log, $WORK/nginx/error.log"
}

# A reference point, not a contender: nginx itself as a reverse proxy (one worker, keep-alive
# connections to the backend), to show what a lean proxy costs on this machine.
start_nginx_proxy() {
    local port
    port=$(free_port)
    mkdir -p "$WORK/nginx-proxy"
    cat >"$WORK/nginx-proxy/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK/nginx-proxy/nginx.pid;
error_log $WORK/nginx-proxy/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $WORK/nginx-proxy/body;
    proxy_temp_path $WORK/nginx-proxy/proxy;
    fastcgi_temp_path $WORK/nginx-proxy/fastcgi;
    uwsgi_temp_path $WORK/nginx-proxy/uwsgi;
    scgi_temp_path $WORK/nginx-proxy/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
    upstream backend {
        server 127.0.0.1:$NGINX_PORT;
        keepalive 64;
        keepalive_requests 10000000;
    }
    server {
        listen 127.0.0.1:$port;
        location / {
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
EOF
    "${CPU1[@]}" nginx -e "$WORK/nginx-proxy/error.log" -c "$WORK/nginx-proxy/nginx.conf" \
        -p "$WORK/nginx-proxy" >"$WORK/nginx-proxy.log" 2>&1 &
    TARGET_PID=$!
    PIDS+=("$TARGET_PID")
    TARGET_URL="http://127.0.0.1:$port"
    wait_http "$TARGET_URL" "nginx as a proxy" "$TARGET_PID" \
        "$WORK/nginx-proxy.log, $WORK/nginx-proxy/error.log"
    # Its master and worker both count as the router.
    mapfile -t TARGET_PIDS < <(
        echo "$TARGET_PID"
        pgrep -P "$TARGET_PID" || true
    )
}

# Records a started target: add_target NAME URL [ROUTER_PIDS...].
add_target() {
    local name=$1 url=$2
    shift 2
    TARGETS+=("$name")
    TARGET_URLS[$name]=$url
    TARGET_ROUTER_PIDS[$name]="$*"
}

# The nginx master and its worker, into the array NGINX_PIDS.
nginx_pids() { mapfile -t NGINX_PIDS < <(echo "$NGINX_PID"; pgrep -P "$NGINX_PID" || true); }

start_ours() { # NAME [VAR=value for the proxy's environment...] [-- proxy options...]
    local name=$1 port vars=() opts=()
    shift
    while (($#)) && [[ $1 != -- ]]; do vars+=("$1"); shift; done
    (($#)) && shift && opts=("$@")
    port=$(free_port)
    env "${vars[@]+"${vars[@]}"}" "${CPU1[@]}" "$WORK/proxy" --listen "127.0.0.1:$port" \
        --backend "node-a=$BACKEND,slots=4096" --overflow overcommit "${opts[@]+"${opts[@]}"}" \
        >"$WORK/proxy-$name.log" 2>&1 &
    TARGET_PID=$!
    PIDS+=("$TARGET_PID")
    TARGET_URL="http://127.0.0.1:$port"
    wait_http "$TARGET_URL" "our proxy" "$TARGET_PID" "$WORK/proxy-$name.log"
}

# The floor, not a contender: examples/passthrough.rs, the same HTTP parts as ours with nothing
# in between, on one tokio worker. "pool": hyper-util's pooled client, as ours uses;
# "per-connection": one backend connection per client connection, driven in the same task.
start_passthrough() { # pool | per-connection
    local port flag=()
    port=$(free_port)
    [[ $1 == per-connection ]] && flag=(--per-connection)
    TOKIO_WORKER_THREADS=1 "${CPU1[@]}" "$WORK/passthrough" "127.0.0.1:$port" \
        "${BACKEND#http://}" "${flag[@]}" >"$WORK/passthrough-$1.log" 2>&1 &
    TARGET_PID=$!
    PIDS+=("$TARGET_PID")
    TARGET_URL="http://127.0.0.1:$port"
    wait_http "$TARGET_URL" "the pass-through ($1)" "$TARGET_PID" "$WORK/passthrough-$1.log"
}

start_sglang() { # policy
    local port prom
    port=$(free_port)
    prom=$(free_port)
    "${CPU1[@]}" "$VENV/bin/smg" launch --host 127.0.0.1 --port "$port" --worker-urls "$BACKEND" \
        --policy "$1" --prometheus-host 127.0.0.1 --prometheus-port "$prom" \
        --log-level "$SGL_LOG" >"$WORK/sglang-$1.log" 2>&1 &
    TARGET_PID=$!
    PIDS+=("$TARGET_PID")
    TARGET_URL="http://127.0.0.1:$port"
    wait_http "$TARGET_URL" "SGLang's router ($1)" "$TARGET_PID" "$WORK/sglang-$1.log"
}

# --- measuring -------------------------------------------------------------------------------

write_lua() {
    write_bench_lua "$WORK/bench.lua" "$SESSIONS"
}

# utime+stime of the given pids, in clock ticks.
ticks() {
    local total=0 pid f
    for pid in "$@"; do
        [[ -r /proc/$pid/stat ]] || continue
        # Fields after the command name (which may hold spaces): 14 and 15 are utime, stime.
        f=$(sed 's/^.*) //' "/proc/$pid/stat")
        read -r -a a <<<"$f"
        total=$((total + a[11] + a[12]))
    done
    echo "$total"
}

now_ns() { date +%s%N; }

# run_wrk WRK_OUT NAME CONNS DURATION URL SERVER_PIDS...: runs wrk (its output into the file
# WRK_OUT) and prints "NAME c=CONNS RESULT ..." plus cores of each side and the servers' ticks.
run_wrk() {
    local out=$1 name=$2 conns=$3 dur=$4 url=$5
    shift 5
    local nginx_before server_before t0 t1 nginx_after server_after line wrk_cpu
    nginx_pids
    nginx_before=$(ticks "${NGINX_PIDS[@]}")
    server_before=$(ticks "$@")
    t0=$(now_ns)
    run_fg "${CPU0[@]}" /usr/bin/time -f "WRKCPU %U %S" -o "$WORK/wrk-time" \
        wrk -t1 -c"$conns" -d"$dur" --latency -s "$WORK/bench.lua" "$url/v1/chat/completions" \
        >"$out" 2>&1
    t1=$(now_ns)
    nginx_after=$(ticks "${NGINX_PIDS[@]}")
    server_after=$(ticks "$@")
    line=$(grep '^RESULT' "$out")
    wrk_cpu=$(awk '/^WRKCPU/ { print $2 + $3 }' "$WORK/wrk-time")
    awk -v line="$line" -v wall_ns=$((t1 - t0)) -v tck="$CLK_TCK" -v wrk="$wrk_cpu" \
        -v ng=$((nginx_after - nginx_before)) -v sv=$((server_after - server_before)) \
        -v name="$name" -v c="$conns" 'BEGIN {
            wall = wall_ns / 1e9
            printf "%s c=%s %s wall_s=%.3f wrk_cores=%.3f nginx_cores=%.3f router_cores=%.3f " \
                "router_ticks=%d\n", name, c, line, wall, wrk / wall, ng / tck / wall, sv / tck / wall, sv
        }'
}

measure() { # NAME URL SERVER_PIDS...
    local name=$1 url=$2 c
    shift 2
    log "$name: warm-up $WARMUP"
    run_fg "${CPU0[@]}" wrk -t1 -c32 -d"$WARMUP" -s "$WORK/bench.lua" \
        "$url/v1/chat/completions" >/dev/null
    for c in "${CONNS[@]}"; do
        log "$name: $c connection(s), $DURATION"
        run_wrk "$WORK/wrk-$name-c$c.txt" "$name" "$c" "$DURATION" "$url" "$@" \
            >>"$WORK/results.txt"
        tail -1 "$WORK/results.txt" >&2
        if grep -q 'non2xx=[1-9]\|errors=[1-9]' <(tail -1 "$WORK/results.txt"); then
            log "$name: errors or non-2xx answers (see $WORK/wrk-$name-c$c.txt)"
        fi
    done
}

# ROUNDS rounds of one short 1-connection wrk run per target, direct included; round r starts at
# the r-th target, so that no target is always measured first or last. One line per run in
# rounds.txt: "NAME c=1 round=R RESULT ...".
measure_rounds() {
    local n=${#TARGETS[@]} r i name url pids=()
    for ((r = 1; r <= ROUNDS; r++)); do
        log "round $r of $ROUNDS: 1 connection, $ROUND_DURATION per target"
        for ((i = 0; i < n; i++)); do
            name=${TARGETS[(i + r - 1) % n]}
            url=${TARGET_URLS[$name]}
            read -r -a pids <<<"${TARGET_ROUTER_PIDS[$name]}"
            run_wrk "$WORK/wrk-$name-round$r.txt" "$name" 1 "$ROUND_DURATION" "$url" \
                "${pids[@]+"${pids[@]}"}" >"$WORK/round-line.txt"
            awk -v r="$r" '{ $2 = $2 " round=" r; print }' "$WORK/round-line.txt" \
                >>"$WORK/rounds.txt"
            if grep -q 'non2xx=[1-9]\|errors=[1-9]' "$WORK/round-line.txt"; then
                log "$name: errors or non-2xx answers in round $r (see $WORK/wrk-$name-round$r.txt)"
            fi
        done
    done
}

# --- main ------------------------------------------------------------------------------------

install_deps
write_lua
: >"$WORK/results.txt"
log "load before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores; pinning: $PIN"
start_nginx
add_target direct "$BACKEND"

start_ours ours
add_target ours "$TARGET_URL" "$TARGET_PID"
# The same binary on one tokio worker thread (tokio reads TOKIO_WORKER_THREADS): no hand-offs
# between threads.
start_ours ours_1thread TOKIO_WORKER_THREADS=1
add_target ours_1thread "$TARGET_URL" "$TARGET_PID"
# Both again with --upstream per-client: each client connection drives its own backend
# connections (examples/proxy/per_client.rs).
start_ours ours_per_client -- --upstream per-client
add_target ours_per_client "$TARGET_URL" "$TARGET_PID"
start_ours ours_per_client_1thread TOKIO_WORKER_THREADS=1 -- --upstream per-client
add_target ours_per_client_1thread "$TARGET_URL" "$TARGET_PID"

for policy in round_robin cache_aware; do
    start_sglang "$policy"
    add_target "sglang_$policy" "$TARGET_URL" "$TARGET_PID"
done
start_nginx_proxy
add_target nginx_proxy "$TARGET_URL" "${TARGET_PIDS[@]}"

for mode in pool per-connection; do
    start_passthrough "$mode"
    add_target "passthrough_$mode" "$TARGET_URL" "$TARGET_PID"
done

for name in "${TARGETS[@]}"; do
    read -r -a router_pids <<<"${TARGET_ROUTER_PIDS[$name]}"
    measure "$name" "${TARGET_URLS[$name]}" "${router_pids[@]+"${router_pids[@]}"}"
done

: >"$WORK/rounds.txt"
if ((ROUNDS > 0)); then
    measure_rounds
fi

log "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$WORK/results.txt" "$DURATION" "$PIN" "$WORK/rounds.txt" "$ROUND_DURATION" "$CLK_TCK" \
    <<'PY' | tee "${OUT:-/dev/null}"
import math, re, statistics, sys

rows = {}
for line in open(sys.argv[1]):
    name, c = line.split()[:2]
    kv = dict(re.findall(r"(\w+)=([\d.]+)", line))
    rows[(name, int(c[2:]))] = {k: float(v) for k, v in kv.items()}

names = [
    ("direct", "nginx directly"),
    ("ours", "our proxy (`node-then-backend`)"),
    ("sglang_round_robin", "SGLang `round_robin`"),
    ("sglang_cache_aware", "SGLang `cache_aware`"),
    ("ours_1thread", "our proxy, 1 tokio worker"),
    ("ours_per_client", "our proxy, `--upstream per-client`"),
    ("ours_per_client_1thread", "our proxy, `--upstream per-client`, 1 tokio worker"),
    ("nginx_proxy", "reference: nginx `proxy_pass`"),
    ("passthrough_pool", "floor: hyper pass-through, pooled client, 1 worker"),
    ("passthrough_per-connection", "floor: hyper pass-through, per-connection upstream, 1 worker"),
]


def ms(us):
    return f"{us / 1000:.3f} ms"


for c in sorted({c for _, c in rows}, reverse=True):
    d = rows[("direct", c)]
    d["rps"] = d["requests"] / (d["duration_us"] / 1e6)
    print(f"\n{c} connection{'s' if c > 1 else ''}, wrk -t1 -c{c} -d{sys.argv[2]}"
          f" (pinned: {'yes' if sys.argv[3] == '1' else 'no'})\n")
    print("| path | requests/s | / direct | p50 | / direct | added p50 | p99 | / direct "
          "| errors | cores: wrk / nginx / router | router CPU per request |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for key, label in names:
        r = rows.get((key, c))
        if r is None:
            continue
        r["rps"] = r["requests"] / (r["duration_us"] / 1e6)
        added = r["p50_us"] - d["p50_us"]
        r["added"] = added
        router = "—" if key == "direct" else f"{r['router_cores']:.2f}"
        per_req = "—" if key == "direct" else f"{r['router_cores'] / r['rps'] * 1e6:.0f} µs"
        print(f"| {label} | {r['rps']:,.0f} | {r['rps'] / d['rps']:.2f}x | {ms(r['p50_us'])} "
              f"| {r['p50_us'] / d['p50_us']:.2f}x | {'—' if key == 'direct' else ms(added)} "
              f"| {ms(r['p99_us'])} | {r['p99_us'] / d['p99_us']:.2f}x "
              f"| {int(r['errors'] + r['non2xx'])} "
              f"| {r['wrk_cores']:.2f} / {r['nginx_cores']:.2f} / {router} "
              f"| {per_req} |")
    print("\n| ours / SGLang | requests/s | p50 | p99 | added p50 | verdict (≥ 5x requests/s, ≤ 0.20x added p50) |")
    print("|---|---:|---:|---:|---:|---|")
    # The floors' rows show the most any proxy built from the same HTTP parts reached in this run.
    for okey, olabel in [("ours", "ours"), ("ours_1thread", "ours, 1 worker"),
                         ("ours_per_client", "ours, per-client"),
                         ("ours_per_client_1thread", "ours, per-client, 1 worker"),
                         ("passthrough_pool", "floor, pooled"),
                         ("passthrough_per-connection", "floor, per-connection")]:
        ours = rows.get((okey, c))
        for key, label in names[2:4]:
            s = rows.get((key, c))
            if ours is None or s is None:
                continue
            rps = ours["rps"] / s["rps"]
            added = (ours["added"] / s["added"]) if s["added"] > 0 else float("nan")
            verdict = " / ".join("pass" if ok else "**miss**" for ok in (rps >= 5, added <= 0.2))
            print(f"| {olabel} / {label} | {rps:.2f}x | {ours['p50_us'] / s['p50_us']:.2f}x "
                  f"| {ours['p99_us'] / s['p99_us']:.2f}x | {added:.2f}x | {verdict} |")
    print()

# The alternating rounds at 1 connection: each round's added p50 is against that round's direct.
rounds = {}  # round -> name -> values
for line in open(sys.argv[4]):
    name = line.split()[0]
    kv = {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line)}
    rounds.setdefault(int(kv["round"]), {})[name] = kv
tck = float(sys.argv[6])
nan = float("nan")


def added_in(rnd, key):
    r, d = rnd.get(key), rnd.get("direct")
    return nan if r is None or d is None else r["p50_us"] - d["p50_us"]


def median(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else nan


def spread(xs, fmt):
    xs = [x for x in xs if not math.isnan(x)]
    return f"{fmt(min(xs))} – {fmt(max(xs))}" if xs else "nan"


def ms_nan(us):
    return "nan" if math.isnan(us) else ms(us)


if rounds:
    print(f"\n1 connection, {len(rounds)} alternating rounds of {sys.argv[5]} (wrk -t1 -c1)"
          f" (pinned: {'yes' if sys.argv[3] == '1' else 'no'})\n")
    print("| path | median p50 | median added p50 | added p50 min – max "
          "| median router CPU per request | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, label in names:
        runs = [rnd[key] for rnd in rounds.values() if key in rnd]
        if not runs:
            continue
        p50 = median([r["p50_us"] for r in runs])
        errors = int(sum(r["errors"] + r["non2xx"] for r in runs))
        if key == "direct":
            print(f"| {label} | {ms(p50)} | — | — | — | {errors} |")
            continue
        added = [added_in(rnd, key) for rnd in rounds.values()]
        cpu = median([r["router_ticks"] / tck / r["requests"] * 1e6 if r["requests"] else nan
                      for r in runs])
        print(f"| {label} | {ms(p50)} | {ms_nan(median(added))} | {spread(added, ms)} "
              f"| {'nan' if math.isnan(cpu) else f'{cpu:.0f} µs'} | {errors} |")

    print("\nours / SGLang, added p50 at 1 connection (per-round ratios)\n")
    print("| ours / SGLang | median ratio | min – max | verdict (≤ 0.20x added p50) |")
    print("|---|---:|---:|---|")
    for okey, olabel in [("ours", "ours"), ("ours_1thread", "ours, 1 worker"),
                         ("ours_per_client", "ours, per-client"),
                         ("ours_per_client_1thread", "ours, per-client, 1 worker"),
                         ("passthrough_pool", "floor, pooled"),
                         ("passthrough_per-connection", "floor, per-connection"),
                         ("nginx_proxy", "nginx `proxy_pass`")]:
        for key, label in names[2:4]:
            ratios = []
            for rnd in rounds.values():
                o, s = added_in(rnd, okey), added_in(rnd, key)
                # A ratio only against a positive SGLang added p50 (else nan, left out).
                ratios.append(o / s if not math.isnan(o) and s > 0 else nan)
            valid = sum(not math.isnan(x) for x in ratios)
            if not valid and all(okey not in rnd or key not in rnd for rnd in rounds.values()):
                continue
            med = median(ratios)
            note = "" if valid == len(ratios) else f" ({valid} of {len(ratios)} rounds)"
            verdict = "pass" if med <= 0.2 else "**miss**"
            print(f"| {olabel} / {label} | {'nan' if math.isnan(med) else f'{med:.2f}x'}{note} "
                  f"| {spread(ratios, lambda x: f'{x:.2f}x')} | {verdict} |")
    print()
PY
