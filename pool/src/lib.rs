//! InferencePool (`inference.networking.k8s.io/v1`): validation by the CRD's own rules, and
//! endpoint resolution the way an endpoint picker does it.
//!
//! * [`validate`] checks one object against the CRD's `openAPIV3Schema` (vendored in
//!   `pool/src/inferencepool.v1.schema.json`, kept equal to `kind/crds/` by a test) with the
//!   generic validator in [`mod@schema`], plus the CRD's two CEL rules, and words every error as
//!   the API server does.
//! * [`resolve`] picks the Pods an endpoint picker would: same namespace, labels matching
//!   `selector.matchLabels`, condition `Ready` = `"True"`, a `podIP`; one `podIP:port` per
//!   target port.
//! * [`Resolution::plugin_config`] turns the endpoints into the plugin's [`PluginConfig`].
//!
//! Pure functions over `serde_json::Value`: no I/O, so the CLI, tests and (if ever wanted) the
//! plugin share them.

pub mod schema;

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::OnceLock;

use serde_json::Value;
use thiserror::Error;

use prefixroute_core::config::{ConfigError, EndpointConfig, PluginConfig};
use schema::{CelRules, FieldError, UnknownRules};

pub const GROUP: &str = "inference.networking.k8s.io";
pub const API_VERSION: &str = "inference.networking.k8s.io/v1";
pub const KIND: &str = "InferencePool";

/// The CRD's `openAPIV3Schema` for v1 (descriptions stripped).
pub const SCHEMA_JSON: &str = include_str!("inferencepool.v1.schema.json");

/// The CRD's `x-kubernetes-validations` rules, by exact text, with the CRD's messages. The
/// validator evaluates exactly these; a rule the CRD adds makes validation fail loudly.
pub const CEL_RULES: [(&str, &str); 2] = [
    (
        "self.kind != 'Service' || has(self.port)",
        "port is required when kind is 'Service' or unspecified (defaults to 'Service')",
    ),
    (
        "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
        "port number must be unique",
    ),
];

/// The parsed schema.
pub fn schema() -> &'static Value {
    static SCHEMA: OnceLock<Value> = OnceLock::new();
    SCHEMA.get_or_init(|| serde_json::from_str(SCHEMA_JSON).unwrap_or(Value::Null))
}

/// Evaluates the InferencePool CRD's CEL rules.
pub struct PoolCel;

impl CelRules for PoolCel {
    fn eval(&self, rule: &str, this: &Value) -> Option<bool> {
        if rule == CEL_RULES[0].0 {
            // `self.kind != 'Service' || has(self.port)` (kind is defaulted before CEL runs).
            let kind = this.get("kind").and_then(Value::as_str);
            let has_port = this.get("port").is_some_and(|p| !p.is_null());
            return Some(kind != Some("Service") || has_port);
        }
        if rule == CEL_RULES[1].0 {
            // Every element's `number` occurs exactly once.
            let items = this.as_array()?;
            let numbers: Vec<Option<&Value>> = items.iter().map(|p| p.get("number")).collect();
            return Some(
                numbers
                    .iter()
                    .all(|n| numbers.iter().filter(|m| *m == n).count() == 1),
            );
        }
        None
    }
}

/// Why an object is not a valid InferencePool.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PoolError {
    #[error("InferencePool {name:?}: no matches for kind \"InferencePool\" in version {api_version:?} (this tool knows {API_VERSION})")]
    WrongVersion { name: String, api_version: String },
    #[error("{}", invalid_message(.name, .errors))]
    Invalid {
        name: String,
        errors: Vec<FieldError>,
    },
}

/// kubectl's wording: `The InferencePool "x" is invalid: <error>`, or a bullet list.
fn invalid_message(name: &str, errors: &[FieldError]) -> String {
    let head = format!("The {KIND} {name:?} is invalid: ");
    match errors {
        [one] => format!("{head}{one}"),
        many => {
            let mut s = head;
            for e in many {
                s.push_str(&format!("\n* {e}"));
            }
            s
        }
    }
}

