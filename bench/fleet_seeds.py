#!/usr/bin/env python3
"""The simulator with replicas that come and go, over many seeds, side by side.

A pod that goes away, restarts or joins moves many groups at once, and how a router places
them decides the next minute's TTFT. One seed proves little (which replica the displaced groups
crowd onto depends on a few percent of learned rate), so this generates the tenants trace the
fleet tests use with each seed (`prefixroute trace --shape tenants --tenants 24 --prompt-words
600 --question-words 40 --rate 60 --requests 1200 --seed S`), simulates it on six replicas
caching a third of the tenants each (`--cache-blocks 420 --slots 4 --decode-ms-per-token 0`)
through three fleet events, and prints per event, prefill cost and binary/policy the mean (and
worst) TTFT p95 over the upper bound's and share of the bound's hit rate:

    scale-in   two of six replicas go away 8 s in (down:1@8 down:2@8)
    restart    one restarts in place 8 s in (restart:0@8; believed until the next scrape)
    scale-out  two join 8 s in (down:4@0 down:5@0 up:4@8 up:5@8)
    failure    one's engine dies 8 s in, its pod and scrapes live on (fail:0@8): every try it
               gets is a 503 that Envoy retries on the failover list, until the gateway takes
               it out after five in a row; also prints the mean tries that failed

    python3 bench/fleet_seeds.py --prefixroute before=OLD/prefixroute --prefixroute after=NEW/prefixroute
    python3 bench/fleet_seeds.py --prefixroute now=target/release/prefixroute --policies latency,prefix

Deterministic: the same binaries and seeds print the same numbers. Standard library only; runs
the binaries, never a network.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sim_seeds import binaries_of, choices_of, seeds_of  # noqa: E402

EVENTS = {
    "scale-in": ["down:1@8", "down:2@8"],
    "restart": ["restart:0@8"],
    "scale-out": ["down:4@0", "down:5@0", "up:4@8", "up:5@8"],
    "failure": ["fail:0@8"],
}
TRACE = ["--shape", "tenants", "--tenants", "24", "--prompt-words", "600",
         "--question-words", "40", "--rate", "60", "--requests", "1200"]
FLEET = ["--replicas", "6", "--cache-blocks", "420", "--slots", "4",
         "--decode-ms-per-token", "0"]


def simulate(binary, path, policy, cost, events):
    args = [binary, "simulate", path, "--policy", policy, "--prefill-ms-per-token", str(cost),
            "--json", *FLEET]
    for e in events:
        args += ["--fleet-event", e]
    report = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
    bound, ours = report["upper_bound"], report["policies"][0]
    return (ours["ttft_p95_ms"] / bound["ttft_p95_ms"],
            ours["hit_rate"] / bound["hit_rate"] if bound["hit_rate"] else 1.0,
            ours.get("failed_tries", 0), ours.get("failed_requests", 0))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefixroute", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--policies", default="latency",
                   help="comma list of simulate policies (each binary runs each)")
    p.add_argument("--events", default=",".join(EVENTS),
                   help=f"comma list of {', '.join(EVENTS)}")
    p.add_argument("--costs", default="0.5,1.0", help="prefill ms per uncached token")
    p.add_argument("--seeds", default="11-30", help="a range, e.g. 11-30")
    args = p.parse_args()
    binaries = binaries_of(args.prefixroute)
    events = choices_of(args.events, EVENTS, "event")
    try:
        costs = [float(c) for c in args.costs.split(",")]
    except ValueError:
        sys.exit(f"--costs {args.costs!r}: expected numbers, e.g. 0.5,1.0")
    seeds = seeds_of(args.seeds)
    policies = args.policies.split(",")
    print(f"seeds {seeds[0]}-{seeds[-1]}; mean (worst, its seed) over seeds: TTFT p95 / the "
          "upper bound's; share of the bound's hit rate")
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for seed in seeds:
            path = os.path.join(tmp, f"tenants-{seed}.jsonl")
            subprocess.run([binaries[0][1], "trace", *TRACE, "--seed", str(seed), "-o", path],
                           check=True, capture_output=True)
            paths.append((seed, path))
        for event in events:
            for cost in costs:
                for name, binary in binaries:
                    for policy in policies:
                        rows = [(*simulate(binary, path, policy, cost, EVENTS[event]), seed)
                                for seed, path in paths]
                        p95 = [r[0] for r in rows]
                        hit = [r[1] for r in rows]
                        worst = max(rows)
                        failed = ""
                        if any(r[2] for r in rows):
                            tries = statistics.mean(r[2] for r in rows)
                            lost = statistics.mean(r[3] for r in rows)
                            failed = f" failed tries {tries:.1f}, failed requests {lost:.1f}"
                        print(f"{event:9s} @{cost}: {name} {policy}: p95 "
                              f"{statistics.mean(p95):4.2f}x ({worst[0]:4.2f}, seed {worst[4]}) "
                              f"hit {statistics.mean(hit) * 100:5.1f}%{failed}", flush=True)


if __name__ == "__main__":
    main()
