#!/usr/bin/env bash
# The side-by-side benchmark: cache effect, cost per request, scale (see bench/README.md).
#
#   bench/run.sh                 # everything, 25-35 minutes on 2 cores
#   bench/run.sh --quick         # shorter traces and runs, ~12 minutes
#   bench/run.sh --sections cost --systems envoy-rr,prefix
#   bench/run.sh --wait-idle 600 # wait (up to 10 min) for the machine to be idle first
#
# Installs the peers (bench/setup.sh) and Envoy (envoy/setup.sh), builds the CLI and the plugin
# (release), then runs bench/bench.py with the given options. Results: bench/results/<time>/.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"

"$root/envoy/setup.sh"
"$here/setup.sh"
echo "bench: building the CLI and the plugin (release) ..." >&2
cargo build --quiet --release --manifest-path "$root/Cargo.toml" -p prefixroute
"$root/plugin/build.sh" --quiet

exec python3 "$here/bench.py" \
  --prefixroute "$target/release/prefixroute" \
  --plugin-wasm "$target/wasm32-wasip1/wasm/prefixroute_plugin.wasm" \
  --envoy "$root/.venv/bin/envoy" \
  "$@"
