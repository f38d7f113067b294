#!/usr/bin/env bash
# What a real llama-server does with a slot's state when another prompt takes the slot, as
# the swarm's `--slot-policy llama` models it. Run by hand (never by CI), after
# `scripts/e2e-llama.sh --setup-only` (this uses its cached llama-server and model).
#
#   scripts/llama-slots.sh
#
# llama-server on loopback with a RAM prompt cache (--cache-ram 256). Conversation A (a long
# system prompt and a question) is answered; then other prompts take slots; then A's next
# turn comes. Seven cases:
#   shared   (-np 1) the other prompt shares A's system prompt: llama-server takes the slot
#            by similarity, keeps more than half of it, and saves nothing, so A's next turn
#            reuses only the system prompt;
#   other    (-np 1) the other prompt shares nothing: the slot is taken as the least
#            recently used, A's state goes to the RAM cache, and A's next turn is restored
#            from there;
#   idle     (-np 2) a stranger's prompt takes the other slot, then B (A's system prompt and
#            a long text of its own) takes A's slot by similarity and keeps more than half
#            of it, saving nothing for that; A's next turn, which would keep less than half
#            of B's slot, searches the RAM cache and is restored from there: A's state went
#            to RAM when the stranger's task started, because A's slot was idle
#            (--cache-idle-slots, the default);
#   no-idle  the same with --no-cache-idle-slots: A's next turn reuses only the system
#            prompt;
#   unified  the same with --kv-unified (llama-server's default when -np is not given): the
#            idle slots saved are cleared too, B finds A's state in RAM and takes it out to
#            continue it, and A's next turn reuses only the system prompt;
#   tie      (-np 2, no RAM cache) A, then B, each a short system prompt and a long text of
#            its own, take the two slots (B's shares too little of A's slot to be drawn to
#            it); then C, the same system prompt and a line, shares as much with either
#            slot: llama-server takes the first slot, B's, though A's is the least recently
#            used. A's next turn reuses all of A; B's only what C shared;
#   walk     (-np 2) the RAM cache holds X (the system prompt and a line) and, saved after
#            it, Y (the system prompt, a paragraph P shares, and a long text of its own);
#            P (the system prompt, that paragraph and a question) takes a slot holding
#            neither, as the least recently used. llama-server walks its states oldest first
#            and takes Y only if P keeps more of Y than of X: it keeps nearly all of X and a
#            third of Y, so X is restored, and P reuses the system prompt, not the paragraph.
# Exits 0 when all seven come out so, by llama-server's own `timings.cache_n`.
#
# Environment: TA_CACHE_DIR (~/.cache/tower-affinity), TA_SLOTS_PORT (18090).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT="${TA_SLOTS_PORT:-18090}"
# shellcheck source-path=SCRIPTDIR source=llama-common.sh
source "$ROOT/scripts/llama-common.sh"

