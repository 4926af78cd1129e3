//! The kind/ manifests, checked without a cluster: they parse, validate against the CRDs the
//! data planes install (`kind/crds`), agree with each other (pool, Service, routes,
//! simulator, filter), and embed plugin configurations `PluginConfig` accepts.

use std::collections::BTreeMap;
use std::process::Command;

use prefixroute_core::config::PluginConfig;
use prefixroute_kind_tests::*;
use prefixroute_pool::{self as pool, schema};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const NS: &str = "prefixroute";

fn plugin_base() -> PluginConfig {
    let path = repo_root().join("kind/plugin-config.json");
    let bytes = std::fs::read(&path).unwrap();
    serde_json::from_slice(&bytes).expect("kind/plugin-config.json is a PluginConfig")
}

fn the_pool() -> Value {
    find("base", "InferencePool", "vllm-sim")
}

/// The Istio EnvoyFilter's patch applied to `applies_to` (with `operation`, when given).
fn istio_patch(applies_to: &str, operation: Option<&str>) -> Value {
    let filter = find("istio", "EnvoyFilter", "prefixroute");
    filter["spec"]["configPatches"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| {
            p["applyTo"] == applies_to && operation.map_or(true, |op| p["patch"]["operation"] == op)
        })
        .unwrap_or_else(|| panic!("Istio: no {applies_to} {operation:?} patch"))
        .clone()
}

/// A Kubernetes quantity of bytes as Envoy Gateway reads one (`32768`, `512Ki`, `5Mi`, `1Gi`).
fn quantity_bytes(v: &Value) -> Option<u64> {
    if let Some(n) = v.as_u64() {
        return Some(n);
    }
    let s = v.as_str()?;
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let scale = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        _ => return None,
    };
    digits.parse::<u64>().ok()?.checked_mul(scale)
}

/// Checks of the Envoy Gateway kinds whose CRDs are not in kind/crds.
fn check_eg_policy(kind: &str, o: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    let spec = &o["spec"];
    let refs: Vec<&Value> = match kind {
        "EnvoyPatchPolicy" => vec![&spec["targetRef"]],
        _ => spec["targetRefs"]
            .as_array()
            .map(|r| r.iter().collect())
            .unwrap_or_default(),
    };
    if refs.is_empty() {
        errs.push(format!("{kind}: no targetRef(s)"));
    }
    for r in refs {
        if r["group"] != "gateway.networking.k8s.io" || r["name"].as_str().is_none() {
            errs.push(format!("{kind}: bad target {r}"));
        }
    }
    match kind {
        "BackendTrafficPolicy" => {
            let lb = &spec["loadBalancer"];
            if !["RoundRobin", "Random", "LeastRequest", "ConsistentHash"]
                .contains(&lb["type"].as_str().unwrap_or_default())
            {
                errs.push(format!("loadBalancer.type {}", lb["type"]));
            }
            let sources = lb["endpointOverride"]["extractFrom"].as_array();
            let header_sources =
                sources.is_some_and(|s| !s.is_empty() && s.iter().all(|s| s["header"].is_string()));
            if !header_sources {
                errs.push("loadBalancer.endpointOverride.extractFrom needs header sources".into());
            }
        }
        "EnvoyPatchPolicy" => {
            if spec["type"] != "JSONPatch" {
                errs.push("type must be JSONPatch".into());
            }
            for p in spec["jsonPatches"].as_array().into_iter().flatten() {
                let t = p["type"].as_str().unwrap_or_default();
                if !t.starts_with("type.googleapis.com/envoy.config.")
                    || p["name"].as_str().is_none()
                {
                    errs.push(format!("bad patch target {p}"));
                }
                if !["add", "remove", "replace", "copy", "move", "test"]
                    .contains(&p["operation"]["op"].as_str().unwrap_or_default())
                {
                    errs.push(format!("bad op in {p}"));
                }
                if let Some(jp) = p["operation"]["jsonPath"].as_str() {
                    if !jp.starts_with("..") && !jp.starts_with('$') {
                        errs.push(format!("jsonPath {jp:?} should start with .. or $"));
                    }
                }
            }
        }
        "ClientTrafficPolicy" => {
            if quantity_bytes(&spec["connection"]["bufferLimit"]).is_none() {
                errs.push(format!(
                    "connection.bufferLimit {} is not a quantity",
                    spec["connection"]["bufferLimit"]
                ));
            }
        }
        _ => errs.push(format!("no checks for {kind}")),
    }
    errs
}

