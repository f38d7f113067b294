#!/usr/bin/env bash
# Keyless agents that open at once with a system prompt new to the fleet, round after round,
# through the proxy onto two real llama-servers of two slots each: where their conversations
# go, and what their later turns reuse by llama-server's own counts. From the second round on,
# the proxy's cache models remember the conversations of the rounds before, long ended. Run by
# hand (never by CI), after `scripts/e2e-llama.sh --setup-only` (this uses its cached
# llama-server and model), with a release build of the proxy:
#
#   cargo build --release --features health,dns,redis --example proxy
#   scripts/llama-openings.sh [PROXY_ARGS...]
#
# Each round: four agents at once (or one every TA_OPENINGS_STAGGER seconds), no session key,
# four chat turns each (`max_tokens` 16, not streamed), all opening with the same system prompt
# of about 500 tokens, new each round. For
# each round: how many conversations each backend took, the later turns sent where the
# conversation's previous turn was served, the share of their prompt tokens llama-server
# reused (`timings.cache_n` over `cache_n + prompt_n`), and the round's time. Exits 0 when in
# every round each backend took conversations and the later turns reused at least 80%.
# Agents that open apart and think between turns (TA_OPENINGS_STAGGER=8 TA_OPENINGS_THINK=6)
# send their turns out of step: llama-server, left to choose, gives a turn the idle slot that
# shares the most with it, another conversation's of the same system prompt, and drops that
# one's tail; with TA_OPENINGS_BACKEND_OPTIONS=,assign-slots the proxy gives each
# conversation a slot of its own. Rounds that put three or four conversations on a backend
# of two slots fall short either way (BENCHMARKS.md, part 31). With a pause between rounds
# longer than the proxy's --live-window (TA_OPENINGS_PAUSE=330), the conversations of the
# rounds before count no more where a round's new ones are spread (part 32).
#
# Environment: TA_CACHE_DIR (~/.cache/tower-affinity), TA_PROXY_BIN
# (target/release/examples/proxy), TA_OPENINGS_PORTS ("18098 18099 18100": two llama-servers,
# then the proxy), TA_OPENINGS_ROUNDS (5), TA_OPENINGS_AGENTS (4), TA_OPENINGS_STAGGER (0:
# seconds between one agent's opening and the next's), TA_OPENINGS_THINK (0: seconds an agent
# thinks between its turns, as agents run tools), TA_OPENINGS_PAUSE (0: seconds between one
# round's end and the next's start), TA_OPENINGS_BACKEND_OPTIONS (added to each --backend,
# e.g. ",assign-slots").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=llama-common.sh
source "$ROOT/scripts/llama-common.sh"

ROUNDS="${TA_OPENINGS_ROUNDS:-5}"
AGENTS="${TA_OPENINGS_AGENTS:-4}"
STAGGER="${TA_OPENINGS_STAGGER:-0}"
THINK="${TA_OPENINGS_THINK:-0}"
PAUSE="${TA_OPENINGS_PAUSE:-0}"
OPTIONS="${TA_OPENINGS_BACKEND_OPTIONS:-}"
two_llamas_and_a_proxy TA_OPENINGS_PORTS "18098 18099 18100"
"$PROXY" --listen "127.0.0.1:${PORTS[2]}" -v \
    --backend "node-a=http://127.0.0.1:${PORTS[0]},id=a$OPTIONS" \
    --backend "node-b=http://127.0.0.1:${PORTS[1]},id=b$OPTIONS" "$@" >"$LOGS/proxy.log" 2>&1 &
PIDS+=("$!")
wait_up "http://127.0.0.1:${PORTS[2]}/metrics" "$!" "$LOGS/proxy.log"
sleep 2 # the first probes read the slot counts

rc=0
python3 - "${PORTS[2]}" "$ROUNDS" "$AGENTS" "$STAGGER" "$THINK" "$PAUSE" <<'PY' || rc=1
import collections, http.client, json, sys, threading, time

port, rounds, agents = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
stagger, think, pause = float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
turns = 4

def post(body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    res = conn.getresponse()
    data = res.read()
    conn.close()
    return res.status, res.getheader("x-affinity-backend"), data

def agent(r, a, out):
    system = f"Round {r}. You are a careful coding assistant. " + " ".join(
        f"Rule {i}: keep answers short and exact." for i in range(40))
    history = [{"role": "system", "content": system}]
    time.sleep(a * stagger)
    for t in range(turns):
        if t > 0:
            time.sleep(think)
        history.append({"role": "user", "content":
                        f"Agent {a}, turn {t}: explain item {a * 10 + t} in one line, with detail {'x' * (50 * t)}."})
        status, backend, data = post({"model": "m", "messages": history, "max_tokens": 16, "temperature": 0})
        if status != 200:
            out.append((a, t, status, backend, None, None))
            return
        answer = json.loads(data)
        timings = answer.get("timings") or {}
        out.append((a, t, status, backend, timings.get("cache_n"), timings.get("prompt_n")))
        history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})

ok = True
for r in range(rounds):
    if r > 0:
        time.sleep(pause)
    out, start = [], time.time()
    threads = [threading.Thread(target=agent, args=(r, a, out)) for a in range(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.time() - start
    out.sort()
    homes = collections.Counter(b for a, t, s, b, c, p in out if t == 0)
    previous, stayed, later, reused, read = {}, 0, 0, 0, 0
    for a, t, s, b, c, p in out:
        if t > 0:
            later += 1
            stayed += previous.get(a) == b
            reused += c or 0
            read += p or 0
        previous[a] = b
    statuses = collections.Counter(s for a, t, s, b, c, p in out)
    share = reused / max(reused + read, 1)
    print(f"round {r + 1}: conversations per backend {dict(sorted(homes.items()))}; "
          f"later turns where the previous went {stayed}/{later}; reused {share:.1%} of their "
          f"prompt tokens; statuses {dict(statuses)}; {took:.1f} s")
    ok &= set(statuses) == {200} and len(homes) == 2 and share >= 0.8
sys.exit(0 if ok else 1)
PY
if ((rc)); then
    echo "FAIL: a round left a backend without conversations, reused less than 80%, or failed a request" >&2
    exit 1
fi
echo "PASS: every round spread its conversations over both backends and reused at least 80%"
