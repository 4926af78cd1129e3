//! `prefixroute pool` as a user runs it: exit codes, the API server's wording, the report, and
//! the `--args` / `--config` outputs.

mod support;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use prefixroute_core::config::PluginConfig;
use serde_json::{json, Value};

fn prefixroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prefixroute"))
        .args(args)
        .output()
        .expect("run prefixroute")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn write(name: &str, contents: &str) -> PathBuf {
    let path = support::scratch_dir().join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

fn pool_yaml(name: &str, spec: &str) -> String {
    format!(
        "apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\nmetadata:\n  name: {name}\n  namespace: llm\nspec:\n{spec}"
    )
}

const VALID_SPEC: &str =
    "  selector:\n    matchLabels:\n      app: vllm\n  targetPorts:\n    - number: 8000\n";

fn pod(name: &str, ns: &str, app: &str, ready: bool, ip: Option<&str>) -> Value {
    let mut status = json!({"phase": "Running", "conditions": [
        {"type": "Initialized", "status": "True"},
        {"type": "Ready", "status": if ready { "True" } else { "False" }},
    ]});
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
        status["podIPs"] = json!([{"ip": ip}]);
    }
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": ns, "labels": {"app": app}},
           "status": status})
}

/// What `kubectl get inferencepools.inference.networking.k8s.io,pods -o json` prints.
fn kubectl_list(target_ports: &[u16]) -> String {
    let ports: Vec<Value> = target_ports.iter().map(|p| json!({"number": p})).collect();
    let list = json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""}, "items": [
        {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
         "metadata": {"name": "vllm", "namespace": "llm", "uid": "1", "generation": 1},
         "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": ports,
                  "appProtocol": "http",
                  "endpointPickerRef": {"group": "", "kind": "Service", "name": "epp",
                                        "port": {"number": 9002}, "failureMode": "FailClose"}},
         "status": {"parents": [{"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"},
                                 "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                                                 "message": "", "lastTransitionTime": "2025-01-01T00:00:00Z"}]}]}},
        pod("vllm-1", "llm", "vllm", true, Some("10.0.0.11")),
        pod("vllm-0", "llm", "vllm", true, Some("10.0.0.10")),
        pod("vllm-2", "llm", "vllm", false, Some("10.0.0.12")),
        pod("vllm-3", "llm", "vllm", true, None),
        pod("web-0", "llm", "web", true, Some("10.0.0.20")),
        pod("vllm-x", "other", "vllm", true, Some("10.0.1.10")),
    ]});
    serde_json::to_string_pretty(&list).unwrap()
}