#[test]
fn every_manifest_parses_and_validates() {
    let crds = Crds::load(&crds_dir());
    let mut failures = Vec::new();
    let mut skipped_rules = 0;
    let objects = kind_objects();
    assert!(
        objects.len() >= 15,
        "only {} objects under kind/",
        objects.len()
    );
    for path in kind_yaml_files().iter().filter(|p| is_helm_values(p)) {
        read_yaml(path);
    }
    for (path, o) in &objects {
        let file = path
            .strip_prefix(repo_root())
            .unwrap_or(path)
            .display()
            .to_string();
        let api_version = o["apiVersion"].as_str().unwrap_or_default();
        let kind = o["kind"].as_str().unwrap_or_default();
        let name = o["metadata"]["name"].as_str().unwrap_or_default();
        let what = format!("{file}: {kind} {name:?}");
        if let Some(checked) = check_custom_resource(&crds, o) {
            skipped_rules += checked.skipped_rules;
            failures.extend(checked.errors.iter().map(|e| format!("{what}: {e}")));
            let namespaced = crds.get(api_version, kind).is_some_and(|c| c.namespaced);
            if namespaced && o["metadata"]["namespace"] != NS {
                failures.push(format!("{what}: not in namespace {NS}"));
            }
            continue;
        }
        let errors: Vec<String> = match (api_version, kind) {
            ("v1", "Namespace") => schema::validate_object_meta(o, false)
                .iter()
                .map(ToString::to_string)
                .collect(),
            ("v1", "Service" | "ConfigMap") | ("apps/v1", "Deployment") => {
                let mut e: Vec<String> = schema::validate_object_meta(o, true)
                    .iter()
                    .map(ToString::to_string)
                    .collect();
                if o["metadata"]["namespace"] != NS {
                    e.push(format!("not in namespace {NS}"));
                }
                e
            }
            (
                "gateway.envoyproxy.io/v1alpha1",
                "BackendTrafficPolicy" | "ClientTrafficPolicy" | "EnvoyPatchPolicy",
            ) => check_eg_policy(kind, o),
            ("kind.x-k8s.io/v1alpha4", "Cluster") => Vec::new(),
            _ => vec![format!(
                "no CRD in {} and no rule here for apiVersion {api_version:?} kind {kind:?}",
                crds_dir().display()
            )],
        };
        failures.extend(errors.iter().map(|e| format!("{what}: {e}")));
    }
    eprintln!(
        "{} objects checked; {skipped_rules} CEL rules of Gateway API/Istio/Envoy Gateway CRDs not evaluated",
        objects.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_validator_catches_a_broken_gateway_manifest() {
    // The generic validator is not vacuous on the big CRDs: a bad port and an unknown field
    // in an HTTPRoute are reported the API server's way.
    let crds = Crds::load(&crds_dir());
    let mut route = find("envoy-gateway", "HTTPRoute", "llm");
    route["spec"]["rules"][0]["backendRefs"][0]["port"] = json!(70000);
    route["spec"]["rules"][0]["colour"] = json!("blue");
    let checked = check_custom_resource(&crds, &route).expect("HTTPRoute CRD is known");
    let text = checked.errors.join("\n");
    assert!(
        text.contains("spec.rules[0].backendRefs[0].port: Invalid value: 70000: spec.rules[0].backendRefs[0].port in body should be less than or equal to 65535"),
        "{text}"
    );
    assert!(
        text.contains("unknown field \"spec.rules[0].colour\""),
        "{text}"
    );
}

#[test]
fn pool_crd_matches_the_vendored_schema() {
    fn strip(v: &Value) -> Value {
        match v {
            Value::Object(m) => Value::Object(
                m.iter()
                    .filter(|(k, _)| k.as_str() != "description")
                    .map(|(k, v)| {
                        let v = if k == "properties" {
                            Value::Object(
                                v.as_object()
                                    .map(|p| p.iter().map(|(k, v)| (k.clone(), strip(v))).collect())
                                    .unwrap_or_default(),
                            )
                        } else {
                            strip(v)
                        };
                        (k.clone(), v)
                    })
                    .collect(),
            ),
            Value::Array(a) => Value::Array(a.iter().map(strip).collect()),
            other => other.clone(),
        }
    }
    let crds = Crds::load(&crds_dir());
    let crd = crds
        .get(pool::API_VERSION, pool::KIND)
        .expect("the InferencePool CRD serves v1");
    assert_eq!(
        &strip(&crd.schema),
        pool::schema(),
        "core/src/pool/inferencepool.v1.schema.json differs from {}: regenerate it from the CRD",
        crd.file
    );
}

#[test]
fn every_cel_rule_of_the_pool_crd_is_one_the_validator_produces() {
    let crds = Crds::load(&crds_dir());
    let crd = crds.get(pool::API_VERSION, pool::KIND).unwrap();
    let rules = schema::cel_rules(&crd.schema);
    assert!(!rules.is_empty());
    let known: Vec<(&str, &str)> = pool::CEL_RULES.to_vec();
    for (path, rule, message) in &rules {
        assert!(
            known.contains(&(rule.as_str(), message.as_str())),
            "{path}: the CRD has a CEL rule the validator does not implement: {rule:?} ({message:?})"
        );
    }
    assert_eq!(
        rules.len(),
        known.len(),
        "the validator implements rules the CRD no longer has"
    );
    // And each message really comes out of the validator for a pool that breaks the rule.
    let mut bad = the_pool();
    bad["spec"]["targetPorts"] = json!([{"number": 8000}, {"number": 8000}]);
    bad["spec"]["endpointPickerRef"] = json!({"name": "epp"});
    let text = pool::validate(&bad, "default").unwrap_err().to_string();
    for (_, message) in known {
        assert!(text.contains(message), "{message:?} not produced:\n{text}");
    }
}

#[test]
fn every_pattern_in_the_crds_compiles() {
    let crds = Crds::load(&crds_dir());
    let mut count = 0;
    for ((api_version, kind), crd) in &crds.versions {
        for p in schema::patterns(&crd.schema) {
            schema::pattern(&p).unwrap_or_else(|e| panic!("{api_version} {kind}: {e}"));
            count += 1;
        }
    }
    assert!(count > 20, "only {count} patterns found");
}

/// The plugin configurations embedded in the variants, as (where, JSON text).
fn embedded_configs() -> Vec<(&'static str, String)> {
    let wasm_patch = istio_patch("HTTP_FILTER", None);
    let configuration = &wasm_patch["patch"]["value"]["typed_config"]["config"]["configuration"];
    assert_eq!(
        configuration["@type"],
        "type.googleapis.com/google.protobuf.StringValue"
    );
    let istio = configuration["value"].as_str().unwrap().to_string();
    let policy = find("envoy-gateway", "EnvoyExtensionPolicy", "prefixroute");
    let eg = serde_json::to_string(&policy["spec"]["wasm"][0]["config"]).unwrap();
    vec![
        ("istio/envoyfilter.yaml", istio),
        ("envoy-gateway/extension-policy.yaml", eg),
    ]
}

/// The pool cluster each variant's gateway builds for the route: Istio's outbound cluster of
/// the pool's shadow Service, Envoy Gateway's cluster of the HTTPRoute's first rule.
fn pool_clusters() -> Vec<(&'static str, String)> {
    let pool = the_pool();
    let name = pool["metadata"]["name"].as_str().unwrap();
    let route = find("envoy-gateway", "HTTPRoute", "llm");
    vec![
        (
            "istio/envoyfilter.yaml",
            format!(
                "outbound|54321||{}.{NS}.svc.cluster.local",
                shadow_service(name)
            ),
        ),
        (
            "envoy-gateway/extension-policy.yaml",
            format!(
                "httproute/{}/{}/rule/0",
                route["metadata"]["namespace"].as_str().unwrap(),
                route["metadata"]["name"].as_str().unwrap()
            ),
        ),
    ]
}

#[test]
fn embedded_plugin_configs_discover_the_pool_cluster_and_list_no_endpoints() {
    let base = plugin_base();
    let clusters = pool_clusters();
    for (file, json) in embedded_configs() {
        let config = PluginConfig::from_json(json.as_bytes()).unwrap_or_else(|e| {
            panic!("{file}: the embedded plugin configuration is rejected: {e}")
        });
        assert!(
            config.endpoints.is_empty(),
            "{file}: no rendered endpoint list"
        );
        let discovery = config.discovery.clone().expect("discovery");
        let expected = &clusters.iter().find(|(f, _)| *f == file).unwrap().1;
        assert_eq!(&discovery.pool_cluster, expected, "{file}");
        assert_eq!(discovery.cluster, "prefixroute_admin", "{file}");
        assert_eq!(
            PluginConfig {
                discovery: None,
                ..config
            },
            base,
            "{file}: differs from kind/plugin-config.json beyond the discovery"
        );
    }
}

/// The admin cluster each variant adds: a STATIC cluster on loopback at the data plane's
/// admin port.
#[test]
fn both_gateways_buffer_a_prompt_as_large_as_the_plugin_reads() {
    // The filter holds the body until its end; a held body past the listener's buffer limit
    // is answered 413 by Envoy (Envoy Gateway's default limit is 32 KiB, Envoy's 1 MiB).
    let max_body = plugin_base().max_body_bytes as u64;
    let istio = istio_patch("LISTENER", None);
    assert_eq!(istio["match"]["context"], "GATEWAY");
    assert_eq!(istio["patch"]["operation"], "MERGE");
    let istio_limit = istio["patch"]["value"]["per_connection_buffer_limit_bytes"]
        .as_u64()
        .expect("Istio: per_connection_buffer_limit_bytes");
    let ctp = find(
        "envoy-gateway",
        "ClientTrafficPolicy",
        "prefixroute-body-buffer",
    );
    assert_eq!(ctp["spec"]["targetRefs"][0]["kind"], "Gateway");
    assert_eq!(ctp["spec"]["targetRefs"][0]["name"], "prefixroute");
    let eg_limit = quantity_bytes(&ctp["spec"]["connection"]["bufferLimit"])
        .expect("Envoy Gateway: connection.bufferLimit");
    for (variant, limit) in [("istio", istio_limit), ("envoy-gateway", eg_limit)] {
        // Room for the headers and a request's trailers beside the body, as `serve` leaves.
        assert!(
            limit >= max_body + (1 << 20),
            "{variant}: buffer limit {limit} bytes, max_body_bytes {max_body}"
        );
    }
    // up.sh applies the policy with the rest of the variant.
    let up = std::fs::read_to_string(repo_root().join("kind/up.sh")).unwrap();
    assert!(up.contains("client-traffic-policy"), "kind/up.sh");
}

#[test]
fn a_quantity_is_read_with_its_binary_or_decimal_suffix_and_nothing_else() {
    assert_eq!(quantity_bytes(&json!("5Mi")), Some(5 << 20));
    assert_eq!(quantity_bytes(&json!("512Ki")), Some(512 << 10));
    assert_eq!(quantity_bytes(&json!("2M")), Some(2_000_000));
    assert_eq!(quantity_bytes(&json!(32768)), Some(32768));
    for bad in [
        json!("5MB"),
        json!("Mi"),
        json!("-1Mi"),
        json!(null),
        json!("1.5Mi"),
    ] {
        assert_eq!(quantity_bytes(&bad), None, "{bad}");
    }
}

#[test]
fn each_variant_reaches_its_own_admin_interface_on_loopback_and_retries_on_the_failover_list() {
    let filter = find("istio", "EnvoyFilter", "prefixroute");
    let patches = filter["spec"]["configPatches"].as_array().unwrap();
    let istio_admin = patches
        .iter()
        .find(|p| p["patch"]["value"]["name"] == "prefixroute_admin")
        .map(|p| p["patch"]["value"].clone())
        .expect("Istio: the admin cluster");
    let eg_admin = find("envoy-gateway", "EnvoyPatchPolicy", "prefixroute")["spec"]["jsonPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "prefixroute_admin")
        .map(|p| p["operation"]["value"].clone())
        .expect("Envoy Gateway: the admin cluster");
    // istio-proxy's admin and Envoy Gateway's EnvoyAdminPort.
    for (cluster, port) in [(istio_admin, 15000), (eg_admin, 19000)] {
        assert_eq!(cluster["type"], "STATIC");
        let socket = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            ["address"]["socket_address"];
        assert_eq!(socket["address"], "127.0.0.1");
        assert_eq!(socket["port_value"], port);
    }
    let failover = plugin_base().failover;
    assert!(failover > 0);
    let route = istio_patch("HTTP_ROUTE", None);
    assert_eq!(route["match"]["context"], "GATEWAY");
    let retry = &route["patch"]["value"]["route"]["retry_policy"];
    assert_eq!(retry["num_retries"], failover);
    for trigger in ["connect-failure", "reset", "retriable-status-codes"] {
        assert!(retry["retry_on"].as_str().unwrap().contains(trigger));
    }
    assert_eq!(retry["retriable_status_codes"], json!([500, 502, 503, 504]));
    let btp = find(
        "envoy-gateway",
        "BackendTrafficPolicy",
        "prefixroute-endpoint-override",
    );
    assert_eq!(btp["spec"]["retry"]["numRetries"], failover);
    let triggers = btp["spec"]["retry"]["retryOn"]["triggers"]
        .as_array()
        .unwrap();
    for trigger in ["connect-failure", "reset", "retriable-status-codes"] {
        assert!(triggers.iter().any(|t| t == trigger), "{trigger}");
    }
    // Server errors are retried in both gateways: the plugin reads the tries from Envoy's
    // attempt-count attribute, which needs no route or virtual-host setting.
    assert_eq!(
        btp["spec"]["retry"]["retryOn"]["httpStatusCodes"],
        json!([500, 502, 503, 504])
    );
}

#[test]
fn up_sh_rendering_keeps_the_manifests_valid() {
    // `prefixroute pool` (which up.sh runs) still resolves the pool's Ready Pods.
    let deployment = find("base", "Deployment", "vllm-sim");
    let mut items = vec![the_pool()];
    for i in 0..deployment["spec"]["replicas"].as_u64().unwrap() {
        items.push(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("vllm-sim-abc-{i}"), "namespace": NS,
                         "labels": deployment["spec"]["template"]["metadata"]["labels"]},
            "status": {"podIP": format!("10.244.0.{}", 10 + i),
                       "conditions": [{"type": "Ready", "status": "True"}]}
        }));
    }
    let mut objects = Vec::new();
    pool::flatten_lists(
        json!({"apiVersion": "v1", "kind": "List", "items": items}),
        &mut objects,
    );
    let p = pool::validate(&objects[0], "default").unwrap();
    let pods: Vec<pool::Pod> = objects
        .iter()
        .filter_map(|o| pool::Pod::from_value(o, "x"))
        .collect();
    assert_eq!(pool::resolve(&p, &pods).endpoints.len(), 3);
    let sha = "ab".repeat(32);

    let crds = Crds::load(&crds_dir());
    for file in [
        "istio/envoyfilter.yaml",
        "envoy-gateway/extension-policy.yaml",
    ] {
        let text = std::fs::read_to_string(repo_root().join("kind").join(file)).unwrap();
        assert_eq!(
            text.matches(&"0".repeat(64)).count(),
            1,
            "{file}: one sha256 placeholder"
        );
        let rendered = render(&text, &sha);
        for o in parse_yaml(&rendered).unwrap() {
            let checked = check_custom_resource(&crds, &o).unwrap();
            assert!(
                checked.errors.is_empty(),
                "{file} rendered: {:?}",
                checked.errors
            );
            let found = serde_json::to_string(&o).unwrap();
            assert!(found.contains(&sha), "{file}: sha256 not rendered");
        }
    }
}

