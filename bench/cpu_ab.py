#!/usr/bin/env python3
"""Envoy's CPU per request, side by side in one run: Envoy without a filter (ROUND_ROBIN), the
floor filter (bench/floor: buffer the body, read it, set the destination; no decision), and the
plugin built as one or more .wasm files (A/B of two builds).

Throughput on this 2-core machine moves by +-15% between runs because wrk, the fake servers and
Envoy share the cores with whatever else runs; Envoy's own CPU time per request (utime + stime
from /proc over a wrk run, divided by the requests) is steadier and is what a plugin change
moves. Rounds alternate the order of the systems; medians are printed, with the ratio of each
system's cost above Envoy-without-a-filter to the first plugin's.

  python3 bench/cpu_ab.py --plugin-wasm old=/tmp/old.wasm --plugin-wasm new=target/wasm32-wasip1/wasm/prefixroute_plugin.wasm
  python3 bench/cpu_ab.py --sizes 1,8,64 --warmth warm,cold --rounds 5
  python3 bench/cpu_ab.py --sizes 8,64 --line-words 12   (prompts broken into lines)
  python3 bench/cpu_ab.py --sizes 8,64 --completions      (completions bodies)
  python3 bench/cpu_ab.py --sizes 64 --warmth warm --completions --questions 512
  python3 bench/cpu_ab.py --sizes 8,64 --text-parts       (each content a list of one text part)
      (a known prefix with a question not met lately, rather than 64 bodies that cycle)
  python3 bench/cpu_ab.py --sizes 8 --warmth warm --floor-variant 12:0 --floor-variant 12:12
      (what a shared-data get and set cost Envoy: the floor filter plus that many calls)

Builds the floor filter (cargo, wasm32-wasip1) unless --floor-wasm is given. Everything listens
on 127.0.0.1; every process it starts is stopped when it ends.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402  (the orchestrator's process helpers)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def envoy_pid(router):
    """The Envoy process of `prefixroute serve`: the process itself once it has exec'd Envoy,
    else its child."""
    pid = router.proc.pid
    for _ in range(3):
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == "envoy":
                return pid
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        children = [int(p) for p in out.stdout.split()]
        if not children:
            break
        pid = children[0]
    raise RuntimeError(f"no Envoy process under prefixroute serve (pid {router.proc.pid})")


def build_floor(gets=0, sets=0):
    """The floor filter; with `gets`/`sets`, the variant that also makes that many shared-data
    calls per request (each variant in its own target directory)."""
    suffix = f"-{gets}-{sets}" if gets or sets else ""
    target = Path(tempfile.gettempdir()) / f"prefixroute-floor-target{suffix}"
    build_env = dict(os.environ, CARGO_TARGET_DIR=str(target),
                     FLOOR_SHARED_GETS=str(gets), FLOOR_SHARED_SETS=str(sets))
    subprocess.run(["cargo", "build", "--quiet", "--release", "--target", "wasm32-wasip1",
                    "--manifest-path", str(HERE / "floor" / "Cargo.toml")],
                   check=True, env=build_env)
    return target / "wasm32-wasip1" / "release" / "prefixroute_floor_filter.wasm"


class Served(bench.Router):
    """`prefixroute serve` with a chosen .wasm (or none) in front of the fleet."""

    def __init__(self, env, name, fleet, wasm, policy, extra=()):
        self.kind, self.name = "envoy-rr" if wasm is None else "latency", name
        self.admin = bench.free_port()
        port = bench.free_port()
        self.url = f"http://127.0.0.1:{port}"
        log_path = env.log_path(f"cpu-{name}")
        argv = [env.prefixroute, "serve", "--policy", policy, "--listen", f"127.0.0.1:{port}",
                "--admin", f"127.0.0.1:{self.admin}", "--envoy", env.envoy,
                "--concurrency", bench.ENVOY_CONCURRENCY, *extra]
        if wasm is not None:
            argv += ["--plugin-wasm", wasm]
        for r in fleet:
            argv += ["--endpoint", f"{r.name}=http://{r.hostport}"]
        self.proc = bench.spawn(argv, log_path)
        bench.wait_until(f"Envoy ({name})",
                         lambda: bench.http_get(f"http://127.0.0.1:{self.admin}/ready") == 200,
                         self.proc, 30, log_path)
        bench.wait_until(f"{name}", lambda: bench.http_get(f"{self.url}/v1/models") == 200,
                         self.proc, 30, log_path)
        self.pid = envoy_pid(self)


def measure(env, served, size, warmth, duration, bodies):
    before = cpu_seconds(served.pid)
    run = bench.wrk_run(env, served.url, size, 32, duration, warmth, bodies)
    used = cpu_seconds(served.pid) - before
    return {"cpu_us": used / max(run["requests"], 1) * 1e6, "rps": run["rps"],
            "errors": run["errors"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench.ab_arguments(p)
    p.add_argument("--floor-wasm", default=None, help="the floor filter (default: build it)")
    p.add_argument("--floor-variant", action="append", default=[],
                   help="GETS:SETS: also the floor filter making that many get_shared_data / "
                        "set_shared_data calls per request (repeat for more)")
    p.add_argument("--sizes", default="8,64", help="body sizes in KB")
    p.add_argument("--warmth", default="warm,cold")
    p.add_argument("--rounds", type=int, default=5)
    bench.add_bodies_arguments(p)
    p.add_argument("--duration", type=int, default=4, help="seconds per wrk run")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    bodies = bench.Bodies.from_args(args)
    plugins, env = bench.ab_setup(args, "cpu-ab")
    floor = args.floor_wasm or str(build_floor())
    fleet = bench.start_fleet(env, 4, 4096, 4096, 0, 0, "cpu")
    systems = []
    results = {}
    try:
        systems.append(Served(env, "Envoy ROUND_ROBIN", fleet, None, "round-robin"))
        systems.append(Served(env, "floor filter", fleet, floor, "latency", ["--static-pool"]))
        for variant in args.floor_variant:
            gets, sets = (int(n) for n in variant.split(":"))
            systems.append(Served(env, f"floor filter + {gets} gets, {sets} sets", fleet,
                                  str(build_floor(gets, sets)), "latency", ["--static-pool"]))
        for name, wasm in plugins:
            systems.append(Served(env, f"prefixroute {name}", fleet, wasm, "latency"))
        for size in [int(s) * 1024 for s in args.sizes.split(",")]:
            for warmth in args.warmth.split(","):
                key = f"{size // 1024} KB {warmth}"
                runs = {s.name: [] for s in systems}
                for s in systems:  # warm-up: JIT tiers, the plugin's scrapes and memo
                    bench.wrk_run(env, s.url, size, 32, 1, warmth, bodies)
                for rnd in range(args.rounds):
                    order = systems if rnd % 2 == 0 else systems[::-1]
                    for s in order:
                        runs[s.name].append(measure(env, s, size, warmth, args.duration,
                                                    bodies))
                results[key] = {name: {"cpu_us": statistics.median(r["cpu_us"] for r in rs),
                                       "rps": statistics.median(r["rps"] for r in rs),
                                       "errors": sum(r["errors"] for r in rs),
                                       "cpu_us_all": [round(r["cpu_us"], 1) for r in rs]}
                                for name, rs in runs.items()}
                bench.log(f"cpu_ab: {key} done")
    finally:
        for s in systems:
            s.close()
        for r in fleet:
            bench.stop(r.proc)
    shutil.rmtree(env.workdir, ignore_errors=True)  # its logs are kept only when a run failed
    print(f"Envoy CPU per request (median of {args.rounds} rounds of {args.duration} s, wrk -c32,"
          f" Envoy --concurrency {bench.ENVOY_CONCURRENCY}); added = minus Envoy without a filter\n")
    first = f"prefixroute {plugins[0][0]}"
    for key, res in results.items():
        base = res["Envoy ROUND_ROBIN"]["cpu_us"]
        print(f"#### {key}\n")
        print("| system | CPU per request | added | added vs " + first + " | req/s | errors |")
        print("|---|---:|---:|---:|---:|---:|")
        ref = res[first]["cpu_us"] - base
        for name, r in res.items():
            added = r["cpu_us"] - base
            vs = f"{added / ref:.2f}x" if name != "Envoy ROUND_ROBIN" and ref > 0 else "-"
            print(f"| {name} | {r['cpu_us']:.0f} us | +{added:.0f} us | {vs} | {r['rps']:.0f} |"
                  f" {r['errors']} |")
        print()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
