#!/usr/bin/env bash
# What a real llama-server does when the prompts of its running requests overfill a unified
# KV cache, and what `context=` on the proxy's `--backend` does about it. Run by hand (never
# by CI), after `scripts/e2e-llama.sh --setup-only` (this uses its cached llama-server and
# model); it builds `--example proxy` (features health, dns, redis) unless TA_PROXY_BIN
# names a binary.
#
#   scripts/llama-context.sh
#
# One llama-server on loopback, `-np 2 -c 1024 --kv-unified` (two slots sharing 1,024 tokens
# of KV, as llama-server's defaults share theirs), no RAM cache. Each prompt is about 990
# tokens: one alone fits, two together do not. Three runs, each sending two such prompts at
# once (different text each run, so that nothing is reused):
#   direct        straight to llama-server: it clears its idle slots, halves its batch, and
#                 then fails both requests with 500 "Context size has been exceeded.";
#   proxy         through the proxy with `slots=2` alone: the same, as the proxy sends both;
#   proxy-context through the proxy with `slots=2,context=1016` (`-c` less the 8 tokens each
#                 answer may take), on a proxy that has seen no answer yet, so that it counts
#                 a token as two bytes: the second request waits for the first, and both are
#                 answered.
#
# Then a slot's share of the context: two more llama-servers, `small` (`-np 2 -c 2048`: 1,024
# tokens a slot) and `large` (`-np 1 -c 4096`), and a conversation of two turns, the second
# about 1,500 tokens:
#   slots-direct  the second turn straight to `small`: 400, "exceeds the available context
#                 size";
#   slots-proxy   through the proxy over both (slot counts and contexts read from /slots), the
#                 first turn on `small` (sessions are tried until one goes there): the second
#                 goes to `large`, and is answered;
#   digits-proxy  through the same proxy, a conversation on `small` whose second turn (574
#                 tokens) stays there and whose third is a tool's output of 1,200 digits,
#                 which the model's tokenizer counts a token each, as the proxy estimates
#                 them: the proxy sends it to `large` at once, and `small` refuses nothing;
#   dense-proxy   the same with a third turn of 1,000 bytes of punctuation (as minified or
#                 generated text runs), some 700 tokens that the proxy estimates at 250 from
#                 their bytes: `small` refuses it, and the proxy retries it on `large`,
#                 which answers;
#   alone-proxy   through a proxy over `small` alone, a conversation's turn of some 1,300
#                 tokens (1,200 digits): `small` refuses it once, and no other backend taking it, the
#                 refusal is the answer (it is not sent again).
# Exits 0 when the eight come out so.
#
# Environment: TA_CACHE_DIR (~/.cache/tower-affinity), TA_CONTEXT_PORT (18095; the proxy on
# the next port, `small` and `large` on the two after, the last proxy on the next),
# TA_PROXY_BIN.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT="${TA_CONTEXT_PORT:-18095}"
PROXY_PORT=$((PORT + 1))
# shellcheck source-path=SCRIPTDIR source=llama-common.sh
source "$ROOT/scripts/llama-common.sh"
for p in "$PORT" $((PORT + 1)) $((PORT + 2)) $((PORT + 3)) $((PORT + 4)); do
    need_free_port "$p" TA_CONTEXT_PORT
done
if [[ -z "${TA_PROXY_BIN:-}" ]]; then
    command -v cargo >/dev/null || { echo "cargo is needed to build the proxy (or set TA_PROXY_BIN)" >&2; exit 2; }
    (cd "$ROOT" && cargo build --release --features health,dns,redis --example proxy) >&2
    TA_PROXY_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/proxy"
fi
[[ -x "$TA_PROXY_BIN" ]] || { echo "no proxy binary at $TA_PROXY_BIN" >&2; exit 2; }

LOGS="$(mktemp -d)"
echo "logs: $LOGS"

LD_LIBRARY_PATH="$BIN" "$BIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$PORT" \
    -np 2 -c 1024 --kv-unified -t 2 --cache-ram 0 >"$LOGS/llama.log" 2>&1 &
