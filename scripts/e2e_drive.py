#!/usr/bin/env python3
"""Drive multi-turn "agent" sessions against an OpenAI-compatible endpoint
(a llama-server, or the tower-affinity proxy in front of several) and measure
how much of each session's previous prompt the serving backend reused from
its KV / prompt cache.

Every session:
  * sends the header ``X-Session-Id: <run-id>-s<N>`` on every request (with
    ``--keyless``, no session key at all: no header, no ``user``,
    ``prompt_cache_key`` or ``metadata`` in the body; the proxy then places each
    turn by what its cache model says each backend holds),
  * starts with the same system prompt and the same spec (a user message of a
    few hundred tokens) as every other session, then a user message with its
    own task, as an agent's first turn carries its user's request (without it,
    sessions that send no key would be one prompt until their first answers
    differ, and no router could tell them apart by prompt at their second turn),
  * then, each turn, appends the assistant's answer and a new user message
    holding "tool output" (a couple hundred tokens, distinct per session and
    turn, and salted with the run id so a later run cannot hit caches filled
    by an earlier one).

Per turn it records ``usage.prompt_tokens`` and
``usage.prompt_tokens_details.cached_tokens`` (llama-server fills the latter;
if it is missing it falls back to the raw response's ``timings.cache_n``) and
the ``x-affinity-backend`` and ``x-affinity-outcome`` response headers when
present.

    reuse(t) = cached_tokens(t) / prompt_tokens(t-1)         for t >= 2

A later turn is a "hit" when reuse >= --reuse-threshold (default 0.8).
With ``--side-model NAME``, after each turn the session also asks for a title of
its conversation with model NAME, under the same session key, as Claude Code asks
a small model for titles; with ``--side-backend ID`` every such request must be
answered by backend ID and no turn may be (the proxy serves a fleet for each model),
else the exit code is 1. The proxy counts these requests too: the token totals
include them.
With ``--resend-every K``, every Kth turn is sent a second time, whole, as a
client retrying it would (not streamed); the resend is a hit when it went to the
backend that served the turn, as the x-affinity-backend headers of both name it (a
resend without the header is a miss), and that backend reused at least the
threshold of its prompt. With ``--assert-min-hit F`` the exit code is 1 unless the share of
hits among later turns, and among resends, is >= F (``--assert-min-hit 1.0``:
every later turn and every resend must hit).
With ``--count-tokens``, before each later turn the session counts its conversation's
tokens as Claude Code does (Anthropic's ``/v1/messages/count_tokens`` under the
session's header); the exit code is 1 unless every count is answered with its
``input_tokens`` and placed apart from the session (``x-affinity-outcome: keyless``).
Any request error exits 2.

Only the official ``openai`` client is used (``pip install openai``), and the
standard library for the token counts.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

try:
    import openai
    from openai import OpenAI
except ImportError:  # pragma: no cover - only hit when run with the wrong python
    sys.exit("e2e_drive.py: the 'openai' package is required (run it with the e2e venv's python)")

SESSION_HEADER = "X-Session-Id"
BACKEND_HEADER = "x-affinity-backend"
OUTCOME_HEADER = "x-affinity-outcome"

SYSTEM_PROMPT = (
    "You are a careful senior Rust engineer working as a coding agent. You read the "
    "specification, call tools, read their output and decide on the next small step. "
    "Answer tersely: one or two sentences naming the next action."
)

SPEC = """\
Specification: tower-affinity, session-affinity load balancing for LLM servers.

1. Purpose. A Tower middleware and service that spreads OpenAI-compatible chat
   completion requests over a fleet of llama-server style backends. Each backend
   keeps a per-slot KV cache of the prompts it has processed. Agent conversations
   resend their whole history on every turn, so a request that lands on the
   backend which served the previous turn of the same session only has to process
   the newly appended tokens. Landing elsewhere forces a full prompt re-processing,
   which on long agent sessions costs seconds of GPU time per turn.
2. Session identity. The session is taken from the X-Session-Id request header.
   Requests without it are balanced by least outstanding requests.
3. Topology. Backends are grouped into nodes. A node is one machine; backends on
   the same node may share a host-memory prompt cache. Each backend has a number
   of slots, its maximum useful concurrency.
4. Policies. round-robin ignores sessions. node-then-backend first pins a session
   to a node, then to a backend within that node, and only moves it when the
   backend is unhealthy or all of its slots are busy for longer than the spill
   timeout. Moves prefer another backend on the same node.
