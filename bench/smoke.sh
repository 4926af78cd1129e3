#!/usr/bin/env bash
# A short version of bench/run.sh so that the benchmark cannot rot (called from test.sh):
# one short trace through Envoy ROUND_ROBIN, the plugin's prefix policy and, if it installs,
# sglang-router, each in front of fresh fake replicas; then a 2 s wrk run per system at 8 KB
# (direct, Envoy RR, plugin). Exits non-zero if a request failed, a counter did not settle, the
# plugin fell back, or prefix did not beat round-robin's hit rate. About a minute once built.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"

"$root/envoy/setup.sh"
# The debug CLI (test.sh's `cargo test` has built it) is enough for a smoke run; the plugin is
# always the release build, as deployed.
cargo build --quiet --manifest-path "$root/Cargo.toml" -p prefixroute
"$root/plugin/build.sh" --quiet

# Peers and wrk are best effort here: without them the smoke run skips that part.
if ! timeout 180 "$here/setup.sh" --peers-only sglang-router; then
  echo "bench/smoke: sglang-router did not install; running without it" >&2
fi
if ! command -v wrk >/dev/null && [ "$(id -u)" -eq 0 ]; then
  timeout 180 bash -c 'DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null 2>&1 ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; }' ||
    echo "bench/smoke: wrk did not install; skipping the cost check" >&2
fi

out="$(mktemp -d "${TMPDIR:-/tmp}/prefixroute-bench-smoke.XXXXXX")"
timeout 300 python3 "$here/bench.py" --smoke --out "$out" \
  --prefixroute "$target/debug/prefixroute" \
  --plugin-wasm "$target/wasm32-wasip1/wasm/prefixroute_plugin.wasm" \
  --envoy "$root/.venv/bin/envoy"
# Kept for a look when the smoke run failed (set -e ends the script above); removed when it passed.
rm -rf "$out"