/// A validated InferencePool (defaults applied).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferencePool {
    pub name: String,
    pub namespace: String,
    pub match_labels: BTreeMap<String, String>,
    pub target_ports: Vec<u16>,
    /// `http` or `kubernetes.io/h2c`.
    pub app_protocol: String,
    pub endpoint_picker: Option<EndpointPickerRef>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointPickerRef {
    pub group: String,
    pub kind: String,
    pub name: String,
    pub port: Option<u16>,
    /// `FailOpen` or `FailClose`.
    pub failure_mode: String,
}

impl fmt::Display for InferencePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(k))?.as_str()
}

fn object_name(object: &Value) -> String {
    str_at(object, &["metadata", "name"])
        .unwrap_or_default()
        .to_string()
}

fn object_namespace(object: &Value, default_namespace: &str) -> String {
    str_at(object, &["metadata", "namespace"])
        .filter(|ns| !ns.is_empty())
        .unwrap_or(default_namespace)
        .to_string()
}

/// True for an object whose kind is InferencePool (any group or version).
pub fn is_inference_pool(object: &Value) -> bool {
    object.get("kind").and_then(Value::as_str) == Some(KIND)
}

/// Validates one InferencePool as the API server would on create (defaults, schema, CEL,
/// metadata). `default_namespace` is used when the object names none.
pub fn validate(object: &Value, default_namespace: &str) -> Result<InferencePool, PoolError> {
    let name = object_name(object);
    let api_version = object
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if api_version != API_VERSION {
        return Err(PoolError::WrongVersion {
            name,
            api_version: api_version.to_string(),
        });
    }
    let mut errors = schema::validate_object_meta(object, true);
    let (defaulted, report) = schema::validate(schema(), object, &PoolCel, UnknownRules::Fail);
    errors.extend(report.errors);
    if !errors.is_empty() {
        return Err(PoolError::Invalid { name, errors });
    }
    let spec = defaulted.get("spec").cloned().unwrap_or(Value::Null);
    let match_labels = string_map(spec.get("selector").and_then(|s| s.get("matchLabels")));
    let target_ports = spec
        .get("targetPorts")
        .and_then(Value::as_array)
        .map(|ports| {
            ports
                .iter()
                .filter_map(|p| p.get("number")?.as_u64())
                .filter_map(|n| u16::try_from(n).ok())
                .collect()
        })
        .unwrap_or_default();
    let endpoint_picker = spec.get("endpointPickerRef").map(|r| EndpointPickerRef {
        group: str_at(r, &["group"]).unwrap_or_default().to_string(),
        kind: str_at(r, &["kind"]).unwrap_or("Service").to_string(),
        name: str_at(r, &["name"]).unwrap_or_default().to_string(),
        port: r
            .get("port")
            .and_then(|p| p.get("number"))
            .and_then(Value::as_u64)
            .and_then(|n| u16::try_from(n).ok()),
        failure_mode: str_at(r, &["failureMode"])
            .unwrap_or("FailClose")
            .to_string(),
    });
    Ok(InferencePool {
        name,
        namespace: object_namespace(object, default_namespace),
        match_labels,
        target_ports,
        app_protocol: str_at(&spec, &["appProtocol"])
            .unwrap_or("http")
            .to_string(),
        endpoint_picker,
    })
}

/// What resolution needs to know of a Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    pub name: String,
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    /// `status.conditions` has `type: Ready` with `status: "True"`.
    pub ready: bool,
    pub pod_ip: Option<String>,
}

