#!/usr/bin/env bash
# Builds the plugin, starts three fake replicas and a real Envoy (2 workers) on 127.0.0.1, runs
# check.py against them, and stops everything it started (by PID). Logs go to $WORK.
#
#   bash plugin/dev/run.sh            # from the repository root
#   ENVOY=/path/to/envoy bash plugin/dev/run.sh
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEV="$ROOT/plugin/dev"
ENVOY="${ENVOY:-$ROOT/.venv/bin/envoy}"
WORK="${WORK:-$(mktemp -d /tmp/prefixroute-dev.XXXXXX)}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/tmp/target-plugin}"

"$ROOT/plugin/build.sh"
WASM="$CARGO_TARGET_DIR/wasm32-wasip1/wasm/prefixroute_plugin.wasm"
cp "$WASM" "$WORK/prefixroute_plugin.wasm"
echo "plugin: $(stat -c %s "$WORK/prefixroute_plugin.wasm") bytes; logs in $WORK"
sed "s#@WASM@#$WORK/prefixroute_plugin.wasm#" "$DEV/envoy.yaml" > "$WORK/envoy.yaml"

# Configuration handling, checked with `envoy --mode validate` (no traffic).
python3 "$DEV/variants.py" "$WORK/envoy.yaml" "$WORK"
"$ENVOY" --mode validate -c "$WORK/struct.yaml" > "$WORK/validate-struct.log" 2>&1 \
  && grep -q "policy least-queue" "$WORK/validate-struct.log" \
  && echo "PASS  Struct configuration (binary protobuf) is accepted" \
  || { echo "FAIL  Struct configuration"; exit 1; }
if "$ENVOY" --mode validate -c "$WORK/invalid.yaml" > "$WORK/validate-invalid.log" 2>&1; then
  echo "FAIL  invalid configuration was accepted"; exit 1
fi
echo "PASS  invalid configuration is refused: $(grep -o 'prefixroute: invalid configuration: .*' \
  "$WORK/validate-invalid.log" | head -1)"

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

for i in 1 2 3; do
  python3 "$DEV/backend.py" "replica-$i" "1800$i" > "$WORK/backend-$i.log" 2>&1 &
  PIDS+=($!)
done
"$ENVOY" -c "$WORK/envoy.yaml" --concurrency 2 --log-level info \
  --component-log-level wasm:info > "$WORK/envoy.log" 2>&1 &
PIDS+=($!)

for _ in $(seq 1 100); do
  if curl -sf http://127.0.0.1:19901/ready > /dev/null 2>&1; then break; fi
  sleep 0.1
done

status=0
python3 "$DEV/check.py" || status=$?
echo "--- plugin log lines (envoy.log) ---"
grep -E "wasm log" "$WORK/envoy.log" | sed -E 's/^\[[^]]*\]\[[0-9]+\]//' | sort | uniq -c | head -20
if grep -qiE "panicked|wasm trap|Function: proxy_on|Plugin configured to fail" "$WORK/envoy.log"; then
  echo "VM FAILURE in envoy.log"; status=1
fi
exit $status