fn shadow_service(pool_name: &str) -> String {
    // Istio's InferencePoolServiceName: <pool>-ip-<first 8 hex digits of sha256(pool)>.
    let hash = hex(&Sha256::digest(pool_name.as_bytes()));
    format!("{pool_name}-ip-{}", &hash[..8])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn istio_cluster_patch_targets_the_pool_shadow_service() {
    let pool = the_pool();
    let name = pool["metadata"]["name"].as_str().unwrap();
    let patch = istio_patch("CLUSTER", Some("MERGE"));
    assert_eq!(
        patch["match"]["cluster"]["service"],
        format!("{}.{NS}.svc.cluster.local", shadow_service(name))
    );
    // Istio gives the pool's first target port the shadow service port 54321.
    assert_eq!(patch["match"]["cluster"]["portNumber"], 54321);
    let policy =
        &patch["patch"]["value"]["load_balancing_policy"]["policies"][0]["typed_extension_config"];
    assert_eq!(
        policy["name"],
        "envoy.load_balancing_policies.override_host"
    );
    assert_eq!(
        policy["typed_config"]["override_host_sources"][0]["header"].as_str(),
        Some(plugin_base().destination_header.as_str())
    );
    assert!(policy["typed_config"]["fallback_policy"]["policies"][0].is_object());
}

#[test]
fn the_filter_may_pause_for_the_body_in_both_variants() {
    // Istio: the full PluginConfig is in the EnvoyFilter.
    let filter = find("istio", "EnvoyFilter", "prefixroute");
    let wasm = istio_patch("HTTP_FILTER", None);
    assert_eq!(wasm["patch"]["operation"], "INSERT_BEFORE");
    assert_eq!(
        wasm["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
        "envoy.filters.http.router"
    );
    let typed = &wasm["patch"]["value"]["typed_config"];
    assert_eq!(
        typed["@type"],
        "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
    );
    assert_eq!(typed["config"]["allow_on_headers_stop_iteration"], true);
    assert_eq!(typed["config"]["failure_policy"], "FAIL_RELOAD");
    assert_eq!(
        typed["config"]["vm_config"]["runtime"],
        "envoy.wasm.runtime.v8"
    );
    assert_eq!(filter["spec"]["targetRefs"][0]["name"], "prefixroute");

    // Envoy Gateway: the patch policy must select the filter the EnvoyExtensionPolicy makes
    // (envoy.filters.http.wasm/envoyextensionpolicy/<ns>/<name>/wasm/<index>).
    let policy = find("envoy-gateway", "EnvoyExtensionPolicy", "prefixroute");
    let generated = format!(
        "envoy.filters.http.wasm/envoyextensionpolicy/{}/{}/wasm/0",
        policy["metadata"]["namespace"].as_str().unwrap(),
        policy["metadata"]["name"].as_str().unwrap()
    );
    let patches = find("envoy-gateway", "EnvoyPatchPolicy", "prefixroute");
    let gateway = find("envoy-gateway", "Gateway", "prefixroute");
    let listener = format!(
        "{NS}/{}/{}",
        gateway["metadata"]["name"].as_str().unwrap(),
        gateway["spec"]["listeners"][0]["name"].as_str().unwrap()
    );
    let mut set = BTreeMap::new();
    for p in patches["spec"]["jsonPatches"].as_array().unwrap() {
        let Some(json_path) = p["operation"]["jsonPath"].as_str() else {
            continue;
        };
        assert_eq!(p["name"], listener.as_str());
        let inner = json_path
            .split_once("match(@.name, '")
            .and_then(|(_, rest)| rest.split_once("')"))
            .map(|(re, _)| re)
            .expect("a match() filter on the filter name");
        let re = schema::pattern(&format!("^{inner}$")).unwrap();
        assert!(
            re.is_match(&generated),
            "{inner} does not select {generated}"
        );
        assert!(
            !re.is_match("envoy.filters.http.wasm/envoyextensionpolicy/other/prefixroute/wasm/0")
        );
        assert!(json_path.ends_with(".typed_config.config"));
        set.insert(
            p["operation"]["path"].as_str().unwrap().to_string(),
            p["operation"]["value"].clone(),
        );
    }
    assert_eq!(
        set.get("allow_on_headers_stop_iteration"),
        Some(&json!(true))
    );
    assert_eq!(set.get("failure_policy"), Some(&json!("FAIL_RELOAD")));
    assert_eq!(patches["spec"]["targetRef"]["name"], "prefixroute");
}

#[test]
fn routes_and_services_cover_exactly_the_pool() {
    let pool = the_pool();
    let spec = &pool["spec"];
    let port = spec["targetPorts"][0]["number"].clone();

    let istio_route = find("istio", "HTTPRoute", "llm");
    let backend = &istio_route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(backend["group"], pool::GROUP);
    assert_eq!(backend["kind"], pool::KIND);
    assert_eq!(backend["name"], pool["metadata"]["name"]);
    assert_eq!(
        find("istio", "Gateway", "prefixroute")["spec"]["gatewayClassName"],
        "istio"
    );

    let eg_route = find("envoy-gateway", "HTTPRoute", "llm");
    let backend = &eg_route["spec"]["rules"][0]["backendRefs"][0];
    let service = find("base", "Service", backend["name"].as_str().unwrap());
    assert_eq!(service["spec"]["selector"], spec["selector"]["matchLabels"]);
    let svc_port = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == backend["port"])
        .expect("the route's port is a Service port")
        .clone();
    let deployment = find("base", "Deployment", "vllm-sim");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let target = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| {
            p["name"] == svc_port["targetPort"] || p["containerPort"] == svc_port["targetPort"]
        })
        .expect("the Service's targetPort is a container port")
        .clone();
    assert_eq!(
        target["containerPort"], port,
        "the Service must reach the pool's target port"
    );
    let class = find("envoy-gateway", "GatewayClass", "prefixroute-eg");
    assert_eq!(
        class["spec"]["controllerName"],
        "gateway.envoyproxy.io/gatewayclass-controller"
    );
    assert_eq!(
        find("envoy-gateway", "Gateway", "prefixroute")["spec"]["gatewayClassName"],
        "prefixroute-eg"
    );

    for (kind, name) in [
        ("BackendTrafficPolicy", "prefixroute-endpoint-override"),
        ("EnvoyExtensionPolicy", "prefixroute"),
    ] {
        let policy = find("envoy-gateway", kind, name);
        let target = &policy["spec"]["targetRefs"][0];
        assert_eq!(
            (target["kind"].as_str(), target["name"].as_str()),
            (Some("HTTPRoute"), Some("llm")),
            "{kind}"
        );
    }
    let btp = find(
        "envoy-gateway",
        "BackendTrafficPolicy",
        "prefixroute-endpoint-override",
    );
    assert_eq!(
        btp["spec"]["loadBalancer"]["endpointOverride"]["extractFrom"][0]["header"].as_str(),
        Some(plugin_base().destination_header.as_str())
    );

    // The picker Service the pool names exists (Istio resolves it) and selects nothing.
    let epp = spec["endpointPickerRef"].clone();
    assert_eq!(epp["failureMode"], "FailOpen");
    let epp_service = find("base", "Service", epp["name"].as_str().unwrap());
    assert!(epp_service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["port"] == epp["port"]["number"]));
    for (path, o) in kind_objects() {
        let labels = &o["spec"]["template"]["metadata"]["labels"];
        if let Some(selector) = epp_service["spec"]["selector"].as_object() {
            let selected = selector.iter().all(|(k, v)| &labels[k] == v);
            assert!(
                !selected,
                "{} has Pods the no-op picker Service selects",
                path.display()
            );
        }
    }
}

