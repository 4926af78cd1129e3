#!/usr/bin/env python3
"""Several gateways at once: does each Envoy's prefix belief still hold when a client spreads
its requests over two (or --gateways N) of them?

Four runs of the same trace, each on fresh fake vLLM replicas that publish KV events, with a
fresh `prefixroute kv-events` relay:

  1 gateway,  index approximate    the plugin's own belief, one Envoy
  N gateways, index approximate    N Envoys (each its own shared data), requests in turn
  1 gateway,  index precise        the servers' KV events through the relay
  N gateways, index precise        every Envoy reads the same relay

The hit rate comes from the replicas' own counters (`prefixroute replay --metrics`). Standard
library only; only 127.0.0.1 is contacted; every process is killed at the end.

usage: bench/gateways.py [--shape tenants|conversations|mixed|rag] [--spread in-turn|by-group]
                        [--requests N] [--gateways N] [--plugin-wasm WASM]
                        [--policy P] [--placement local|consistent] [--kv-interval-ms MS]
                        [--kv-wait-ms MS] [--only precise|approximate] [--out FILE.json]
(needs the release plugin, the CLI and Envoy in .venv: run after ./test.sh or bench/setup.sh)
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
CLI = TARGET / "debug" / "prefixroute"
WASM = TARGET / "wasm32-wasip1" / "wasm" / "prefixroute_plugin.wasm"
ENVOY = Path(os.environ.get("ENVOY") or ROOT / ".venv" / "bin" / "envoy")

# The traces (`--shape`): each with its fleet.
SHAPES = {
    # Caches that hold about half of the tenants' prompts (24 tenants of ~13 blocks, 3 × 52).
    "tenants": {
        "trace": ["--shape", "tenants", "--tenants", "24", "--prompt-words", "180",
                  "--question-words", "12", "--rate", "20", "--seed", "7"],
        "replicas": 3, "kv_blocks": 52,
    },
    # The sweep's conversations (bench.py): 24 growing conversations behind one system prompt,
    # whose turns alternate between the gateways.
    "conversations": {
        "trace": ["--shape", "conversations", "--tenants", "24", "--prompt-words", "150",
                  "--question-words", "30", "--rate", "20", "--seed", "13"],
        "replicas": 6, "kv_blocks": 900,
    },
    # The sweep's mixed: 16 tenants' questions and 16 conversations sharing a system prompt.
    "mixed": {
        "trace": ["--shape", "mixed", "--tenants", "16", "--prompt-words", "400",
                  "--question-words", "30", "--rate", "20", "--seed", "16"],
        "replicas": 6, "kv_blocks": 900,
    },
    # The sweep's RAG: 8 documents of ~1,900 tokens, each in the user message after one short
    # instruction every document shares; each replica caches three.
    "rag": {
        "trace": ["--shape", "rag", "--tenants", "8", "--prompt-words", "1500",
                  "--question-words", "20", "--rate", "15", "--seed", "14"],
        "replicas": 6, "kv_blocks": 380,
    },
}
REPLICAS = 3
KV_BLOCKS = 52
TRACE = SHAPES["tenants"]["trace"]
PREFILL_MS_PER_TOKEN = "0.5"

procs = []


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv, log):
    p = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL,
                         stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    procs.append(p)
    return p


def stop_all():
    while procs:
        p = procs.pop()
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def get(url, timeout=2.0):
    assert url.startswith("http://127.0.0.1:"), url
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except Exception:  # noqa: BLE001 - any failure means "not yet"
        return None, b""


def wait(what, check, seconds=30):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {seconds} s")


def replica(work, name):
    port, events = free_port(), free_port()
    spawn([CLI, "fake-server", "--port", port, "--name", name, "--kv-blocks", KV_BLOCKS,
           "--lanes", "4", "--prefill-ms-per-token", PREFILL_MS_PER_TOKEN,
           "--kv-events", f"tcp://127.0.0.1:{events}"], work / f"{name}.log")
    wait(name, lambda: get(f"http://127.0.0.1:{port}/health")[0] == 200)
    return name, port, events


KV_INTERVAL_MS = "200"
KV_WAIT_MS = "1000"
POLICY = "latency"
SPREAD = "in-turn"


def run(work, gateways, index, trace):
    fleet = [replica(work, f"replica-{i}") for i in range(REPLICAS)]
    relay = free_port()
    argv = [CLI, "kv-events", "--listen", f"127.0.0.1:{relay}"]
    for _, port, events in fleet:
        argv += ["--publisher", f"127.0.0.1:{port}=tcp://127.0.0.1:{events}"]
    spawn(argv, work / "relay.log")
    wait("relay", lambda: get(f"http://127.0.0.1:{relay}/health")[0] == 200)
    # ZMQ's slow joiner: publish until the relay hears every replica.
    def heard():
        for _, port, _ in fleet:
            body = json.dumps({"model": "cc-sim", "max_tokens": 1,
                               "prompt": f"warm {time.monotonic()} " * 12}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"content-type": "application/json"})
            urllib.request.urlopen(req, timeout=5).read()
        status, body = get(f"http://127.0.0.1:{relay}/stats")
        return status == 200 and all(s["messages"] > 0 for s in json.loads(body)["servers"])
    wait("relay subscriptions", heard)
    urls, admins = [], []
    for g in range(gateways):
        port, admin = free_port(), free_port()
        argv = [CLI, "serve", "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
                "--plugin-wasm", WASM, "--envoy", ENVOY, "--policy", POLICY,
                "--index", index, "--prior-ms-per-token", PREFILL_MS_PER_TOKEN,
                "--placement", PLACEMENT]
        if index == "precise":
            argv += ["--kv-relay", f"127.0.0.1:{relay}", "--kv-interval-ms", KV_INTERVAL_MS,
                     "--kv-wait-ms", KV_WAIT_MS]
        for name, rport, _ in fleet:
            argv += ["--endpoint", f"{name}=http://127.0.0.1:{rport}"]
        spawn(argv, work / f"envoy-{g}.log")
        wait(f"gateway {g}", lambda: get(f"http://127.0.0.1:{admin}/ready")[0] == 200)
        urls.append(f"http://127.0.0.1:{port}")
        admins.append(admin)
    time.sleep(2.5)  # the first discovery, scrapes and feed fetches
    argv = [CLI, "replay", trace, "--json", "--no-progress", "--timeout-s", "60",
            "--url-spread", SPREAD]
    for u in urls:
        argv += ["--url", u]
    for name, port, _ in fleet:
        argv += ["--metrics", f"{name}=http://127.0.0.1:{port}"]
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=True)
    # Requests another gateway routed whose ends a gateway's feed marked (precise only).
    ends_marked = fetches = 0
    for admin in admins:
        _, body = get(f"http://127.0.0.1:{admin}/stats?filter=kv\\.(ends_marked|fetch\\.ok)")
        ends_marked += sum(int(v) for v in re.findall(rb"kv\.ends_marked: (\d+)", body))
        fetches += sum(int(v) for v in re.findall(rb"kv\.fetch\.ok: (\d+)", body))
    stop_all()
    report = json.loads(out.stdout)
    served = list(report["endpoints"].values())
    return {
        "gateways": gateways,
        "index": index,
        "placement": PLACEMENT,
        "requests": report["requests"],
        "errors": report["errors"],
        "hit_rate": report["server_counters"]["hit_rate"],
        "latency_p50_ms": report["latency_ms"]["p50"],
        "latency_p95_ms": report["latency_ms"]["p95"],
        "groups_on_one": f'{report["groups_on_one_endpoint"]["single"]}/'
                         f'{report["groups_on_one_endpoint"]["groups"]}',
        # Requests on the busiest replica over the mean (replicas that got none count).
        "max_mean": max(served) * REPLICAS / sum(served) if sum(served) else None,
        "requests_per_replica": served,
        "ends_marked": ends_marked,
        # Feed pages the gateways fetched, all of them, over the run.
        "feed_fetches": fetches,
    }


def main():
    global KV_INTERVAL_MS, KV_WAIT_MS, POLICY, REPLICAS, KV_BLOCKS, TRACE, SPREAD, PLACEMENT, WASM
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--gateways", type=int, default=2, choices=range(2, 9), metavar="N",
                    help="gateways in the run compared with one (2..8, default 2)")
    ap.add_argument("--kv-interval-ms", default="200",
                    help="how often each gateway's plugin fetches the relay's feed")
    ap.add_argument("--kv-wait-ms", default="1000",
                    help="how long the relay may hold a feed fetch with nothing new (a long "
                         "poll); 0 polls every --kv-interval-ms")
    ap.add_argument("--only", choices=["approximate", "precise"])
    ap.add_argument("--policy", default="latency")
    ap.add_argument("--placement", choices=["local", "consistent"], default="local",
                    help="consistent: every group also gets a home all gateways compute alike")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tenants",
                    help="the trace and its fleet (default: tenants)")
    ap.add_argument("--spread", choices=["in-turn", "by-group"], default="in-turn",
                    help="requests to the gateways in turn, or each trace group through one "
                         "(session affinity)")
    ap.add_argument("--seed", type=int,
                    help="the trace's seed instead of the shape's own (the simulator's "
                         "`bench/sim_seeds.py` finds the seeds worth a real run)")
    ap.add_argument("--plugin-wasm", type=Path, default=WASM,
                    help=f"the plugin every gateway loads (default {WASM})")
    ap.add_argument("--out")
    args = ap.parse_args()
    WASM = args.plugin_wasm
    KV_INTERVAL_MS = args.kv_interval_ms
    KV_WAIT_MS = args.kv_wait_ms
    POLICY = args.policy
    PLACEMENT = args.placement
    SPREAD = args.spread
    shape = SHAPES[args.shape]
    REPLICAS, KV_BLOCKS, TRACE = shape["replicas"], shape["kv_blocks"], list(shape["trace"])
    if args.seed is not None:
        TRACE[TRACE.index("--seed") + 1] = str(args.seed)
    for path in (CLI, WASM, ENVOY):
        if not path.exists():
            sys.exit(f"gateways: {path} is missing (build first: ./test.sh or bench/setup.sh)")
    work = Path(tempfile.mkdtemp(prefix="prefixroute-gateways-"))
    trace = work / "trace.jsonl"
    subprocess.run([str(CLI), "trace", *TRACE, "--requests", str(args.requests), "-o", str(trace)],
                   check=True, capture_output=True)
    rows = []
    try:
        for index in [args.only] if args.only else ("approximate", "precise"):
            for gateways in (1, args.gateways):
                rows.append(run(work, gateways, index, trace))
                print(f"  {gateways} gateway(s), {index}: {rows[-1]}", file=sys.stderr)
    finally:
        stop_all()
    shutil.rmtree(work, ignore_errors=True)  # kept (logs, configurations) only when a run failed
    print(f"{REPLICAS} fake replicas ({KV_BLOCKS} blocks of 16 tokens each), "
          f"`prefixroute trace {' '.join(TRACE)} --requests {args.requests}`, policy {POLICY}, "
          f"placement {PLACEMENT}, "
          f"feed fetched every {KV_INTERVAL_MS} ms, held up to {KV_WAIT_MS} ms, "
          f"requests to the gateways {SPREAD}\n")
    print(f"{'index':<12} {'gateways':>8} {'errors':>6} {'hit rate':>9} {'p50':>9} {'p95':>9}"
          f"  groups on one  max/mean  ends marked")
    for r in rows:
        balance = f"{r['max_mean']:.2f}" if r["max_mean"] is not None else "-"
        print(f"{r['index']:<12} {r['gateways']:>8} {r['errors']:>6} {100 * r['hit_rate']:>8.1f}%"
              f" {r['latency_p50_ms']:>6.1f} ms {r['latency_p95_ms']:>6.1f} ms"
              f"  {r['groups_on_one']:>13}  {balance:>8}  {r['ends_marked']:>11}")
    by = {(r["index"], r["gateways"]): r["hit_rate"] for r in rows}
    for index in [args.only] if args.only else ("approximate", "precise"):
        drop = 100 * (by[(index, 1)] - by[(index, args.gateways)])
        print(f"{index}: {args.gateways} gateways lose {drop:.1f} points of hit rate against one")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
