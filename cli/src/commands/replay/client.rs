//! Plain-HTTP client for the replayer: hyper-util's pooled client, with every exchange (connect,
//! send, whole body) bounded by one timeout so an unresponsive endpoint cannot hang a run.
//!
//! Only `http://` is supported: the replayer targets a router, Envoy or replicas on the same
//! network, and leaving TLS out keeps the build free of native TLS libraries.

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::http::uri::{Authority, PathAndQuery};
use hyper::{HeaderMap, Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Responses above this are cut off as a transport error rather than buffered without bound.
const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// A base URL such as `http://127.0.0.1:8080` or `http://gateway/prefix`: API paths are
/// appended to its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    authority: Authority,
    /// Path without a trailing slash; empty for the root.
    path: String,
}

impl BaseUrl {
    pub fn parse(text: &str) -> Result<BaseUrl> {
        let uri: Uri = text
            .parse()
            .with_context(|| format!("{text:?} is not a URL"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => bail!("{text}: https is not supported, use plain http://"),
            _ => bail!("{text:?} is not an http:// URL"),
        }
        let Some(authority) = uri.authority().cloned() else {
            bail!("{text:?} has no host");
        };
        if uri.query().is_some() {
            bail!("{text:?}: a base URL takes no query string");
        }
        Ok(BaseUrl {
            authority,
            path: uri.path().trim_end_matches('/').to_string(),
        })
    }

    /// True when the URL names no path of its own (`http://host:port` or `http://host:port/`).
    pub fn is_root(&self) -> bool {
        self.path.is_empty()
    }

    /// The URL with `path` (starting with `/`) appended.
    pub fn join(&self, path: &str) -> Result<Uri> {
        let path_and_query: PathAndQuery = format!("{}{path}", self.path)
            .parse()
            .with_context(|| format!("bad path {path:?}"))?;
        Ok(Uri::builder()
            .scheme("http")
            .authority(self.authority.clone())
            .path_and_query(path_and_query)
            .build()?)
    }
}

impl fmt::Display for BaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.path)
    }
}

/// Why an exchange produced no HTTP response. `kind()` names are stable: they are keys of the
/// replayer's JSON output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The server answered, but not with 2xx.
    Status(StatusCode),
    Timeout(Duration),
    /// No connection (refused, unreachable, DNS).
    Connect(String),
    /// The connection broke or the response was malformed.
    Transport(String),
}

impl Failure {
    pub fn kind(&self) -> String {
        match self {
            Failure::Status(status) => format!("http_{}", status.as_u16()),
            Failure::Timeout(_) => "timeout".into(),
            Failure::Connect(_) => "connect".into(),
            Failure::Transport(_) => "transport".into(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Status(status) => write!(f, "HTTP {status}"),
            Failure::Timeout(limit) => write!(f, "no complete response within {limit:?}"),
            Failure::Connect(detail) => write!(f, "cannot connect: {detail}"),
            Failure::Transport(detail) => write!(f, "{detail}"),
        }
    }
}

/// An error and its causes, joined with ": ".
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The client's own message is vague ("client error (Connect)"); its causes say what a person
/// needs ("tcp connect error: Connection refused").
fn causes(err: &hyper_util::client::legacy::Error) -> String {
    match std::error::Error::source(err) {
        Some(cause) => chain(cause),
        None => err.to_string(),
    }
}

/// One complete response of any status.
#[derive(Debug)]
pub struct Exchange {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// When the first byte of the body arrived (a streamed answer's first token); `None` for
    /// an empty body.
    pub first_byte: Option<Instant>,
}

#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl HttpClient {
    pub fn new(timeout: Duration) -> HttpClient {
        let mut connector = HttpConnector::new();
        // Requests are small and latency is what is measured.
        connector.set_nodelay(true);
        HttpClient {
            inner: Client::builder(TokioExecutor::new()).build(connector),
            timeout,
        }
    }

    pub async fn get(&self, uri: Uri) -> Result<Exchange, Failure> {
        self.send(Method::GET, uri, None).await
    }

    pub async fn post_json(&self, uri: Uri, body: Bytes) -> Result<Exchange, Failure> {
        self.send(Method::POST, uri, Some(body)).await
    }

    async fn send(
        &self,
        method: Method,
        uri: Uri,
        body: Option<Bytes>,
    ) -> Result<Exchange, Failure> {
        let mut request = Request::new(Full::new(body.clone().unwrap_or_default()));
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        if body.is_some() {
            request
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        tokio::time::timeout(self.timeout, self.exchange(request))
            .await
            .unwrap_or(Err(Failure::Timeout(self.timeout)))
    }

    async fn exchange(&self, request: Request<Full<Bytes>>) -> Result<Exchange, Failure> {
        let response = self.inner.request(request).await.map_err(|err| {
            if err.is_connect() {
                Failure::Connect(causes(&err))
            } else {
                Failure::Transport(causes(&err))
            }
        })?;
        let (parts, body) = response.into_parts();
        let mut body = Limited::new(body, MAX_RESPONSE_BYTES);
        let mut bytes = Vec::new();
        let mut first_byte = None;
        // Frame by frame rather than `collect`: the first data frame's time is a streamed
        // answer's time to first token.
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|err| {
                Failure::Transport(format!("reading the response: {}", chain(&*err)))
            })?;
            if let Ok(data) = frame.into_data() {
                if !data.is_empty() {
                    first_byte.get_or_insert_with(Instant::now);
                    bytes.extend_from_slice(&data);
                }
            }
        }
        Ok(Exchange {
            status: parts.status,
            headers: parts.headers,
            body: Bytes::from(bytes),
            first_byte,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_join_api_paths() {
        let base = BaseUrl::parse("http://127.0.0.1:8080/").unwrap();
        assert!(base.is_root());
        assert_eq!(
            base.join("/v1/completions").unwrap().to_string(),
            "http://127.0.0.1:8080/v1/completions"
        );
        let prefixed = BaseUrl::parse("http://gw/llm/").unwrap();
        assert_eq!(prefixed.to_string(), "http://gw/llm");
        assert_eq!(
            prefixed.join("/metrics").unwrap().to_string(),
            "http://gw/llm/metrics"
        );
    }

    #[test]
    fn unusable_urls_are_refused_with_a_reason() {
        for (url, reason) in [
            ("https://x", "https is not supported"),
            ("ftp://x", "not an http:// URL"),
            ("localhost:8080", "not an http:// URL"),
            ("http://x/?a=1", "no query"),
            ("not a url", "not a URL"),
        ] {
            let err = BaseUrl::parse(url).unwrap_err().to_string();
            assert!(err.contains(reason), "{url}: {err}");
        }
    }
}
