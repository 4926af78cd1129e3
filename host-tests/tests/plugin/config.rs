//! Configuration: every invalid one is refused with a clear log line, valid ones are accepted
//! in each form Envoy may hand over (JSON text, a binary `google.protobuf.Struct`, a
//! double-encoded JSON string).

use host_tests::LogLevel;
use serde_json::{json, Value};

use crate::common::{self, config};

/// Configures a fresh VM; returns the plugin's answer and its error log lines.
fn configure(raw: &[u8]) -> (bool, Vec<String>, Vec<String>) {
    let host = common::host();
    let mut vm = host.vm().unwrap();
    let ok = vm.configure(raw).unwrap();
    assert!(vm.trapped().is_none());
    let logs = |level: LogLevel| -> Vec<String> {
        vm.capture()
            .logs
            .iter()
            .filter(|l| l.level == level)
            .map(|l| l.message.clone())
            .collect()
    };
    (ok, logs(LogLevel::Error), logs(LogLevel::Info))
}

fn with(field: &str, value: Value) -> Vec<u8> {
    let mut c = config(2, json!({}));
    c[field] = value;
    c.to_string().into_bytes()
}

fn scrape(value: Value) -> Vec<u8> {
    with("scrape", value)
}

#[test]
fn each_invalid_configuration_is_refused_with_a_specific_error_log() {
    let many: Vec<Value> = (0..1025)
        .map(|i| json!({"name": format!("e{i}"), "address": format!("10.0.{}.{}:80", i / 250, i % 250 + 1)}))
        .collect();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"".to_vec(), "at least one endpoint"),
        (b"not json at all".to_vec(), "invalid configuration JSON"),
        (b"{}".to_vec(), "at least one endpoint"),
        (br#"{"endpoints": []}"#.to_vec(), "at least one endpoint"),
        (br#"{"endpoints": [{"name": "a", "address": "replica-a:8000"}]}"#.to_vec(), "is not ip:port"),
        (br#"{"endpoints": [{"name": "a", "address": "10.0.0.1:0"}]}"#.to_vec(), "is not ip:port"),
        (br#"{"endpoints": [{"name": "a"}]}"#.to_vec(), "missing field `address`"),
        (
            br#"{"endpoints": [{"name": "a", "address": "10.0.0.1:1"}, {"name": "a", "address": "10.0.0.2:1"}]}"#.to_vec(),
            "name \"a\" is used twice",
        ),
        (
            br#"{"endpoints": [{"name": "a", "address": "10.0.0.1:1"}, {"name": "b", "address": "10.0.0.1:1"}]}"#.to_vec(),
            "address \"10.0.0.1:1\" is used twice",
        ),
        (json!({"endpoints": many}).to_string().into_bytes(), "at most 1024"),
        (with("polcy", json!("prefix")), "unknown field `polcy`"),
        (with("policy", json!("fastest")), "unknown variant `fastest`"),
        (with("weights", json!({"queue": -1})), "weights.queue"),
        (with("weights", json!({"speed": 1})), "unknown field `speed`"),
        (with("block_size", json!(0)), "block_size"),
        (with("block_size", json!(5000)), "block_size"),
        (with("block_size", json!(16.5)), "invalid type: floating point `16.5`, expected usize"),
        (with("block_size", json!("16")), "invalid type: string \"16\", expected usize"),
        (with("index_capacity_blocks", json!(0)), "index_capacity_blocks"),
        (with("destination_header", json!("X Dest")), "destination_header"),
        (with("destination_header", json!("")), "destination_header"),
        (with("max_body_bytes", json!(0)), "max_body_bytes"),
        (with("match_length", json!({"weight": 1.5, "scale": 10})), "match_length.weight"),
        (with("saturation", json!({"queue_threshold": 0.5})), "saturation.queue_threshold"),
        (scrape(json!({"interval_ms": 5})), "scrape.interval_ms"),
        (scrape(json!({"timeout_ms": 0})), "scrape.timeout_ms"),
        (scrape(json!({"interval_ms": 100, "timeout_ms": 5000})), "scrape.timeout_ms"),
        (scrape(json!({"stale_after_ms": 10})), "scrape.stale_after_ms"),
        (scrape(json!({"failures_to_down": 0})), "scrape.failures_to_down"),
        (scrape(json!({"cluster": ""})), "scrape.cluster"),
        (scrape(json!({"path": "metrics"})), "scrape.path"),
        (b"\x0a\xff\xff".to_vec(), "invalid configuration JSON"),
        (b"[1, 2, 3]".to_vec(), "invalid configuration JSON"),
        (json!("not a config").to_string().into_bytes(), "invalid configuration JSON"),
    ];
    for (raw, needle) in cases {
        let (ok, errors, _) = configure(&raw);
        let shown = String::from_utf8_lossy(&raw[..raw.len().min(80)]).into_owned();
        assert!(!ok, "accepted {shown}");
        assert_eq!(errors.len(), 1, "{shown}: {errors:?}");
        assert!(
            errors[0].starts_with("prefixroute: invalid configuration: ")
                && errors[0].contains(needle),
            "{shown}: expected {needle:?} in {:?}",
            errors[0]
        );
    }
}

#[test]
fn a_valid_configuration_is_accepted_and_summarised() {
    let c = config(
        3,
        json!({"policy": "least-queue", "scrape": {"interval_ms": 400, "timeout_ms": 200, "stale_after_ms": 2000}}),
    );
    let (ok, errors, info) = configure(c.to_string().as_bytes());
    assert!(ok);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(info.len(), 1);
    assert!(
        info[0].starts_with("prefixroute: 3 endpoints, policy least-queue")
            && info[0].contains("tick 100 ms"),
        "{}",
        info[0]
    );
    // The tick period the plugin asked for is a quarter of the interval.
    let host = common::host();
    let vm = common::configured(&host, &c);
    assert_eq!(vm.tick_period_ms(), 100);
}

/// The wire form of a `google.protobuf.Struct`, which Envoy passes for a YAML/JSON
/// configuration of type Struct.
fn encode_struct(v: &Value) -> Vec<u8> {
    fn varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    fn field(n: u64, payload: &[u8], out: &mut Vec<u8>) {
        varint(n << 3 | 2, out);
        varint(payload.len() as u64, out);
        out.extend_from_slice(payload);
    }
    fn value(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        match v {
            Value::Null => out.extend_from_slice(&[8, 0]),
            Value::Bool(b) => out.extend_from_slice(&[4 << 3, u8::from(*b)]),
            Value::Number(n) => {
                out.push(2 << 3 | 1);
                out.extend_from_slice(&n.as_f64().unwrap().to_le_bytes());
            }
            Value::String(s) => field(3, s.as_bytes(), &mut out),
            Value::Array(items) => {
                let mut list = Vec::new();
                for item in items {
                    field(1, &value(item), &mut list);
                }
                field(6, &list, &mut out);
            }
            Value::Object(_) => field(5, &encode_struct(v), &mut out),
        }
        out
    }
    let mut out = Vec::new();
    for (k, item) in v.as_object().unwrap() {
        let mut entry = Vec::new();
        field(1, k.as_bytes(), &mut entry);
        field(2, &value(item), &mut entry);
        field(1, &entry, &mut out);
    }
    out
}

#[test]
fn struct_and_double_encoded_configurations_are_accepted() {
    let c = config(2, json!({"policy": "prefix-only", "block_size": 32}));
    let (ok, errors, info) = configure(&encode_struct(&c));
    assert!(ok, "{errors:?}");
    assert!(
        info[0].contains("2 endpoints, policy prefix-only"),
        "{info:?}"
    );
    let double = Value::String(c.to_string()).to_string();
    let (ok, errors, _) = configure(double.as_bytes());
    assert!(ok, "{errors:?}");
    // A Struct with a bad value is refused like JSON.
    let mut bad = c.clone();
    bad["block_size"] = json!(0);
    let (ok, errors, _) = configure(&encode_struct(&bad));
    assert!(!ok);
    assert!(errors[0].contains("block_size"), "{errors:?}");
}

/// A type error names the field, as every range error does (a line/column would point into the
/// re-encoded configuration, not the operator's text).
#[test]
fn a_type_error_names_the_field() {
    for (field, value) in [
        ("block_size", json!(16.5)),
        ("seed", json!("7")),
        ("max_body_bytes", json!(-1)),
    ] {
        let (ok, errors, _) = configure(&with(field, value));
        assert!(!ok);
        assert!(errors[0].contains(field), "{field}: {:?}", errors[0]);
    }
}