5. Health. A backend that fails a request with a connection error, or answers
   with status 5xx, is ejected for a back-off period and probed again later.
   Session bindings to an ejected backend are re-assigned lazily.
6. Observability. Every proxied response carries the header x-affinity-backend
   with the chosen backend's name and address. GET /metrics exposes Prometheus
   counters: requests per backend, affinity hits, affinity misses, spills,
   ejections, and a gauge of in-flight requests per backend.
7. Limits. Session tables are bounded (LRU with a time-to-live). The middleware
   must never buffer streaming responses; it forwards server-sent events as they
   arrive and frees the slot when the stream ends or the client disconnects.
8. Non-goals. No request rewriting, no authentication, no retries of requests
   that reached a backend.

Start by proposing the first step of the implementation plan."""

_WORDS = (
    "slot backend session node spill eject probe latency header bucket ring hash "
    "token prompt cache prefix window stream chunk frame buffer queue permit "
    "lease timer epoch shard tenant route policy metric gauge counter sample "
    "future poll waker ready pending error retry budget limit quota weight"
).split()


def task(run_id: str, session: int) -> str:
    """The session's own request: one line, distinct per (run, session)."""
    rng = random.Random(f"{run_id}/{session}/task")
    w = rng.sample(_WORDS, 3)
    return f"Task {session} (run {run_id}): add a {w[0]} {w[1]} to the {w[2]} module, with tests."


def tool_output(run_id: str, session: int, turn: int) -> str:
    """A couple hundred tokens of fake tool output, distinct per (run, session, turn)."""
    rng = random.Random(f"{run_id}/{session}/{turn}")
    tool = rng.choice(["cargo test", "rg", "cat", "cargo clippy", "ls -l"])
    lines = [
        f"Tool output for step {turn} (run {run_id}, session {session}):",
        f"$ {tool} src/{rng.choice(_WORDS)}_{session}_{turn}.rs",
    ]
    for i in range(5):
        w = rng.sample(_WORDS, 4)
        lines.append(
            f"{i + 1:02d} fn {w[0]}_{w[1]}_{rng.randint(0, 999)}(&mut self, {w[2]}: u{rng.choice([8, 16, 32, 64])}) "
            f"-> Result<{w[3].capitalize()}> // {rng.randint(1000, 9999)}"
        )
    lines.append(f"exit status: {rng.choice([0, 0, 0, 1, 101])}")
    lines.append("What is the next step? Answer in one sentence.")
    return "\n".join(lines)


@dataclass
class TurnRecord:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int | None
    cached_source: str
    completion_tokens: int
    backend: str
    latency_ms: float
    outcome: str = "-"
    stream: bool = False
    prev_prompt_tokens: int | None = None
    reuse: float | None = None
    hit: bool | None = None
    answer: str = field(default="", repr=False)


# What --stream-without-usage found wrong in the streams, from every session's thread.
stream_errors: list[str] = []


@dataclass
class Resend:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int | None
    backend: str
    outcome: str
    first_backend: str
    hit: bool = False


@dataclass
class Side:
    """A title request sent beside a turn with --side-model."""

    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int | None
    backend: str
    outcome: str


# The --side-model requests, from every session's thread.
side_requests: list[Side] = []


def side(client, args, session: int, turn: int) -> Side:
    """Asks --side-model for a title of the session's conversation, as an agent asks a small
    model beside its own."""
    messages = [
        {"role": "system", "content": "Give the conversation below a title of at most five words."},
        {"role": "user", "content": task(args.run_id, session)},
    ]
    raw, prompt, cached = ask(client, args.side_model, messages, 8)
    return Side(
        session=session,
        turn=turn,
        prompt_tokens=prompt,
        cached_tokens=cached,
        backend=raw.headers.get(BACKEND_HEADER, "-"),
        outcome=raw.headers.get(OUTCOME_HEADER, "-"),
    )


@dataclass
class Count:
    """A token count sent before a later turn with --count-tokens."""

    session: int
    turn: int
    status: int
    input_tokens: int | None
    backend: str
    outcome: str

    @property
    def ok(self) -> bool:
        """Answered, with a count, and placed apart from the session (keyless)."""
        return self.status == 200 and (self.input_tokens or 0) > 0 and self.outcome == "keyless"