PIDS+=($!)
wait_up "http://127.0.0.1:$PORT/health" "$!" "$LOGS/llama.log"

# pair RUN URL: two prompts at once; prints each answer's status, and exits 0 if the run
# came out as its name says it should: both answered (proxy-context), or both refused with
# llama-server's 500 "Context size has been exceeded." (direct, proxy).
pair() {
    python3 - "$@" <<'PY'
import json, sys, threading, urllib.error, urllib.request

run, url = sys.argv[1], sys.argv[2] + "/v1/chat/completions"

def prompt(tag):
    rules = " ".join(f"Rule {tag}{i}: keep the code tidy." for i in range(75))
    return [{"role": "user", "content": rules}]

def ask(tag, session, out):
    body = json.dumps({"messages": prompt(tag), "max_tokens": 8, "temperature": 0}).encode()
    headers = {"content-type": "application/json", "x-session-id": session}
    req = urllib.request.Request(url, body, headers)
    try:
        r = urllib.request.urlopen(req, timeout=600)
        j = json.load(r)
        out[session] = (r.status, j["usage"]["prompt_tokens"])
    except urllib.error.HTTPError as e:
        out[session] = (e.code, e.read().decode(errors="replace")[:120])
    except Exception as e:  # no answer at all (a dropped connection, a timeout): no status
        out[session] = (None, f"{type(e).__name__}: {e}")

out = {}
threads = [threading.Thread(target=ask, args=(run + s, run + "-" + s, out)) for s in "ab"]
for t in threads:
    t.start()
for t in threads:
    t.join()
for s, r in sorted(out.items()):
    print(f"{run}: {s}: {r}")
# llama-server's answer to prompts that overfill its context; any other (a 200, another
# error, no answer at all) beside it is not what the run shows.
def overfilled(r):
    return r[0] == 500 and "Context size has been exceeded" in str(r[1])

answers = list(out.values())
ok = len(answers) == 2 and (all(r[0] == 200 for r in answers) if run == "proxy-context"
                            else all(overfilled(r) for r in answers))
print(f"{run}: {'as expected' if ok else 'NOT as expected'}")
sys.exit(0 if ok else 1)
PY
}

start_proxy() { # backend options
    "$TA_PROXY_BIN" --listen "127.0.0.1:$PROXY_PORT" --no-slots-probe \
        --backend "n=http://127.0.0.1:$PORT,$1" >"$LOGS/proxy-$1.log" 2>&1 &
    PROXY_PID=$!
    PIDS+=("$PROXY_PID")
    wait_up "http://127.0.0.1:$PROXY_PORT/metrics" "$PROXY_PID" "$LOGS/proxy-$1.log"
}

fail=0
pair direct "http://127.0.0.1:$PORT" || fail=1
start_proxy slots=2
pair proxy "http://127.0.0.1:$PROXY_PORT" || fail=1
stop_pids "$PROXY_PID"
start_proxy slots=2,context=1016
pair proxy-context "http://127.0.0.1:$PROXY_PORT" || fail=1
echo "llama-server errors \"Context size has been exceeded\": $(grep -c "Context size has been exceeded" "$LOGS/llama.log" || true)"
stop_pids "$PROXY_PID"

# --- a slot's share of the context ---
SMALL=$((PORT + 2))
LARGE=$((PORT + 3))
LD_LIBRARY_PATH="$BIN" "$BIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$SMALL" \
    -np 2 -c 2048 -t 1 --cache-ram 0 >"$LOGS/small.log" 2>&1 &
SMALL_PID=$!
PIDS+=("$SMALL_PID")
LD_LIBRARY_PATH="$BIN" "$BIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$LARGE" \
    -np 1 -c 4096 -t 1 --cache-ram 0 >"$LOGS/large.log" 2>&1 &
LARGE_PID=$!
PIDS+=("$LARGE_PID")
wait_up "http://127.0.0.1:$SMALL/health" "$SMALL_PID" "$LOGS/small.log"
wait_up "http://127.0.0.1:$LARGE/health" "$LARGE_PID" "$LOGS/large.log"
"$TA_PROXY_BIN" --listen "127.0.0.1:$PROXY_PORT" \
    --backend "n1=http://127.0.0.1:$SMALL,id=small" \
    --backend "n2=http://127.0.0.1:$LARGE,id=large" >"$LOGS/proxy-slots.log" 2>&1 &