impl Pod {
    /// Reads a Pod object (`kind: Pod`, `apiVersion: v1`); `None` for anything else.
    pub fn from_value(object: &Value, default_namespace: &str) -> Option<Pod> {
        if object.get("kind").and_then(Value::as_str) != Some("Pod")
            || object.get("apiVersion").and_then(Value::as_str) != Some("v1")
        {
            return None;
        }
        let labels = string_map(object.get("metadata").and_then(|m| m.get("labels")));
        let status = object.get("status");
        let ready = status
            .and_then(|s| s.get("conditions"))
            .and_then(Value::as_array)
            .is_some_and(|conds| {
                conds.iter().any(|c| {
                    c.get("type").and_then(Value::as_str) == Some("Ready")
                        && c.get("status").and_then(Value::as_str) == Some("True")
                })
            });
        let pod_ip = status
            .and_then(|s| s.get("podIP"))
            .and_then(Value::as_str)
            .filter(|ip| !ip.is_empty())
            .map(str::to_string);
        Some(Pod {
            name: object_name(object),
            namespace: object_namespace(object, default_namespace),
            labels,
            ready,
            pod_ip,
        })
    }
}

/// One `podIP:port` the pool routes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The pod name, or `pod:port` when the pool has several target ports.
    pub name: String,
    pub pod: String,
    pub ip: IpAddr,
    pub port: u16,
}

impl Endpoint {
    /// `ip:port`, IPv6 in brackets (what Envoy's override_host expects).
    pub fn address(&self) -> String {
        match self.ip {
            IpAddr::V4(ip) => format!("{ip}:{}", self.port),
            IpAddr::V6(ip) => format!("[{ip}]:{}", self.port),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.address())
    }
}

/// Why a Pod that matches the selector is not an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Excluded {
    NotReady,
    NoPodIp,
    BadPodIp(String),
}

impl fmt::Display for Excluded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Excluded::NotReady => f.write_str("not Ready"),
            Excluded::NoPodIp => f.write_str("no podIP yet"),
            Excluded::BadPodIp(ip) => write!(f, "podIP {ip:?} is not an IP address"),
        }
    }
}

/// The endpoints of one pool.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Resolution {
    pub endpoints: Vec<Endpoint>,
    /// Pods that match the selector in the pool's namespace (sorted by name).
    pub selected: Vec<String>,
    /// Selected pods left out, with the reason.
    pub excluded: Vec<(String, Excluded)>,
}

impl Resolution {
    /// The plugin configuration for these endpoints: `base` with its endpoint list replaced,
    /// validated by [`PluginConfig::validate`].
    pub fn plugin_config(&self, base: PluginConfig) -> Result<PluginConfig, ConfigError> {
        let config = PluginConfig {
            endpoints: self
                .endpoints
                .iter()
                .map(|e| EndpointConfig {
                    name: e.name.clone(),
                    address: e.address(),
                })
                .collect(),
            ..base
        };
        config.validate()?;
        Ok(config)
    }
}

/// The pool's endpoints among `pods`, as an endpoint picker selects them.
pub fn resolve(pool: &InferencePool, pods: &[Pod]) -> Resolution {
    let mut selected: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.namespace == pool.namespace)
        .filter(|p| {
            pool.match_labels
                .iter()
                .all(|(k, v)| p.labels.get(k) == Some(v))
        })
        .collect();
    selected.sort_by(|a, b| a.name.cmp(&b.name));
    selected.dedup_by(|a, b| a.name == b.name);
    let several = pool.target_ports.len() > 1;
    let mut out = Resolution {
        selected: selected.iter().map(|p| p.name.clone()).collect(),
        ..Resolution::default()
    };
    for pod in selected {
        if !pod.ready {
            out.excluded.push((pod.name.clone(), Excluded::NotReady));
            continue;
        }
        let Some(ip) = &pod.pod_ip else {
            out.excluded.push((pod.name.clone(), Excluded::NoPodIp));
            continue;
        };
        let Ok(ip) = ip.parse::<IpAddr>() else {
            out.excluded
                .push((pod.name.clone(), Excluded::BadPodIp(ip.clone())));
            continue;
        };
        for &port in &pool.target_ports {
            out.endpoints.push(Endpoint {
                name: if several {
                    format!("{}:{port}", pod.name)
                } else {
                    pod.name.clone()
                },
                pod: pod.name.clone(),
                ip,
                port,
            });
        }
    }
    out
}

