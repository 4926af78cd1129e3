//! `prefixroute kv-events`: the relay between the servers' KV events and the plugin.
//!
//! One ZMQ SUB socket per server (vLLM's publisher, or `fake-server --kv-events`) feeds that
//! server's truth (`prefixroute-kvevents`): the router's own block hashes it holds, rebuilt
//! after lost messages. The plugin fetches what changed with its own callouts,
//! `GET /v1/kv/feed?since=VERSION&limit=N[&wait_ms=W][&layout=2]` (core's binary `FeedPage`,
//! layout 2 with each server's runs when asked for, else layout 1; one fetch at
//! a time across all Envoy workers), into its shared data. With `wait_ms` the fetch is a long
//! poll: held until something changes after `since` (or `wait_ms` passes), then answered after
//! [`LINGER`] more, so one answer carries what arrives together and a gateway fetches at most
//! about once per `LINGER`. `GET /stats` says, per server, what the
//! relay got and what it could not use; `GET /health` answers 200.
//!
//! A publisher that disconnects (ZMQ's monitor says so) is not live any more: its truth is
//! unknown, and the plugin falls back to its own belief for that server until events flow
//! again (the first message after a silence starts from empty: what it held before is void).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prefixroute_kvevents::feed::Feed;
use prefixroute_kvevents::schema::Message;
use prefixroute_kvevents::truth::ServerTruth;
use serde_json::json;
use tokio::net::TcpListener;
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket};

#[derive(clap::Args)]
pub struct Args {
    /// Where the plugin fetches the feed (keep it on loopback or a private network).
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// A server: its pool address (the ip:port the plugin routes to) and its KV-event
    /// publisher, `IP:PORT=tcp://HOST:PORT`, which the relay connects to (repeat for each).
    #[arg(long = "publisher", value_name = "IP:PORT=tcp://HOST:PORT")]
    publishers: Vec<String>,
    /// Also bind a SUB socket here for publishers that connect to the relay (vLLM's
    /// `kv-events-config` with `endpoint: tcp://RELAY:5557`, as in Kubernetes where pod IPs
    /// change); each server is named by its topic, `kv@<ip:port>@<model>`.
    #[arg(long, value_name = "tcp://IP:PORT")]
    bind: Option<String>,
    /// Servers learned from topics at most (`--bind`): bounds the relay's memory.
    #[arg(long, default_value_t = 1024)]
    max_servers: usize,
    /// The serving port of servers whose topic names only an IP (`kv@<ip>@<model>`).
    #[arg(long)]
    default_port: Option<u16>,
    /// The model the servers serve: the router's chains start from it.
    #[arg(long, default_value = "cc-sim")]
    model: String,
    /// The router's block size; events of another block size cannot be mapped.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Blocks a server can hold at most (`num_gpu_blocks`): bounds the relay's memory per
    /// server; more means removals were missed, and the oldest are dropped.
    #[arg(long, default_value_t = 1 << 20)]
    capacity_blocks: usize,
    /// Changes kept for fetchers; one further behind gets a full snapshot.
    #[arg(long, default_value_t = 1 << 20)]
    max_log: usize,
}

/// What the relay counts per server beyond its truth's own counts.
#[derive(Debug, Default, Clone, Copy)]
struct Wire {
    malformed_messages: u64,
    rejected_events: u64,
    disconnects: u64,
}

/// How long a long poll waits, once there is news, for what comes with it (the events of the
/// other servers' requests of the same moment) before it answers: it bounds how often each
/// gateway fetches, for at most this much more delay (the simulator finds 10 ms of feed delay
/// as good as none, docs/benchmarks.md).
const LINGER: std::time::Duration = std::time::Duration::from_millis(10);

struct State {
    feed: Feed,
    /// The feed's version after every change, for the long polls waiting on it.
    version: tokio::sync::watch::Sender<u64>,
    addresses: Vec<String>,
    wire: Vec<Wire>,
    /// Model, block size and capacity of servers learned from topics (`--bind`).
    learned: (String, usize, usize),
    max_servers: usize,
    default_port: Option<u16>,
    /// Messages on the bound socket whose topic names no `ip:port`, or beyond --max-servers.
    unknown_topics: u64,
}

impl State {
    /// Wakes the long polls: the feed changed (or may have).
    fn changed(&self) {
        self.version.send_replace(self.feed.version());
    }

