#!/usr/bin/env python3
"""prefixroute's side-by-side benchmark: cache effect, cost per request and scale, measured in
one run against the routers a user would pick instead.

Run it through bench/run.sh (installs the peers and builds first) or bench/smoke.sh. Standard
library only. Every process it starts gets its own process group and is killed on exit, on
Ctrl-C and on SIGTERM; every wait has a deadline; only 127.0.0.1 is ever contacted.

Sections:
  cache   the same traces through each router in front of fresh fake vLLM replicas; hit rate
          from the replicas' own counters, TTFT, load spread, groups kept on one replica, and a
          one-server unlimited-cache upper bound per trace.
  sweep   where prefill hurts: tenants, a hot tenant, conversations, tenants and
          conversations on one gateway, RAG and a trace with nothing shared, each at 0.1, 0.5
          and 1 ms per uncached token, with caches that hold
          a third to a half of the groups; the latency targets checked per trace and cost.
  cost    wrk (closed loop) against a zero-latency backend at 1, 8 and 64 KB bodies: unloaded
          latency (1 connection) and throughput (many connections), as ratios to Envoy RR.
  scale   the core's criterion benches and the index memory example.
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TARGET = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")

# --------------------------------------------------------------------------------------------
# What is measured. Changing any of this changes the numbers in docs/benchmarks.md: say so there.
# --------------------------------------------------------------------------------------------

# Each scenario: a trace (`prefixroute trace` flags), the fleet (replicas and their cache), and
# the fake servers' timing. `quick_requests` replaces `requests` with --quick.
SCENARIOS = {
    "tenants": {
        "title": "(a) 40 tenants, ~2,900-token system prompts, 8 replicas each caching ~8 tenants",
        "trace": {"shape": "tenants", "tenants": 40, "prompt-words": 2500,
                  "question-words": 120, "rate": 20, "requests": 600, "seed": 1},
        "quick_requests": 200,
        "replicas": 8, "kv_blocks": 1600, "lanes": 4,
        "prefill_overhead_ms": 5, "prefill_ms_per_token": 0.1,
    },
    "hot": {
        "title": "(b) hot tenant (70% of traffic) at 120 req/s, 8 replicas with 2 lanes each",
        "trace": {"shape": "tenants", "tenants": 8, "prompt-words": 800, "question-words": 40,
                  "rate": 120, "requests": 1200, "hot": 0.7, "seed": 2},
        "quick_requests": 480,
        "replicas": 8, "kv_blocks": 256, "lanes": 2,
        "prefill_overhead_ms": 5, "prefill_ms_per_token": 0.5,
    },
    "conversations": {
        "title": "(c) 48 multi-turn conversations sharing one ~1,200-token system prompt, 8 replicas",
        "trace": {"shape": "conversations", "tenants": 48, "prompt-words": 1000,
                  "question-words": 30, "rate": 16, "requests": 480, "seed": 3},
        "quick_requests": 200,
        "replicas": 8, "kv_blocks": 768, "lanes": 4,
        "prefill_overhead_ms": 5, "prefill_ms_per_token": 0.2,
    },
    "rag": {
        "title": "(d) RAG: 6 documents of ~3,500 tokens, many short questions, 8 replicas",
        "trace": {"shape": "rag", "tenants": 6, "prompt-words": 3000, "question-words": 20,
                  "rate": 20, "requests": 400, "seed": 4},
        "quick_requests": 160,
        "replicas": 8, "kv_blocks": 512, "lanes": 4,
        "prefill_overhead_ms": 5, "prefill_ms_per_token": 0.1,
    },
}

SMOKE_SCENARIO = {
    "smoke": {
        "title": "smoke: 8 tenants, 3 replicas of 64 blocks (the demo's shape), 64 requests",
        "trace": {"shape": "tenants", "tenants": 8, "prompt-words": 180, "question-words": 12,
                  "rate": 40, "requests": 64, "seed": 42},
        "quick_requests": 64,
        "replicas": 3, "kv_blocks": 64, "lanes": 4,
        "prefill_overhead_ms": 5, "prefill_ms_per_token": 1.0,
    },
}

# The prefill-cost sweep. Every trace runs at each cost through each router in front of fresh
# replicas whose caches hold a third to a half of the trace's groups, so a router that does not
# partition the groups loses them to eviction. `splittable`: the groups can be spread evenly
# over the replicas (the max/mean target applies); `shared`: requests share prefixes (the
# hit-rate targets apply; the nothing-shared trace is judged on TTFT against LEAST_REQUEST).
SWEEP_COSTS = [0.1, 0.5, 1.0]
SWEEP_SCENARIOS = {
    "tenants": {
        "title": "24 tenants, ~750-token system prompts; each replica caches a third of them",
        "trace": {"shape": "tenants", "tenants": 24, "prompt-words": 600,
                  "question-words": 40, "rate": 20, "requests": 400, "seed": 11},
        "quick_requests": 200, "replicas": 6, "kv_blocks": 420, "lanes": 4,
        "splittable": True, "shared": True,
    },
    "hot": {
        "title": "8 tenants, one with 60% of the traffic at 50 req/s; caches hold half of them",
        "trace": {"shape": "tenants", "tenants": 8, "prompt-words": 600, "question-words": 40,
                  "rate": 50, "requests": 600, "hot": 0.6, "seed": 12},
        "quick_requests": 300, "replicas": 6, "kv_blocks": 200, "lanes": 2,
        "splittable": False, "shared": True,
    },
    "conversations": {
        "title": "24 conversations sharing a ~190-token system prompt, growing every turn",
        "trace": {"shape": "conversations", "tenants": 24, "prompt-words": 150,
                  "question-words": 30, "rate": 20, "requests": 400, "seed": 13},
        "quick_requests": 200, "replicas": 6, "kv_blocks": 900, "lanes": 4,
        "splittable": True, "shared": True,
    },
    "mixed": {
        "title": "16 tenants' questions and 16 conversations on one gateway (~500-token system prompts); caches hold a third of the groups",
        "trace": {"shape": "mixed", "tenants": 16, "prompt-words": 400, "question-words": 30,
                  "rate": 20, "requests": 400, "seed": 16},
        "quick_requests": 200, "replicas": 6, "kv_blocks": 900, "lanes": 4,
        "splittable": True, "shared": True,
    },
    # The other traces are a few hundred requests: what a router counts in its first seconds
    # is most of what it sees. Here conversations end after 8 turns and new ones take their
    # slots, so groups keep coming and going for a minute.
    "long": {
        "title": "a long-lived gateway: `mixed` whose conversations end after 8 turns and new ones start, 1,200 requests",
        "trace": {"shape": "mixed", "tenants": 16, "prompt-words": 400, "question-words": 30,
                  "rate": 20, "requests": 1200, "seed": 17, "turns": 8},
        "quick_requests": 400, "replicas": 6, "kv_blocks": 900, "lanes": 4,
        "splittable": True, "shared": True,
    },
    "rag": {
        "title": "8 documents of ~1,900 tokens over 6 replicas caching 3 documents each",
        "trace": {"shape": "rag", "tenants": 8, "prompt-words": 1500, "question-words": 20,
                  "rate": 15, "requests": 300, "seed": 14},
        "quick_requests": 150, "replicas": 6, "kv_blocks": 380, "lanes": 4,
        "splittable": False, "shared": True,
    },
    "unique": {
        "title": "nothing shared: every request a new ~380-token prompt",
        "trace": {"shape": "unique", "prompt-words": 300, "question-words": 20,
                  "rate": 15, "requests": 300, "seed": 15},
        "quick_requests": 150, "replicas": 6, "kv_blocks": 400, "lanes": 4,
        "splittable": True, "shared": False,
    },
}
# Opt-in sweep traces (`--sweep-scenarios`), not in the default sweep.
EXTRA_SWEEP_SCENARIOS = {
    # `tenants` in Chinese characters: ~800 characters per system prompt, so with one token
    # per character (a model's tokenizer gives ~0.7-1.5) a replica caches a third of them, as
    # in `tenants`. The fake servers tokenize each character as a token (`--non-ascii pieces`,
    # their default); run `latency-skip` beside `latency` to see a router that skips them.
    "tenants-han": {
        "title": "24 tenants whose ~800-character system prompts are in Chinese; each replica caches a third of them",
        "trace": {"shape": "tenants", "tenants": 24, "prompt-words": 400,
                  "question-words": 20, "rate": 20, "requests": 400, "seed": 11,
                  "script": "han"},
        "quick_requests": 200, "replicas": 6, "kv_blocks": 420, "lanes": 4,
        "splittable": True, "shared": True,
    },
}
SWEEP_ROUTERS = ["envoy-lr", "sglang", "vllm", "prefix", "latency"]
PEERS = {"envoy-rr", "envoy-lr", "sglang", "vllm"}

# Routers in the cache section. "ours" marks prefixroute's own policies; the rest are peers.
CACHE_ROUTERS = ["envoy-rr", "envoy-lr", "sglang", "vllm", "prefix", "prefix-only", "latency"]
COST_SYSTEMS = ["direct", "envoy-rr", "latency", "sglang", "vllm"]
OURS = {"prefix", "prefix-only", "latency", "latency-skip"}
PLUGIN = OURS
LABEL = {
    "direct": "direct (no router)",
    "envoy-rr": "Envoy ROUND_ROBIN",
    "envoy-lr": "Envoy LEAST_REQUEST",
    "sglang": "sglang-router cache_aware",
    "vllm": "vllm-router cache_aware",
    "prefix": "prefixroute prefix",
    "prefix-only": "prefixroute prefix-only",
    "latency": "prefixroute latency",
    "latency-skip": "prefixroute latency, non_ascii: skip",
    "upper": "upper bound: 1 server, unlimited cache",
}

COST_SIZES = [1024, 8192, 65536]
# warm: bodies cycle through 16 tenants x 4 questions (every prefix seen before);
# cold: a unique first line per request, so no block ever matches.
COST_WARMTH = ["warm", "cold"]
ENVOY_CONCURRENCY = 2  # Envoy workers everywhere; the peers run 2 tokio workers on 2 cores.
UPPER_BOUND_BLOCKS = 262_144
BLOCK_SIZE = 16

TARGETS = {
    "hit_vs_best_peer": "hit rate >= the best peer's on every trace",
    "hit_vs_upper": "hit rate within 5% of the upper bound (>= 0.95 x bound)",
    "max_mean": "max/mean requests per replica <= 1.3",
    "added_p50": "added p50 <= 0.1 ms over Envoy RR at 8 KB, warm and cold",
    "throughput": "throughput vs Envoy RR >= 0.85x at 8 KB warm, 0.75x at 8 KB cold, 0.6x at "
                  "64 KB warm and cold, and ahead of sglang-router in every cell",
}

# --------------------------------------------------------------------------------------------
# Processes: every child in its own process group, all killed on exit.
# --------------------------------------------------------------------------------------------

_children = []
_children_lock = threading.Lock()


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def spawn(argv, log_path, env=None, stderr_pipe=False):
    """Starts argv in a new session (its own process group); stdout (and stderr unless piped)
    go to log_path."""
    logf = open(log_path, "ab")
    proc = subprocess.Popen(
        [str(a) for a in argv],
        stdin=subprocess.DEVNULL,
        stdout=logf,
        stderr=subprocess.PIPE if stderr_pipe else subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    proc._bench_log = logf  # closed in stop()
    with _children_lock:
        _children.append(proc)
    return proc


def stop(proc, grace=5.0):
    """SIGTERM to the child's process group, SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)
    else:
        # The leader exited; make sure nothing it started lingers in its group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc._bench_log.close()
    except Exception:
        pass
    with _children_lock:
        if proc in _children:
            _children.remove(proc)


