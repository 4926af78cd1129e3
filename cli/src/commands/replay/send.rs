//! One trace record → one HTTP request → one [`Outcome`].

use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use hyper::header::CONTENT_TYPE;
use hyper::{HeaderMap, Uri};
use prefixroute_sim::simulation::GatewaySpread;
use prefixroute_sim::trace::TraceRecord;
use serde_json::Value;
use tokio::time::Instant;

use super::client::{BaseUrl, Exchange, Failure, HttpClient};

/// Set by prefixroute's plugin: the endpoint it picked. Preferred over the replica's own name,
/// because it is what the router believes it did.
const ROUTER_ENDPOINT: &str = "x-prefixroute-endpoint";
/// Set by `prefixroute fake-server` (and easy to add to any replica).
const SERVED_BY: &str = "x-served-by";
/// The plugin's explanation of a decision: `x-prefixroute-policy`, `-match`,
/// `-uncached-tokens`, `-queue-ms`, `-ttft-ms`, `-fallback`.
const ROUTER_HEADERS: &str = "x-prefixroute-";

/// A request ready to go: everything that costs time is done before the clock starts.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub group: String,
    /// When to send, from the start of the run.
    pub at: Duration,
    pub uri: Uri,
    pub body: Bytes,
}

/// The OpenAI API a body belongs to: completions bodies carry `prompt`, chat bodies `messages`.
fn api_path(body: &Value) -> &'static str {
    if body.get("prompt").is_some() && body.get("messages").is_none() {
        "/v1/completions"
    } else {
        "/v1/chat/completions"
    }
}

/// A streamed answer reports usage only when asked; the replayer needs it, so a streaming body
/// that says nothing about usage asks for it. Anything else is sent exactly as written.
fn with_usage_requested(body: &Value) -> Value {
    let mut body = body.clone();
    let streams = body.get("stream").and_then(Value::as_bool) == Some(true);
    if let (true, Some(object)) = (streams, body.as_object_mut()) {
        object
            .entry("stream_options")
            .or_insert_with(|| serde_json::json!({"include_usage": true}));
    }
    body
}

/// Request `i` goes to the base `spread` picks (several gateways: in turn, or each group to
/// one of them, as the simulator's `--gateways`).
pub fn prepare(
    records: &[TraceRecord],
    bases: &[BaseUrl],
    spread: GatewaySpread,
) -> Result<Vec<Prepared>> {
    anyhow::ensure!(!bases.is_empty(), "no URL to send to");
    records
        .iter()
        .enumerate()
        .map(|(i, record)| {
            Ok(Prepared {
                group: record.group.clone(),
                at: Duration::try_from_secs_f64(record.t).with_context(|| {
                    format!("request {}: t = {} is out of range", i + 1, record.t)
                })?,
                uri: bases[spread.gateway(i, &record.group, bases.len())]
                    .join(api_path(&record.body))?,
                body: Bytes::from(with_usage_requested(&record.body).to_string()),
            })
        })
        .collect()
}

/// Prompt tokens and the cached part of them, from a response's `usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl Usage {
    fn from_value(usage: &Value) -> Option<Usage> {
        Some(Usage {
            prompt_tokens: usage.get("prompt_tokens")?.as_u64()?,
            // Servers without prompt-token details report no cache use, not an error.
            cached_tokens: usage
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
        })
    }
}

/// Usage from a JSON body, or from the last SSE event that carries it.
pub fn usage_of(headers: &HeaderMap, body: &[u8]) -> Option<Usage> {
    let is_stream = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if !is_stream {
        let value: Value = serde_json::from_slice(body).ok()?;
        return Usage::from_value(value.get("usage")?);
    }
    // The usage event comes last, just before [DONE]: search from the end.
    String::from_utf8_lossy(body)
        .lines()
        .rev()
        .filter_map(|line| line.strip_prefix("data:"))
        .filter_map(|data| serde_json::from_str::<Value>(data.trim()).ok())
        .find_map(|event| event.get("usage").and_then(Usage::from_value))
}

fn endpoint_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get(ROUTER_ENDPOINT)
        .or_else(|| headers.get(SERVED_BY))
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

/// What a successful request told us.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub endpoint: Option<String>,
    pub usage: Option<Usage>,
    /// The router's explanation, when it gave one: every `x-prefixroute-*` header but the
    /// endpoint, by name without the prefix, in the order received.
    pub router: Vec<(String, String)>,
    /// From sending to the first byte of the body: a streamed answer's time to first token
    /// (for an answer sent whole, about its latency). `None` for an empty body.
    pub first_byte: Option<Duration>,
}

