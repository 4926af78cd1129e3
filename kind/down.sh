#!/usr/bin/env bash
# kind/down.sh — deletes the kind cluster kind/up.sh created (KIND_CLUSTER, default
# prefixroute), and with it everything installed in it.
#
# NEEDS: a running Docker engine and kind on PATH. Images pulled or built into the local Docker
# (the simulator, prefixroute-wasm:dev) are kept; `docker rmi` them if wanted.
set -Eeuo pipefail

cluster=${KIND_CLUSTER:-prefixroute}

die() {
    printf 'down.sh: error: %s\n' "$*" >&2
    exit 1
}

command -v kind >/dev/null 2>&1 ||
    die "kind is not installed (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
command -v docker >/dev/null 2>&1 || die "docker is not installed"
docker info >/dev/null 2>&1 || die "cannot reach a Docker engine: start dockerd (or Docker Desktop)"

if kind get clusters 2>/dev/null | grep -qx "$cluster"; then
    kind delete cluster --name "$cluster" || die "kind could not delete the cluster $cluster"
    echo "deleted kind cluster $cluster"
else
    echo "no kind cluster named $cluster: nothing to do"
fi