def stop_all():
    with _children_lock:
        procs = list(_children)
    for proc in reversed(procs):
        try:
            stop(proc, grace=2.0)
        except Exception:
            pass


def _on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=1.0):
    """Status code of a GET, or None if it could not connect / timed out."""
    assert url.startswith("http://127.0.0.1:"), url
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, urllib.error.URLError):
        return None


def wait_until(what, check, proc, deadline_s, log_path):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; log: {log_path}")
        if check():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {deadline_s:.0f} s; log: {log_path}")


# --------------------------------------------------------------------------------------------
# The pieces: fake replicas, routers, replay, wrk.
# --------------------------------------------------------------------------------------------


class Env:
    """Paths of everything the run uses."""

    def __init__(self, args, workdir):
        self.prefixroute = Path(args.prefixroute)
        self.wasm = Path(args.plugin_wasm)
        self.envoy = Path(args.envoy)
        # Decode ms per output token on the sweep's and cache section's replicas; with
        # decode time the traces stream and TTFT is the first byte (see `make_trace`).
        self.decode_ms = getattr(args, "decode_ms", 0.0)
        # Our routers are told the replicas' lanes instead of learning them.
        self.prior_lanes_from_fleet = getattr(args, "prior_lanes_from_fleet", False)
        self.balance_factor = getattr(args, "balance_factor", None)
        self.venv_python = BENCH / ".venv" / "bin" / "python"
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.wrk = shutil.which("wrk")
        self.peers_available = {
            "sglang": self._has_module("sglang_router"),
            "vllm": self._has_module("vllm_router"),
        }

    def _has_module(self, module):
        if not self.venv_python.exists():
            return False
        r = subprocess.run([str(self.venv_python), "-c", f"import {module}"],
                           capture_output=True, timeout=60)
        return r.returncode == 0

    def log_path(self, name):
        return self.logs / f"{name}.log"


def ab_arguments(parser):
    """The options every A/B script takes: the CLI, Envoy and the plugin builds to compare."""
    parser.add_argument("--prefixroute",
                        default=str(ROOT / "target" / "release" / "prefixroute"))
    parser.add_argument("--envoy", default=str(ROOT / ".venv" / "bin" / "envoy"))
    parser.add_argument("--plugin-wasm", action="append", default=[],
                        help="NAME=PATH of a plugin build (repeat to compare; default: this "
                             "tree's)")


def ab_setup(args, tag):
    """What an A/B script (cpu_ab.py, startup.py) starts from: the `--plugin-wasm NAME=PATH`
    builds (default: this tree's) and an Env in a fresh work directory; wrk is required."""
    plugins = [tuple(s.split("=", 1)) for s in args.plugin_wasm] or [
        ("plugin", str(ROOT / "target" / "wasm32-wasip1" / "wasm" / "prefixroute_plugin.wasm"))]
    workdir = Path(tempfile.mkdtemp(prefix=f"prefixroute-{tag}-"))
    ns = argparse.Namespace(prefixroute=args.prefixroute, plugin_wasm=plugins[0][1],
                            envoy=args.envoy)
    env = Env(ns, workdir)
    if env.wrk is None:
        sys.exit(f"{tag}: wrk is not installed (bench/run.sh installs it)")
    return plugins, env


def our_router_flags(env, lanes):
    """The flags `serve` and `simulate` share that `--prior-lanes-from-fleet` and
    `--balance-factor` give our routers (`lanes`: the replicas')."""
    flags = []
    if env.prior_lanes_from_fleet:
        flags += ["--prior-lanes", lanes]
    if env.balance_factor is not None:
        flags += ["--balance-factor", env.balance_factor]
    return flags


class FakeReplica:
    def __init__(self, env, name, kv_blocks, lanes, overhead_ms, per_token_ms, tag, extra=()):
        self.name = name
        self.lanes = lanes
        log_path = env.log_path(f"{tag}-{name}")
        self.proc = spawn(
            [env.prefixroute, "fake-server", "--port", "0", "--name", name,
             "--kv-blocks", kv_blocks, "--block-size", BLOCK_SIZE, "--lanes", lanes,
             "--prefill-overhead-ms", overhead_ms, "--prefill-ms-per-token", per_token_ms,
             "--decode-ms-per-token", env.decode_ms, *extra],
            log_path, stderr_pipe=True)
        self.url = None
        lines = []
        deadline = time.monotonic() + 20
        # The start line is the first thing it prints; readline blocks only until then.
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline().decode(errors="replace")
            if not line:
                break
            lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            stop(self.proc)
            raise RuntimeError(f"fake-server {name} did not start: {''.join(lines)}")
        # Keep draining stderr into the log so the child never blocks on a full pipe.
        logf = self.proc._bench_log

        def drain(stream=self.proc.stderr):
            for chunk in iter(lambda: stream.readline(), b""):
                try:
                    logf.write(chunk)
                except ValueError:
                    break

        threading.Thread(target=drain, daemon=True).start()

    @property
    def hostport(self):
        return self.url[len("http://"):]


def start_fleet(env, n, kv_blocks, lanes, overhead_ms, per_token_ms, tag):
    fleet = []
    try:
        for i in range(n):
            fleet.append(FakeReplica(env, f"replica-{i}", kv_blocks, lanes, overhead_ms,
                                     per_token_ms, tag))
    except Exception:
        for r in fleet:
            stop(r.proc)
        raise
    return fleet


def plugin_counters(admin):
    """The plugin's own counters (`prefixroute.*`, without the per-endpoint gauges and
    `routed.*`) from the Envoy admin interface on port `admin`."""
    url = f"http://127.0.0.1:{admin}/stats?filter=prefixroute"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except (OSError, urllib.error.URLError):
        return {"error": "admin unreachable"}
    stats = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        name = name.strip()
        if name.startswith("wasmcustom.prefixroute.") and value.strip().isdigit() \
                and ".endpoint." not in name and ".routed." not in name:
            stats[name[len("wasmcustom."):]] = int(value)
    return stats


