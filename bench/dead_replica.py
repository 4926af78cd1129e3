#!/usr/bin/env python3
"""A replica whose engine died, side by side in one run: two healthy fake replicas and one that
answers every completion with a 5xx at once while its /metrics say idle (`fake-server
--fail-status`), behind each system in turn, fresh replicas for each, the same trace.

For each system: the requests that failed (what the client saw), the tries Envoy retried
(`cluster.prefixroute_pool.upstream_rq_retry`: each a request whose first try went to the dead
replica; the route retries server errors on the next replica of the destination header), the
plugin's ejections, where the answers came from, and latency.

  python3 bench/dead_replica.py --plugin-wasm before=OLD.wasm --plugin-wasm after=NEW.wasm \\
      [--systems envoy-rr,envoy-lr,sglang,vllm] [--status 503] [--requests 300]

Everything listens on 127.0.0.1; every process it starts is stopped when it ends.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402  (the orchestrator's process helpers)

RETRIES = "cluster.prefixroute_pool.upstream_rq_retry"
EJECTED = "wasmcustom.prefixroute.endpoint_ejected"


def envoy_counter(admin, name):
    url = f"http://127.0.0.1:{admin}/stats?filter={name}"
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            key, _, value = line.partition(": ")
            if key.strip() == name and value.strip().isdigit():
                return int(value)
    return 0


def run_one(env, kind, wasm, trace, status, per_token_ms):
    """One system in front of fresh replicas: its replay summary and Envoy's counters."""
    if wasm:
        env.wasm = Path(wasm)
    tag = f"dead-{kind}-{Path(wasm).stem if wasm else ''}"
    fleet = bench.start_fleet(env, 2, 256, 4, 5.0, per_token_ms, tag)
    try:
        fleet.append(bench.FakeReplica(env, "dead", 256, 4, 5.0, per_token_ms,
                                       tag, ["--fail-status", status]))
        router = bench.Router(env, kind, fleet, tag)
        try:
            summary = bench.replay(env, trace, router.url, fleet, 600, tag)
            counters = {}
            if router.admin is not None:
                counters = {"retries": envoy_counter(router.admin, RETRIES),
                            "ejected": envoy_counter(router.admin, EJECTED)}
        finally:
            router.close()
    finally:
        for r in fleet:
            bench.stop(r.proc)
    return summary, counters


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench.ab_arguments(p)
    p.add_argument("--systems", default="envoy-rr,envoy-lr,sglang,vllm",
                   help="the other systems, a comma list (envoy-rr, envoy-lr, sglang, vllm)")
    p.add_argument("--status", default="503", help="what the dead replica answers")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--per-token-ms", type=float, default=0.2,
                   help="the healthy replicas' prefill ms per uncached token")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    plugins = [tuple(s.split("=", 1)) for s in args.plugin_wasm] or [
        ("plugin", str(bench.ROOT / "target" / "wasm32-wasip1" / "wasm" /
                       "prefixroute_plugin.wasm"))]
    workdir = Path(tempfile.mkdtemp(prefix="prefixroute-dead-"))
    env = bench.Env(argparse.Namespace(prefixroute=args.prefixroute,
                                       plugin_wasm=plugins[0][1], envoy=args.envoy), workdir)
    trace = workdir / "tenants.jsonl"
    subprocess.run([str(a) for a in [env.prefixroute, "trace", "--shape", "tenants",
                                     "--tenants", 8, "--requests", args.requests, "--rate", 20,
                                     "--seed", 3, "-o", trace]],
                   check=True, capture_output=True)
    systems = [(f"prefixroute {name}", "latency", wasm) for name, wasm in plugins]
    for kind in [s for s in args.systems.split(",") if s]:
        if kind in ("sglang", "vllm") and not env.peers_available[kind]:
            bench.log(f"dead-replica: {kind} is not installed (bench/setup.sh); skipped")
            continue
        systems.append((bench.LABEL.get(kind, kind), kind, None))
    rows = []
    for label, kind, wasm in systems:
        bench.log(f"dead-replica: {label}")
        summary, counters = run_one(env, kind, wasm, trace, args.status, args.per_token_ms)
        rows.append({"system": label, "summary": summary, **counters})
    print(f"\n{args.requests} requests of 8 tenants (`prefixroute trace --shape tenants "
          f"--tenants 8 --seed 3`); replicas r0, r1 healthy, `dead` answers {args.status}\n")
    print("| system | failed requests | first tries on the dead replica (Envoy's retries) "
          "| ejections | answered by | latency p50 / p95 |")
    print("|---|---:|---:|---:|---|---|")
    for r in rows:
        s = r["summary"]
        lat = s["latency_ms"]
        by = ", ".join(f"{k} {v}" for k, v in sorted(s["endpoints"].items()))
        print(f"| {r['system']} | {s['errors']} | {r.get('retries', '-')} | "
              f"{r.get('ejected', '-')} | {by} | {lat['p50']:.1f} / {lat['p95']:.1f} ms |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
