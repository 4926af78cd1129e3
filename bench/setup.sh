#!/usr/bin/env bash
# Installs what the benchmark needs besides Envoy (envoy/setup.sh) and the Rust builds:
#   * the peers, from PyPI into bench/.venv (gitignored): sglang-router and vllm-router, pinned
#     so that numbers stay comparable; override with PEERS="sglang-router==X vllm-router==Y";
#   * wrk (Debian package) for the cost section, when run as root and it is missing.
# Idempotent. `bench/setup.sh --peers-only sglang-router` installs just that (used by smoke.sh).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
peers="${PEERS:-sglang-router==0.3.2 vllm-router==0.1.17}"
want_wrk=1
if [ "${1:-}" = "--peers-only" ]; then
  shift
  want_wrk=0
  if [ $# -gt 0 ]; then
    selected=""
    for name in "$@"; do
      for spec in $peers; do
        case "$spec" in "$name"|"$name"==*) selected="$selected $spec" ;; esac
      done
    done
    peers="$selected"
  fi
fi

venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  echo "bench/setup: creating $venv" >&2
  python3 -m venv "$venv"
fi
missing=""
for spec in $peers; do
  name="${spec%%==*}"
  version="${spec#*==}"
  have="$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null || true)"
  if [ "$spec" = "$name" ]; then
    [ -n "$have" ] || missing="$missing $spec"
  elif [ "$have" != "$version" ]; then
    missing="$missing $spec"
  fi
done
if [ -n "$missing" ]; then
  echo "bench/setup: pip install$missing" >&2
  # shellcheck disable=SC2086 # word splitting of the package list is intended
  "$venv/bin/pip" install --quiet --disable-pip-version-check $missing
fi

if [ "$want_wrk" = 1 ] && ! command -v wrk >/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "bench/setup: wrk is missing and this is not root: apt-get install -y wrk" >&2
    exit 1
  fi
  echo "bench/setup: apt-get install wrk" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null
fi
