#!/usr/bin/env bash
# Builds the web demo and serves it on http://127.0.0.1:PORT/ (default 8000).
# Usage: web-demo/serve.sh [PORT]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
port="${1:-8000}"
"$here/build.sh"
echo "prefixroute web demo: http://127.0.0.1:$port/  (Ctrl-C to stop)" >&2
# python's http.server sends .wasm as application/wasm, which WebAssembly.instantiateStreaming needs.
exec python3 -m http.server "$port" --bind 127.0.0.1 --directory "$here/www"
