#!/usr/bin/env bash
# The main job: a real Envoy (2 workers) with the prefixroute plugin in front of three fake vLLM
# replicas, against Envoy's own round-robin and least-request balancers, on the same trace.
# Each policy gets fresh replicas; the table comes from the replicas' own prefix-cache counters.
#
#   envoy/demo.sh                       # default trace: 8 tenants, 64 requests
#   envoy/demo.sh --policies round-robin,prefix,prefix-only
#   envoy/demo.sh path/to/trace.jsonl   # any `prefixroute trace` file
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"

"$root/envoy/setup.sh"
echo "building the CLI and the plugin (release) ..." >&2
cargo build --quiet --release --manifest-path "$root/Cargo.toml" -p prefixroute
"$root/plugin/build.sh" --quiet

exec "$target/release/prefixroute" compare \
  --envoy "$root/.venv/bin/envoy" \
  --plugin-wasm "$target/wasm32-wasip1/wasm/prefixroute_plugin.wasm" \
  --scrape-interval-ms 250 --scrape-timeout-ms 200 --stale-after-ms 2000 \
  "$@"
