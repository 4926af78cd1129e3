#!/usr/bin/env python3
"""Requests routed without the plugin right after Envoy starts, side by side in one run.

`prefixroute serve` discovers its pool from Envoy's admin interface by default. Until a
worker's plugin knows the pool, each request falls back to Envoy's own pick (counted as
`prefixroute.fallback.no_endpoints`). This starts a fresh Envoy per round and plugin build,
sends load the moment Envoy is ready (wrk, 16 connections, 1 KB chat bodies, for --seconds),
and prints how many of those requests fell back.

  python3 bench/startup.py --plugin-wasm before=/tmp/old.wasm --plugin-wasm after=<this tree's .wasm>

Everything listens on 127.0.0.1; every process it starts is stopped when it ends.
"""
import argparse
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402  (the orchestrator's process helpers)


def one_start(env, fleet, wasm, seconds, tag):
    """A fresh Envoy with `wasm`; load from the moment /ready answers. Returns (requests,
    fallbacks)."""
    admin, port = bench.free_port(), bench.free_port()
    argv = [env.prefixroute, "serve", "--listen", f"127.0.0.1:{port}",
            "--admin", f"127.0.0.1:{admin}", "--envoy", env.envoy, "--plugin-wasm", wasm,
            "--concurrency", bench.ENVOY_CONCURRENCY]
    for r in fleet:
        argv += ["--endpoint", f"{r.name}=http://{r.hostport}"]
    log_path = env.log_path(f"startup-{tag}")
    proc = bench.spawn(argv, log_path)
    try:
        bench.wait_until("Envoy", lambda: bench.http_get(f"http://127.0.0.1:{admin}/ready")
                         == 200, proc, 30, log_path)
        run = bench.wrk_run(env, f"http://127.0.0.1:{port}", 1024, 16, seconds)
        counters = bench.plugin_counters(admin)
        return run["requests"], counters.get("prefixroute.fallback.no_endpoints", 0)
    finally:
        bench.stop(proc)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench.ab_arguments(p)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=int, default=2, help="seconds of load after each start")
    args = p.parse_args()
    plugins, env = bench.ab_setup(args, "startup")
    fleet = bench.start_fleet(env, 4, 4096, 4096, 0, 0, "startup")
    runs = {name: [] for name, _ in plugins}
    try:
        for rnd in range(args.rounds):
            order = plugins if rnd % 2 == 0 else plugins[::-1]
            for name, wasm in order:
                runs[name].append(one_start(env, fleet, wasm, args.seconds, f"{name}-{rnd}"))
    finally:
        for r in fleet:
            bench.stop(r.proc)
    shutil.rmtree(env.workdir, ignore_errors=True)  # its logs are kept only when a run failed
    print(f"Requests in the first {args.seconds} s after Envoy is ready (wrk -c16, 1 KB chat"
          f" bodies, Envoy --concurrency {bench.ENVOY_CONCURRENCY}, pool discovered from the"
          f" admin interface), {args.rounds} starts each\n")
    print("| build | requests (median) | fell back: no endpoints (median) | share | every start |")
    print("|---|---:|---:|---:|---|")
    for name, rs in runs.items():
        reqs = statistics.median(r for r, _ in rs)
        fell = statistics.median(f for _, f in rs)
        every = ", ".join(f"{f}/{r}" for r, f in rs)
        print(f"| {name} | {reqs:.0f} | {fell:.0f} | {fell / max(reqs, 1):.2%} | {every} |")


if __name__ == "__main__":
    main()