class Router:
    """One router process in front of a fleet; `url` is where clients send requests."""

    def __init__(self, env, kind, fleet, tag):
        self.kind = kind
        self.proc = None
        self.admin = None
        log_path = env.log_path(f"{tag}-{kind}")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        workers = [r.url for r in fleet]
        if kind == "direct":
            assert len(fleet) >= 1
            self.url = fleet[0].url
            return
        if kind in ("envoy-rr", "envoy-lr") or kind in PLUGIN:
            policy = {"envoy-rr": "round-robin", "envoy-lr": "least-request",
                      "latency-skip": "latency"}.get(kind, kind)
            admin = free_port()
            self.admin = admin
            argv = [env.prefixroute, "serve", "--policy", policy,
                    "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
                    "--envoy", env.envoy, "--plugin-wasm", env.wasm,
                    "--concurrency", ENVOY_CONCURRENCY]
            for r in fleet:
                argv += ["--endpoint", f"{r.name}=http://{r.hostport}"]
            if kind in PLUGIN:
                argv += our_router_flags(env, fleet[0].lanes)
            if kind == "latency-skip":
                # Characters outside ASCII skipped, as llm-d-inference-sim's tokenizer does
                # (and the router did before `non_ascii`); the fake servers count them.
                argv += ["--non-ascii", "skip"]
            self.proc = spawn(argv, log_path)
            wait_until(f"Envoy ({kind})",
                       lambda: http_get(f"http://127.0.0.1:{admin}/ready") == 200,
                       self.proc, 30, log_path)
        elif kind in ("sglang", "vllm"):
            prom = free_port()
            if kind == "sglang":
                argv = [env.venv_python, "-m", "sglang_router.launch_router",
                        "--log-level", "warn"]
            else:
                argv = [env.venv_python, "-m", "vllm_router.launch_router",
                        "--log-level", "warning"]
            argv += ["--worker-urls", *workers, "--policy", "cache_aware",
                     "--host", "127.0.0.1", "--port", port,
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", prom]
            self.proc = spawn(argv, log_path)
        else:
            raise ValueError(kind)
        # Ready = a GET through the router reaches a replica (touches no cache).
        wait_until(f"router {kind}", lambda: http_get(f"{self.url}/v1/models") == 200,
                   self.proc, 60, log_path)
        if kind in PLUGIN:
            # As `prefixroute compare` does: let the first scrapes land (default interval 1 s).
            time.sleep(2.1)

    def plugin_stats(self):
        """The plugin's own counters (prefixroute.*) from Envoy's admin, or {} for other
        routers. Fallbacks other than not_routable mean a request was not routed by prefix."""
        if self.kind not in PLUGIN or self.admin is None:
            return {}
        return plugin_counters(self.admin)

    def close(self):
        if self.proc is not None:
            stop(self.proc)


def make_trace(env, spec, requests, path):
    argv = [env.prefixroute, "trace", "-o", path]
    for key, value in spec.items():
        if key == "requests":
            value = requests
        argv += [f"--{key}", value]
    if env.decode_ms:
        # Streamed answers: the replay times each first token apart from its decoding.
        argv.append("--stream")
    subprocess.run([str(a) for a in argv], check=True, capture_output=True, timeout=60)


def replay(env, trace, url, fleet, timeout_s, tag):
    """One replay; every request's line (where it went, its latency, the plugin's explanation
    headers) is kept in the run's logs as `<tag>.requests.jsonl`."""
    argv = [env.prefixroute, "replay", trace, "--url", url, "--json", "--no-progress",
            "--timeout-s", 60, "--requests-out", env.logs / f"{tag}.requests.jsonl"]
    for r in fleet:
        argv += ["--metrics", f"{r.name}={r.url}"]
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                       timeout=timeout_s)
    if r.returncode != 0 and not r.stdout.strip().startswith("{"):
        raise RuntimeError(f"replay failed ({r.returncode}): {r.stderr.strip()}")
    return json.loads(r.stdout)


def percentile(values, p):
    """The value below which a share `p` of `values` lie (nearest rank), or None."""
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))] if values else None


def besides_prefill(requests_path, per_token_ms):
    """Each answered request's TTFT less its uncached tokens × the prefill cost, ms: what the
    gateway, the connections, the replica's fixed overhead and any queue added to it. Two
    routers that send the same misses differ here by their own time and their queues."""
    out = []
    with open(requests_path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("error") is None and r.get("ttft_ms") is not None:
                uncached = r["prompt_tokens"] - r["cached_tokens"]
                out.append(r["ttft_ms"] - uncached * per_token_ms)
    return out


def max_over_mean(counts):
    mean = sum(counts) / len(counts) if counts else 0
    return max(counts) / mean if mean > 0 else None


def summarize_replay(summary, fleet_names, streamed=False):
    """A replay's report as one table row. TTFT is the replay's latency (the last byte of an
    answer sent whole, which without decode time is its first token), or with `streamed`
    traces the first byte of the stream (`ttft_ms`)."""
    counts = [summary["endpoints"].get(n, 0) for n in fleet_names]
    sc = summary.get("server_counters") or {}
    g = summary["groups_on_one_endpoint"]
    ttft = summary["ttft_ms"] if streamed else summary["latency_ms"]
    return {
        "requests": summary["requests"],
        "errors": summary["errors"],
        "errors_by_kind": summary["errors_by_kind"],
        "hit_rate": sc.get("hit_rate"),
        "settled": sc.get("settled"),
        "p50_ms": ttft["p50"],
        "p95_ms": ttft["p95"],
        "max_ms": ttft["max"],
        "latency_p95_ms": summary["latency_ms"]["p95"],
        "per_replica": counts,
        "unknown_endpoint": summary["endpoints"].get("unknown", 0),
        "max_mean": max_over_mean(counts) if len(counts) > 1 else None,
        "groups_on_one": [g["single"], g["groups"]],
        "max_send_lag_ms": summary["max_send_lag_ms"],
        "prompt_tokens": summary["usage"]["prompt_tokens"],
    }


# --------------------------------------------------------------------------------------------
# Section: cache effect.
# --------------------------------------------------------------------------------------------


def run_one(env, kind, sc, trace, requests, per_token_ms, tag):
    """One router (or the upper bound) in front of fresh replicas, one replay of `trace`."""
    span = requests / max(sc["trace"]["rate"], 1e-9)
    budget = span * 3 + 180
    overhead = sc.get("prefill_overhead_ms", 5)
    if kind == "upper":
        fleet = start_fleet(env, 1, UPPER_BOUND_BLOCKS, sc["lanes"] * sc["replicas"], overhead,
                            per_token_ms, f"{tag}-upper")
    else:
        fleet = start_fleet(env, sc["replicas"], sc["kv_blocks"], sc["lanes"], overhead,
                            per_token_ms, f"{tag}-{kind}")
    router = None
    try:
        router = Router(env, "direct" if kind == "upper" else kind, fleet, tag)
        t0 = time.monotonic()
        summary = replay(env, trace, router.url, fleet, budget, f"{tag}-{kind}")
        row = summarize_replay(summary, [r.name for r in fleet], bool(env.decode_ms))
        row["wall_s"] = time.monotonic() - t0
        row["plugin_stats"] = router.plugin_stats()
        extra = besides_prefill(env.logs / f"{tag}-{kind}.requests.jsonl", float(per_token_ms))
        row["besides_prefill_p50_ms"] = percentile(extra, 0.5)
        row["besides_prefill_p95_ms"] = percentile(extra, 0.95)
        return row
    finally:
        if router is not None:
            router.close()
        for r in fleet:
            stop(r.proc)


def run_sweep(env, scenarios, routers, costs, quick):
    """Every scenario at every prefill cost through every router and the upper bound."""
    results = {}
    for key, sc in scenarios.items():
        requests = sc["quick_requests"] if quick else sc["trace"]["requests"]
        trace = env.workdir / f"sweep-{key}.jsonl"
        make_trace(env, sc["trace"], requests, trace)
        results[key] = {"title": sc["title"], "scenario": sc, "requests": requests,
                        "decode_ms": env.decode_ms,
                        "prior_lanes_from_fleet": env.prior_lanes_from_fleet,
                        "balance_factor": env.balance_factor, "costs": {}}
        for cost in costs:
            rows = {}
            for kind in routers + ["upper"]:
                if kind in ("sglang", "vllm") and not env.peers_available[kind]:
                    continue
                row = run_one(env, kind, sc, trace, requests, cost, f"sweep-{key}-{cost}")
                rows[kind] = row
                log(f"sweep/{key}@{cost}: {kind:<9} hit {fmt_pct(row['hit_rate'])}  "
                    f"p95 {fmt_ms(row['p95_ms'])}  max/mean {fmt_ratio(row['max_mean'])}  "
                    f"errors {row['errors']}")
            results[key]["costs"][str(cost)] = rows
    return results


def run_sim_sweep(env, scenarios, costs):
    """The sweep's grid through `prefixroute simulate` (deterministic, every policy): the same
    traces, fleets and costs, without Envoy, processes or clocks."""
    results = {}
    for key, sc in scenarios.items():
        trace = env.workdir / f"sim-{key}.jsonl"
        make_trace(env, sc["trace"], sc["trace"]["requests"], trace)
        results[key] = {"title": sc["title"], "scenario": sc, "costs": {}}
        for cost in costs:
            argv = [env.prefixroute, "simulate", trace, "--json", "--replicas", sc["replicas"],
                    "--cache-blocks", sc["kv_blocks"], "--slots", sc["lanes"],
                    "--block-size", BLOCK_SIZE, "--decode-ms-per-token", env.decode_ms,
                    "--prefill-ms-per-token", cost]
            argv += our_router_flags(env, sc["lanes"])
            r = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                               timeout=600, check=True)
            results[key]["costs"][str(cost)] = json.loads(r.stdout)
        log(f"sim-sweep/{key}: done")
    return results


