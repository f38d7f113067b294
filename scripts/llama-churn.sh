#!/usr/bin/env bash
# Streamed turns through the proxy onto two real llama-servers, more at once than their slots,
# with and without `--no-resend-on-close`: llama-server closes its connection after each
# streamed answer, unannounced, and a request that a freed slot lets through can go out on it
# before the close is seen. Run by hand (never by CI), after `scripts/e2e-llama.sh --setup-only`
# (this uses its cached llama-server and model), with a release build of the proxy:
#
#   cargo build --release --features health,dns,redis --example proxy
#   scripts/llama-churn.sh [PROXY_ARGS...]      # e.g. --upstream per-client
#
# Two llama-servers (-np 2 each: four slots), the proxy in front (its default --overflow wait),
# eight sessions of six streamed chat turns each, a thread a session over one keep-alive
# connection, `max_tokens` 8; each run stops at 60 s. For each run: the statuses the clients
# got, and each backend's failures, health and requests sent again at the end (from /metrics;
# the proxy's log's count of them beside it). Exits 0 when the run with sending again on got 200 for
# every request and failed no backend.
#
# Environment: TA_CACHE_DIR (~/.cache/tower-affinity), TA_PROXY_BIN
# (target/release/examples/proxy), TA_CHURN_PORTS ("18095 18096 18097": two llama-servers,
# then the proxy), TA_CHURN_SESSIONS (8), TA_CHURN_TURNS (6).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=llama-common.sh
source "$ROOT/scripts/llama-common.sh"

SESSIONS="${TA_CHURN_SESSIONS:-8}"
TURNS="${TA_CHURN_TURNS:-6}"
two_llamas_and_a_proxy TA_CHURN_PORTS "18095 18096 18097"

# run LABEL [proxy args...]: one run; prints its line, and returns 1 if a request was not
# answered 200 or a backend failed.
run() {
    local label="$1" pid rc=0
    shift
    "$PROXY" --listen "127.0.0.1:${PORTS[2]}" -v \
        --backend "node-a=http://127.0.0.1:${PORTS[0]}" \
        --backend "node-b=http://127.0.0.1:${PORTS[1]}" "$@" >"$LOGS/proxy-$label.log" 2>&1 &
    pid=$!
    PIDS+=("$pid")
    wait_up "http://127.0.0.1:${PORTS[2]}/metrics" "$pid" "$LOGS/proxy-$label.log"
    sleep 2 # the first probes read the slot counts
    python3 - "${PORTS[2]}" "$SESSIONS" "$TURNS" "$label" "$LOGS" <<'PY' || rc=1
import collections, http.client, json, re, sys, threading, time, urllib.request

port, sessions, turns, label, logs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
deadline = time.time() + 60
statuses, lock = collections.Counter(), threading.Lock()

def session(s):
    conn, history = None, [{"role": "system", "content": "You are terse."}]
    for t in range(turns):
        if time.time() > deadline:
            with lock:
                statuses["not sent (60 s)"] += 1
            continue
        history.append({"role": "user", "content": f"session {s} turn {t}: name a colour"})
        body = json.dumps({"model": "m", "messages": history, "max_tokens": 8, "stream": True})
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=45)
            conn.request("POST", "/v1/chat/completions", body,
                         {"content-type": "application/json", "x-session-id": f"churn-{s}"})
            res = conn.getresponse()
            res.read()
            with lock:
                statuses[res.status] += 1
            history.append({"role": "assistant", "content": "blue"})
            if res.will_close:
                conn.close()
                conn = None
        except Exception as e:  # a client error is counted, and the connection opened again
            with lock:
                statuses[type(e).__name__] += 1
            if conn:
                conn.close()
            conn = None
    if conn:
        conn.close()

threads = [threading.Thread(target=session, args=(s,)) for s in range(sessions)]
for t in threads:
    t.start()
for t in threads:
    t.join()
time.sleep(1)
metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
def per_backend(name):
    return [int(float(v)) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", metrics, re.M)]
failures, healthy = per_backend("tower_affinity_backend_failures_total"), per_backend("tower_affinity_backend_healthy")
log = open(f"{logs}/proxy-{label}.log", errors="replace").read()
again = per_backend("tower_affinity_backend_sent_again_total")
print(f"{label:>10}: statuses {dict(statuses)}; backend failures {failures}, healthy {healthy}; sent again {again} (log: {log.count('sent again')})")
ok = set(statuses) == {200} and sum(failures) == 0
sys.exit(0 if ok else 1)
PY
    stop_pids "$pid"
    return "$rc"
}

on=0
run resend "$@" || on=1
run no-resend --no-resend-on-close "$@" || true
if ((on)); then
    echo "FAIL: with sending again on, a request was not answered 200 or a backend failed" >&2
    exit 1
fi
echo "PASS: with sending again on, every request answered 200 and no backend failed"
