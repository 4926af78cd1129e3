//! HTTP: one function per endpoint, errors as vLLM (FastAPI) answers them.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full, LengthLimitError, Limited};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderName, HeaderValue, ALLOW, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use prefixroute_core::request::{parse_value, RequestError};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::exposition;
use super::openai::{self, Api, Reply};
use super::replica::{Job, Replica, ReplicaConfig};

pub type Body = BoxBody<Bytes, Infallible>;

/// vLLM's default for completions when the body names no `max_tokens`.
const DEFAULT_MAX_TOKENS: usize = 16;
/// Context length the fake model claims (Llama-3.1-8B's); prompts plus output beyond it are
/// rejected as vLLM rejects them. It also bounds the work one request can ask for.
pub const MAX_MODEL_LEN: usize = 131_072;
/// Far above any real prompt; only there so a runaway client cannot exhaust memory.
const MAX_BODY_BYTES: usize = 64 << 20;

const SERVED_BY: HeaderName = HeaderName::from_static("x-served-by");

/// State shared by every connection.
pub struct Server {
    pub replica: Arc<Replica>,
    name: String,
    served_by: HeaderValue,
    next_id: AtomicU64,
    /// `--fail-status`: every completion is answered with this status at once.
    fail_status: Option<StatusCode>,
}

impl Server {
    /// A server; with `events`, its cache changes go there (the KV-event publisher).
    pub fn new(
        name: String,
        config: ReplicaConfig,
        events: Option<
            tokio::sync::mpsc::UnboundedSender<Vec<prefixroute_kvevents::schema::Event>>,
        >,
    ) -> anyhow::Result<Server> {
        let served_by = HeaderValue::from_str(&name)
            .map_err(|_| anyhow::anyhow!("--name {name:?} cannot be sent as an HTTP header"))?;
        Ok(Server {
            replica: Arc::new(Replica::with_events(config, events)),
            name,
            served_by,
            next_id: AtomicU64::new(0),
            fail_status: None,
        })
    }

    /// Answers every completion with `status` at once, as a server whose engine died while its
    /// HTTP server and `/metrics` live on (the metrics then say idle).
    pub fn failing_with(mut self, status: StatusCode) -> Server {
        self.fail_status = Some(status);
        self
    }

    fn reply(&self, api: Api) -> Reply {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        Reply::new(
            api,
            format!("{}-{n}", self.name),
            unix_now(),
            self.replica.config.model.clone(),
        )
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[derive(Clone, Copy)]
enum Route {
    Chat,
    Completions,
    Models,
    Health,
    Metrics,
}

const ROUTES: [(&str, Method, Route); 5] = [
    ("/v1/chat/completions", Method::POST, Route::Chat),
    ("/v1/completions", Method::POST, Route::Completions),
    ("/v1/models", Method::GET, Route::Models),
    ("/health", Method::GET, Route::Health),
    ("/metrics", Method::GET, Route::Metrics),
];

/// The hyper service: routes, then stamps `x-served-by` on every answer, errors included, so a
/// client behind a router can always tell which replica answered.
pub async fn handle(
    server: Arc<Server>,
    request: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let mut response = route(&server, request).await;
    response
        .headers_mut()
        .insert(SERVED_BY, server.served_by.clone());
    Ok(response)
}

async fn route(server: &Arc<Server>, request: Request<Incoming>) -> Response<Body> {
    let path = request.uri().path();
    let Some((_, allowed, route)) = ROUTES.iter().find(|(p, _, _)| *p == path) else {
        return json_response(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"}));
    };
    if request.method() != allowed {
        let mut response = json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({"detail": "Method Not Allowed"}),
        );
        if let Ok(allow) = HeaderValue::from_str(allowed.as_str()) {
            response.headers_mut().insert(ALLOW, allow);
        }
        return response;
    }
    let replica = &server.replica;
    match route {
        Route::Chat => generate(server, request, Api::Chat).await,
        Route::Completions => generate(server, request, Api::Completions).await,
        Route::Models => json_response(
            StatusCode::OK,
            &openai::models(&replica.config.model, unix_now(), MAX_MODEL_LEN),
        ),
        Route::Health => with_status(StatusCode::OK, Empty::new().boxed()),
        Route::Metrics => {
            let page = exposition::render(&replica.config, &replica.snapshot());
            let mut response = with_status(StatusCode::OK, Full::from(page).boxed());
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static(exposition::CONTENT_TYPE),
            );
            response
        }
    }
}

fn with_status(status: StatusCode, body: Body) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response
}

fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut response = with_status(status, Full::from(value.to_string()).boxed());
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// A request the server refuses, answered with OpenAI's error envelope.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
        }
    }

    fn response(&self) -> Response<Body> {
        let body = openai::error(&self.message, self.kind, self.status.as_u16());
        json_response(self.status, &body)
    }
}

impl From<RequestError> for ApiError {
    fn from(err: RequestError) -> Self {
        ApiError::bad_request(err.to_string())
    }
}

async fn read_body(request: Request<Incoming>) -> Result<Bytes, ApiError> {
    match Limited::new(request.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => Err(ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "invalid_request_error",
            message: format!("request body is larger than {MAX_BODY_BYTES} bytes"),
        }),
        Err(err) => Err(ApiError::bad_request(format!(
            "cannot read the request body: {err}"
        ))),
    }
}

/// A generation request that passed every check vLLM would make before queueing it.
#[derive(Debug)]
struct Plan {
    api: Api,
    job: Job,
    stream: bool,
    include_usage: bool,
}

impl Plan {
    fn parse(api: Api, body: &[u8], replica: &Replica) -> Result<Plan, ApiError> {
        let config = &replica.config;
        let value: Value =
            serde_json::from_slice(body).map_err(|e| RequestError::NotJson(e.to_string()))?;
        let mut request = parse_value(&value)?;
        // Each endpoint takes only its own prompt field, as vLLM's request models do.
        let field = match api {
            Api::Chat => "messages",
            Api::Completions => "prompt",
        };
        if value.get(field).is_none() {
            return Err(ApiError::bad_request(format!("`{field}` is required")));
        }
        if !request.model.is_empty() && request.model != config.model {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                kind: "NotFoundError",
                message: format!("The model `{}` does not exist.", request.model),
            });
        }
        // The cache belongs to the one model served: a body that names it and one that leaves
        // `model` out must share blocks, as they do in vLLM.
        request.model.clone_from(&config.model);
        let output_tokens = request
            .max_tokens
            .map_or(DEFAULT_MAX_TOKENS, |n| n as usize);
        if output_tokens == 0 {
            return Err(ApiError::bad_request("max_tokens must be at least 1"));
        }
        let job = replica.job(&request, output_tokens);
        check_lengths(job.tokens(), output_tokens)?;
        let include_usage = value
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(Plan {
            api,
            job,
            stream: request.stream,
            include_usage,
        })
    }
}

fn check_lengths(prompt_tokens: &[usize], output_tokens: usize) -> Result<(), ApiError> {
    for &tokens in prompt_tokens {
        if tokens == 0 {
            return Err(ApiError::bad_request("The prompt cannot be empty"));
        }
        if tokens + output_tokens > MAX_MODEL_LEN {
            return Err(ApiError::bad_request(format!(
                "This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you \
                 requested {} tokens ({tokens} in the messages, {output_tokens} in the \
                 completion).",
                tokens + output_tokens
            )));
        }
    }
    Ok(())
}

async fn generate(server: &Arc<Server>, request: Request<Incoming>, api: Api) -> Response<Body> {
    let body = read_body(request).await;
    if let (Some(status), Ok(_)) = (server.fail_status, &body) {
        let message = "the engine is not running (fake-server --fail-status)".to_string();
        let kind = "server_error";
        return ApiError {
            status,
            kind,
            message,
        }
        .response();
    }
    let plan = match body.and_then(|body| Plan::parse(api, &body, &server.replica)) {
        Ok(plan) => plan,
        Err(err) => return err.response(),
    };
    let mut reply = server.reply(plan.api);
    reply.prompts = plan.job.prompts();
    reply.output_tokens = plan.job.output_tokens;
    if plan.stream {
        stream(Arc::clone(server), plan, reply)
    } else {
        complete(server, plan, reply).await
    }
}

/// The semaphore is never closed, so this is unreachable in practice; answering beats panicking.
fn no_lane() -> Response<Body> {
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        kind: "ServiceUnavailableError",
        message: "no lane available".into(),
    }
    .response()
}

async fn complete(server: &Arc<Server>, plan: Plan, mut reply: Reply) -> Response<Body> {
    let Ok(lane) = server.replica.admit(&plan.job).await else {
        return no_lane();
    };
    lane.prefill().await;
    // The first token comes out of the prefill; each further one costs a decode step.
    lane.decode(plan.job.output_tokens.saturating_sub(1)).await;
    reply.prompt_tokens = lane.prompt_tokens;
    reply.cached_tokens = lane.cached_tokens;
    let body = reply.completion();
    lane.finish();
    json_response(StatusCode::OK, &body)
}