def report_sim_sweep(sim):
    lines = []
    for key, res in sim.items():
        costs = list(res["costs"])
        lines.append(f"#### {key}: {res['title']}")
        lines.append("")
        lines.append("| policy |" + "".join(f" hit (of bound) @{c} | p95 @{c} | max/mean @{c} |"
                                          for c in costs))
        lines.append("|---|" + "---:|---:|---:|" * len(costs))
        policies = [p["policy"] for p in res["costs"][costs[0]]["policies"]]
        for i, policy in enumerate(policies + ["upper bound"]):
            cells = []
            for c in costs:
                out = res["costs"][c]
                bound = out["upper_bound"]
                row = bound if policy == "upper bound" else out["policies"][i]
                share = (f" ({row['hit_rate'] / bound['hit_rate'] * 100:.0f}%)"
                         if bound["hit_rate"] and policy != "upper bound" else "")
                counts = row["requests_per_replica"]
                mean = sum(counts) / len(counts) if counts else 0
                mm = "-" if policy == "upper bound" or not mean else f"{max(counts) / mean:.2f}x"
                cells.append(f" {fmt_pct(row['hit_rate'])}{share} | "
                             f"{fmt_ms(row['ttft_p95_ms'], 0)} | {mm} |")
            lines.append(f"| {policy} |" + "".join(cells))
        lines.append("")
    return "\n".join(lines)


def sweep_targets(sweep):
    """The latency policy's targets per scenario and cost (see SWEEP_SCENARIOS)."""
    out = []
    for key, res in sweep.items():
        sc = res["scenario"]
        for cost, rows in res["costs"].items():
            ours, upper = rows.get("latency"), rows.get("upper")
            if not ours or not upper:
                continue
            peers = {k: r for k, r in rows.items() if k in PEERS}
            e = {"scenario": key, "cost": cost, "hit": ours["hit_rate"],
                 "upper": upper["hit_rate"], "p95": ours["p95_ms"],
                 "max_mean": ours["max_mean"]}
            if peers:
                best = min(peers, key=lambda k: peers[k]["p95_ms"])
                e["best_peer_p95"] = (best, peers[best]["p95_ms"])
                e["ok_p95"] = ours["p95_ms"] <= peers[best]["p95_ms"]
            if sc["shared"]:
                e["ok_upper"] = (ours["hit_rate"] or 0) >= 0.95 * (upper["hit_rate"] or 0)
                if "sglang" in rows:
                    e["sglang_hit"] = rows["sglang"]["hit_rate"]
                    e["ok_sglang"] = (ours["hit_rate"] or 0) >= (rows["sglang"]["hit_rate"] or 0)
            elif "envoy-lr" in rows:
                lr = rows["envoy-lr"]["p95_ms"]
                e["lr_p95"] = lr
                e["ok_lr"] = ours["p95_ms"] <= 1.1 * lr
            if sc["splittable"] and ours["max_mean"] is not None:
                e["ok_max_mean"] = ours["max_mean"] <= 1.3
            out.append(e)
    return out


def decode_text(decode_ms):
    if not decode_ms:
        return "no decode time"
    return (f"{decode_ms:g} ms of decode per output token (streamed answers; TTFT is "
            "the first byte)")


def report_sweep(sweep):
    lines = []
    for key, res in sweep.items():
        sc = res["scenario"]
        costs = list(res["costs"])
        lines.append(f"#### {key}: {res['title']}")
        lines.append("")
        lines.append(f"Trace: `prefixroute trace {trace_flags(sc['trace'], res['requests'])}`. "
                     f"Replicas: {sc['replicas']} fake servers, {sc['kv_blocks']} blocks x "
                     f"{BLOCK_SIZE} tokens of cache, {sc['lanes']} lanes, prefill 5 ms + the cost "
                     f"below per uncached token, {decode_text(res.get('decode_ms', 0))}."
                     + (" Our routers are told the replicas' lanes (`--prior-lanes`)."
                        if res.get("prior_lanes_from_fleet") else "")
                     + (f" Our routers' `latency.balance_factor`: {res['balance_factor']:g}."
                        if res.get("balance_factor") is not None else ""))
        lines.append("")
        head = "| router |" + "".join(f" hit @{c} | p95 @{c} | max/mean @{c} |" for c in costs)
        lines.append(head + " besides prefill p50 / p95 @" + costs[-1] + " |")
        lines.append("|---|" + "---:|---:|---:|" * len(costs) + "---:|")
        kinds = [k for k in list(res["costs"][costs[0]]) if k != "upper"] + ["upper"]
        for kind in kinds:
            cells = []
            for c in costs:
                row = res["costs"][c].get(kind)
                if row is None:
                    cells.append(" - | - | - |")
                    continue
                mm = "-" if kind == "upper" else fmt_ratio(row["max_mean"])
                cells.append(f" {fmt_pct(row['hit_rate'])} | {fmt_ms(row['p95_ms'])} | {mm} |")
            last = res["costs"][costs[-1]].get(kind) or {}
            p50, p95 = last.get("besides_prefill_p50_ms"), last.get("besides_prefill_p95_ms")
            cells.append(f" {fmt_ms(p50, 2)} / {fmt_ms(p95, 2)} |" if p50 is not None else " - |")
            name = LABEL[kind] + (" (ours)" if kind in OURS else "")
            lines.append(f"| {name} |" + "".join(cells))
        lines.append("")
    lines.append("\"Besides prefill\": each request's TTFT less its uncached tokens × the cost "
                 "(the replica's 5 ms, the gateway's own time, any queue), at the last cost; "
                 "`bench/gateway_time.py` takes the gateway's part apart.")
    lines.append("")
    return "\n".join(lines)


def report_sweep_targets(entries):
    lines = ["| trace | cost (ms/token) | latency hit | / upper bound (≥ 0.95) | vs sglang-router "
             "hit | TTFT p95 | best peer p95 | max/mean (≤ 1.3 if splittable) |",
             "|---|---:|---:|---|---|---:|---|---|"]
    for e in entries:
        share = (e["hit"] / e["upper"]) if e.get("upper") else None
        upper = f"{fmt_ratio(share)} {verdict(e['ok_upper'])}" if "ok_upper" in e else "-"
        sg = (f"{fmt_pct(e['sglang_hit'])} {verdict(e['ok_sglang'])}"
              if "ok_sglang" in e else "-")
        if "ok_lr" in e:
            peer = f"LEAST_REQUEST {fmt_ms(e['lr_p95'])} (≤ 1.1×) {verdict(e['ok_lr'])}"
        elif "best_peer_p95" in e:
            name, p95 = e["best_peer_p95"]
            peer = f"{LABEL[name]} {fmt_ms(p95)} {verdict(e['ok_p95'])}"
        else:
            peer = "-"
        mm = (f"{fmt_ratio(e['max_mean'])} {verdict(e['ok_max_mean'])}"
              if "ok_max_mean" in e else fmt_ratio(e["max_mean"]))
        lines.append(f"| {e['scenario']} | {e['cost']} | {fmt_pct(e['hit'])} | {upper} | {sg} | "
                     f"{fmt_ms(e['p95'])} | {peer} | {mm} |")
    return "\n".join(lines)