    /// The server a topic names (`kv@<ip:port>@<model>`), added on first sight.
    fn server_of_topic(&mut self, topic: &str) -> Option<usize> {
        let named = topic.strip_prefix("kv@")?.split('@').next()?;
        let address = match (named.parse::<std::net::IpAddr>(), self.default_port) {
            (Ok(std::net::IpAddr::V6(ip)), Some(port)) => format!("[{ip}]:{port}"),
            (Ok(ip), Some(port)) => format!("{ip}:{port}"),
            _ => named.to_string(),
        };
        if !prefixroute_core::config::is_ip_port(&address) {
            return None;
        }
        let address = address.as_str();
        if let Some(i) = self.addresses.iter().position(|a| a == address) {
            return Some(i);
        }
        if self.addresses.len() >= self.max_servers {
            return None;
        }
        let (model, block_size, capacity) = &self.learned;
        let i = self
            .feed
            .add_server(address, ServerTruth::new(model, *block_size, *capacity));
        self.addresses.push(address.to_string());
        self.wire.push(Wire::default());
        eprintln!("kv-events: {address}: first events on the bound socket");
        Some(i)
    }
}

type Shared = Arc<Mutex<State>>;

fn lock(state: &Shared) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

fn parse_publisher(spec: &str) -> Result<(String, String)> {
    let (address, endpoint) = spec
        .split_once('=')
        .with_context(|| format!("--publisher {spec:?}: expected IP:PORT=tcp://HOST:PORT"))?;
    if !prefixroute_core::config::is_ip_port(address) {
        bail!("--publisher {spec:?}: {address:?} is not the server's IP:PORT");
    }
    if !endpoint.starts_with("tcp://") {
        bail!("--publisher {spec:?}: {endpoint:?} is not a tcp:// ZMQ endpoint");
    }
    Ok((address.to_string(), endpoint.to_string()))
}

