#!/usr/bin/env python3
"""Where a request's time goes in the gateway, side by side in one run.

Each system in front of its own fresh fake replicas, one sweep trace at one prefill cost:
  - Envoy LEAST_REQUEST (`prefixroute serve --policy least-request`: no filter);
  - the floor filter (bench/floor: a wasm filter that holds the headers, buffers the body,
    reads it and sets the destination; what any body-routing proxy-wasm filter costs, with
    no routing work);
  - prefixroute's plugin (`latency`);
  - sglang-router cache_aware, when it is installed (no access log: the client's view only).

From Envoy's access log (`prefixroute serve --access-log`), per request, in microseconds:
`routing` (request's last byte → first byte sent upstream: the filters, the plugin's
decision among them, and the upstream connection), `response_headers` (upstream's response
headers → first byte sent downstream) and `response` (the upstream response, first byte to
last, its body's callbacks included); their sum is the gateway's own time besides the server's.

From the client, for every system: each request's time besides its prefill,
TTFT − uncached tokens × cost (the gateway, the connections, the server's fixed overhead and
any queue), median and 95th percentile. Against the upper bound's (one replica straight, no
gateway) it is what the router costs a request.

  python3 bench/gateway_time.py [--scenario rag] [--cost 0.5] [--prefixroute BIN]
      [--plugin-wasm [NAME=]WASM ...] [--envoy ENVOY] [--floor-wasm WASM] [--out DIR]

With several `--plugin-wasm NAME=PATH`, each build is a row of its own (an A/B in one run).

Everything listens on 127.0.0.1; every process it starts is stopped when it ends.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402  (the orchestrator's process helpers and sweep scenarios)
import cpu_ab  # noqa: E402  (the floor filter's build; `prefixroute serve` in front of a fleet)

PHASES = ["routing_us", "response_headers_us", "response_us"]


def gateway(env, name, fleet, tag, policy, wasm=None, extra=()):
    """`prefixroute serve` (cpu_ab's) with `wasm` (or none) and an access log."""
    access_log = env.logs / f"{tag}-{name}.access.log"
    router = cpu_ab.Served(env, name, fleet, wasm, policy, ["--access-log", access_log, *extra])
    router.access_log = access_log
    return router


def envoy_side(path):
    """Each phase of every request in an access log, and their sum."""
    phases = {p: [] for p in PHASES + ["gateway_us"]}
    for line in open(path):
        row = json.loads(line)
        if not all(isinstance(row.get(p), int) for p in PHASES):
            continue  # a request Envoy answered itself (no upstream timestamps)
        for p in PHASES:
            phases[p].append(row[p])
        phases["gateway_us"].append(sum(row[p] for p in PHASES))
    return phases


def run(env, kind, sc, trace, requests, cost, floor_wasm, wasm=None):
    """One system (`wasm`: the plugin build of a `latency` row) in front of fresh replicas."""
    tag = f"gateway-{kind}"
    span = requests / max(sc["trace"]["rate"], 1e-9)
    overhead = sc.get("prefill_overhead_ms", 5)
    replicas, blocks, lanes = sc["replicas"], sc["kv_blocks"], sc["lanes"]
    if kind == "upper":
        replicas, blocks, lanes = 1, bench.UPPER_BOUND_BLOCKS, lanes * replicas
    fleet = bench.start_fleet(env, replicas, blocks, lanes, overhead, cost, tag)
    router = None
    try:
        if kind == "envoy-lr":
            router = gateway(env, kind, fleet, tag, "least-request")
        elif kind == "floor":
            router = gateway(env, kind, fleet, tag, "latency", floor_wasm, ["--static-pool"])
        elif wasm is not None:
            router = gateway(env, kind, fleet, tag, "latency", wasm,
                             bench.our_router_flags(env, lanes))
        else:
            router = bench.Router(env, "direct" if kind == "upper" else kind, fleet, tag)
        if wasm is not None or kind == "floor":
            # The plugin's first scrapes and discovery, as the sweep gives it.
            time.sleep(2.5)
        bench.replay(env, trace, router.url, fleet, span * 3 + 180, tag)
        out = {"client_ms": bench.besides_prefill(env.logs / f"{tag}.requests.jsonl", cost)}
        if hasattr(router, "access_log"):
            out["envoy_us"] = envoy_side(router.access_log)
        return out
    finally:
        if router is not None:
            router.close()
        for r in fleet:
            bench.stop(r.proc)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="rag", choices=sorted(bench.SWEEP_SCENARIOS))
    p.add_argument("--cost", type=float, default=0.5, help="prefill ms per uncached token")
    p.add_argument("--prefixroute", default=str(bench.ROOT / "target" / "release" / "prefixroute"))
    p.add_argument("--plugin-wasm", action="append", default=[],
                   help="[NAME=]PATH of a plugin build (repeat to compare; default: this tree's)")
    p.add_argument("--envoy", default=str(bench.ROOT / ".venv" / "bin" / "envoy"))
    p.add_argument("--floor-wasm", default=None, help="the floor filter (default: build it)")
    p.add_argument("--out", default=None, help="directory for logs (default: a temp dir)")
    args = p.parse_args()
    workdir = Path(args.out or tempfile.mkdtemp(prefix="prefixroute-gateway-time-"))
    workdir.mkdir(parents=True, exist_ok=True)
    builds = [tuple(b.split("=", 1)) if "=" in b else ("prefixroute latency", b)
              for b in args.plugin_wasm] or [
        ("prefixroute latency",
         str(bench.ROOT / "target" / "wasm32-wasip1" / "wasm" / "prefixroute_plugin.wasm"))]
    args.plugin_wasm = builds[0][1]
    env = bench.Env(args, workdir)
    floor_wasm = args.floor_wasm or str(cpu_ab.build_floor())
    sc = bench.SWEEP_SCENARIOS[args.scenario]
    requests = sc["trace"]["requests"]
    trace = workdir / f"{args.scenario}.jsonl"
    bench.make_trace(env, sc["trace"], requests, trace)
    kinds = ["upper", "envoy-lr", "floor"]
    if env.peers_available["sglang"]:
        kinds.insert(2, "sglang")
    label = {"upper": "upper bound (one replica, no gateway)", "envoy-lr": "Envoy LEAST_REQUEST",
             "sglang": "sglang-router cache_aware", "floor": "floor filter (Envoy + wasm)"}
    wasm_of = {}
    for i, (name, path) in enumerate(builds):
        kind = f"plugin-{i}"
        kinds.append(kind)
        label[kind], wasm_of[kind] = name, path
    results = {}
    try:
        for kind in kinds:
            results[kind] = run(env, kind, sc, trace, requests, args.cost, floor_wasm,
                                wasm_of.get(kind))
            bench.log(f"gateway-time: {label[kind]} done")
    finally:
        bench.stop_all()
    (workdir / "gateway_time.json").write_text(json.dumps({label[k]: results[k] for k in kinds}))
    print(f"`{args.scenario}` ({sc['title']}), {args.cost} ms per uncached token, "
          f"{requests} requests; Envoy --concurrency {bench.ENVOY_CONCURRENCY}\n")
    print("| system | besides prefill p50 | p95 | vs upper bound p50 | routing p50 / p90 µs "
          "| response headers p50 µs | response p50 µs | gateway p50 / p90 µs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    pct = bench.percentile
    base = pct(results["upper"]["client_ms"], 0.5)
    for kind in kinds:
        r = results[kind]
        c50, c95 = pct(r["client_ms"], 0.5), pct(r["client_ms"], 0.95)
        cells = [f"{c50:.2f} ms", f"{c95:.2f} ms", f"+{c50 - base:.2f} ms"]
        e = r.get("envoy_us")
        if e and e["gateway_us"]:
            cells += [f"{pct(e['routing_us'], .5)} / {pct(e['routing_us'], .9)}",
                      f"{pct(e['response_headers_us'], .5)}",
                      f"{pct(e['response_us'], .5)}",
                      f"{pct(e['gateway_us'], .5)} / {pct(e['gateway_us'], .9)}"]
        else:
            cells += ["-"] * 4
        print(f"| {label[kind]} | " + " | ".join(cells) + " |")
    print(f"\nlogs: {workdir}")


if __name__ == "__main__":
    main()