#[test]
fn valid_pool_report() {
    let path = write("valid.yaml", &pool_yaml("vllm", VALID_SPEC));
    let out = prefixroute(&["pool", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("InferencePool llm/vllm: valid"), "{stdout}");
    assert!(
        stdout.contains("appProtocol     http"),
        "defaults are applied: {stdout}"
    );
    assert!(stdout.contains("the input has no Pods"), "{stdout}");
}

#[test]
fn resolves_kubectl_output_like_an_endpoint_picker() {
    let path = write("list.json", &kubectl_list(&[8000]));
    let out = prefixroute(&["pool", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("endpoints       2 (2 of 4 selected Pods)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("vllm-0  10.0.0.10:8000  vllm-0"),
        "{stdout}"
    );
    assert!(stdout.contains("excluded: vllm-2 (not Ready)"), "{stdout}");
    assert!(
        stdout.contains("excluded: vllm-3 (no podIP yet)"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("web-0") && !stdout.contains("vllm-x"),
        "{stdout}"
    );

    let out = prefixroute(&["pool", path.to_str().unwrap(), "--args"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "--endpoint vllm-0=http://10.0.0.10:8000\n--endpoint vllm-1=http://10.0.0.11:8000\n"
    );

    let out = prefixroute(&["pool", path.to_str().unwrap(), "--config"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let config = PluginConfig::from_json(&out.stdout).expect("core accepts the configuration");
    let endpoints: Vec<(&str, &str)> = config
        .endpoints
        .iter()
        .map(|e| (e.name.as_str(), e.address.as_str()))
        .collect();
    assert_eq!(
        endpoints,
        [("vllm-0", "10.0.0.10:8000"), ("vllm-1", "10.0.0.11:8000")]
    );
    assert_eq!(config.policy, PluginConfig::default().policy);
}

#[test]
fn several_target_ports_and_a_base_config() {
    let path = write("ports.json", &kubectl_list(&[8000, 8001]));
    let out = prefixroute(&["pool", path.to_str().unwrap(), "--args"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let lines: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    assert_eq!(
        lines,
        [
            "--endpoint vllm-0:8000=http://10.0.0.10:8000",
            "--endpoint vllm-0:8001=http://10.0.0.10:8001",
            "--endpoint vllm-1:8000=http://10.0.0.11:8000",
            "--endpoint vllm-1:8001=http://10.0.0.11:8001",
        ]
    );
    let base = write(
        "base.json",
        r#"{"endpoints": [], "policy": "least-queue", "model": "m", "block_size": 32}"#,
    );
    let out = prefixroute(&[
        "pool",
        path.to_str().unwrap(),
        "--config",
        "--compact",
        "--base",
        base.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "--compact is one line: {stdout}");
    assert!(stdout.starts_with("{\"endpoints\":"), "{stdout}");
    let config = PluginConfig::from_json(stdout.as_bytes()).unwrap();
    assert_eq!((config.endpoints.len(), config.block_size), (4, 32));
    assert_eq!(config.model.as_deref(), Some("m"));
}

/// Runs `pool` on one InferencePool spec and returns (exit code, stderr).
fn invalid(spec: &str) -> (Option<i32>, String) {
    let path = write("invalid.yaml", &pool_yaml("bad", spec));
    let out = prefixroute(&["pool", path.to_str().unwrap()]);
    (out.status.code(), text(&out.stderr))
}

#[test]
fn invalid_pools_exit_1_with_the_api_server_wording() {
    let cases = [
        (
            "  selector: {matchLabels: {app: vllm}}\n  targetPorts: [{number: 8000}, {number: 8000}]\n",
            "The InferencePool \"bad\" is invalid: spec.targetPorts: Invalid value: \"array\": port number must be unique",
        ),
        (
            "  selector: {matchLabels: {app: vllm}}\n  targetPorts: [{number: 8000}]\n  endpointPickerRef: {name: epp}\n",
            "spec.endpointPickerRef: Invalid value: \"object\": port is required when kind is 'Service' or unspecified (defaults to 'Service')",
        ),
        (
            "  selector: {matchLabels: {app: vllm}}\n  targetPorts: [{number: 1}, {number: 2}, {number: 3}, {number: 4}, {number: 5}, {number: 6}, {number: 7}, {number: 8}, {number: 9}]\n",
            "spec.targetPorts: Too many: 9: must have at most 8 items",
        ),
        (
            "  selector: {matchLabels: {}}\n  targetPorts: [{number: 8000}]\n",
            "spec.selector.matchLabels: Invalid value: 0: spec.selector.matchLabels in body should have at least 1 properties",
        ),
        (
            "  selector: {matchLabels: {app: vllm}}\n  targetPorts: [{number: 8000}]\n  appProtocol: grpc\n",
            "spec.appProtocol: Unsupported value: \"grpc\": supported values: \"http\", \"kubernetes.io/h2c\"",
        ),
        (
            "  selector: {matchLabels: {app: vllm}}\n  targetPorts: []\n",
            "spec.targetPorts: Invalid value: 0: spec.targetPorts in body should have at least 1 items",
        ),
        (
            "  targetPorts: [{number: 0}]\n",
            "spec.selector: Required value",
        ),
    ];
    for (spec, want) in cases {
        let (code, stderr) = invalid(spec);
        assert_eq!(code, Some(1), "{spec}\n{stderr}");
        assert!(
            stderr.contains(want),
            "{spec}\nwant: {want}\ngot:  {stderr}"
        );
    }
    let (_, stderr) = invalid("  targetPorts: [{number: 0}]\n");
    assert!(
        stderr.contains("* spec.targetPorts[0].number: Invalid value: 0: spec.targetPorts[0].number in body should be greater than or equal to 1"),
        "{stderr}"
    );
}

#[test]
fn every_pool_is_validated_and_pool_selects_one() {
    let two = format!(
        "{}---\n{}",
        pool_yaml("good", VALID_SPEC),
        pool_yaml(
            "broken",
            "  selector: {}\n  targetPorts: [{number: 8000}]\n"
        )
    );
    let path = write("two.yaml", &two);
    let out = prefixroute(&["pool", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).contains("InferencePool llm/good: valid"));
    assert!(text(&out.stderr).contains(
        "The InferencePool \"broken\" is invalid: spec.selector.matchLabels: Required value"
    ));

    let out = prefixroute(&["pool", path.to_str().unwrap(), "--pool", "good"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    let out = prefixroute(&["pool", path.to_str().unwrap(), "--args"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("choose one with --pool NAME"),
        "{}",
        text(&out.stderr)
    );

    let out = prefixroute(&["pool", path.to_str().unwrap(), "--pool", "nope"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("it has: good, broken"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn usage_and_input_errors_exit_2() {
    let out = prefixroute(&["pool", "/nonexistent/pool.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("cannot read /nonexistent/pool.yaml"));

    let path = write(
        "nopool.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\n",
    );
    let out = prefixroute(&["pool", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("no InferencePool in"));

    let path = write("broken.yaml", "kind: [unclosed\n");
    let out = prefixroute(&["pool", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));

    // No Ready endpoint: nothing to print flags for.
    let path = write("valid2.yaml", &pool_yaml("vllm", VALID_SPEC));
    let out = prefixroute(&["pool", path.to_str().unwrap(), "--config"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("has no endpoints: the input has no Pods"));
}

#[test]
fn old_api_versions_are_not_this_crd() {
    let yaml = pool_yaml("old", VALID_SPEC).replace(
        "inference.networking.k8s.io/v1",
        "inference.networking.x-k8s.io/v1alpha2",
    );
    let path = write("old.yaml", &yaml);
    let out = prefixroute(&["pool", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no matches for kind \"InferencePool\" in version \"inference.networking.x-k8s.io/v1alpha2\""),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn reads_stdin() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_prefixroute"))
        .args(["pool", "-", "--args"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(kubectl_list(&[8000]).as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).lines().count(), 2);
}

#[test]
fn the_kind_pool_is_valid() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kind/base/inferencepool.yaml");
    let out = prefixroute(&["pool", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("InferencePool prefixroute/vllm-sim: valid"));
}