#[test]
fn simulator_deployment_matches_the_pool_and_the_plugin() {
    let base = plugin_base();
    let pool = pool::validate(&the_pool(), "default").unwrap();
    let d = find("base", "Deployment", "vllm-sim");
    assert_eq!(d["spec"]["replicas"], 3);
    let labels = &d["spec"]["template"]["metadata"]["labels"];
    for (k, v) in &pool.match_labels {
        assert_eq!(
            labels[k].as_str(),
            Some(v.as_str()),
            "Pods must carry the pool's labels"
        );
    }
    let c = &d["spec"]["template"]["spec"]["containers"][0];
    let image = c["image"].as_str().unwrap();
    let (repo, tag) = image.rsplit_once(':').expect("a pinned tag");
    assert_eq!(repo, "ghcr.io/llm-d/llm-d-inference-sim");
    assert!(
        tag.starts_with('v') && tag != "latest",
        "pin a released tag, not {tag}"
    );
    assert!(c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["containerPort"] == u64::from(pool.target_ports[0])));

    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let value = |flag: &str| -> Option<&str> {
        args.iter()
            .position(|a| *a == flag)
            .and_then(|i| args.get(i + 1).copied())
    };
    assert_eq!(
        value("--model"),
        base.model.as_deref(),
        "the plugin counts this model's metrics"
    );
    assert_eq!(
        value("--port"),
        Some(pool.target_ports[0].to_string().as_str())
    );
    assert!(args.contains(&"--enable-kvcache"));
    assert!(value("--kv-cache-size").is_some_and(|v| v.parse::<u32>().is_ok()));
    assert_eq!(
        value("--block-size"),
        Some(base.block_size.to_string().as_str()),
        "router and server must agree on the block size"
    );
    for flag in [
        "--prefill-time-per-token",
        "--prefill-overhead",
        "--inter-token-latency",
    ] {
        let v = value(flag).unwrap_or_else(|| panic!("{flag} missing"));
        assert!(
            v.ends_with("ms") || v.ends_with("us") || v.ends_with('s'),
            "{flag} {v}: a duration"
        );
    }
    let env: BTreeMap<&str, &str> = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap(),
                e["valueFrom"]["fieldRef"]["fieldPath"]
                    .as_str()
                    .unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(env.get("POD_IP"), Some(&"status.podIP"));
    assert_eq!(env.get("POD_NAME"), Some(&"metadata.name"));
}