def run_cache(env, scenarios, routers, quick):
    results = {}
    for key, sc in scenarios.items():
        requests = sc["quick_requests"] if quick else sc["trace"]["requests"]
        trace = env.workdir / f"trace-{key}.jsonl"
        make_trace(env, sc["trace"], requests, trace)
        span = requests / max(sc["trace"]["rate"], 1e-9)
        budget = span * 3 + 180
        rows = {}
        log(f"cache/{key}: {requests} requests over ~{span:.0f} s, "
            f"{sc['replicas']} replicas x {sc['kv_blocks']} blocks")
        for kind in routers + ["upper"]:
            if kind in ("sglang", "vllm") and not env.peers_available[kind]:
                log(f"cache/{key}: {kind} not installed, skipped")
                continue
            tag = f"cache-{key}"
            if kind == "upper":
                fleet = start_fleet(env, 1, UPPER_BOUND_BLOCKS, sc["lanes"] * sc["replicas"],
                                    sc["prefill_overhead_ms"], sc["prefill_ms_per_token"],
                                    f"{tag}-upper")
            else:
                fleet = start_fleet(env, sc["replicas"], sc["kv_blocks"], sc["lanes"],
                                    sc["prefill_overhead_ms"], sc["prefill_ms_per_token"],
                                    f"{tag}-{kind}")
            router = None
            try:
                router = Router(env, "direct" if kind == "upper" else kind, fleet, tag)
                t0 = time.monotonic()
                summary = replay(env, trace, router.url, fleet, budget, f"{tag}-{kind}")
                row = summarize_replay(summary, [r.name for r in fleet], bool(env.decode_ms))
                row["wall_s"] = time.monotonic() - t0
                row["plugin_stats"] = router.plugin_stats()
                rows[kind] = row
                hit = row["hit_rate"]
                log(f"cache/{key}: {kind:<12} hit {fmt_pct(hit)}  p50 {fmt_ms(row['p50_ms'])}"
                    f"  p95 {fmt_ms(row['p95_ms'])}  errors {row['errors']}  "
                    f"per replica {row['per_replica']}")
            finally:
                if router is not None:
                    router.close()
                for r in fleet:
                    stop(r.proc)
        results[key] = {"title": sc["title"], "scenario": sc, "requests": requests,
                        "decode_ms": env.decode_ms, "rows": rows}
    return results


# --------------------------------------------------------------------------------------------
# Section: cost per request.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bodies:
    """What the cost bodies (bench/chat.lua) are like besides their size and warmth.

    `line_words`: a line break (`\\n` in the JSON) every that many words of the prompts; 0,
    none. `completions`: the prompts as completions bodies to /v1/completions. `questions`:
    distinct questions per tenant of the warm bodies (4: the same 64 bodies cycle, each met
    again and again; hundreds: a known system prompt or document with a question not met
    lately, which is what a completions prompt, one string, meets in practice). `text_parts`:
    each chat content a list of one text part (`[{"type": "text", "text": ...}]`)."""
    line_words: int = 0
    completions: bool = False
    questions: int = 4
    text_parts: bool = False

    @classmethod
    def from_args(cls, args):
        if args.completions and args.text_parts:
            sys.exit("--text-parts is a chat's content; it does not go with --completions")
        return cls(args.line_words, args.completions, args.questions, args.text_parts)

    def path(self):
        return "/v1/completions" if self.completions else "/v1/chat/completions"

    def env(self):
        return {"LINE_WORDS": str(self.line_words), "COMPLETIONS": "1" if self.completions else "0",
                "QUESTIONS": str(self.questions), "TEXT_PARTS": "1" if self.text_parts else "0"}

    def describe(self):
        """A sentence for the reports (empty for the default bodies)."""
        parts = []
        if self.line_words:
            parts.append(f" Prompts broken into lines of {self.line_words} words (a `\\n` "
                         f"escape each).")
        if self.completions:
            parts.append(" Completions bodies (`prompt`: the system prompt and the question) to "
                         "/v1/completions.")
        if self.text_parts:
            parts.append(" Every content a list of one text part.")
        if self.questions != 4:
            parts.append(f" Warm bodies: {self.questions} questions per tenant.")
        return "".join(parts)


def add_bodies_arguments(p):
    """The command-line options of [`Bodies`]."""
    p.add_argument("--line-words", type=int, default=0,
                   help="prompts broken into lines of this many words (a JSON `\\n` escape "
                        "each, as in most real prompts); 0 (default): one line")
    p.add_argument("--completions", action="store_true",
                   help="the prompts as completions bodies (`prompt`) to /v1/completions")
    p.add_argument("--text-parts", action="store_true",
                   help="every chat content as a list of one text part "
                        "(`[{\"type\": \"text\", \"text\": ...}]`)")
    p.add_argument("--questions", type=int, default=4,
                   help="distinct questions per tenant of the warm bodies (default 4: 64 bodies "
                        "that cycle; e.g. 512: a known prefix with a question not met lately)")


