#!/usr/bin/env bash
# Builds the web demo and runs its browser test (node's test runner, playwright-core driving
# Debian's chromium). Used by CI. Installs chromium and the npm packages when missing.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [ ! -x /usr/bin/chromium ]; then
  echo "test.sh: installing Debian's chromium" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
if [ ! -d "$here/node_modules/playwright-core" ]; then
  (cd "$here" && npm ci --no-audit --no-fund)
fi

"$here/build.sh"
cd "$here"
exec node --test test/
