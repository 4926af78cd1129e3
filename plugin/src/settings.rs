//! Plugin configuration as Envoy hands it over, and the timings derived from it.

use crate::pbstruct::decode_struct;
use prefixroute_core::config::{ConfigError, PluginConfig};
use serde_json::{Number, Value};

/// Parses the filter's `configuration`.
///
/// Envoy passes a `google.protobuf.StringValue` (or `BytesValue`) as its raw bytes, and any
/// other message, e.g. a `google.protobuf.Struct`, as its binary protobuf serialisation: JSON
/// text is parsed as JSON, anything else is decoded as a Struct. A Struct has only doubles, so
/// integer fields arrive as `1000.0`; those are turned back into integers before core's strict
/// validation. A JSON *string* holding the configuration (double-encoded) is unwrapped.
pub fn load_config(raw: &[u8]) -> Result<PluginConfig, ConfigError> {
    let mut value = match serde_json::from_slice::<Value>(raw) {
        Ok(v) => v,
        Err(json_error) => match decode_struct(raw) {
            Some(v) => v,
            None => return Err(ConfigError::Json(json_error.to_string())),
        },
    };
    if let Value::String(inner) = &value {
        // From its bytes: one serde_json reader type in the plugin (see core's `metrics`).
        value = serde_json::from_slice(inner.as_bytes())
            .map_err(|e| ConfigError::Json(e.to_string()))?;
    }
    integral_floats_to_integers(&mut value);
    PluginConfig::from_value(value)
}

fn integral_floats_to_integers(value: &mut Value) {
    match value {
        Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
                if f.fract() == 0.0 && f.abs() < 9.007_199_254_740_992e15 {
                    *n = if f >= 0.0 {
                        Number::from(f as u64)
                    } else {
                        Number::from(f as i64)
                    };
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integral_floats_to_integers),
        Value::Object(map) => map.values_mut().for_each(integral_floats_to_integers),
        _ => {}
    }
}

/// The root contexts' tick: a quarter of the scrape interval (so a scrape starts at most a
/// quarter interval late), between 10 ms and 1 s (the heartbeat of in-flight counts).
pub fn tick_ms(interval_ms: u64) -> u64 {
    (interval_ms / 4).clamp(10, 1000)
}

/// The first tick of a root context whose pool is discovered. Until the first discovery
/// answer, every request falls back to Envoy's own pick (there is no member to route to), and
/// at the regular tick that lasted a quarter of the scrape interval after each Envoy start
/// (`bench/startup.py`: 22% of the first 2 s of load before this, none after).
pub const FIRST_TICK_MS: u64 = 10;

/// The tick period to ask for after a tick that ran at `current`: the regular `tick`, or,
/// while the pool is still `awaiting` its first membership, twice `current` up to `tick` (a
/// discovery that keeps failing, or an Envoy without the admin cluster, costs a handful of fast
/// ticks, not a fast tick forever).
pub fn next_tick_ms(current: u64, tick: u64, awaiting: bool) -> u64 {
    if awaiting {
        current.saturating_mul(2).clamp(1, tick.max(1))
    } else {
        tick
    }
}

/// After this long without a heartbeat an instance's in-flight counts are ignored and it is
/// reaped: many ticks, so a busy worker is not mistaken for a dead one.
pub fn instance_stale_ms(tick_ms: u64) -> u64 {
    (tick_ms * 8).max(3000)
}

/// The OpenAI endpoints whose bodies the router scores: POST `/v1/chat/completions` and
/// `/v1/completions` (any query string).
pub fn is_routable(method: &str, path: &str) -> bool {
    let path = path.split(['?', '#']).next().unwrap_or("");
    method.eq_ignore_ascii_case("POST")
        && matches!(path, "/v1/chat/completions" | "/v1/completions")
}

