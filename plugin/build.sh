#!/usr/bin/env bash
# Builds the .wasm Envoy loads, <target>/wasm32-wasip1/wasm/prefixroute_plugin.wasm: cargo's
# `wasm` profile, then binaryen's `wasm-opt -Oz --converge --low-memory-unused` over the linked
# module, in place.
#
# Why a post-link pass: LLVM optimises each function, wasm-opt the module as V8 will compile
# it (locals, branches, duplicate functions). Measured at git 8e5ff11 (docs/benchmarks.md):
# 489,018 -> 435,462 bytes (11% less for every Envoy worker to load and compile) and 0.4-3%
# fewer wasm instructions per request (host-tests table); Envoy's CPU per request did not move
# beyond bench/cpu_ab.py's noise. `-Oz --converge` rather than `-O3` since git af392d2: 6.9 KB
# less (406,202 -> 398,619 bytes at that commit, under issue 12's 400 KB) for +0.0% to +1.4%
# instructions per request (the size passes inline less; the loops are LLVM's either way).
# `--low-memory-unused`: wasm-opt may then fold a constant added to an address into the load's
# or store's offset (one instruction fewer each), which is exact unless the address wraps
# below 1 KiB. Nothing lives there: Rust links the stack first, so the lowest KiB is the last
# of its 1 MiB stack (the data starts at 1 MiB), never reached. Measured at git 11b0ce6: 399,651
# -> 397,623 bytes and 0.6-2.0% fewer wasm instructions per request (docs/benchmarks.md).
#
# Usage: plugin/build.sh [cargo build options, e.g. --quiet]. Honours CARGO_TARGET_DIR;
# WASM_OPT names the wasm-opt binary (default: `wasm-opt` on PATH; Debian/Ubuntu:
# `apt-get install binaryen`, macOS: `brew install binaryen`). Without wasm-opt the module cargo
# linked is left as it is (it behaves the same, it is only bigger and slower) and a warning
# says so. Plain `cargo build -p prefixroute-plugin --target wasm32-wasip1 --profile wasm`
# relinks cargo's module over the optimised one; run this script again to optimise it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

cargo build --manifest-path "$root/Cargo.toml" -p prefixroute-plugin \
  --target wasm32-wasip1 --profile wasm "$@"

dir="${CARGO_TARGET_DIR:-$root/target}/wasm32-wasip1/wasm"
wasm="$dir/prefixroute_plugin.wasm"
# wasm-opt's output is kept beside the module with the sha256 of the cargo output it came
# from and the passes that made it: cargo relinks its own module on every build, even when
# nothing changed, and then the optimised one is copied back instead of optimised again.
cache="$dir/prefixroute_plugin.wasm-opt"
passes=(-Oz --converge --low-memory-unused)
digest() {
  if command -v sha256sum >/dev/null; then sha256sum "$1"; else shasum -a 256 "$1"; fi | cut -d' ' -f1
}
linked="$(digest "$wasm") ${passes[*]}"
if [ -f "$cache" ] && [ -f "$cache.from" ]; then
  if [ "$(cat "$cache.from")" = "$linked" ]; then
    cp "$cache" "$wasm.tmp" && mv "$wasm.tmp" "$wasm"
    exit 0
  fi
  if [ "$(digest "$cache") ${passes[*]}" = "$linked" ]; then
    exit 0 # already the optimised module
  fi
fi

wasm_opt=${WASM_OPT:-wasm-opt}
if ! command -v "$wasm_opt" >/dev/null; then
  echo "plugin/build.sh: warning: $wasm_opt (binaryen) not found; $wasm is not optimised" \
    "(install binaryen, or set WASM_OPT)" >&2
  exit 0
fi
# Exactly the features rustc's wasm32-wasip1 target enables (`rustc --print cfg --target
# wasm32-wasip1`), so wasm-opt validates the module and introduces nothing Envoy's V8 or
# wasmtime would not run; plus SIMD when the module already uses it (.cargo/config.toml enables
# it for this target: core's chat reader scans and checks strings 16 bytes at a time; wasm-opt
# may then also copy memory 16 bytes at a time). A module built without it (`RUSTFLAGS=`)
# validates without SIMD, so wasm-opt is not allowed to add any.
features=(--enable-bulk-memory --enable-sign-ext --enable-mutable-globals
  --enable-nontrapping-float-to-int --enable-multivalue --enable-reference-types)
if ! "$wasm_opt" "${features[@]}" "$wasm" -o /dev/null 2>/dev/null; then
  features+=(--enable-simd)
fi
"$wasm_opt" "${passes[@]}" "${features[@]}" "$wasm" -o "$cache.tmp"
mv "$cache.tmp" "$cache"
echo "$linked" >"$cache.from"
cp "$cache" "$wasm.tmp" && mv "$wasm.tmp" "$wasm"
