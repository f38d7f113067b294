#!/usr/bin/env python3
"""Summarise one `cargo bench` run (criterion's estimates) as the Markdown tables of BENCHMARKS.md.

Usage: python3 scripts/bench-summary.py [TARGET_DIR]   (default: target)

Every figure is criterion's point estimate (the regression slope where criterion fits one, as it
prints), and every ratio is taken between figures of the same run. The memory bench prints its
own tables (`cargo bench --bench memory`).
"""

import json
import os
import sys

ROOT = os.path.join(sys.argv[1] if len(sys.argv) > 1 else "target", "criterion")
FLEETS = ["2x2", "16x8", "64x8", "256x8"]


def ns(*path):
    """Criterion's point estimate for a benchmark, in nanoseconds, or None if it did not run."""
    f = os.path.join(ROOT, *path, "new", "estimates.json")
    try:
        with open(f) as fh:
            e = json.load(fh)
    except FileNotFoundError:
        return None
    est = e.get("slope") or e["mean"]
    return est["point_estimate"]


def fmt(x):
    if x is None:
        return "n/a"
    if x >= 1000:
        return f"{x / 1000:.2f} µs"
    return f"{x:.0f} ns"


def verdict(ok):
    return "pass" if ok else "**miss**"


def policy():
    print("### Part 1a: the policy alone (`Snapshot::choose`, `NodeThenBackend`)\n")
    print("| fleet | home hit | same-node spill | new session | keyless | of which `Snapshot::view` |")
    print("|---|---:|---:|---:|---:|---:|")
    for f in FLEETS:
        row = [ns("policy", s, f) for s in ["home_hit", "same_node_spill", "new_session", "keyless", "view"]]
        print(f"| {f} | " + " | ".join(fmt(x) for x in row) + " |")
    print()


def call():
    direct = ns("call", "direct")
    print("### Part 1b: the whole `call` path (mock backends answering at once)\n")
    print(f"`call/direct` (the same request straight to one mock backend): {fmt(direct)}. "
          "Router cost = figure - direct.\n")
    print("| fleet | home hit | same-node spill | new session | keyless | home hit - direct | new session - direct |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for f in FLEETS:
        row = [ns("call", s, f) for s in ["home_hit", "same_node_spill", "new_session", "keyless"]]
        extra = [None if (x is None or direct is None) else x - direct for x in (row[0], row[2])]
        print(f"| {f} | " + " | ".join(fmt(x) for x in row + extra) + " |")
    hdr, hdr_direct = ns("call", "home_hit_header", "16x8"), ns("call", "direct_header")
    print()
    print(f"Home hit with the default `HeaderKey` (SHA-256 of the header) on 16x8: {fmt(hdr)}; "
          f"direct with the same request: {fmt(hdr_direct)}; router cost "
          f"{fmt(None if hdr is None or hdr_direct is None else hdr - hdr_direct)}.")
    print(f"Key alone: SHA-256 of a 14-byte id {fmt(ns('key', 'sha256'))}; "
          f"`HeaderKey::extract` {fmt(ns('key', 'header'))}.\n")


def table():
    print("### Part 1c: home hits by session-table size (16x8, keys spread over the table)\n")
    print("| sessions | home hit (call path) | ratio to 1 thousand |")
    print("|---:|---:|---:|")
    base = ns("table", "home_hit", "1000")
    for n in ["1000", "100000", "1000000"]:
        x = ns("table", "home_hit", n)
        r = None if x is None or base is None else x / base
        print(f"| {int(n):,} | {fmt(x)} | {'n/a' if r is None else f'{r:.2f}x'} |")
    print()


def targets():
    direct = ns("call", "direct")
    hit_policy = ns("policy", "home_hit", "16x8")
    hit_call = ns("call", "home_hit", "16x8")
    new_policy = ns("policy", "new_session", "64x8")
    new_call = ns("call", "new_session", "64x8")
    small, big = ns("table", "home_hit", "1000"), ns("table", "home_hit", "1000000")
    print("### Part 1: targets\n")
    print("| figure | value | target | verdict |")
    print("|---|---:|---:|---|")
    if hit_policy is not None:
        print(f"| home hit, policy alone (16x8) | {fmt(hit_policy)} | ≤ 150 ns | {verdict(hit_policy <= 150)} |")
    if hit_call is not None and direct is not None:
        d = hit_call - direct
        print(f"| home hit, router cost on the call path (16x8, minus direct) | {fmt(d)} | ≤ 150 ns | {verdict(d <= 150)} |")
    if new_policy is not None:
        print(f"| new session, policy alone (64x8) | {fmt(new_policy)} | ≤ 1 µs | {verdict(new_policy <= 1000)} |")
    if new_call is not None and direct is not None:
        d = new_call - direct
        print(f"| new session, router cost on the call path (64x8, minus direct) | {fmt(d)} | ≤ 1 µs | {verdict(d <= 1000)} |")
    if small is not None and big is not None:
        r = big / small
        print(f"| home hit, 1 million / 1 thousand sessions | {r:.2f}x | ≤ 1.5x | {verdict(r <= 1.5)} |")
    print()


def throughput():
    print("### Part 2: throughput against `tower::balance::p2c::Balance` (same backends, same run)\n")
    print("| runtime | requests | affinity | p2c | affinity / p2c | p2c behind `Buffer` | affinity / p2c_buffer | build alone | target | verdict |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for group, name in [("throughput_st", "current-thread, 1 caller"), ("throughput_mt", "2 workers, 32 callers")]:
        for mix in ["keyed", "keyless"]:
            a, p, pb = ns(group, "affinity", mix), ns(group, "p2c", mix), ns(group, "p2c_buffer", mix)
            build = ns("throughput_st", "build", mix)
            # Throughput ratio = inverse of the time ratio.
            r = None if a is None or p is None else p / a
            rb = None if a is None or pb is None else pb / a
            rps = lambda t: "n/a" if t is None else f"{1e9 / t / 1e6:.2f} M/s"
            print(f"| {name} | {mix} | {rps(a)} | {rps(p)} | "
                  f"{'n/a' if r is None else f'{r:.2f}x'} | {rps(pb)} | "
                  f"{'n/a' if rb is None else f'{rb:.2f}x'} | {fmt(build)} | ≥ 1.0x | "
                  f"{'n/a' if r is None else verdict(r >= 1.0)} |")
    print()


if __name__ == "__main__":
    if not os.path.isdir(ROOT):
        sys.exit(f"no criterion results under {ROOT}: run `cargo bench` first")
    targets()
    policy()
    call()
    table()
    throughput()