#[test]
fn plugin_module_and_scrape_cluster_are_the_same_in_both_variants() {
    let base = plugin_base();
    let server = find("base", "Service", "prefixroute-wasm");
    let port = server["spec"]["ports"][0]["port"].as_u64().unwrap();
    let fqdn = format!("prefixroute-wasm.{NS}.svc.cluster.local");
    let url = format!("http://{fqdn}:{port}/prefixroute.wasm");

    let wasm = istio_patch("HTTP_FILTER", None);
    let remote = &wasm["patch"]["value"]["typed_config"]["config"]["vm_config"]["code"]["remote"];
    assert_eq!(remote["http_uri"]["uri"], url.as_str());
    assert_eq!(
        remote["http_uri"]["cluster"],
        format!("outbound|{port}||{fqdn}")
    );
    let policy = find("envoy-gateway", "EnvoyExtensionPolicy", "prefixroute");
    assert_eq!(
        policy["spec"]["wasm"][0]["code"]["http"]["url"],
        url.as_str()
    );

    let istio_cluster = istio_patch("CLUSTER", Some("ADD"))["patch"]["value"].clone();
    let eg_cluster = find("envoy-gateway", "EnvoyPatchPolicy", "prefixroute")["spec"]
        ["jsonPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["type"] == "type.googleapis.com/envoy.config.cluster.v3.Cluster")
        .map(|p| p["operation"]["value"].clone())
        .expect("the scrape cluster");
    for cluster in [istio_cluster, eg_cluster] {
        assert_eq!(cluster["name"], base.scrape.cluster.as_str());
        assert_eq!(cluster["type"], "ORIGINAL_DST");
        assert_eq!(cluster["lb_policy"], "CLUSTER_PROVIDED");
        assert_eq!(cluster["original_dst_lb_config"]["use_http_header"], true);
    }
}

#[test]
fn scripts_pass_bash_n_and_shellcheck() {
    let kind = repo_root().join("kind");
    for script in ["up.sh", "down.sh"] {
        let path = kind.join(script);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("#!/usr/bin/env bash\n"), "{script}");
        assert!(
            text.contains("NEEDS:"),
            "{script} must say it needs Docker and network at the top"
        );
        let out = Command::new("bash")
            .arg("-n")
            .arg(&path)
            .output()
            .expect("bash");
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        match Command::new("shellcheck").arg(&path).output() {
            Ok(out) => assert!(
                out.status.success(),
                "shellcheck {script}:\n{}",
                String::from_utf8_lossy(&out.stdout)
            ),
            Err(_) => eprintln!("shellcheck not installed: {script} only checked with bash -n"),
        }
    }
    let up = std::fs::read_to_string(kind.join("up.sh")).unwrap();
    for tool in ["docker", "kind", "kubectl", "helm"] {
        assert!(
            up.contains(&format!("need {tool} ")),
            "up.sh must check for {tool} first"
        );
    }
    // up.sh's awk render and render() here agree on the placeholder, and nothing else is
    // rendered.
    assert!(up.contains(&"0".repeat(64)));
    assert!(
        !up.contains("pool-config") && !up.contains("PLUGIN_CONFIG"),
        "up.sh renders no endpoint list"
    );
}

