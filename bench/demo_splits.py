#!/usr/bin/env python3
"""How often real Envoy splits a group of the demo trace, per plugin build, side by side.

`prefixroute compare` (the README's main job: the demo trace, fake replicas, real Envoy with
the plugin) run RUNS times per build, the builds in turn, with the Envoy test's fast scrapes
(`cli/tests/envoy.rs`, `latency_and_prefix_beat_round_robin_by_20_points_and_pin_their_tenants`).
A run splits when some group's requests reached more than one replica. An even trace needs
no copy; a split there is a router acting on too little evidence (docs/benchmarks.md: the
bounded share's small samples, each Envoy worker counting its own requests).

  python3 bench/demo_splits.py [--runs 16] [--policy latency] [--concurrency 2]
      [--prefixroute BIN] [--envoy ENVOY] [--plugin-wasm NAME=PATH ...]

Everything listens on 127.0.0.1 (compare's own processes); nothing is left behind.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402  (ab_arguments: the CLI, Envoy and plugin builds)

FAST_SCRAPES = ["--scrape-interval-ms", "200", "--scrape-timeout-ms", "150",
                "--stale-after-ms", "1000"]


def one_run(args, wasm):
    """Groups on more than one replica in one `compare` run, and the groups counted."""
    argv = [args.prefixroute, "compare", "--json", "--policies", args.policy,
            "--concurrency", str(args.concurrency), "--envoy", args.envoy,
            "--plugin-wasm", wasm, *FAST_SCRAPES]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"compare failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    rows = json.loads(r.stdout)
    row = next(x for x in rows if x["policy"] == args.policy)
    summary = row["summary"]
    if summary["errors"]:
        sys.exit(f"compare answered {summary['errors']} requests with errors")
    groups = summary["groups_on_one_endpoint"]
    return groups["groups"] - groups["single"], groups["groups"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.ab_arguments(p)
    p.add_argument("--runs", type=int, default=16, help="compare runs per build")
    p.add_argument("--policy", default="latency")
    p.add_argument("--concurrency", type=int, default=2, help="Envoy workers")
    args = p.parse_args()
    builds = [tuple(s.split("=", 1)) for s in args.plugin_wasm] or [
        ("plugin", str(bench.ROOT / "target" / "wasm32-wasip1" / "wasm" /
                       "prefixroute_plugin.wasm"))]
    split_runs = {name: 0 for name, _ in builds}
    split_groups = {name: 0 for name, _ in builds}
    for i in range(args.runs):
        for name, wasm in builds:
            split, groups = one_run(args, wasm)
            split_runs[name] += split > 0
            split_groups[name] += split
            print(f"run {i + 1:>3} {name}: {split} of {groups} groups split", flush=True)
    print(f"\n{args.policy}, {args.concurrency} Envoy workers, {args.runs} runs each:")
    for name, _ in builds:
        print(f"  {name}: {split_runs[name]} runs with a split group "
              f"({split_groups[name]} groups in all)")


if __name__ == "__main__":
    main()
