#!/usr/bin/env bash
# How far a prompt chain's token estimate (four bytes a token, scaled by what a backend's
# answers taught) falls from a real tokenizer's count, and how often a conversation growing
# past a slot's context would be refused at home for it. Run by hand (never by CI), after
# `scripts/e2e-llama.sh --setup-only` (this uses its cached llama-server and model, whose
# tokenizer counts).
#
#   scripts/estimate-error.sh
#
# Fifteen conversations of fourteen turns each are built from this repository's own text as
# commit `14ec3cc` has it (TA_ESTIMATE_TEXT_AT names another), so that runs of the script at
# any two commits estimate and count the same conversations: a system prompt and a request
# of prose, then answers of prose and tool outputs of code
# (`src/`), prose (the README and BENCHMARKS), JSON (a file listing) or logs (lines with
# numbers), in five mixes (mostly code, mostly prose, ...). Each turn's body is estimated by
# the crate (`PromptFacts::from_body`, in a small program built against this checkout) and
# counted by llama-server (`/apply-template`, then `/tokenize`). Then, over 50 random
# interleavings of the conversations on one backend:
#   - the error of the estimate scaled as the balancer learns the scale, as the ratio of the
#     averages (now) and as the average of the ratios (before), with 0%, 10% and 30% of the
#     requests a one-line question (27 tokens, 4 by the estimate);
#   - of the conversations that grow past a slot's context of 12,000 or 16,000 tokens, the
#     share that would send a turn home that the home refuses (its count past the context,
#     its scaled estimate under it), with the scale as now.
#
# Environment: TA_CACHE_DIR (~/.cache/tower-affinity), TA_ESTIMATE_PORT (18100, clear of
# the default ports of e2e-llama.sh, llama-slots.sh and llama-context.sh, beside which it runs),
# TA_ESTIMATE_TEXT_AT (14ec3cc).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT="${TA_ESTIMATE_PORT:-18100}"
TEXT_AT="${TA_ESTIMATE_TEXT_AT:-14ec3cc}"
# shellcheck source-path=SCRIPTDIR source=llama-common.sh
source "$ROOT/scripts/llama-common.sh"
need_free_port "$PORT" TA_ESTIMATE_PORT
command -v cargo >/dev/null || { echo "cargo is needed (it builds the estimator)" >&2; exit 2; }
git -C "$ROOT" cat-file -e "$TEXT_AT^{commit}" 2>/dev/null || {
    echo "the conversations are built from commit $TEXT_AT: this needs git and a clone that has it" \
        "(not a shallow one), or set TA_ESTIMATE_TEXT_AT" >&2
    exit 2
}

WORK="$(mktemp -d)"

# The estimator: each file given is a request body; prints its path and the chain's tokens.
mkdir -p "$WORK/est/src"
cat >"$WORK/est/Cargo.toml" <<EOF
[package]
name = "estimate"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
tower-affinity = { path = "$ROOT" }

[workspace]
EOF
cat >"$WORK/est/src/main.rs" <<'EOF'
fn main() {
    for path in std::env::args().skip(1) {
        let body = std::fs::read(&path).expect("a body");
        let facts = tower_affinity::key::PromptFacts::from_body(&body);
        println!("{path} {}", facts.chain.tokens());
    }
}
EOF
(cd "$WORK/est" && CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/estimate-error" \
    cargo build --release --quiet)
ESTIMATE="${CARGO_TARGET_DIR:-$ROOT/target}/estimate-error/release/estimate"

LD_LIBRARY_PATH="$BIN" "$BIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$PORT" \
    -np 1 -c 65536 -t 2 >"$WORK/llama.log" 2>&1 &
PIDS+=($!)
wait_up "http://127.0.0.1:$PORT/health" "$!" "$WORK/llama.log"

python3 - "$ROOT" "$WORK" "$ESTIMATE" "http://127.0.0.1:$PORT" "$TEXT_AT" <<'PY'
import json, os, random, subprocess, sys, urllib.request

root, work, estimate, url, text_at = sys.argv[1:6]
random.seed(1)

def post(path, obj):
    req = urllib.request.Request(url + path, json.dumps(obj).encode(),
                                 {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))

def counted(messages):
    prompt = post("/apply-template", {"messages": messages})["prompt"]
    return len(post("/tokenize", {"content": prompt, "parse_special": True})["tokens"])

def git(*args):
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                          check=True).stdout

def text(path):
    return git("show", f"{text_at}:{path}")

sources = sorted(f for f in git("ls-tree", "-r", "--name-only", text_at, "src").split()
                 if f.endswith(".rs"))
texts = {f: text(f) for f in sources}
code = [texts[f] for f in sources]
prose = [text(f) for f in ("README.md", "BENCHMARKS.md", "CHANGELOG.md")]

def piece(text, n):
    i = random.randrange(0, max(1, len(text) - n))
    return text[i:i + n]

