#!/usr/bin/env python3
"""The simulator's `latency` policy over many seeds of the sweep's traces, side by side.

One sweep trace is one seed: a change that moves its TTFT p95 by three requests out of 400 can
look like a win or a loss by luck. This generates each scenario with several seeds (the sweep's
own trace parameters, `bench/bench.py`'s SWEEP_SCENARIOS, only the seed changes), simulates each
`prefixroute` binary given on the same traces (its `latency` policy, or each of `--policies`),
and prints per scenario and prefill cost the mean
(and worst) share of the upper bound's hit rate, TTFT p95 over the bound's, and busiest replica
over the mean. Deterministic: the same binaries and seeds print the same numbers.

    python3 bench/sim_seeds.py --prefixroute before=OLD/prefixroute --prefixroute after=NEW/prefixroute
    python3 bench/sim_seeds.py --prefixroute now=target/release/prefixroute --scenarios mixed,long --seeds 21-28
    python3 bench/sim_seeds.py --prefixroute now=... --costs 0.5 \
        --simulate-args '--gateways 2 --index precise --kv-interval-ms 200'
    python3 bench/sim_seeds.py --prefixroute now=... --decode-ms 10 \
        --policies latency,prefix,least-queue,round-robin
    python3 bench/sim_seeds.py --prefixroute now=... --scenarios hot --requests 2400 \
        --simulate-args '--gateways 3 --index precise'

Standard library only; runs the binaries, never a network.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import SWEEP_SCENARIOS, max_over_mean  # noqa: E402

COSTS = (0.1, 0.5, 1.0)
# `prefixroute simulate --policy`'s names.
POLICIES = ("latency", "prefix", "prefix-only", "least-queue", "round-robin", "random")


def seeds_of(text):
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def binaries_of(specs):
    """`NAME=PATH` arguments as (name, path) pairs; exits with a message unless each path is an
    executable."""
    binaries = [b.partition("=")[::2] for b in specs]
    for name, path in binaries:
        if not path or not os.access(path, os.X_OK):
            sys.exit(f"--prefixroute {name}={path}: not an executable")
    return binaries


def choices_of(text, known, what):
    """A comma list of names, each one of `known`; exits with a message naming the first that
    is not."""
    names = text.split(",")
    for n in names:
        if n not in known:
            sys.exit(f"unknown {what} {n!r} (one of {', '.join(known)})")
    return names


def trace(binary, scenario, seed, out, requests=None):
    """The scenario's trace with `seed` (and `requests` requests instead of its own count, when
    given) written to `out`."""
    args = [binary, "trace", "-o", out]
    for key, value in SWEEP_SCENARIOS[scenario]["trace"].items():
        if key == "seed":
            value = seed
        elif key == "requests" and requests:
            value = requests
        args += [f"--{key}", str(value)]
    subprocess.run(args, check=True, capture_output=True)


def simulate(binary, path, scenario, cost, policies, extra=(), decode_ms=0.0):
    """One trace through `simulate`: per policy (in `policies`' order), the share of the upper
    bound's hit rate, TTFT p95 over the bound's, and busiest replica over the mean."""
    sc = SWEEP_SCENARIOS[scenario]
    out = subprocess.run(
        [binary, "simulate", path, "--policy", ",".join(policies),
         "--replicas", str(sc["replicas"]),
         "--cache-blocks", str(sc["kv_blocks"]), "--slots", str(sc["lanes"]),
         "--block-size", "16", "--decode-ms-per-token", str(decode_ms),
         "--prefill-ms-per-token", str(cost), "--json", *extra],
        check=True, capture_output=True, text=True).stdout
    report = json.loads(out)
    bound = report["upper_bound"]
    by_policy = {p["policy"]: p for p in report["policies"]}
    rows = []
    for policy in policies:
        ours = by_policy[policy]
        per = ours["requests_per_replica"]
        rows.append((ours["hit_rate"] / bound["hit_rate"] if bound["hit_rate"] else 1.0,
                     ours["ttft_p95_ms"] / bound["ttft_p95_ms"],
                     max_over_mean(per)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefixroute", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--scenarios", default="mixed,conversations,long")
    p.add_argument("--seeds", default="21-28", help="a range, e.g. 21-28")
    p.add_argument("--costs", default=",".join(map(str, COSTS)),
                   help="prefill ms per uncached token, a comma list")
    p.add_argument("--simulate-args", default="", metavar="ARGS",
                   help="more `simulate` flags for every run, e.g. "
                        "'--gateways 2 --index precise --kv-interval-ms 200'")
    p.add_argument("--decode-ms", type=float, default=0.0,
                   help="decode ms per output token on the simulated replicas (the sweep's is 0): "
                        "a request holds its lane this long per output token after its first byte")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per trace instead of the scenario's own (a few hundred): a "
                        "longer trace shows the steady state past the first seconds, which "
                        "dominate a short trace's p95 (a cold start, gateways not yet scraped)")
    p.add_argument("--policies", default="latency",
                   help="simulator policies to compare, a comma list (e.g. "
                        "latency,prefix,least-queue,round-robin)")
    args = p.parse_args()
    policies = choices_of(args.policies, POLICIES, "policy")
    extra = shlex.split(args.simulate_args)
    costs = [float(c) for c in args.costs.split(",")]
    binaries = binaries_of(args.prefixroute)
    scenarios = choices_of(args.scenarios, SWEEP_SCENARIOS, "scenario")
    seeds = seeds_of(args.seeds)
    print(f"seeds {seeds[0]}-{seeds[-1]}; mean (worst) over seeds: share of the bound's hit "
          "rate, TTFT p95 / bound's, max/mean")
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in scenarios:
            paths = []
            for seed in seeds:
                path = os.path.join(tmp, f"{scenario}-{seed}.jsonl")
                trace(binaries[0][1], scenario, seed, path, args.requests)
                paths.append(path)
            for cost in costs:
                cells = []
                for name, binary in binaries:
                    runs = [simulate(binary, path, scenario, cost, policies, extra,
                                     args.decode_ms) for path in paths]
                    for i, policy in enumerate(policies):
                        hit, p95, spread = zip(*(run[i] for run in runs))
                        label = name if len(policies) == 1 else f"{name} {policy}"
                        cells.append(
                            f"{label}: {statistics.mean(hit) * 100:5.1f}% ({min(hit) * 100:5.1f}) "
                            f"p95 {statistics.mean(p95):4.2f}x ({max(p95):4.2f}) "
                            f"max/mean {statistics.mean(spread):4.2f} ({max(spread):4.2f})")
                print(f"{scenario:13s} @{cost}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
