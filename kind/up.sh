#!/usr/bin/env bash
# kind/up.sh istio|envoy-gateway — prefixroute on a local kind cluster, end to end.
#
# NEEDS: a running Docker engine and network access (images, Helm charts), plus docker, kind,
# kubectl, helm, cargo (with the wasm32-wasip1 target) and curl on PATH. It cannot run in a
# sandbox without Docker; the manifests it applies are checked offline by `cargo test`
# (kind-tests/).
#
# What it does, each step failing with a message that says what to fix:
#   1. builds the prefixroute CLI and the plugin (prefixroute.wasm);
#   2. creates the kind cluster (or reuses it) and installs the Gateway API and InferencePool
#      CRDs (the same files the tests validate against: kind/crds, or PREFIXROUTE_CRDS_DIR);
#   3. installs the chosen data plane with Helm (Istio with the Inference Extension enabled, or
#      Envoy Gateway with EnvoyPatchPolicy enabled);
#   4. loads the images (the simulator, and a tiny HTTP server holding prefixroute.wasm);
#   5. applies kind/base (namespace, 3 llm-d-inference-sim replicas, the InferencePool, the wasm
#      server) and waits for the Pods;
#   6. checks the pool with `prefixroute pool` over `kubectl get inferencepools,pods -o json`
#      (the plugin itself discovers the pool's members from the gateway), renders the module's
#      sha256 into the variant's manifests, then applies them;
#   7. sends smoke requests through the gateway and checks prefixroute answered them.
#
# Environment: KIND_CLUSTER (default prefixroute), ISTIO_VERSION, ENVOY_GATEWAY_VERSION,
# PREFIXROUTE_CRDS_DIR, CARGO_TARGET_DIR, LOCAL_PORT (port-forward, default 18080).
# Tear down with kind/down.sh.
set -Eeuo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
variant=${1:-}
cluster=${KIND_CLUSTER:-prefixroute}
context="kind-$cluster"
ns=prefixroute
istio_version=${ISTIO_VERSION:-1.28.0}
eg_version=${ENVOY_GATEWAY_VERSION:-v1.6.0}
crds=${PREFIXROUTE_CRDS_DIR:-$root/kind/crds}
target=${CARGO_TARGET_DIR:-$root/target}
local_port=${LOCAL_PORT:-18080}

die() {
    printf '\nup.sh: error: %s\n' "$*" >&2
    exit 1
}
step() { printf '\n==> %s\n' "$*"; }
trap 'die "step failed (line $LINENO): $BASH_COMMAND"' ERR

case "$variant" in
istio | envoy-gateway) ;;
*) die "usage: kind/up.sh istio|envoy-gateway" ;;
esac

need() {
    command -v "$1" >/dev/null 2>&1 || die "$1 is not installed: $2"
}
need docker "install Docker (https://docs.docker.com/engine/install/)"
need kind "install kind (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
need kubectl "install kubectl (https://kubernetes.io/docs/tasks/tools/)"
need helm "install Helm 3 (https://helm.sh/docs/intro/install/)"
need cargo "install Rust (https://rustup.rs)"
need curl "install curl"
need awk "install awk"
need sha256sum "install coreutils (sha256sum)"
docker info >/dev/null 2>&1 ||
    die "cannot reach a Docker engine: start dockerd (or Docker Desktop) and check that $(id -un) may use it"
[[ -f $crds/inference.networking.k8s.io_inferencepools.yaml && -f $crds/gatewayapi-crds.yaml ]] ||
    die "CRDs not found in $crds (they ship in kind/crds; PREFIXROUTE_CRDS_DIR overrides the directory)"

k() { kubectl --context "$context" "$@"; }