fn router_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter_map(|(name, value)| {
            let name = name.as_str().strip_prefix(ROUTER_HEADERS)?;
            (name != "endpoint").then(|| {
                (
                    name.to_string(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
        })
        .collect()
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub group: String,
    /// How late the request left compared with its timestamp (a concurrency limit, or an
    /// overloaded client, makes this grow; open-loop replay wants it near zero).
    pub send_lag: Duration,
    pub latency: Duration,
    pub result: Result<Answer, Failure>,
}

fn answer(exchange: Exchange, sent: Instant) -> Result<Answer, Failure> {
    if !exchange.status.is_success() {
        return Err(Failure::Status(exchange.status));
    }
    Ok(Answer {
        endpoint: endpoint_of(&exchange.headers),
        usage: usage_of(&exchange.headers, &exchange.body),
        router: router_headers(&exchange.headers),
        first_byte: exchange
            .first_byte
            .map(|at| at.saturating_duration_since(sent)),
    })
}

/// Sends one request now; `due` is when it should have left, for the lag.
pub async fn send(client: &HttpClient, request: Prepared, due: Instant) -> Outcome {
    let sent = Instant::now();
    let result = client
        .post_json(request.uri, request.body)
        .await
        .and_then(|exchange| answer(exchange, sent));
    Outcome {
        group: request.group,
        send_lag: sent.saturating_duration_since(due),
        latency: sent.elapsed(),
        result,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;
    use serde_json::json;

    #[test]
    fn the_routers_explanation_is_every_prefixroute_header_but_the_endpoint() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("x-prefixroute-endpoint", "r1"),
            ("x-prefixroute-policy", "latency"),
            ("x-prefixroute-ttft-ms", "42"),
            ("x-served-by", "replica-1"),
            ("content-type", "application/json"),
        ] {
            headers.insert(name, HeaderValue::from_static(value));
        }
        assert_eq!(
            router_headers(&headers),
            vec![
                ("policy".to_string(), "latency".to_string()),
                ("ttft-ms".to_string(), "42".to_string())
            ]
        );
        assert_eq!(endpoint_of(&headers).as_deref(), Some("r1"));
        assert!(router_headers(&HeaderMap::new()).is_empty());
    }

    #[test]
    fn path_follows_the_prompt_field() {
        assert_eq!(api_path(&json!({"prompt": "x"})), "/v1/completions");
        assert_eq!(api_path(&json!({"messages": []})), "/v1/chat/completions");
    }

    #[test]
    fn streams_ask_for_usage_unless_they_already_say() {
        let asked = with_usage_requested(&json!({"stream": true}));
        assert_eq!(asked["stream_options"]["include_usage"], true);
        let own = json!({"stream": true, "stream_options": {"include_usage": false}});
        assert_eq!(with_usage_requested(&own), own);
        let plain = json!({"prompt": "x"});
        assert_eq!(with_usage_requested(&plain), plain);
    }

    #[test]
    fn usage_is_read_from_json_and_from_sse() {
        let mut headers = HeaderMap::new();
        let body =
            br#"{"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        assert_eq!(
            usage_of(&headers, body),
            Some(Usage {
                prompt_tokens: 40,
                cached_tokens: 32
            })
        );
        assert_eq!(
            usage_of(&headers, br#"{"usage":{"prompt_tokens":5}}"#),
            Some(Usage {
                prompt_tokens: 5,
                cached_tokens: 0
            })
        );
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        let sse = b"data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n";
        assert_eq!(usage_of(&headers, sse).unwrap().prompt_tokens, 7);
        assert_eq!(usage_of(&headers, b"data: [DONE]\n\n"), None);
    }

    #[test]
    fn the_router_header_wins_over_the_replica_name() {
        let mut headers = HeaderMap::new();
        headers.insert(SERVED_BY, HeaderValue::from_static("a"));
        assert_eq!(endpoint_of(&headers).as_deref(), Some("a"));
        headers.insert(ROUTER_ENDPOINT, HeaderValue::from_static("10.0.0.1:8000"));
        assert_eq!(endpoint_of(&headers).as_deref(), Some("10.0.0.1:8000"));
    }
}