PROXY_PID=$!
PIDS+=("$PROXY_PID")
wait_up "http://127.0.0.1:$PROXY_PORT/metrics" "$PROXY_PID" "$LOGS/proxy-slots.log"

# The turns' client, for the runs below: ask(url, messages, session) sends one turn and
# returns its status, where it went ("backend (outcome)" from the proxy's headers, "-" when
# sent straight), its prompt tokens (or the refusal's first bytes) and its answer's text. No
# answer, or a 200 that is no chat completion, has no status (None) and says what it was, so
# that the run prints its verdict as it does for any other answer.
cat >"$LOGS/turns.py" <<'PY'
import json, urllib.error, urllib.request

def ask(url, messages, session):
    body = json.dumps({"messages": messages, "max_tokens": 8, "temperature": 0}).encode()
    headers = {"content-type": "application/json", "x-session-id": session}
    req = urllib.request.Request(url + "/v1/chat/completions", body, headers)
    try:
        r = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as e:
        return e.code, where(e.headers), e.read().decode(errors="replace")[:140], ""
    except OSError as e:  # refused, dropped, timed out
        return None, "-", f"no answer: {type(e).__name__}: {e}", ""
    try:
        j = json.load(r)
        return r.status, where(r.headers), j["usage"]["prompt_tokens"], j["choices"][0]["message"]["content"]
    except (OSError, ValueError, LookupError, TypeError) as e:
        return None, where(r.headers), f"no chat completion: {type(e).__name__}: {e}", ""

def where(headers):
    backend = headers.get("x-affinity-backend")
    return f'{backend} ({headers.get("x-affinity-outcome", "-")})' if backend else "-"
PY

# conversation RUN URL: a short turn, then a long one, under sessions tried until the first
# turn goes to `small` (through the proxy); exits 0 if the run came out as its name says.
conversation() {
    python3 - "$LOGS" "$@" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
from turns import ask

run, url = sys.argv[2], sys.argv[3]
first = [{"role": "user", "content": "Name a colour."}]
ask_turn = lambda messages, session: ask(url, messages, session)

for i in range(16):
    session = f"{run}-{i}"
    status, backend, tokens, text = ask_turn(first, session)
    print(f"{run}: first turn of {session}: {status} on {backend}, {tokens} tokens")
    # Straight to `small`, or through the proxy to `small`: the second turn must move.
    home_small = status == 200 and (run == "slots-direct" or backend.startswith("small"))
    if home_small:
        break
rules = " ".join(f"Rule {i}: keep the code tidy." for i in range(200))
second = first + [{"role": "assistant", "content": text}, {"role": "user", "content": rules}]
status, backend, tokens, _ = ask_turn(second, session)
print(f"{run}: second turn: {status} on {backend}: {tokens}")
if not home_small:
    print(f"{run}: no first turn went to small")
ok = home_small and (status == 400 if run == "slots-direct"
                     else (status == 200 and backend.startswith("large")))
print(f"{run}: {'as expected' if ok else 'NOT as expected'}")
sys.exit(0 if ok else 1)
PY
}

conversation slots-direct "http://127.0.0.1:$SMALL" || fail=1
conversation slots-proxy "http://127.0.0.1:$PROXY_PORT" || fail=1
grep "request context read from /slots" "$LOGS/proxy-slots.log" | sed 's/^.*backend=/proxy: backend=/' || true