/// The body length a request's `content-length` header declares; `None` when it is absent
/// or not a plain decimal count (RFC 9110 §8.6), so a garbled value never decides anything.
pub fn declared_length(content_length: &str) -> Option<usize> {
    let digits = content_length.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_declared_length_is_a_plain_decimal_count_or_nothing() {
        assert_eq!(declared_length("1572864"), Some(1_572_864));
        assert_eq!(declared_length(" 42 "), Some(42));
        assert_eq!(declared_length("0"), Some(0));
        for garbled in [
            "",
            "-1",
            "+5",
            "1e6",
            "12,34",
            "0x10",
            "99999999999999999999999",
        ] {
            assert_eq!(declared_length(garbled), None, "{garbled:?}");
        }
    }

    #[test]
    fn struct_style_doubles_are_accepted() {
        let c = load_config(
            br#"{"endpoints":[{"name":"a","address":"127.0.0.1:8001"}],
                 "block_size":16.0,"scrape":{"interval_ms":1000.0,"timeout_ms":500,"stale_after_ms":5e3},
                 "weights":{"prefix":3.5},"seed":7.0}"#,
        )
        .unwrap();
        assert_eq!(c.block_size, 16);
        assert_eq!(c.scrape.stale_after_ms, 5000);
        assert_eq!(c.weights.prefix, 3.5);
        assert_eq!(c.seed, 7);
    }

    #[test]
    fn binary_struct_configuration_is_decoded() {
        let config = serde_json::json!({
            "endpoints": [{"name": "a", "address": "127.0.0.1:8001"}],
            "policy": "least-queue",
            "block_size": 32.0,
            "scrape": {"interval_ms": 250.0, "timeout_ms": 100.0, "stale_after_ms": 1000.0}
        });
        let bytes = crate::pbstruct::tests::encode_struct(&config);
        let c = load_config(&bytes).unwrap();
        assert_eq!((c.block_size, c.scrape.interval_ms), (32, 250));
        assert_eq!(c.policy, prefixroute_core::Policy::LeastQueue);
    }

    #[test]
    fn double_encoded_string_is_unwrapped() {
        let inner = r#"{"endpoints":[{"name":"a","address":"127.0.0.1:8001"}]}"#;
        let outer = serde_json::to_vec(&Value::String(inner.into())).unwrap();
        assert_eq!(load_config(&outer).unwrap().endpoints.len(), 1);
    }

    #[test]
    fn errors_are_core_messages() {
        let err = load_config(br#"{"endpoints":[{"name":"a","address":"x"}]}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"endpoints[0].address "x" is not ip:port"#
        );
        let err = load_config(b"not json").unwrap_err();
        assert!(
            err.to_string().starts_with("invalid configuration JSON"),
            "{err}"
        );
        // No configuration at all decodes as an empty Struct.
        let err = load_config(b"").unwrap_err();
        assert_eq!(
            err.to_string(),
            "endpoints: at least one endpoint is required (or configure discovery)"
        );
        // A fractional value for an integer field is still refused.
        let err = load_config(
            br#"{"endpoints":[{"name":"a","address":"127.0.0.1:1"}],"block_size":16.5}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("block_size") || err.to_string().contains("16.5"));
    }

    #[test]
    fn timings() {
        assert_eq!(tick_ms(1000), 250);
        assert_eq!(tick_ms(10), 10);
        assert_eq!(tick_ms(60_000), 1000);
        assert_eq!(instance_stale_ms(250), 3000);
        assert_eq!(instance_stale_ms(1000), 8000);
    }

    #[test]
    fn ticks_awaiting_the_first_membership_start_fast_and_back_off_to_the_regular_tick() {
        let mut period = FIRST_TICK_MS;
        let mut seen = vec![period];
        while period != 250 {
            period = next_tick_ms(period, 250, true);
            seen.push(period);
        }
        assert_eq!(seen, [10, 20, 40, 80, 160, 250]);
        assert_eq!(
            next_tick_ms(250, 250, true),
            250,
            "never slower than the tick"
        );
        assert_eq!(
            next_tick_ms(20, 250, false),
            250,
            "the pool is known: regular ticks"
        );
    }

    #[test]
    fn routable_requests() {
        assert!(is_routable("POST", "/v1/chat/completions"));
        assert!(is_routable("post", "/v1/completions?x=1"));
        assert!(!is_routable("GET", "/v1/chat/completions"));
        assert!(!is_routable("POST", "/v1/models"));
        assert!(!is_routable("POST", "/v1/chat/completions/extra"));
        assert!(!is_routable("POST", ""));
    }
}