# The --count-tokens requests, from every session's thread.
token_counts: list[Count] = []


def count_tokens(args, sid: str | None, session: int, turn: int, messages) -> Count:
    """Counts the conversation's tokens as Claude Code does (Anthropic's
    /v1/messages/count_tokens, under the session's header): llama-server answers it without
    reading the prompt into a slot, and the proxy places it apart from the session."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    body = {"model": args.model, "system": system, "messages": [m for m in messages if m["role"] != "system"]}
    headers = {"content-type": "application/json", "authorization": f"Bearer {args.api_key}"}
    if sid is not None:
        headers[SESSION_HEADER] = sid
    url = args.base_url.rstrip("/") + "/messages/count_tokens"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    status, data, got = 0, {}, {}
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as res:
            status, got = res.status, res.headers
            data = json.loads(res.read() or b"{}")
    except urllib.error.HTTPError as e:
        status, got = e.code, e.headers
    except (urllib.error.URLError, OSError, ValueError):
        pass
    n = data.get("input_tokens") if isinstance(data, dict) else None
    return Count(
        session=session,
        turn=turn,
        status=status,
        input_tokens=n if isinstance(n, int) else None,
        backend=got.get(BACKEND_HEADER, "-") if got else "-",
        outcome=got.get(OUTCOME_HEADER, "-") if got else "-",
    )


def _cached_tokens(completion, raw_json: dict) -> tuple[int | None, str]:
    usage = getattr(completion, "usage", None)
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    if cached is not None:
        return int(cached), "usage"
    timings = raw_json.get("timings") if isinstance(raw_json, dict) else None
    if isinstance(timings, dict) and timings.get("cache_n") is not None:
        return int(timings["cache_n"]), "timings"
    return None, "missing"


def ask(client, model: str, messages, max_tokens: int):
    """One request not streamed: the raw response, its prompt tokens and cached tokens."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
    )
    completion = raw.parse()
    try:
        raw_json = json.loads(raw.text)
    except (ValueError, AttributeError):
        raw_json = {}
    cached, _ = _cached_tokens(completion, raw_json)
    prompt = int(completion.usage.prompt_tokens) if completion.usage else 0
    return raw, prompt, cached


def resend(client, args, session: int, turn: int, messages, first: TurnRecord) -> Resend:
    """Sends turn `turn` again, whole, as a client retrying it would."""
    raw, prompt, cached = ask(client, args.model, messages, args.max_tokens)
    r = Resend(
        session=session,
        turn=turn,
        prompt_tokens=prompt,
        cached_tokens=cached,
        backend=raw.headers.get(BACKEND_HEADER, "-"),
        outcome=raw.headers.get(OUTCOME_HEADER, "-"),
        first_backend=first.backend,
    )
    # Where the two went is known only from the proxy's header: without it ("-" on both) the
    # resend cannot count as sent where the turn went.
    r.hit = (
        r.backend != "-"
        and r.backend == first.backend
        and prompt > 0
        and (cached or 0) >= args.reuse_threshold * prompt
    )
    return r


