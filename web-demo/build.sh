#!/usr/bin/env bash
# Builds the web demo: prefixroute-core + this crate → wasm32 → wasm-bindgen → www/pkg/.
# Usage: web-demo/build.sh   (honours CARGO_TARGET_DIR; installs the pinned wasm-bindgen CLI
# and the wasm32 target when they are missing)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
export PATH="$HOME/.cargo/bin:$PATH"
target_dir="${CARGO_TARGET_DIR:-$root/target}"

# The CLI must be exactly the version of the wasm-bindgen crate (pinned with `=` in Cargo.toml).
version="$(sed -n 's/^wasm-bindgen = "=\([0-9.]*\)".*/\1/p' "$here/Cargo.toml")"
if [ -z "$version" ]; then
  echo "build.sh: cannot read the pinned wasm-bindgen version from $here/Cargo.toml" >&2
  exit 1
fi
if [ "$(wasm-bindgen --version 2>/dev/null)" != "wasm-bindgen $version" ]; then
  echo "build.sh: installing wasm-bindgen-cli $version (takes a few minutes, once)" >&2
  cargo install wasm-bindgen-cli --version "$version" --locked
fi
if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx wasm32-unknown-unknown; then
  rustup target add wasm32-unknown-unknown
fi

cargo build --release --target wasm32-unknown-unknown -p prefixroute-web-demo \
  --manifest-path "$root/Cargo.toml"
wasm="$target_dir/wasm32-unknown-unknown/release/prefixroute_web_demo.wasm"
rm -rf "$here/www/pkg"
wasm-bindgen --target web --no-typescript --out-dir "$here/www/pkg" "$wasm"
echo "build.sh: $(du -h "$here/www/pkg/prefixroute_web_demo_bg.wasm" | cut -f1) wasm in $here/www/pkg" >&2