/// Answers with the event-stream headers at once (as vLLM does) and produces the events from a
/// task, which holds the lane until the last event is handed to the connection.
fn stream(server: Arc<Server>, plan: Plan, reply: Reply) -> Response<Body> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(stream_events(server, plan, reply, tx));
    let mut response = with_status(StatusCode::OK, ChannelBody(rx).boxed());
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Sends one SSE event; false once the client is gone, so the caller stops and frees its lane.
async fn send(tx: &mpsc::Sender<Bytes>, data: &str) -> bool {
    tx.send(Bytes::from(format!("data: {data}\n\n")))
        .await
        .is_ok()
}

async fn stream_events(server: Arc<Server>, plan: Plan, mut reply: Reply, tx: mpsc::Sender<Bytes>) {
    // A client that hangs up while queued or prefilling must not keep a lane busy.
    let lane = tokio::select! {
        lane = server.replica.admit(&plan.job) => lane,
        () = tx.closed() => return,
    };
    let Ok(lane) = lane else { return };
    tokio::select! {
        () = lane.prefill() => {}
        () = tx.closed() => return,
    }
    reply.prompt_tokens = lane.prompt_tokens;
    reply.cached_tokens = lane.cached_tokens;
    if let Some(chunk) = reply.role_chunk() {
        if !send(&tx, &chunk.to_string()).await {
            return;
        }
    }
    for step in 0..reply.output_tokens {
        if step > 0 {
            lane.decode(1).await;
        }
        for index in 0..reply.prompts {
            if !send(&tx, &reply.token_chunk(index, step).to_string()).await {
                return;
            }
        }
    }
    // vLLM sends usage in a stream only when asked to.
    if plan.include_usage && !send(&tx, &reply.usage_chunk().to_string()).await {
        return;
    }
    if send(&tx, "[DONE]").await {
        lane.finish();
    }
}

/// A response body fed by a channel; dropping it (the client left) closes the channel.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|data| Ok(Frame::data(data))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ReplicaConfig {
        ReplicaConfig {
            model: "cc-sim".into(),
            kv_blocks: 64,
            block_size: 16,
            non_ascii: prefixroute_core::tokenizer::NonAscii::Pieces,
            lanes: 4,
            prefill_overhead_ms: 0.0,
            prefill_ms_per_token: 0.0,
            decode_ms_per_token: 0.0,
        }
    }

    fn parse(api: Api, body: &str) -> Result<Plan, ApiError> {
        Plan::parse(api, body.as_bytes(), &Replica::new(config()))
    }

    #[test]
    fn plans_take_defaults_and_usage_option() {
        let plan = parse(
            Api::Chat,
            r#"{"messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        assert!(plan.stream && plan.include_usage);
        assert_eq!(plan.job.output_tokens, DEFAULT_MAX_TOKENS);
        let plan = parse(
            Api::Completions,
            r#"{"model":"cc-sim","prompt":["a","b"],"max_tokens":3}"#,
        )
        .unwrap();
        assert_eq!((plan.job.prompts(), plan.job.output_tokens), (2, 3));
        let words = "w ".repeat(40);
        let named = parse(
            Api::Completions,
            &format!(r#"{{"model":"cc-sim","prompt":"{words}"}}"#),
        )
        .unwrap();
        let unnamed = parse(Api::Completions, &format!(r#"{{"prompt":"{words}"}}"#)).unwrap();
        assert_eq!(named.job.chains().len(), 1);
        assert_eq!(named.job.chains()[0].len(), 2, "40 tokens, 2 full blocks");
        assert_eq!(named.job.chains(), unnamed.job.chains());
    }

    #[test]
    fn bad_requests_are_refused_with_a_status() {
        let status = |api, body| parse(api, body).unwrap_err().status;
        assert_eq!(status(Api::Chat, "{"), StatusCode::BAD_REQUEST);
        assert_eq!(
            status(Api::Chat, r#"{"prompt":"x"}"#),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            status(Api::Completions, r#"{"prompt":"x","model":"other"}"#),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            status(Api::Completions, r#"{"prompt":"x","max_tokens":0}"#),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            status(Api::Completions, r#"{"prompt":""}"#),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            status(
                Api::Completions,
                r#"{"prompt":"x","max_tokens":4000000000}"#
            ),
            StatusCode::BAD_REQUEST
        );
    }
}