/// Flattens `kind: List` (what `kubectl get a,b -o json` prints) and typed lists
/// (`PodList`, `InferencePoolList`, whose items may lack kind/apiVersion) into objects.
pub fn flatten_lists(document: Value, out: &mut Vec<Value>) {
    let kind = document
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let is_list = kind.ends_with("List") && document.get("items").is_some_and(Value::is_array);
    if !is_list {
        if !document.is_null() {
            out.push(document);
        }
        return;
    }
    let api_version = document.get("apiVersion").cloned();
    let item_kind = kind.strip_suffix("List").unwrap_or_default().to_string();
    if let Some(Value::Array(items)) = document.get("items").cloned() {
        for mut item in items {
            if kind != "List" {
                if let Some(obj) = item.as_object_mut() {
                    obj.entry("kind")
                        .or_insert_with(|| Value::String(item_kind.clone()));
                    if let Some(v) = &api_version {
                        obj.entry("apiVersion").or_insert_with(|| v.clone());
                    }
                }
            }
            flatten_lists(item, out);
        }
    }
}

/// The string-valued entries of a JSON object (labels, selectors); absent or not an object
/// = empty.
fn string_map(value: Option<&Value>) -> BTreeMap<String, String> {
    value
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::schema::ErrorKind;
    use super::*;
    use serde_json::json;

    fn pool(spec: Value) -> Value {
        json!({
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": "vllm", "namespace": "llm"},
            "spec": spec,
        })
    }

    fn valid_spec() -> Value {
        json!({
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
        })
    }

    fn messages(object: &Value) -> Vec<String> {
        match validate(object, "default") {
            Ok(_) => Vec::new(),
            Err(PoolError::Invalid { errors, .. }) => {
                errors.iter().map(ToString::to_string).collect()
            }
            Err(e) => vec![e.to_string()],
        }
    }

    #[test]
    fn schema_is_the_crd() {
        assert!(schema().get("properties").is_some());
        let rules = schema::cel_rules(schema());
        let pairs: Vec<(&str, &str)> = rules
            .iter()
            .map(|(_, r, m)| (r.as_str(), m.as_str()))
            .collect();
        for (rule, message) in CEL_RULES {
            assert!(pairs.contains(&(rule, message)), "{rule}");
        }
        assert_eq!(pairs.len(), CEL_RULES.len());
        for p in schema::patterns(schema()) {
            schema::pattern(&p).unwrap();
        }
    }

    #[test]
    fn valid_pool_gets_defaults() {
        let p = validate(&pool(valid_spec()), "default").unwrap();
        assert_eq!(p.namespace, "llm");
        assert_eq!(p.target_ports, [8000]);
        assert_eq!(p.app_protocol, "http");
        let epp = p.endpoint_picker.unwrap();
        assert_eq!((epp.kind.as_str(), epp.port), ("Service", Some(9002)));
        let mut minimal =
            pool(json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 1}]}));
        minimal["metadata"] = json!({"name": "p"});
        let p = validate(&minimal, "team").unwrap();
        assert_eq!((p.namespace.as_str(), p.endpoint_picker), ("team", None));
    }

    #[test]
    fn duplicate_ports_use_the_crd_message() {
        let mut spec = valid_spec();
        spec["targetPorts"] = json!([{"number": 8000}, {"number": 8001}, {"number": 8000}]);
        assert_eq!(
            messages(&pool(spec)),
            ["spec.targetPorts: Invalid value: \"array\": port number must be unique"]
        );
    }

    #[test]
    fn service_ref_without_port() {
        let mut spec = valid_spec();
        spec["endpointPickerRef"] = json!({"name": "epp"});
        assert_eq!(
            messages(&pool(spec.clone())),
            ["spec.endpointPickerRef: Invalid value: \"object\": port is required when kind is 'Service' or unspecified (defaults to 'Service')"]
        );
        spec["endpointPickerRef"] = json!({"name": "epp", "kind": "Service", "group": ""});
        assert_eq!(messages(&pool(spec.clone())).len(), 1);
        spec["endpointPickerRef"] =
            json!({"name": "epp", "kind": "Picker", "group": "example.com"});
        assert!(messages(&pool(spec)).is_empty());
    }

    #[test]
    fn more_than_eight_ports() {
        let mut spec = valid_spec();
        let ports: Vec<Value> = (8000..8009).map(|n| json!({"number": n})).collect();
        spec["targetPorts"] = Value::Array(ports);
        assert_eq!(
            messages(&pool(spec)),
            ["spec.targetPorts: Too many: 9: must have at most 8 items"]
        );
    }

    #[test]
    fn empty_selector() {
        let mut spec = valid_spec();
        spec["selector"] = json!({"matchLabels": {}});
        assert_eq!(
            messages(&pool(spec.clone())),
            ["spec.selector.matchLabels: Invalid value: 0: spec.selector.matchLabels in body should have at least 1 properties"]
        );
        spec["selector"] = json!({});
        assert_eq!(
            messages(&pool(spec)),
            ["spec.selector.matchLabels: Required value"]
        );
    }

    #[test]
    fn bad_app_protocol_and_other_enums() {
        let mut spec = valid_spec();
        spec["appProtocol"] = json!("grpc");
        spec["endpointPickerRef"]["failureMode"] = json!("Retry");
        let got = messages(&pool(spec));
        assert!(got.contains(&"spec.appProtocol: Unsupported value: \"grpc\": supported values: \"http\", \"kubernetes.io/h2c\"".to_string()), "{got:?}");
        assert!(got.contains(&"spec.endpointPickerRef.failureMode: Unsupported value: \"Retry\": supported values: \"FailOpen\", \"FailClose\"".to_string()), "{got:?}");
    }

    #[test]
    fn ranges_required_and_unknown_fields() {
        let got = messages(&pool(json!({
            "selector": {"matchLabels": {"app": "-bad-"}},
            "targetPorts": [{"number": 0}, {"number": 65536}, {}],
            "targetPortNumber": 8000
        })));
        for want in [
            "spec.targetPorts[0].number: Invalid value: 0: spec.targetPorts[0].number in body should be greater than or equal to 1",
            "spec.targetPorts[1].number: Invalid value: 65536: spec.targetPorts[1].number in body should be less than or equal to 65535",
            "spec.targetPorts[2].number: Required value",
            "spec.selector.matchLabels.app: Invalid value: \"-bad-\": spec.selector.matchLabels.app in body should match '^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$'",
            "unknown field \"spec.targetPortNumber\"",
        ] {
            assert!(got.iter().any(|g| g == want), "missing {want}\n{got:#?}");
        }
        assert_eq!(messages(&pool(Value::Null)), ["spec: Required value"]);
        let mut nameless = pool(valid_spec());
        nameless["metadata"] = json!({});
        assert_eq!(
            messages(&nameless),
            ["metadata.name: Required value: name or generateName is required"]
        );
    }

    #[test]
    fn wrong_version_and_error_display() {
        let mut old = pool(valid_spec());
        old["apiVersion"] = json!("inference.networking.x-k8s.io/v1alpha2");
        assert!(matches!(
            validate(&old, "d"),
            Err(PoolError::WrongVersion { .. })
        ));
        let e = PoolError::Invalid {
            name: "p".into(),
            errors: vec![
                FieldError {
                    field: schema::FieldPath::root().child("spec"),
                    kind: ErrorKind::Required {
                        detail: String::new(),
                    },
                },
                FieldError {
                    field: schema::FieldPath::root().child("x"),
                    kind: ErrorKind::UnknownField,
                },
            ],
        };
        assert_eq!(
            e.to_string(),
            "The InferencePool \"p\" is invalid: \n* spec: Required value\n* unknown field \"x\""
        );
    }

    fn pod(name: &str, ns: &str, labels: Value, ready: bool, ip: Option<&str>) -> Value {
        let mut status = json!({"conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": if ready { "True" } else { "False" }}
        ]});
        if let Some(ip) = ip {
            status["podIP"] = json!(ip);
        }
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": ns, "labels": labels},
               "status": status})
    }

    fn pods(values: &[Value]) -> Vec<Pod> {
        values
            .iter()
            .filter_map(|v| Pod::from_value(v, "default"))
            .collect()
    }

    #[test]
    fn resolution_selects_like_an_endpoint_picker() {
        let p = validate(&pool(valid_spec()), "default").unwrap();
        let all = pods(&[
            pod(
                "vllm-b",
                "llm",
                json!({"app": "vllm", "x": "y"}),
                true,
                Some("10.0.0.2"),
            ),
            pod(
                "vllm-a",
                "llm",
                json!({"app": "vllm"}),
                true,
                Some("10.0.0.1"),
            ),
            pod(
                "other-app",
                "llm",
                json!({"app": "other"}),
                true,
                Some("10.0.0.3"),
            ),
            pod("no-labels", "llm", json!({}), true, Some("10.0.0.9")),
            pod(
                "elsewhere",
                "prod",
                json!({"app": "vllm"}),
                true,
                Some("10.0.0.4"),
            ),
            pod(
                "starting",
                "llm",
                json!({"app": "vllm"}),
                false,
                Some("10.0.0.5"),
            ),
            pod("pending", "llm", json!({"app": "vllm"}), true, None),
            pod("v6", "llm", json!({"app": "vllm"}), true, Some("fd00::7")),
        ]);
        let r = resolve(&p, &all);
        let got: Vec<(String, String)> = r
            .endpoints
            .iter()
            .map(|e| (e.name.clone(), e.url()))
            .collect();
        assert_eq!(
            got,
            [
                ("v6".to_string(), "http://[fd00::7]:8000".to_string()),
                ("vllm-a".into(), "http://10.0.0.1:8000".into()),
                ("vllm-b".into(), "http://10.0.0.2:8000".into()),
            ]
        );
        assert_eq!(
            r.excluded,
            [
                ("pending".to_string(), Excluded::NoPodIp),
                ("starting".to_string(), Excluded::NotReady)
            ]
        );
        assert_eq!(r.selected.len(), 5);
        let config = r.plugin_config(PluginConfig::default()).unwrap();
        assert_eq!(config.endpoints[1].address, "10.0.0.1:8000");
        let json = serde_json::to_vec(&config).unwrap();
        assert_eq!(PluginConfig::from_json(&json).unwrap(), config);
    }

    #[test]
    fn several_target_ports_name_each_endpoint() {
        let mut spec = valid_spec();
        spec["targetPorts"] = json!([{"number": 8000}, {"number": 8001}]);
        let p = validate(&pool(spec), "default").unwrap();
        let r = resolve(
            &p,
            &pods(&[pod(
                "vllm-a",
                "llm",
                json!({"app": "vllm"}),
                true,
                Some("10.0.0.1"),
            )]),
        );
        let got: Vec<(&str, String)> = r
            .endpoints
            .iter()
            .map(|e| (e.name.as_str(), e.address()))
            .collect();
        assert_eq!(
            got,
            [
                ("vllm-a:8000", "10.0.0.1:8000".to_string()),
                ("vllm-a:8001", "10.0.0.1:8001".to_string())
            ]
        );
    }

    #[test]
    fn no_endpoints_is_a_config_error() {
        let p = validate(&pool(valid_spec()), "default").unwrap();
        let r = resolve(&p, &[]);
        assert_eq!(
            r.plugin_config(PluginConfig::default()),
            Err(ConfigError::NoEndpoints)
        );
    }

    #[test]
    fn lists_flatten() {
        let doc = json!({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "PodList", "items": [{"metadata": {"name": "a"}}]},
            pool(valid_spec()),
        ]});
        let mut out = Vec::new();
        flatten_lists(doc, &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0]["kind"], "Pod");
        assert_eq!(out[0]["apiVersion"], "v1");
        assert!(is_inference_pool(&out[1]));
    }
}