def listing(n):
    files = [{"path": f, "size": len(texts[f].encode()), "lines": texts[f].count("\n")}
             for f in random.sample(sources, 20)]
    return json.dumps({"files": files}, indent=2)[:n]

def log(n):
    lines, size = [], 0
    while size < n:
        line = (f"[run {random.randrange(1000):4d}s] session {random.randrange(64)} turn "
                f"{random.randrange(40)}: prompt={random.randrange(100000)} "
                f"cached={random.randrange(100000)} backend=127.0.0.1:{18000 + random.randrange(100)} "
                f"{random.randrange(10000)} ms")
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)

kinds = [lambda n: piece(random.choice(code), n), lambda n: piece(random.choice(prose), n),
         listing, log]
mixes = [[0.8, 0.1, 0.05, 0.05], [0.1, 0.7, 0.1, 0.1], [0.2, 0.1, 0.6, 0.1],
         [0.2, 0.1, 0.1, 0.6], [0.4, 0.3, 0.15, 0.15]]
system = piece(prose[0], 8000)
rows = []
os.makedirs(work + "/bodies", exist_ok=True)
for c in range(15):
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": piece(prose[0], 600)}]
    for t in range(14):
        messages = messages + [{"role": "assistant",
                                "content": piece(random.choice(prose), random.randrange(200, 1500))}]
        k = random.choices(range(4), mixes[c % 5])[0]
        messages = messages + [{"role": "tool" if k != 1 else "user",
                                "content": kinds[k](random.randrange(500, 6000))}]
        path = f"{work}/bodies/{c}-{t}.json"
        with open(path, "w") as f:
            json.dump({"model": "m", "messages": messages}, f)
        rows.append([c, t, path, counted(messages)])
out = subprocess.run([estimate] + [r[2] for r in rows], capture_output=True, text=True,
                     check=True).stdout
est = dict(line.rsplit(" ", 1) for line in out.splitlines())
by = {}
for c, t, path, n in rows:
    by.setdefault(c, []).append((int(est[path]), n))

ratios = sorted(n / e for conv in by.values() for e, n in conv)
print(f"{len(rows)} prompts, {min(e for conv in by.values() for e, _ in conv)} to "
      f"{max(e for conv in by.values() for e, _ in conv)} tokens by the estimate; "
      f"the tokenizer's count per estimated token: {ratios[0]:.3f} to {ratios[-1]:.3f}, "
      f"median {ratios[len(ratios) // 2]:.3f}")

def interleavings(tiny_share):
    for seed in range(50):
        rnd = random.Random(seed)
        pos, live, order = {c: 0 for c in by}, list(by), []
        while live:
            if rnd.random() < tiny_share:
                order.append((None, 4, 27))
                continue
            c = rnd.choice(live)
            e, n = by[c][pos[c]]
            order.append((c, e, n))
            pos[c] += 1
            if pos[c] == len(by[c]):
                live.remove(c)
        yield order

class Scale:
    def __init__(self, ratio_of_averages):
        self.ratio_of_averages = ratio_of_averages
        self.r = self.tokens = self.estimates = None

    def get(self):
        if self.ratio_of_averages:
            return self.tokens / self.estimates if self.estimates else None
        return self.r

    def learn(self, e, n):
        blend = lambda old, x: x if old is None else old + 0.25 * (x - old)
        if self.ratio_of_averages:
            self.tokens, self.estimates = blend(self.tokens, n), blend(self.estimates, e)
        else:
            self.r = blend(self.r, n / e)

def quantiles(errors):
    errors.sort()
    q = lambda p: errors[min(len(errors) - 1, int(p * len(errors)))]
    return f"p5 {q(0.05):+.3f}, median {q(0.5):+.3f}, p95 {q(0.95):+.3f}"

print("error of the scaled estimate (count / (estimate x scale) - 1), long prompts only:")
for tiny in (0.0, 0.1, 0.3):
    line = []
    for name, how in (("ratio of averages", True), ("average of ratios", False)):
        errors = []
        for order in interleavings(tiny):
            scale = Scale(how)
            for c, e, n in order:
                s = scale.get()
                if s is not None and c is not None:
                    errors.append(n / (e * s) - 1)
                scale.learn(e, n)
        line.append(f"{name}: {quantiles(errors)}")
    print(f"  {tiny:.0%} one-line questions: " + "; ".join(line))

for limit in (12000, 16000):
    refused = crossing = 0
    for order in interleavings(0.0):
        scale, moved, hit, cross = Scale(True), set(), set(), set()
        for c, e, n in order:
            s = scale.get() or 1.0
            if c not in moved:
                if n >= limit:
                    cross.add(c)
                if e * s >= limit:
                    moved.add(c)
                elif n >= limit:
                    hit.add(c)
            scale.learn(e, n)
        refused += len(hit)
        crossing += len(cross)
    print(f"slot context {limit}: {refused} of {crossing} conversations growing past it "
          f"({100 * refused / max(1, crossing):.0f}%) sent a turn home that it refuses")
PY