tmp=$(mktemp -d)
port_forward=
cleanup() {
    if [[ -n $port_forward ]]; then kill "$port_forward" 2>/dev/null || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT

# ---------------------------------------------------------------------------------------------
step "1/7 build the prefixroute CLI and the plugin"
rustup target add wasm32-wasip1 >/dev/null 2>&1 ||
    echo "   (rustup not found or offline: assuming the wasm32-wasip1 target is installed)"
(cd "$root" && cargo build --release -p prefixroute) ||
    die "cargo build of the CLI failed"
"$root/plugin/build.sh" ||
    die "cargo build of the plugin failed (is the wasm32-wasip1 target installed?)"
cli=$target/release/prefixroute
wasm=$target/wasm32-wasip1/wasm/prefixroute_plugin.wasm
[[ -x $cli ]] || die "the CLI was not built at $cli"
[[ -f $wasm ]] || die "the plugin was not built at $wasm"
wasm_sha=$(sha256sum "$wasm" | cut -d' ' -f1)
echo "   plugin: $wasm ($(wc -c <"$wasm") bytes, sha256 $wasm_sha)"

# ---------------------------------------------------------------------------------------------
step "2/7 kind cluster $cluster and CRDs"
if kind get clusters 2>/dev/null | grep -qx "$cluster"; then
    echo "   reusing the existing cluster $cluster"
else
    kind create cluster --name "$cluster" --config "$here/cluster.yaml" --wait 180s ||
        die "kind could not create the cluster (see the messages above)"
fi
k cluster-info >/dev/null || die "kubectl cannot reach the cluster through context $context"
# Server-side apply: the Gateway API CRDs are too large for client-side apply's annotation.
k apply --server-side --force-conflicts -f "$crds/gatewayapi-crds.yaml" >/dev/null ||
    die "could not install the Gateway API CRDs from $crds"
k apply --server-side --force-conflicts -f "$crds/inference.networking.k8s.io_inferencepools.yaml" ||
    die "could not install the InferencePool CRD from $crds"
k wait --for=condition=Established --timeout=60s \
    crd/inferencepools.inference.networking.k8s.io crd/httproutes.gateway.networking.k8s.io ||
    die "the CRDs did not become Established"

# ---------------------------------------------------------------------------------------------
step "3/7 install $variant"
if [[ $variant == istio ]]; then
    helm repo add istio https://istio-release.storage.googleapis.com/charts --force-update >/dev/null ||
        die "could not add the Istio Helm repository (network?)"
    helm upgrade --install istio-base istio/base --kube-context "$context" \
        -n istio-system --create-namespace --version "$istio_version" --wait ||
        die "helm could not install istio/base $istio_version"
    helm upgrade --install istiod istio/istiod --kube-context "$context" \
        -n istio-system --version "$istio_version" -f "$here/istio/istiod.values.yaml" --wait ||
        die "helm could not install istio/istiod $istio_version"
else
    helm upgrade --install eg oci://docker.io/envoyproxy/gateway-helm --kube-context "$context" \
        -n envoy-gateway-system --create-namespace --version "$eg_version" \
        -f "$here/envoy-gateway/envoy-gateway.values.yaml" --wait ||
        die "helm could not install Envoy Gateway $eg_version"
    k -n envoy-gateway-system wait --for=condition=Available --timeout=180s deployment/envoy-gateway ||
        die "the envoy-gateway controller did not become Available"
fi

# ---------------------------------------------------------------------------------------------
step "4/7 images"
sim_image=$(awk '$1 == "image:" && $2 ~ /llm-d-inference-sim/ { print $2; exit }' "$here/base/vllm-sim.yaml")
[[ -n $sim_image ]] || die "no simulator image found in base/vllm-sim.yaml"
docker pull "$sim_image" || die "could not pull $sim_image (network?)"
kind load docker-image "$sim_image" --name "$cluster" || die "kind could not load $sim_image"
cp "$here/wasm-server/Dockerfile" "$wasm" "$tmp/"
mv "$tmp/prefixroute_plugin.wasm" "$tmp/prefixroute.wasm"
docker build -q -t prefixroute-wasm:dev "$tmp" >/dev/null || die "docker could not build prefixroute-wasm:dev"
kind load docker-image prefixroute-wasm:dev --name "$cluster" || die "kind could not load prefixroute-wasm:dev"
# The KV-event relay runs the CLI itself.
cli_tmp=$(mktemp -d)
cp "$here/kv-events/Dockerfile" "$cli" "$cli_tmp/"
docker build -q -t prefixroute-cli:dev "$cli_tmp" >/dev/null || die "docker could not build prefixroute-cli:dev"
kind load docker-image prefixroute-cli:dev --name "$cluster" || die "kind could not load prefixroute-cli:dev"
rm -rf "$cli_tmp"

# ---------------------------------------------------------------------------------------------
step "5/7 simulator replicas, InferencePool and wasm server"
k apply -f "$here/base/namespace.yaml" || die "could not create the namespace"
for f in vllm-sim inferencepool wasm-server kv-events; do
    k apply -f "$here/base/$f.yaml" || die "could not apply base/$f.yaml"
done
# A new module under the same tag: restart the server so it serves the new file.
k -n "$ns" rollout restart deployment/prefixroute-wasm >/dev/null
for d in vllm-sim prefixroute-wasm prefixroute-kv-events; do
    k -n "$ns" rollout status "deployment/$d" --timeout=300s ||
        die "deployment $d did not become ready (kubectl -n $ns describe pods)"
done

# ---------------------------------------------------------------------------------------------
step "6/7 check the pool and apply the $variant manifests"
k -n "$ns" get inferencepools.inference.networking.k8s.io,pods -o json >"$tmp/pool.json" ||
    die "could not read the pool and its Pods"
"$cli" pool "$tmp/pool.json" --pool vllm-sim ||
    die "prefixroute pool rejected the InferencePool (errors above)"

# Replaces the zero sha256 with the module's (the plugin discovers the pool: nothing else to fill).
render() {
    WASM_SHA256="$wasm_sha" awk '
        {
            gsub(/0000000000000000000000000000000000000000000000000000000000000000/, ENVIRON["WASM_SHA256"])
            print
        }' "$1"
}

if [[ $variant == istio ]]; then
    manifests=(gateway envoyfilter)
else
    manifests=(gateway client-traffic-policy backend-traffic-policy extension-policy patch-policy)
fi
for m in "${manifests[@]}"; do
    render "$here/$variant/$m.yaml" >"$tmp/$m.yaml"
    k apply -f "$tmp/$m.yaml" || die "could not apply $variant/$m.yaml"
done
k -n "$ns" wait --for=condition=Programmed --timeout=300s gateway/prefixroute ||
    die "the Gateway is not Programmed (kubectl -n $ns describe gateway prefixroute)"

# ---------------------------------------------------------------------------------------------
step "7/7 smoke requests through the gateway"
if [[ $variant == istio ]]; then
    svc_ns=$ns
    svc=$(k -n "$ns" get svc -l gateway.networking.k8s.io/gateway-name=prefixroute -o name | head -n1)
else
    svc_ns=envoy-gateway-system
    svc=$(k -n "$svc_ns" get svc \
        -l "gateway.envoyproxy.io/owning-gateway-name=prefixroute,gateway.envoyproxy.io/owning-gateway-namespace=$ns" \
        -o name | head -n1)
fi
[[ -n $svc ]] || die "no Service found for the Gateway's proxies"
k -n "$svc_ns" port-forward "$svc" "$local_port:80" >"$tmp/port-forward.log" 2>&1 &
port_forward=$!
for _ in $(seq 1 30); do
    curl -s -o /dev/null "http://127.0.0.1:$local_port/" && break
    sleep 1
done

# One long shared system prompt (a tenant's), a different short question each time.
system=$(for _ in $(seq 1 60); do printf 'You are the support assistant of tenant acme. '; done)
endpoints=()
for i in 1 2 3 4; do
    # The wasm VM loads (and fetches the module) on the first requests: retry a little.
    body=$(printf '{"model":"prefixroute-sim","max_tokens":8,"messages":[{"role":"system","content":"%s"},{"role":"user","content":"question %s"}]}' "$system" "$i")
    ok=
    for _ in $(seq 1 20); do
        if curl -sS --max-time 60 -o "$tmp/body" -D "$tmp/headers" \
            -H 'content-type: application/json' \
            --data "$body" \
            "http://127.0.0.1:$local_port/v1/chat/completions" &&
            grep -q '^HTTP/[0-9.]* 200' "$tmp/headers"; then
            ok=1
            break
        fi
        sleep 3
    done
    [[ -n $ok ]] || {
        cat "$tmp/headers" "$tmp/body" 2>/dev/null || true
        die "request $i through the gateway did not succeed (port-forward log: $(cat "$tmp/port-forward.log"))"
    }
    endpoint=$(awk -F': ' 'tolower($1) == "x-prefixroute-endpoint" { sub(/\r$/, "", $2); print $2 }' "$tmp/headers")
    [[ -n $endpoint ]] ||
        die "request $i was answered without an x-prefixroute-endpoint header: the prefixroute filter is not in the path"
    policy=$(awk -F': ' 'tolower($1) == "x-prefixroute-policy" { sub(/\r$/, "", $2); print $2 }' "$tmp/headers")
    echo "   request $i -> $endpoint (policy $policy)"
    endpoints+=("$endpoint")
done
if [[ ${endpoints[1]} == "${endpoints[2]}" && ${endpoints[2]} == "${endpoints[3]}" ]]; then
    echo "   the shared system prompt stayed on ${endpoints[1]} after the first request"
else
    echo "   note: repeated requests went to different endpoints (${endpoints[*]}); load can outweigh the prefix"
fi

printf '\nprefixroute (%s) is up. Gateway: kubectl --context %s -n %s port-forward %s %s:80\n' \
    "$variant" "$context" "$svc_ns" "$svc" "$local_port"