#[test]
fn the_kv_event_relay_is_wired_to_the_simulator_and_to_both_variants() {
    let base = plugin_base();
    assert_eq!(base.index, prefixroute_core::config::IndexMode::Precise);
    let relay = find("base", "Deployment", "prefixroute-kv-events");
    let service = find("base", "Service", "prefixroute-kv-events");
    let args: Vec<&str> = relay["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| *a == flag)
            .and_then(|i| args.get(i + 1).copied())
            .unwrap_or_else(|| panic!("relay {flag} missing"))
    };
    assert_eq!(args[0], "kv-events");
    assert_eq!(value("--block-size"), base.block_size.to_string());
    assert_eq!(Some(value("--model")), base.model.as_deref());
    let port_of = |name: &str| {
        service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["targetPort"] == name)
            .and_then(|p| p["port"].as_u64())
            .unwrap_or_else(|| panic!("no Service port for {name}"))
    };
    let fqdn = format!("prefixroute-kv-events.{NS}.svc.cluster.local");
    // The simulator publishes to the relay's bound SUB socket.
    let sim = find("base", "Deployment", "vllm-sim");
    let sim_args: Vec<&str> = sim["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let zmq = sim_args
        .iter()
        .position(|a| *a == "--zmq-endpoint")
        .map(|i| sim_args[i + 1])
        .expect("the simulator publishes KV events");
    assert_eq!(zmq, format!("tcp://{fqdn}:{}", port_of("zmq")));
    assert!(value("--bind").ends_with(":5557"));
    // Both variants reach the relay's feed through the cluster the plugin names.
    let istio = find("istio", "EnvoyFilter", "prefixroute")["spec"]["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["patch"]["value"]["name"] == base.kv_events.cluster.as_str())
        .map(|p| p["patch"]["value"].clone())
        .expect("Istio: the relay's cluster");
    let eg = find("envoy-gateway", "EnvoyPatchPolicy", "prefixroute")["spec"]["jsonPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == base.kv_events.cluster.as_str())
        .map(|p| p["operation"]["value"].clone())
        .expect("Envoy Gateway: the relay's cluster");
    for cluster in [istio, eg] {
        let socket = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            ["address"]["socket_address"];
        assert_eq!(socket["address"], fqdn.as_str());
        assert_eq!(socket["port_value"], port_of("feed"));
        assert_eq!(cluster["type"], "STRICT_DNS");
    }
}