pub fn run(args: Args) -> Result<()> {
    let publishers = args
        .publishers
        .iter()
        .map(|p| parse_publisher(p))
        .collect::<Result<Vec<_>>>()?;
    if args.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    if publishers.is_empty() && args.bind.is_none() {
        bail!("give --publisher IP:PORT=tcp://HOST:PORT for each server, or --bind tcp://IP:PORT");
    }
    let mut feed = Feed::new(args.max_log);
    for (address, _) in &publishers {
        feed.add_server(
            address,
            ServerTruth::new(&args.model, args.block_size, args.capacity_blocks),
        );
    }
    let state: Shared = Arc::new(Mutex::new(State {
        version: tokio::sync::watch::Sender::new(feed.version()),
        feed,
        addresses: publishers.iter().map(|(a, _)| a.clone()).collect(),
        wire: vec![Wire::default(); publishers.len()],
        learned: (args.model.clone(), args.block_size, args.capacity_blocks),
        max_servers: args.max_servers.max(publishers.len()),
        default_port: args.default_port,
        unknown_topics: 0,
    }));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let listener = TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let local = listener.local_addr()?;
        for (server, (address, endpoint)) in publishers.into_iter().enumerate() {
            tokio::spawn(subscribe(Arc::clone(&state), server, address, endpoint));
        }
        if let Some(bind) = &args.bind {
            let mut socket = SubSocket::new();
            let bound = socket
                .bind(bind)
                .await
                .with_context(|| format!("--bind {bind}: cannot bind"))?;
            socket.subscribe("").await.context("cannot subscribe")?;
            eprintln!("kv-events: publishers may connect to {bound}");
            tokio::spawn(receive_bound(Arc::clone(&state), socket));
        }
        eprintln!("kv-events relay listening on http://{local}");
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(err) => {
                    eprintln!("kv-events: accept failed: {err}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let state = Arc::clone(&state);
            let service = service_fn(move |request| handle(Arc::clone(&state), request));
            tokio::spawn(async move {
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}

/// Follows one publisher for ever (ZMQ reconnects by itself).
async fn subscribe(state: Shared, server: usize, address: String, endpoint: String) {
    let mut socket = SubSocket::new();
    let mut monitor = socket.monitor();
    // connect() waits until the publisher is there; ZMQ then reconnects after a loss itself.
    loop {
        match socket.connect(&endpoint).await {
            Ok(()) => break,
            Err(err) => {
                eprintln!("kv-events: {address}: cannot connect to {endpoint}: {err}; retrying");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    }
    if let Err(err) = socket.subscribe("").await {
        eprintln!("kv-events: {address}: cannot subscribe: {err}");
        return;
    }
    eprintln!("kv-events: {address}: subscribed to {endpoint}");
    loop {
        tokio::select! {
            received = socket.recv() => match received {
                Ok(message) => {
                    let frames: Vec<&[u8]> = message.iter().map(|b| b.as_ref()).collect();
                    let mut s = lock(&state);
                    match Message::decode(&frames) {
                        Ok((message, rejected)) => {
                            s.wire[server].rejected_events += rejected.len() as u64;
                            s.feed.apply(server, &message);
                            s.changed();
                        }
                        Err(_) => s.wire[server].malformed_messages += 1,
                    }
                }
                Err(err) => {
                    eprintln!("kv-events: {address}: receive failed: {err}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            },
            Some(event) = monitor.next() => {
                if let SocketEvent::Disconnected(_) = event {
                    let mut s = lock(&state);
                    s.wire[server].disconnects += 1;
                    s.feed.lost(server);
                    s.changed();
                    eprintln!("kv-events: {address}: publisher disconnected; its truth is unknown until it publishes again");
                }
            }
        }
    }
}

/// The bound socket: every connected publisher's messages, each server known by its topic. A
/// publisher that restarts starts its sequence over, which its truth treats as a gap.
async fn receive_bound(state: Shared, mut socket: SubSocket) {
    loop {
        match socket.recv().await {
            Ok(message) => {
                let frames: Vec<&[u8]> = message.iter().map(|b| b.as_ref()).collect();
                let mut s = lock(&state);
                let decoded = Message::decode(&frames);
                let Ok((message, rejected)) = decoded else {
                    s.unknown_topics += 1;
                    continue;
                };
                match s.server_of_topic(&message.topic) {
                    Some(server) => {
                        s.wire[server].rejected_events += rejected.len() as u64;
                        s.feed.apply(server, &message);
                        s.changed();
                    }
                    None => s.unknown_topics += 1,
                }
            }
            Err(err) => {
                eprintln!("kv-events: bound socket: receive failed: {err}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// Waits until the feed has changed after `since` (at once if it has; a `since` from another
/// relay's life, ahead of this one's version, gets its snapshot at once), for at most
/// `wait_ms`, then [`LINGER`] more.
async fn long_poll(state: &Shared, since: u64, wait_ms: u64) {
    let mut version = lock(state).version.subscribe();
    let current = *version.borrow_and_update();
    if current == since {
        let wait = std::time::Duration::from_millis(wait_ms);
        let news = tokio::time::timeout(wait, version.wait_for(|&v| v != since)).await;
        if !matches!(news, Ok(Ok(_))) {
            return;
        }
    }
    tokio::time::sleep(LINGER).await;
}

fn query_u64(query: &str, key: &str) -> Option<u64> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.parse().ok())
}

async fn handle(
    state: Shared,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let reply = |status: StatusCode, kind: &str, body: Vec<u8>| {
        Response::builder()
            .status(status)
            .header("content-type", kind)
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_default()
    };
    if request.method() != Method::GET {
        return Ok(reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            b"GET only\n".to_vec(),
        ));
    }
    let query = request.uri().query().unwrap_or("");
    Ok(match request.uri().path() {
        "/v1/kv/feed" => {
            let since = query_u64(query, "since").unwrap_or(0);
            let limit = query_u64(query, "limit")
                .unwrap_or(65_536)
                .clamp(1, 1 << 20) as usize;
            let wait_ms = query_u64(query, "wait_ms")
                .unwrap_or(0)
                .min(prefixroute_core::config::MAX_FEED_WAIT_MS);
            if wait_ms > 0 {
                long_poll(&state, since, wait_ms).await;
            }
            let page = lock(&state).feed.page(since, limit);
            // Runs only for a fetcher that reads them: a plugin from before them reads layout 1
            // only, and the relay may be upgraded first.
            let body = if query_u64(query, "layout").unwrap_or(1) >= 2 {
                page.encode()
            } else {
                page.encode_without_runs()
            };
            reply(StatusCode::OK, "application/octet-stream", body)
        }
        "/stats" => {
            let s = lock(&state);
            let servers: Vec<_> = s
                .addresses
                .iter()
                .enumerate()
                .map(|(i, address)| {
                    let c = s.feed.counts(i).unwrap_or_default();
                    let w = s.wire[i];
                    json!({
                        "address": address,
                        "live": s.feed.is_live(i),
                        "blocks": s.feed.blocks(i),
                        "messages": c.messages,
                        "stored": c.stored,
                        "removed": c.removed,
                        "gaps": c.gaps,
                        "orphans": c.orphans,
                        "foreign_block_size": c.foreign_block_size,
                        "over_capacity": c.over_capacity,
                        "skipped": c.skipped,
                        "malformed_messages": w.malformed_messages,
                        "rejected_events": w.rejected_events,
                        "disconnects": w.disconnects,
                    })
                })
                .collect();
            let body = json!({
                "version": s.feed.version(),
                "unknown_topics": s.unknown_topics,
                "servers": servers,
            });
            reply(
                StatusCode::OK,
                "application/json",
                serde_json::to_vec_pretty(&body).unwrap_or_default(),
            )
        }
        "/health" => reply(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
        _ => reply(StatusCode::NOT_FOUND, "text/plain", b"not found\n".to_vec()),
    })
}