def run_session(args, session: int, log) -> tuple[list[TurnRecord], list[Resend]]:
    sid = f"{args.run_id}-s{session}"
    client = OpenAI(
        base_url=args.base_url,
        api_key=args.api_key,
        default_headers={} if args.keyless else {SESSION_HEADER: sid},
        timeout=args.timeout,
        max_retries=0,  # a retry could land elsewhere and hide a miss
    )
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": SPEC},
        {"role": "user", "content": task(args.run_id, session)},
    ]
    records: list[TurnRecord] = []
    resends: list[Resend] = []
    for turn in range(1, args.turns + 1):
        if turn > 1:
            messages.append({"role": "user", "content": tool_output(args.run_id, session, turn)})
            if args.count_tokens:
                token_counts.append(count_tokens(args, None if args.keyless else sid, session, turn, messages))
        t0 = time.monotonic()
        stream = args.stream_every > 0 and turn % args.stream_every == 0
        if stream:
            # Streamed, asking for the usage chunk unless told not to; llama.cpp's timings ride
            # on the last chunk.
            extra_args = {} if args.stream_without_usage else {"stream_options": {"include_usage": True}}
            raw = client.chat.completions.with_raw_response.create(
                model=args.model,
                messages=messages,
                max_tokens=args.max_tokens,
                temperature=0,
                stream=True,
                **extra_args,
            )
            parts, usage, raw_json = [], None, {}
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
                extra = getattr(chunk, "model_extra", None) or {}
                if isinstance(extra.get("timings"), dict):
                    raw_json = {"timings": extra["timings"]}
                    if args.stream_without_usage and not chunk.choices:
                        stream_errors.append(f"session {session} turn {turn}: timings on a chunk without choices")
            if args.stream_without_usage and usage is not None:
                stream_errors.append(f"session {session} turn {turn}: a usage chunk it did not ask for")
            latency_ms = (time.monotonic() - t0) * 1000.0
            answer = "".join(parts)

            class _Completion:  # what _cached_tokens reads
                pass

            completion = _Completion()
            completion.usage = usage
            if usage is None and isinstance(raw_json.get("timings"), dict):
                # No usage asked for: llama-server's timings say it all.
                t = raw_json["timings"]

                class _Usage:
                    prompt_tokens = int(t.get("prompt_n", 0)) + int(t.get("cache_n", 0))
                    completion_tokens = int(t.get("predicted_n", 0))
                    prompt_tokens_details = None

                usage = _Usage()
        else:
            raw = client.chat.completions.with_raw_response.create(
                model=args.model,
                messages=messages,
                max_tokens=args.max_tokens,
                temperature=0,
            )
            latency_ms = (time.monotonic() - t0) * 1000.0
            completion = raw.parse()
            try:
                raw_json = json.loads(raw.text)
            except (ValueError, AttributeError):
                raw_json = {}
            answer = completion.choices[0].message.content or ""
            usage = completion.usage
        cached, source = _cached_tokens(completion, raw_json)
        rec = TurnRecord(
            session=session,
            turn=turn,
            prompt_tokens=int(usage.prompt_tokens) if usage else 0,
            cached_tokens=cached,
            cached_source=source,
            completion_tokens=int(usage.completion_tokens) if usage else 0,
            backend=raw.headers.get(BACKEND_HEADER, "-"),
            latency_ms=latency_ms,
            outcome=raw.headers.get(OUTCOME_HEADER, "-"),
            stream=stream,
            answer=answer,
        )
        if records:
            prev = records[-1].prompt_tokens
            rec.prev_prompt_tokens = prev
            if prev > 0:
                rec.reuse = (cached or 0) / prev
                rec.hit = rec.reuse >= args.reuse_threshold
        records.append(rec)
        log(
            f"  session {session} turn {turn}: prompt={rec.prompt_tokens} cached={rec.cached_tokens} "
            f"backend={rec.backend} outcome={rec.outcome} {latency_ms:.0f} ms"
        )
        if args.resend_every > 0 and turn % args.resend_every == 0:
            r = resend(client, args, session, turn, messages, rec)
            resends.append(r)
            log(
                f"  session {session} turn {turn} sent again: prompt={r.prompt_tokens} "
                f"cached={r.cached_tokens} backend={r.backend} outcome={r.outcome}"
            )
        if args.side_model:
            t = side(client, args, session, turn)
            side_requests.append(t)
            log(f"  session {session} turn {turn} title ({args.side_model}): backend={t.backend} outcome={t.outcome}")
        messages.append({"role": "assistant", "content": answer})
    return records, resends


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100.0 * x:.0f}%"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:18080/v1")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=0, help="parallel sessions (default: all)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "sk-no-key"))
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    ap.add_argument("--reuse-threshold", type=float, default=0.8)
    ap.add_argument(
        "--keyless",
        action="store_true",
        help=f"send no session key: no {SESSION_HEADER} header, no key fields in the body",
    )
    ap.add_argument(
        "--assert-min-hit",
        type=float,
        default=None,
        help="exit 1 unless this share (0..1) of later turns reused >= the threshold",
    )
    ap.add_argument(
        "--stream-every",
        type=int,
        default=0,
        help="stream every Nth turn (with stream_options.include_usage); 0: none",
    )
    ap.add_argument(
        "--stream-without-usage",
        action="store_true",
        help="streamed turns do not ask for usage; exit 1 if a usage chunk arrives anyway, "
        "or llama-server's timings on a chunk without choices",
    )
    ap.add_argument(
        "--resend-every",
        type=int,
        default=0,
        help="send every Nth turn a second time, whole, as a client retrying it; 0: none",
    )
    ap.add_argument(
        "--side-model",
        default=None,
        help="after each turn, ask this model for a title under the same session key",
    )
    ap.add_argument(
        "--side-backend",
        default=None,
        help="the backend id (x-affinity-backend) that must answer every --side-model request, and no turn",
    )
    ap.add_argument(
        "--count-tokens",
        action="store_true",
        help="before each later turn, count the conversation's tokens under the session "
        "(/v1/messages/count_tokens); exit 1 unless each is answered and placed keyless",
    )
    ap.add_argument("--run-id", default=None, help="salt for session ids and tool output (default: random)")
    ap.add_argument("--label", default="", help="printed in the summary line")
    ap.add_argument("--json-out", default=None, help="write all per-turn records to this file")
    ap.add_argument("--show-answers", action="store_true")
    args = ap.parse_args()
    if args.run_id is None:
        args.run_id = os.urandom(4).hex()
    conc = args.concurrency or args.sessions

    lock = threading.Lock()

    def log(msg: str) -> None:
        with lock:
            print(msg, flush=True)

    log(
        f"e2e_drive: base_url={args.base_url} sessions={args.sessions} turns={args.turns} "
        f"concurrency={conc} max_tokens={args.max_tokens} run_id={args.run_id} "
        f"keys={'none' if args.keyless else SESSION_HEADER} (openai {openai.__version__})"
    )
    t0 = time.monotonic()
    records: list[TurnRecord] = []
    resends: list[Resend] = []
    errors: list[str] = []
    with cf.ThreadPoolExecutor(max_workers=conc) as pool:
        futs = {pool.submit(run_session, args, s, log): s for s in range(args.sessions)}
        for fut in cf.as_completed(futs):
            try:
                turns, again = fut.result()
                records.extend(turns)
                resends.extend(again)
            except Exception as exc:  # noqa: BLE001 - report every failure
                errors.append(f"session {futs[fut]}: {type(exc).__name__}: {exc}")
    wall = time.monotonic() - t0
    records.sort(key=lambda r: (r.session, r.turn))

    print()
    hdr = (
        f"{'sess':>4} {'turn':>4} {'backend':<28} {'outcome':<16} {'prompt':>6} {'cached':>6} {'src':<7} "
        f"{'prev':>6} {'reuse':>6} {'hit':>4} {'ms':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in records:
        hit = "-" if r.hit is None else ("yes" if r.hit else "NO")
        print(
            f"{r.session:>4} {r.turn:>4} {r.backend[:28]:<28} {r.outcome[:16]:<16} {r.prompt_tokens:>6} "
            f"{'-' if r.cached_tokens is None else r.cached_tokens:>6} {r.cached_source:<7} "
            f"{'-' if r.prev_prompt_tokens is None else r.prev_prompt_tokens:>6} {fmt_pct(r.reuse):>6} {hit:>4} {r.latency_ms:>7.0f}"
        )
        if args.show_answers:
            print(f"{'':>10}answer: {r.answer!r}")

    later = [r for r in records if r.turn >= 2 and r.hit is not None]
    hits = sum(1 for r in later if r.hit)
    share = hits / len(later) if later else 0.0
    per_session_backends = {}
    for r in records:
        per_session_backends.setdefault(r.session, []).append(r.backend)
    print()
    for s, bs in sorted(per_session_backends.items()):
        print(f"session {s}: backends {' -> '.join(bs)}")
    served: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    for r in records:
        served[r.backend] = served.get(r.backend, 0) + 1
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    print("requests per backend: " + ", ".join(f"{b} {n}" for b, n in sorted(served.items())))
    print("outcomes: " + ", ".join(f"{o} {n}" for o, n in sorted(outcomes.items())))
    resends.sort(key=lambda r: (r.session, r.turn))
    for r in resends:
        print(
            f"session {r.session} turn {r.turn} sent again: backend {r.backend} (first {r.first_backend}), "
            f"outcome {r.outcome}, cached {'-' if r.cached_tokens is None else r.cached_tokens} "
            f"of {r.prompt_tokens}: {'hit' if r.hit else 'MISS'}"
            + (f" (no {BACKEND_HEADER} header)" if r.backend == "-" else "")
        )
    resend_hits = sum(1 for r in resends if r.hit)
    resend_share = resend_hits / len(resends) if resends else 1.0
    # The proxy counts resends and title requests too: its totals are compared with these.
    extra = resends + side_requests
    total_prompt = sum(r.prompt_tokens for r in records) + sum(r.prompt_tokens for r in extra)
    total_cached = sum(r.cached_tokens or 0 for r in records) + sum(r.cached_tokens or 0 for r in extra)
    side_served: dict[str, int] = {}
    for t in side_requests:
        side_served[t.backend] = side_served.get(t.backend, 0) + 1
    if side_requests:
        print("title requests per backend: " + ", ".join(f"{b} {n}" for b, n in sorted(side_served.items())))
    if any(r.cached_source == "missing" for r in records):
        print("WARNING: some responses carried neither usage.prompt_tokens_details.cached_tokens nor timings.cache_n")
    for kind, flag in (("non-stream", False), ("stream", True)):
        rs = [r for r in records if r.stream == flag]
        if rs:
            print(
                f"{kind} turns: {len(rs)}, prompt tokens {sum(r.prompt_tokens for r in rs)}, "
                f"cached tokens {sum(r.cached_tokens or 0 for r in rs)}"
            )
    label = f"[{args.label}] " if args.label else ""
    print(
        f"SUMMARY {label}later-turn hits (reuse >= {args.reuse_threshold:.0%}): {hits}/{len(later)} = {share:.0%}; "
        f"cached/prompt tokens overall: {total_cached}/{total_prompt} = "
        f"{(total_cached / total_prompt if total_prompt else 0):.0%}; "
        + (f"resends where sent and reused: {resend_hits}/{len(resends)}; " if resends else "")
        + (f"title requests: {len(side_requests)}; " if side_requests else "")
        + (
            f"token counts answered and placed keyless: {sum(c.ok for c in token_counts)}/{len(token_counts)}; "
            if args.count_tokens
            else ""
        )
        + f"wall {wall:.1f} s"
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {"args": vars(args), "share": share, "hits": hits, "later": len(later),
                 "prompt_tokens": total_prompt, "cached_tokens": total_cached,
                 "served": served, "outcomes": outcomes,
                 "records": [asdict(r) for r in records],
                 "resends": [asdict(r) for r in resends],
                 "sides": [asdict(t) for t in side_requests],
                 "counts": [asdict(c) for c in token_counts], "errors": errors},
                f,
                indent=2,
            )
    if errors:
        for e in errors:
            print(f"ERROR {e}", file=sys.stderr)
        return 2
    if len(records) != args.sessions * args.turns:
        print("ERROR: missing turn records", file=sys.stderr)
        return 2
    if stream_errors:
        for e in stream_errors:
            print(f"STREAM: {e}", file=sys.stderr)
        print(f"ASSERTION FAILED: {len(stream_errors)} streams not as the client asked", file=sys.stderr)
        return 1
    if args.count_tokens:
        wrong = [c for c in token_counts if not c.ok]
        for c in wrong:
            print(
                f"COUNT: session {c.session} turn {c.turn}: status {c.status}, input_tokens "
                f"{c.input_tokens}, backend {c.backend}, outcome {c.outcome}",
                file=sys.stderr,
            )
        if wrong or len(token_counts) != args.sessions * (args.turns - 1):
            print(
                f"ASSERTION FAILED: {len(wrong)} of {len(token_counts)} token counts not answered "
                f"or not placed keyless",
                file=sys.stderr,
            )
            return 1
    if args.side_backend:
        astray = [t for t in side_requests if t.backend != args.side_backend]
        crossed = [r for r in records if r.backend == args.side_backend]
        if astray or crossed or len(side_requests) != len(records):
            print(
                f"ASSERTION FAILED: of {len(side_requests)} title requests {len(astray)} not on "
                f"{args.side_backend}; {len(crossed)} turns on it",
                file=sys.stderr,
            )
            return 1
        print(f"ASSERTION OK: every title request on {args.side_backend}, no turn there")
    if args.assert_min_hit is not None:
        if share + 1e-9 < args.assert_min_hit:
            print(f"ASSERTION FAILED: hit share {share:.0%} < required {args.assert_min_hit:.0%}", file=sys.stderr)
            return 1
        if resend_share + 1e-9 < args.assert_min_hit:
            print(
                f"ASSERTION FAILED: resends where sent and reused {resend_share:.0%} "
                f"< required {args.assert_min_hit:.0%}",
                file=sys.stderr,
            )
            return 1
        print(f"ASSERTION OK: hit share {share:.0%} >= required {args.assert_min_hit:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