def wrk_run(env, url, body_bytes, connections, duration_s, warmth="warm", bodies=Bodies()):
    """One wrk run of bench/chat.lua's bodies (see [`Bodies`])."""
    argv = [env.wrk, "-t1", f"-c{connections}", f"-d{duration_s}s", "--timeout", "5s",
            "-s", BENCH / "chat.lua", f"{url}{bodies.path()}"]
    e = dict(os.environ, BODY_BYTES=str(body_bytes), COLD="1" if warmth == "cold" else "0",
             **bodies.env())
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=e,
                       timeout=duration_s + 60)
    line = next((l for l in r.stdout.splitlines() if l.startswith("WRK_JSON ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({r.returncode}): {r.stdout[-500:]} {r.stderr[-500:]}")
    data = json.loads(line[len("WRK_JSON "):])
    errors = sum(data["errors"].values())
    return {
        "requests": data["requests"],
        "rps": data["requests"] / (data["duration_us"] / 1e6),
        "errors": errors,
        "error_detail": data["errors"],
        "p50_ms": data["latency_us"]["p50"] / 1000,
        "p99_ms": data["latency_us"]["p99"] / 1000,
        "mean_ms": data["latency_us"]["mean"] / 1000,
    }


def cost_key(size, warmth):
    return f"{size // 1024}KB-{warmth}"


def run_cost(env, systems, sizes, duration_s, connections, rounds, warmths=("warm",),
             bodies=Bodies()):
    """For each size and warmth, each system: a 1-connection run (unloaded latency) and a
    `connections`-connection run (throughput). Rounds alternate the order of the systems so
    that drift in the machine's load does not always favour the same one; the median of the
    rounds is reported. Keys: `cost_key(size, warmth)`."""
    results = {}
    backends = start_fleet(env, 4, 4096, 4096, 0, 0, "cost")
    try:
        for size in sizes:
            for warmth in warmths:
                key = cost_key(size, warmth)
                per_system = {s: [] for s in systems}
                for rnd in range(rounds):
                    order = systems if rnd % 2 == 0 else list(reversed(systems))
                    for kind in order:
                        if kind in ("sglang", "vllm") and not env.peers_available[kind]:
                            continue
                        router = Router(env, kind, backends, f"cost-{key}")
                        try:
                            # warm-up
                            wrk_run(env, router.url, size, connections, 1, warmth, bodies)
                            lat = wrk_run(env, router.url, size, 1, duration_s, warmth,
                                          bodies)
                            thr = wrk_run(env, router.url, size, connections, duration_s,
                                          warmth, bodies)
                            stats = router.plugin_stats()
                        finally:
                            router.close()
                        per_system[kind].append({"unloaded": lat, "loaded": thr,
                                                 "plugin_stats": stats})
                        log(f"cost/{key}/{kind:<9} round {rnd + 1}: "
                            f"p50 {lat['p50_ms']:.3f} ms p99 {lat['p99_ms']:.3f} ms, "
                            f"{thr['rps']:.0f} req/s (errors {lat['errors'] + thr['errors']})")
                results[key] = {"size": size, "warmth": warmth,
                                "systems": {k: median_run(v) for k, v in per_system.items()
                                            if v}}
    finally:
        for r in backends:
            stop(r.proc)
    return results


def median_run(runs):
    def med(values):
        values = sorted(values)
        return values[len(values) // 2] if len(values) % 2 else \
            (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2

    out = {"rounds": runs, "plugin_stats": [r.get("plugin_stats", {}) for r in runs]}
    for phase in ("unloaded", "loaded"):
        out[phase] = {k: med([r[phase][k] for r in runs])
                      for k in ("rps", "p50_ms", "p99_ms", "mean_ms")}
        out[phase]["errors"] = sum(r[phase]["errors"] for r in runs)
        out[phase]["requests"] = sum(r[phase]["requests"] for r in runs)
    return out


# --------------------------------------------------------------------------------------------
# Section: scale.
# --------------------------------------------------------------------------------------------


def run_scale(quick):
    argv = ["cargo", "bench", "--manifest-path", ROOT / "Cargo.toml", "-p", "prefixroute-core",
            "--bench", "routing", "--", "--noplot"]
    if quick:
        argv += ["--warm-up-time", "1", "--measurement-time", "2"]
    log("scale: cargo bench -p prefixroute-core --bench routing (compiles first)")
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"cargo bench failed: {r.stderr[-2000:]}")
    benches = parse_criterion(r.stdout)
    log("scale: cargo run --release -p prefixroute-core --example index_memory")
    m = subprocess.run(["cargo", "run", "--quiet", "--release", "--manifest-path",
                        str(ROOT / "Cargo.toml"), "-p", "prefixroute-core", "--example",
                        "index_memory"], capture_output=True, text=True, timeout=900)
    if m.returncode != 0:
        raise RuntimeError(f"index_memory failed: {m.stderr[-2000:]}")
    per_entry = re.search(r"=\s*([\d.]+) B per block-endpoint entry", m.stdout)
    return {"criterion": benches, "index_memory_output": m.stdout.strip(),
            "bytes_per_entry": float(per_entry.group(1)) if per_entry else None}


def parse_criterion(text):
    """Criterion's text output -> [{name, time: [lo, mid, hi] with units, thrpt: ...}].
    The "change:" block after a result (comparison with a saved baseline) is skipped."""
    out = []
    pending = None
    current = None
    in_change = False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("change:"):
            in_change = True
            continue
        if "time:" in line:
            prefix = line.split("time:")[0].strip()
            if prefix:
                pending, in_change = prefix, False
            elif in_change:
                continue
            m = re.search(r"time:\s+\[([^\]]+)\]", line)
            current = {"name": pending, "time": m.group(1).split() if m else None,
                       "thrpt": None}
            out.append(current)
        elif "thrpt:" in line:
            if not in_change and current is not None:
                m = re.search(r"thrpt:\s+\[([^\]]+)\]", line)
                current["thrpt"] = m.group(1).split() if m else None
        elif s and not line.startswith(" ") and not s.startswith(("Found ", "Benchmarking",
                                                                   "WARNING", "Gnuplot")):
            pending, in_change = s, False
    return out


# --------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------


def fmt_pct(v):
    return "-" if v is None else f"{v * 100:.1f}%"


def fmt_ms(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f} ms"


def fmt_ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def verdict(ok):
    return "meets" if ok else "**MISSES**"


def trace_flags(trace, requests):
    return " ".join(f"--{k} {requests if k == 'requests' else v}" for k, v in trace.items())


def report_cache(cache):
    lines = []
    for key, res in cache.items():
        rows = res["rows"]
        sc = res["scenario"]
        lines.append(f"### {res['title']}")
        lines.append("")
        t = sc["trace"]
        flags = " ".join(f"--{k} {res['requests'] if k == 'requests' else v}"
                         for k, v in t.items())
        lines.append(f"Trace: `prefixroute trace {flags}`. Replicas: {sc['replicas']} fake "
                     f"servers, {sc['kv_blocks']} blocks x {BLOCK_SIZE} tokens of cache, "
                     f"{sc['lanes']} lanes, prefill {sc['prefill_overhead_ms']} ms + "
                     f"{sc['prefill_ms_per_token']} ms per uncached token, "
                     f"{decode_text(res.get('decode_ms', 0))}.")
        lines.append("")
        lines.append("| router | hit rate | TTFT p50 | TTFT p95 | max/mean | groups on one "
                     "| requests per replica | errors |")
        lines.append("|---|---:|---:|---:|---:|---:|---|---:|")
        for kind, row in rows.items():
            g = row["groups_on_one"]
            name = LABEL[kind] + (" (ours)" if kind in OURS else "")
            per = " ".join(str(c) for c in row["per_replica"]) if kind != "upper" else "-"
            mm = "-" if row["max_mean"] is None else f"{row['max_mean']:.2f}"
            note = "" if row["settled"] else " (counters unsettled)"
            lines.append(f"| {name} | {fmt_pct(row['hit_rate'])}{note} | {fmt_ms(row['p50_ms'])} "
                         f"| {fmt_ms(row['p95_ms'])} | {mm} | "
                         f"{g[0]}/{g[1] if kind != 'upper' else g[1]} | {per} | {row['errors']} |")
        lines.append("")
    return "\n".join(lines)


def cache_targets(cache):
    """Per scenario: our default policy (latency, else prefix) vs the best peer, vs the upper
    bound, and its max/mean."""
    out = []
    for key, res in cache.items():
        rows = res["rows"]
        policy = "latency" if "latency" in rows else "prefix"
        ours = rows.get(policy)
        if ours is None or ours["hit_rate"] is None:
            continue
        peers = {k: v for k, v in rows.items()
                 if k not in OURS and k != "upper" and v["hit_rate"] is not None}
        best_kind = max(peers, key=lambda k: peers[k]["hit_rate"]) if peers else None
        upper = rows.get("upper", {}).get("hit_rate")
        entry = {"scenario": key, "policy": policy, "ours_hit": ours["hit_rate"],
                 "best_peer": best_kind,
                 "best_peer_hit": peers[best_kind]["hit_rate"] if best_kind else None,
                 "upper": upper, "max_mean": ours["max_mean"],
                 "p95_ms": ours["p95_ms"],
                 "best_peer_p95_ms": peers[best_kind]["p95_ms"] if best_kind else None}
        entry["ok_vs_peer"] = best_kind is None or ours["hit_rate"] >= entry["best_peer_hit"]
        entry["ok_vs_upper"] = upper is not None and ours["hit_rate"] >= 0.95 * upper
        entry["ok_max_mean"] = ours["max_mean"] is not None and ours["max_mean"] <= 1.3
        out.append(entry)
    return out


def report_cache_targets(entries):
    lines = ["| trace | policy | hit | best peer (hit) | vs best peer | upper bound | "
             "hit / bound | max/mean ≤ 1.3 |", "|---|---|---:|---|---|---:|---:|---|"]
    for e in entries:
        peer = "-" if e["best_peer"] is None else \
            f"{LABEL[e['best_peer']]} ({fmt_pct(e['best_peer_hit'])})"
        ratio = "-" if not e["upper"] else f"{e['ours_hit'] / e['upper'] * 100:.1f}%"
        max_mean = "-" if e["max_mean"] is None else f"{e['max_mean']:.2f}"
        lines.append(
            f"| {e['scenario']} | {e['policy']} | {fmt_pct(e['ours_hit'])} | {peer} | "
            f"{verdict(e['ok_vs_peer'])} "
            f"| {fmt_pct(e['upper'])} | {ratio} {verdict(e['ok_vs_upper'])} | "
            f"{max_mean} {verdict(e['ok_max_mean'])} |")
    return "\n".join(lines)


def report_cost(cost, duration_s, connections, rounds, bodies=Bodies()):
    lines = [f"wrk -t1, {duration_s} s per run, median of {rounds} round(s); unloaded = 1 "
             f"connection (closed loop), loaded = {connections} connections. Envoy "
             f"--concurrency {ENVOY_CONCURRENCY}. Ratios are to Envoy ROUND_ROBIN in the same "
             f"run; added = minus Envoy RR. Warm: bodies cycle through 16 tenants x 4 "
             f"questions; cold: a unique first line per request, so no block ever matches."
             f"{bodies.describe()}",
             ""]
    for cell in cost.values():
        systems = cell["systems"]
        base = systems.get("envoy-rr")
        lines.append(f"#### {cell['size'] // 1024} KB bodies, {cell['warmth']}")
        lines.append("")
        lines.append("| system | p50 | p99 | added p50 | added p99 | max req/s | vs RR "
                     "| loaded p50 | loaded p99 | errors |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for kind, m in systems.items():
            u, l = m["unloaded"], m["loaded"]
            if base:
                bu, bl = base["unloaded"], base["loaded"]
                add50 = f"{u['p50_ms'] - bu['p50_ms']:+.3f} ms"
                add99 = f"{u['p99_ms'] - bu['p99_ms']:+.3f} ms"
                rr = fmt_ratio(l["rps"] / bl["rps"]) if bl["rps"] else "-"
            else:
                add50 = add99 = rr = "-"
            lines.append(f"| {LABEL[kind]} | {u['p50_ms']:.3f} ms | {u['p99_ms']:.3f} ms | "
                         f"{add50} | {add99} | {l['rps']:.0f} | {rr} | {l['p50_ms']:.2f} ms | "
                         f"{l['p99_ms']:.2f} ms | {u['errors'] + l['errors']} |")
        lines.append("")
    return "\n".join(lines)


# Throughput floors vs Envoy RR (issue 12), by (size, warmth); cells not listed have none.
THROUGHPUT_FLOORS = {(8192, "warm"): 0.85, (8192, "cold"): 0.75,
                     (65536, "warm"): 0.6, (65536, "cold"): 0.6}


def cost_targets(cost):
    out = []
    for cell in cost.values():
        systems = cell["systems"]
        base = systems.get("envoy-rr")
        ours = systems.get("latency") or systems.get("prefix")
        if not base or not ours:
            continue
        size, warmth = cell["size"], cell["warmth"]
        ratio = (ours["loaded"]["rps"] / base["loaded"]["rps"]) if base["loaded"]["rps"] \
            else None
        sglang = systems.get("sglang")
        sglang_ratio = (sglang["loaded"]["rps"] / base["loaded"]["rps"]) \
            if sglang and base["loaded"]["rps"] else None
        floor = THROUGHPUT_FLOORS.get((size, warmth))
        e = {"size": size, "warmth": warmth,
             "throughput_ratio_rounds": round_ratios(ours, base),
             "sglang_ratio_rounds": round_ratios(sglang, base) if sglang else [],
             "added_p50_ms": ours["unloaded"]["p50_ms"] - base["unloaded"]["p50_ms"],
             "added_p99_ms": ours["unloaded"]["p99_ms"] - base["unloaded"]["p99_ms"],
             "throughput_ratio": ratio, "floor": floor, "sglang_ratio": sglang_ratio}
        e["ok_p50"] = e["added_p50_ms"] <= 0.1 if size == 8192 else None
        e["ok_throughput"] = None if floor is None else (ratio is not None and ratio >= floor)
        e["ok_vs_sglang"] = None if sglang_ratio is None else \
            (ratio is not None and ratio > sglang_ratio)
        out.append(e)
    return out


def round_ratios(system, base):
    """Loaded req/s over Envoy RR's, round by round (rounds ran close in time, in alternating
    order): the spread a single cell's verdict carries on a busy 2-core machine."""
    pairs = zip(system.get("rounds", []), base.get("rounds", []))
    return [r["loaded"]["rps"] / b["loaded"]["rps"] for r, b in pairs if b["loaded"]["rps"]]


def fmt_ratio_spread(ratio, rounds):
    """`0.79x (0.76-0.83)`: the median ratio, then the lowest and highest round's."""
    text = fmt_ratio(ratio)
    if len(rounds) > 1:
        text += f" ({min(rounds):.2f}–{max(rounds):.2f})"
    return text


def report_cost_targets(entries):
    lines = ["| body | added p50 (≤ 0.1 ms at 8 KB) | added p99 | throughput vs RR (rounds' range) | "
             "sglang-router vs RR (we must be ahead) |", "|---|---|---:|---|---|"]
    for e in entries:
        p50 = f"{e['added_p50_ms']:+.3f} ms" + \
            (f" {verdict(e['ok_p50'])}" if e["ok_p50"] is not None else "")
        thr = fmt_ratio_spread(e["throughput_ratio"], e.get("throughput_ratio_rounds", []))
        if e["floor"] is not None:
            thr += f", floor {e['floor']:.2f}x {verdict(e['ok_throughput'])}"
        sg = "-" if e["sglang_ratio"] is None else \
            f"{fmt_ratio_spread(e['sglang_ratio'], e.get('sglang_ratio_rounds', []))} " \
            f"{verdict(e['ok_vs_sglang'])}"
        lines.append(f"| {e['size'] // 1024} KB {e['warmth']} | {p50} | "
                     f"{e['added_p99_ms']:+.3f} ms | {thr} | {sg} |")
    return "\n".join(lines)


def report_scale(scale):
    lines = ["| bench | time (median of criterion's estimate) | throughput |", "|---|---:|---:|"]
    for b in scale["criterion"]:
        t = " ".join(b["time"][2:4]) if b["time"] else "-"
        thr = " ".join(b["thrpt"][2:4]) if b["thrpt"] else "-"
        lines.append(f"| {b['name']} | {t} | {thr} |")
    lines.append("")
    lines.append("Index memory (`cargo run --release -p prefixroute-core --example "
                 "index_memory`):")
    lines.append("")
    lines.append("```")
    lines.append(scale["index_memory_output"])
    lines.append("```")
    return "\n".join(lines)


def versions(env):
    def run(argv):
        try:
            r = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                               timeout=30)
            return (r.stdout + r.stderr).strip()
        except Exception as e:  # noqa: BLE001 - a missing tool is reported, not fatal
            return f"unavailable ({e})"

    v = {
        "prefixroute": run([env.prefixroute, "--version"]),
        "git": run(["git", "-C", ROOT, "describe", "--always", "--dirty"]),
        "envoy": re.sub(r".*version: ", "", run([env.envoy, "--version"])),
        "wrk": run([env.wrk, "--version"]).splitlines()[0] if env.wrk else "not installed",
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "plugin_wasm_bytes": env.wasm.stat().st_size if env.wasm.exists() else None,
    }
    if env.venv_python.exists():
        for dist in ("sglang-router", "vllm-router"):
            # One line either way: a version, or that the package is not in the venv (a
            # traceback in the report's header says nothing more).
            v[dist] = run([env.venv_python, "-c",
                           "import importlib.metadata as m\n"
                           f"try: print(m.version('{dist}'))\n"
                           "except m.PackageNotFoundError: print('not installed')"])
    return v


def wait_for_idle(limit_s, threshold):
    end = time.monotonic() + limit_s
    while True:
        load1 = os.getloadavg()[0]
        if load1 <= threshold or time.monotonic() >= end:
            return load1
        log(f"load average {load1:.2f} > {threshold}; waiting (up to {limit_s:.0f} s total)")
        time.sleep(min(15.0, max(0.0, end - time.monotonic())))


# --------------------------------------------------------------------------------------------
# Main.
# --------------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="shorter traces, 3 s wrk runs, short criterion runs")
    p.add_argument("--smoke", action="store_true",
                   help="CI smoke: one short trace, Envoy RR vs plugin prefix (+ sglang-router "
                        "if installed), a 2 s cost check; exits 1 if anything is wrong")
    p.add_argument("--sections", default="cache,sim-sweep,sweep,cost,scale",
                   help="comma list of cache, sim-sweep, sweep, cost, scale (default: all)")
    p.add_argument("--sweep-scenarios", default=",".join(SWEEP_SCENARIOS),
                   help="sweep traces to run (default: all but the opt-in "
                        + ", ".join(EXTRA_SWEEP_SCENARIOS) + ")")
    p.add_argument("--sweep-routers", default=",".join(SWEEP_ROUTERS),
                   help="routers in the sweep section (default: all)")
    p.add_argument("--costs", default=",".join(str(c) for c in SWEEP_COSTS),
                   help="prefill costs of the sweep, ms per uncached token")
    p.add_argument("--decode-ms", type=float, default=0.0,
                   help="decode ms per output token on the replicas of the sweep, the simulator "
                        "sweep and the cache section (default 0); above 0 the traces stream "
                        "and TTFT is each answer's first byte")
    p.add_argument("--prior-lanes-from-fleet", action="store_true",
                   help="tell our routers the replicas' lanes (`serve --prior-lanes`, the "
                        "plugin's `latency.lanes`; `simulate --prior-lanes` in the simulator "
                        "sweep), as an operator who knows how many sequences a replica "
                        "prefills at once would; by default they learn it")
    p.add_argument("--balance-factor", type=float, default=None,
                   help="our routers' `latency.balance_factor` (`serve`/`simulate "
                        "--balance-factor`; 0 turns a hot prefix's bounded share off); by "
                        "default theirs (2)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="cache traces to run (default: all)")
    p.add_argument("--routers", default=",".join(CACHE_ROUTERS),
                   help="routers in the cache section (default: all)")
    p.add_argument("--systems", default=",".join(COST_SYSTEMS),
                   help="systems in the cost section (default: all)")
    p.add_argument("--duration", type=int, default=None, help="seconds per wrk run")
    p.add_argument("--connections", type=int, default=32, help="wrk connections (loaded)")
    p.add_argument("--rounds", type=int, default=None, help="cost rounds (median reported)")
    p.add_argument("--cost-sizes", default=",".join(str(s // 1024) for s in COST_SIZES),
                   help="cost body sizes in KB")
    p.add_argument("--warmth", default=",".join(COST_WARMTH),
                   help="cost prompts: warm (prefixes seen before), cold (never seen), or both")
    add_bodies_arguments(p)
    p.add_argument("--wait-idle", type=float, default=0,
                   help="wait up to this many seconds for the 1-minute load average to drop "
                        "below --idle-load before starting")
    p.add_argument("--idle-load", type=float, default=0.5)
    p.add_argument("--out", default=None, help="results directory (default: bench/results/<time>)")
    p.add_argument("--prefixroute", default=str(TARGET / "release" / "prefixroute"))
    p.add_argument("--plugin-wasm",
                   default=str(TARGET / "wasm32-wasip1" / "wasm" / "prefixroute_plugin.wasm"))
    p.add_argument("--envoy", default=os.environ.get("ENVOY", str(ROOT / ".venv/bin/envoy")))
    args = p.parse_args()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    workdir = Path(args.out) if args.out else BENCH / "results" / (
        ("smoke-" if args.smoke else "") + stamp)
    workdir.mkdir(parents=True, exist_ok=True)
    env = Env(args, workdir)
    for path, what in ((env.prefixroute, "the prefixroute CLI"), (env.wasm, "the plugin"),
                       (env.envoy, "Envoy")):
        if not path.exists():
            sys.exit(f"bench: {what} not found at {path} (run bench/run.sh, which builds)")

    sections = set(args.sections.split(","))
    quick = args.quick
    if args.smoke:
        scenarios = SMOKE_SCENARIO
        routers = ["envoy-rr", "prefix", "latency"] + (
            ["sglang"] if env.peers_available["sglang"] else [])
        cost_systems = ["direct", "envoy-rr", "latency"]
        cost_sizes = [8192]
        cost_warmth = ["warm"]
        duration = args.duration or 2
        connections = 8
        rounds = 1
        sections = {"cache"} | ({"cost"} if env.wrk else set())
        if not env.wrk:
            log("smoke: wrk not installed, cost check skipped")
    else:
        scenarios = {k: SCENARIOS[k] for k in args.scenarios.split(",")}
        every_sweep = {**SWEEP_SCENARIOS, **EXTRA_SWEEP_SCENARIOS}
        sweep_scenarios = {k: every_sweep[k] for k in args.sweep_scenarios.split(",")}
        sweep_routers = args.sweep_routers.split(",")
        costs = [float(c) for c in args.costs.split(",")]
        routers = args.routers.split(",")
        cost_systems = args.systems.split(",")
        cost_sizes = [int(x) * 1024 for x in args.cost_sizes.split(",")]
        cost_warmth = args.warmth.split(",")
        duration = args.duration or (3 if quick else 10)
        connections = args.connections
        rounds = args.rounds or (1 if quick else 2)
    if "cost" in sections and not env.wrk:
        sys.exit("bench: wrk not found (apt-get install -y wrk; bench/run.sh does it)")

    load_before = wait_for_idle(args.wait_idle, args.idle_load) if args.wait_idle else \
        os.getloadavg()[0]
    results = {"started": stamp, "quick": quick, "smoke": args.smoke,
               "versions": versions(env), "load_average_start": os.getloadavg(),
               "envoy_concurrency": ENVOY_CONCURRENCY}
    log(f"results in {workdir}; load average {load_before:.2f}")
    failures = []
    try:
        if "cache" in sections:
            results["cache"] = run_cache(env, scenarios, routers, quick)
        if "sim-sweep" in sections:
            results["sim_sweep"] = run_sim_sweep(env, sweep_scenarios, costs)
        if "sweep" in sections:
            results["sweep"] = run_sweep(env, sweep_scenarios, sweep_routers, costs, quick)
        if "cost" in sections:
            bodies = Bodies.from_args(args)
            results["cost"] = run_cost(env, cost_systems, cost_sizes, duration, connections,
                                       rounds, cost_warmth, bodies)
            results["cost_settings"] = {"duration_s": duration, "connections": connections,
                                        "rounds": rounds, **dataclasses.asdict(bodies)}
        if "scale" in sections:
            results["scale"] = run_scale(quick)
    finally:
        stop_all()
    results["load_average_end"] = os.getloadavg()

    md = [f"# prefixroute benchmark {stamp}" + (" (quick)" if quick else "")
          + (" (smoke)" if args.smoke else ""), ""]
    if args.smoke:
        md.append("Smoke run: checks that every part of the benchmark works; its numbers come "
                  "from very short runs (and a debug CLI when run by smoke.sh) and mean nothing.")
        md.append("")
    md.append("Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()))
    md.append("")
    md.append("Load average (1/5/15 min) at start {:.2f} {:.2f} {:.2f}, at end {:.2f} {:.2f} "
              "{:.2f}.".format(*results["load_average_start"], *results["load_average_end"]))
    md.append("")
    if "cache" in results:
        md += ["## Cache effect", "",
               "Hit rate: the replicas' own `vllm:prefix_cache_hits_total / queries_total` "
               "growth over the run. TTFT: `prefixroute replay` latency (send to last byte of "
               "a non-streaming answer with max_tokens 16 and no decode time, so prefill + "
               "queueing + transport)" + (
                   f"; here {decode_text(env.decode_ms)}" if env.decode_ms else "") + ".", "",
               report_cache(results["cache"])]
        entries = cache_targets(results["cache"])
        results["cache_targets"] = entries
        if entries:
            md += ["### Targets: prefixroute's default policy", "",
                   report_cache_targets(entries), ""]
        for key, res in results["cache"].items():
            for kind, row in res["rows"].items():
                if row["errors"]:
                    failures.append(f"cache/{key}/{kind}: {row['errors']} errors "
                                    f"{row['errors_by_kind']}")
                if row["hit_rate"] is None or not row["settled"]:
                    failures.append(f"cache/{key}/{kind}: server counters not settled")
                if row["unknown_endpoint"]:
                    failures.append(f"cache/{key}/{kind}: {row['unknown_endpoint']} answers "
                                    "named no replica")
    if "sim_sweep" in results:
        md += ["## Prefill-cost sweep in the simulator", "",
               "`prefixroute simulate` on the sweep's traces and fleets (deterministic; every "
               "policy; the share of the upper bound in brackets).", "",
               report_sim_sweep(results["sim_sweep"])]
    if "sweep" in results:
        md += ["## Prefill-cost sweep", "",
               "Every trace at each prefill cost, through each router in front of fresh "
               "replicas whose caches hold a third to a half of the groups. Hit rate, TTFT and "
               "max/mean as in the cache section.", "", report_sweep(results["sweep"])]
        entries = sweep_targets(results["sweep"])
        results["sweep_targets"] = entries
        if entries:
            md += ["### Targets: prefixroute latency", "", report_sweep_targets(entries), ""]
        for key, res in results["sweep"].items():
            for cost, rows in res["costs"].items():
                for kind, row in rows.items():
                    if row["errors"]:
                        failures.append(f"sweep/{key}@{cost}/{kind}: {row['errors']} errors "
                                        f"{row['errors_by_kind']}")
                    if row["hit_rate"] is None or not row["settled"]:
                        failures.append(f"sweep/{key}@{cost}/{kind}: server counters not "
                                        "settled")
    def plugin_problems(where, stats):
        for name, value in stats.items():
            bad = (".fallback." in name and not name.endswith("not_routable")) \
                or name.endswith(("prefixroute.shared_data.errors", "prefixroute.header_errors"))
            if bad and value:
                failures.append(f"{where}: plugin counter {name} = {value}")

    for key, res in results.get("cache", {}).items():
        for kind, row in res["rows"].items():
            plugin_problems(f"cache/{key}/{kind}", row.get("plugin_stats") or {})
    for key, res in results.get("sweep", {}).items():
        for cost, rows in res["costs"].items():
            for kind, row in rows.items():
                plugin_problems(f"sweep/{key}@{cost}/{kind}", row.get("plugin_stats") or {})
    for key, cell in results.get("cost", {}).items():
        for kind, m in cell["systems"].items():
            for stats in m.get("plugin_stats", []):
                plugin_problems(f"cost/{key}/{kind}", stats or {})
    if "cost" in results:
        md += ["## Cost per request", "",
               report_cost(results["cost"], duration, connections, rounds,
                           Bodies.from_args(args))]
        entries = cost_targets(results["cost"])
        results["cost_targets"] = entries
        if entries:
            md += ["### Targets: prefixroute latency vs Envoy RR", "",
                   report_cost_targets(entries), ""]
        for key, cell in results["cost"].items():
            for kind, m in cell["systems"].items():
                for phase in ("unloaded", "loaded"):
                    if m[phase]["errors"] or m[phase]["requests"] == 0:
                        failures.append(f"cost/{key}/{kind}/{phase}: {m[phase]['errors']} "
                                        f"errors of {m[phase]['requests']} requests")
    if "scale" in results:
        md += ["## Scale", "", report_scale(results["scale"]), ""]
    if args.smoke and "cache" in results:
        rows = results["cache"]["smoke"]["rows"]
        rr = rows.get("envoy-rr")
        for policy in ("prefix", "latency"):
            ours = rows.get(policy)
            if rr and ours and rr["hit_rate"] is not None and ours["hit_rate"] is not None:
                if not ours["hit_rate"] > rr["hit_rate"]:
                    failures.append(f"smoke: {policy} hit rate {fmt_pct(ours['hit_rate'])} is "
                                    f"not above Envoy RR's {fmt_pct(rr['hit_rate'])}")
            else:
                failures.append(f"smoke: missing Envoy RR or {policy} results")
    if failures:
        md += ["## Problems", ""] + [f"- {f}" for f in failures] + [""]
    results["problems"] = failures

    text = "\n".join(md)
    (workdir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (workdir / "report.md").write_text(text + "\n")
    print(text)
    log(f"wrote {workdir / 'report.md'} and results.json")
    if failures:
        log(f"{len(failures)} problem(s): " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    try:
        code = main()
    finally:
        stop_all()
    sys.exit(code)