# run_case CASE LOG SLOTS CONTEXT [llama-server flags...]
run_case() {
    local case="$1" log="$2" slots="$3" ctx="$4" pid rc=0
    shift 4
    need_free_port "$PORT" TA_SLOTS_PORT
    LD_LIBRARY_PATH="$BIN" "$BIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$PORT" \
        -np "$slots" -c "$ctx" -t 2 --cache-ram 256 "$@" >"$log" 2>&1 &
    pid=$!
    PIDS+=("$pid")
    wait_up "http://127.0.0.1:$PORT/health" "$pid" "$log" || rc=1
    ((rc)) || python3 - "$case" "$PORT" <<'PY' || rc=1
import json, sys, urllib.request

case, port = sys.argv[1], sys.argv[2]
url = f"http://127.0.0.1:{port}/v1/chat/completions"

def ask(messages):
    body = json.dumps({"messages": messages, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(url, body, {"content-type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=300))
    # Every case is judged by the tokens reused: an answer without them is no 0 (which some
    # cases expect), but no verdict.
    cache_n = (r.get("timings") or {}).get("cache_n")
    if not isinstance(cache_n, int):
        print(f"{case:>6}: NOT as expected: the answer has no timings.cache_n to judge it by")
        sys.exit(1)
    return r["choices"][0]["message"]["content"], r["usage"]["prompt_tokens"], cache_n

system = " ".join(f"Rule {i}: keep the code tidy and the tests green." for i in range(150))
code = "fn main() { println!(\"hello, {}\", name); }\n" * 20
a = [{"role": "system", "content": system},
     {"role": "user", "content": "Here is my code:\n" + code + "Write a haiku about it."}]
if case == "walk":
    def words(tag, n):
        return " ".join(f"{tag} note {i}: the build of module {i} took {3 * i} ms." for i in range(n))
    para = words("shared", 20)
    x = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
    y = [{"role": "system", "content": system},
         {"role": "user", "content": para + " " + words("own", 250)}]
    p = [{"role": "system", "content": system},
         {"role": "user", "content": para + " Which module was slowest?"}]
    def other(n):
        return [{"role": "system", "content": f"You are helper {n}."},
                {"role": "user", "content": f"Count to {n}. " * 20}]
    _, x_prompt, _ = ask(x)      # X in a slot
    ask(other(1))                # the other slot; X, idle, is saved
    _, y_prompt, y_reused = ask(y)  # Y takes X's slot by similarity (keeps most of X)
    ask(other(2))                # Y, idle, is saved after X
    ask(other(3))                # both slots hold strangers now
    _, p_prompt, p_reused = ask(p)
    print(f"{case:>6}: X {x_prompt} tokens, Y {y_prompt} (reused {y_reused}); "
          f"P {p_prompt} tokens reused {p_reused}")
    # X restored: what X shares with P (the system prompt, as Y's turn reused from X's slot,
    # less the few tokens llama-server reads again), not Y's paragraph (some 360 tokens more).
    ok = y_reused - 32 <= p_reused <= y_reused + 8
    print(f"{case:>6}: {'as expected' if ok else 'NOT as expected'}")
    sys.exit(0 if ok else 1)
if case == "tie":
    brief = "You are a coding agent. Answer briefly."
    def own(name, n):
        return "".join(f"{name} line {i}: the value is {7 * i} and the test is green\n"
                       for i in range(n))
    a = [{"role": "system", "content": brief},
         {"role": "user", "content": "Here is file A:\n" + own("A", 60) + "Review it."}]
    b = [{"role": "system", "content": brief},
         {"role": "user", "content": "Here is file B:\n" + own("B", 60) + "Review it."}]
    a_answer, a_prompt, _ = ask(a)
    b_answer, b_prompt, _ = ask(b)
    _, _, shared = ask([{"role": "system", "content": brief},
                        {"role": "user", "content": "Here is a question."}])
    _, _, a_reused = ask(a + [{"role": "assistant", "content": a_answer},
                              {"role": "user", "content": "Now the tests."}])
    _, _, b_reused = ask(b + [{"role": "assistant", "content": b_answer},
                              {"role": "user", "content": "Now the tests."}])
    print(f"{case:>6}: A {a_prompt} and B {b_prompt} tokens; C reused {shared}; "
          f"A's next turn reused {a_reused}, B's {b_reused}")
    ok = a_reused >= a_prompt - 16 and b_reused <= shared + 2
    print(f"{case:>6}: {'as expected' if ok else 'NOT as expected'}")
    sys.exit(0 if ok else 1)
answer, a_prompt, _ = ask(a)
if case in ("idle", "no-idle", "unified"):
    ask([{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Name three prime numbers. " * 30}])
    log = "".join(f"line {i}: all {i} tests passed in {3 * i} ms\n" for i in range(200))
    other = [{"role": "system", "content": system},
             {"role": "user", "content": "Here is a test log:\n" + log + "Summarize it."}]
elif case == "shared":
    other = [{"role": "system", "content": system},
             {"role": "user", "content": "List three prime numbers."}]
else:
    other = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "Name three prime numbers. " * 30}]
_, _, shared = ask(other)
a2 = a + [{"role": "assistant", "content": answer},
          {"role": "user", "content": "Now one about caches."}]
_, a2_prompt, reused = ask(a2)
print(f"{case:>6}: A's first prompt {a_prompt} tokens; the other prompt reused {shared}; "
      f"A's next turn {a2_prompt} tokens, reused {reused}")
if case in ("shared", "no-idle", "unified"):
    # Only the system prompt the other prompt shared: A's own tail was dropped unsaved.
    ok = reused <= shared + 2 and reused < a_prompt - 100
else:
    # A's first prompt, restored from the RAM cache (llama-server reads its last few
    # tokens again).
    ok = reused >= a_prompt - 16
print(f"{case:>6}: {'as expected' if ok else 'NOT as expected'}")
sys.exit(0 if ok else 1)
PY
    # Stopped, and waited for, before the next case's server takes the port.
    stop_pids "$pid"
    return "$rc"
}

LOGS="$(mktemp -d)"
status=0
run_case shared "$LOGS/shared.log" 1 8192 || status=1
run_case other "$LOGS/other.log" 1 8192 || status=1
run_case idle "$LOGS/idle.log" 2 16384 || status=1
run_case no-idle "$LOGS/no-idle.log" 2 16384 --no-cache-idle-slots || status=1
run_case unified "$LOGS/unified.log" 2 16384 --kv-unified || status=1
run_case tie "$LOGS/tie.log" 2 16384 --cache-ram 0 || status=1
run_case walk "$LOGS/walk.log" 2 16384 || status=1
# (No such line, from a server that never started, is no reason to stop before the verdict.)
grep -h 'selected slot' "$LOGS"/*.log | sed 's/^[^|]*| task [^|]*| /  llama-server: /' || true
[[ $status == 0 ]] && echo "PASS" || echo "FAIL (logs: $LOGS)"
exit $status