# dense RUN URL: a conversation homed on `small` (two turns of prose, which teach the proxy
# the backends' tokens a byte; the second, under 600 tokens, stays home), then a turn over
# `small`'s 1,024 tokens a slot by the model's own tokenizer: for digits-proxy 1,200 digits,
# a token each, as the proxy estimates them; for dense-proxy 1,000 bytes of punctuation,
# about 700 tokens, which the proxy estimates at four bytes a token (250), the turn under the
# slot's context. Exits 0 if the prose turn stayed home and the third is answered on `large`.
dense() {
    python3 - "$LOGS" "$@" <<'PY'
import random, sys
sys.path.insert(0, sys.argv[1])
from turns import ask as ask_at

run, url = sys.argv[2], sys.argv[3]
ask = lambda messages, session: ask_at(url, messages, session)

rules = " ".join("Rule: keep the code tidy and the tests green." for _ in range(30))
for i in range(16):
    session = f"{run}-{i}"
    messages = [{"role": "user", "content": f"Conversation {run} {i}. " + rules}]
    status, backend, tokens, text = ask(messages, session)
    print(f"{run}: first turn of {session}: {status} on {backend}, {tokens} tokens")
    if backend.startswith("small"):
        break
more = " ".join("Rule: name things for what they do." for _ in range(20))
messages += [{"role": "assistant", "content": text}, {"role": "user", "content": more}]
status, backend, tokens, text = ask(messages, session)
print(f"{run}: prose turn: {status} on {backend}, {tokens} tokens")
prose_home = backend.startswith("small")
if run == "digits-proxy":
    third = "".join(str(i % 10) for i in range(1200))
else:
    rnd = random.Random(7)
    third = "".join(rnd.choice("#%&*+<=>@^|~;:,.?!") for _ in range(1000))
messages += [{"role": "assistant", "content": text}, {"role": "user", "content": third}]
status, backend, tokens, _ = ask(messages, session)
print(f"{run}: third turn: {status} on {backend}: {tokens}")
ok = prose_home and status == 200 and backend.startswith("large")
print(f"{run}: {'as expected' if ok else 'NOT as expected'}")
sys.exit(0 if ok else 1)
PY
}

refusals() { grep -c "exceeds the available context size" "$LOGS/small.log" || true; }
for run in digits-proxy dense-proxy; do
    before=$(refusals)
    dense "$run" "http://127.0.0.1:$PROXY_PORT" || fail=1
    refused=$(($(refusals) - before))
    want=$([[ "$run" == digits-proxy ]] && echo 0 || echo 1)
    echo "$run: prompts small refused meanwhile: $refused (expected $want)"
    [[ "$refused" == "$want" ]] || fail=1
done

# alone: a proxy over `small` alone; a conversation's second turn of 1,200 digits is more
# than a slot takes, by the estimate too; sent home all the same (no backend takes it), it is
# refused once, and the refusal is the answer. Exits 0 if so.
ALONE_PORT=$((PORT + 4))
"$TA_PROXY_BIN" --listen "127.0.0.1:$ALONE_PORT" \
    --backend "n1=http://127.0.0.1:$SMALL,id=small" >"$LOGS/proxy-alone.log" 2>&1 &
PIDS+=($!)
wait_up "http://127.0.0.1:$ALONE_PORT/metrics" "$!" "$LOGS/proxy-alone.log"
before=$(refusals)
python3 - "$LOGS" "http://127.0.0.1:$ALONE_PORT" <<'PY' || fail=1
import sys
sys.path.insert(0, sys.argv[1])
from turns import ask

url = sys.argv[2]
messages = [{"role": "user", "content": "Name a colour."}]
status, backend, tokens, text = ask(url, messages, "alone")
print(f"alone-proxy: first turn: {status} on {backend}, {tokens} tokens")
digits = "".join(str(i % 10) for i in range(1200))
messages += [{"role": "assistant", "content": text}, {"role": "user", "content": digits}]
status, backend, body, _ = ask(url, messages, "alone")
print(f"alone-proxy: second turn: {status} on {backend}: {body}")
ok = status == 400 and backend == "small (home-hit)"
print(f"alone-proxy: {'as expected' if ok else 'NOT as expected'}")
sys.exit(0 if ok else 1)
PY
refused=$(($(refusals) - before))
echo "alone-proxy: prompts small refused meanwhile: $refused (expected 1)"
[[ "$refused" == 1 ]] || fail=1
echo "logs: $LOGS"
exit "$fail"
