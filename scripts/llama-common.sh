# shellcheck shell=bash
# Sourced by the scripts that run the llama-server `scripts/e2e-llama.sh --setup-only` cached
# (llama-slots.sh, llama-context.sh, estimate-error.sh, llama-churn.sh, llama-openings.sh):
# where it is, a check that it and the tools are there, the processes started (stopped on every
# exit, Ctrl-C included), a check that a port is free, a wait for a server to answer, and two
# llama-servers started for a proxy in front.

CACHE="${TA_CACHE_DIR:-$HOME/.cache/tower-affinity}"
BIN="$CACHE/bin"
MODEL="$CACHE/models/gemma-3-270m-q4_k_m.gguf"

for tool in curl python3; do
    command -v "$tool" >/dev/null || {
        echo "$tool is needed (Debian: apt-get install $tool)" >&2
        exit 2
    }
done
[[ -x "$BIN/llama-server" && -f "$MODEL" ]] || {
    echo "no cached llama-server or model in $CACHE: run scripts/e2e-llama.sh --setup-only first" >&2
    exit 2
}

# The processes started (append each one's pid); all are stopped when the script exits.
PIDS=()

# stop_pids PID...: SIGTERM, five seconds, then SIGKILL; returns once each has exited, so that
# its port is free again, and takes them out of PIDS.
stop_pids() {
    local p alive keep=()
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 50); do
        alive=0
        for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
        ((alive)) || break
        sleep 0.1
    done
    kill -KILL "$@" 2>/dev/null || true
    for p in "$@"; do wait "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do [[ " $* " == *" $p "* ]] || keep+=("$p"); done
    PIDS=("${keep[@]}")
}

# shellcheck disable=SC2317  # invoked via trap
stop_all() {
    local rc=$?
    trap - EXIT INT TERM
    if ((${#PIDS[@]})); then stop_pids "${PIDS[@]}"; fi
    exit "$rc"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# need_free_port PORT VARIABLE: exits unless nothing listens on 127.0.0.1:PORT, so that a
# server left running or another run's is never taken for the one this script starts.
need_free_port() {
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
        echo "port $1 on 127.0.0.1 is already in use (another run, or a server left running?);" \
            "stop it or set $2 to another port" >&2
        exit 2
    fi
}

# wait_up URL PID LOG: until URL answers 200, while PID runs (two minutes at most); fails
# otherwise, naming URL and LOG and printing LOG's last lines.
wait_up() {
    local url=$1 pid=$2 log=$3 code='' deadline=$((SECONDS + 120))
    while ((SECONDS < deadline)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "the process (pid $pid) exited before answering $url; the end of $log:" >&2
            tail -n 20 "$log" >&2
            return 1
        fi
        code=$(curl -s -m 2 -o /dev/null -w '%{http_code}' "$url" || true)
        [[ $code == 200 ]] && return 0
        sleep 0.5
    done
    echo "no 200 from $url within 120 s (last status '$code'); the end of $log:" >&2
    tail -n 20 "$log" >&2
    return 1
}

# two_llamas_and_a_proxy VARIABLE DEFAULT: the three ports the environment VARIABLE names
# (else DEFAULT: two llama-servers, then the proxy) in PORTS, each checked free; the proxy's
# release build (or TA_PROXY_BIN) in PROXY, checked there; a new log directory in LOGS; and two
# llama-servers of two slots each (`-np 2 -c 8192`) on the first two ports, up.
two_llamas_and_a_proxy() {
    local var=$1 i port
    read -r -a PORTS <<<"${!var:-$2}"
    ((${#PORTS[@]} == 3)) || {
        echo "$var must name 3 ports, not '${!var:-}'" >&2
        exit 2
    }
    PROXY="${TA_PROXY_BIN:-$ROOT/target/release/examples/proxy}"
    [[ -x "$PROXY" ]] || {
        echo "no proxy at $PROXY: cargo build --release --features health,dns,redis --example proxy" >&2
        exit 2
    }
    LOGS="$(mktemp -d)"
    echo "logs in $LOGS"
    for port in "${PORTS[@]}"; do need_free_port "$port" "$var"; done
    for i in 0 1; do
        LD_LIBRARY_PATH="$BIN" "$BIN/llama-server" -m "$MODEL" --host 127.0.0.1 \
            --port "${PORTS[$i]}" -np 2 -c 8192 -t 1 >"$LOGS/llama-$i.log" 2>&1 &
        PIDS+=("$!")
    done
    for i in 0 1; do
        wait_up "http://127.0.0.1:${PORTS[$i]}/health" "${PIDS[$i]}" "$LOGS/llama-$i.log"
    done
}
