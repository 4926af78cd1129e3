//! `prefixroute fake-server`: a vLLM look-alike, so routers, Envoy and the replayer can be tested
//! end to end without a GPU.
//!
//! It speaks the part of vLLM's OpenAI server a router touches (chat and completions, streaming,
//! `/v1/models`, `/health`, `/metrics` with vLLM's names), and its prefix cache is core's
//! `BlockCache`, so its hit counters mean exactly what the simulator's mean. Time is real: a
//! request waits for a lane, then sleeps for its prefill and decode.

mod exposition;
mod kv_events;
mod openai;
mod replica;
mod routes;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};

use prefixroute_core::tokenizer::NonAscii;
use replica::ReplicaConfig;
use routes::Server;

/// How long a stop waits for requests in flight before closing their connections.
const DRAIN: Duration = Duration::from_secs(3);

#[derive(clap::Args)]
pub struct Args {
    /// Port to listen on; 0 picks a free one (the start line on stderr names it).
    #[arg(long)]
    port: u16,
    /// Replica name, returned in the `x-served-by` header of every response.
    #[arg(long)]
    name: String,
    /// Address to bind. Only this address is listened on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Model served (`/v1/models`); requests naming another model get 404, as from vLLM.
    #[arg(long, default_value = "cc-sim")]
    model: String,
    /// Prefix-cache capacity, in blocks (`num_gpu_blocks`).
    #[arg(long, default_value_t = 64, value_parser = positive)]
    kv_blocks: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16, value_parser = positive)]
    block_size: usize,
    /// Characters outside ASCII: one token each (`pieces`), or skipped as llm-d-inference-sim
    /// does (`skip`). The router's `non_ascii` must say the same.
    #[arg(long, default_value = "pieces")]
    non_ascii: NonAscii,
    /// Requests served at once; the rest wait (`vllm:num_requests_waiting`).
    #[arg(long, default_value_t = 4, value_parser = lanes)]
    lanes: usize,
    /// Fixed prefill cost of every request, in ms.
    #[arg(long, default_value_t = 5.0, value_parser = millis)]
    prefill_overhead_ms: f64,
    /// Prefill cost of each uncached prompt token, in ms.
    #[arg(long, default_value_t = 1.0, value_parser = millis)]
    prefill_ms_per_token: f64,
    /// Cost of each output token after the first, in ms (spaces out stream chunks).
    #[arg(long, default_value_t = 0.0, value_parser = millis)]
    decode_ms_per_token: f64,
    /// Publish KV-cache events as vLLM does (`--kv-events-config` with the zmq publisher): a
    /// ZMQ PUB socket bound here (port 0 picks one; the second start line names it), topic
    /// `kv@<ip:port>@<model>`.
    #[arg(long, value_name = "tcp://IP:PORT", conflicts_with = "kv_events_to")]
    kv_events: Option<String>,
    /// Publish KV events by connecting to a relay that binds (`prefixroute kv-events --bind`),
    /// as vLLM does with `endpoint: tcp://RELAY:PORT`.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    kv_events_to: Option<String>,
    /// Answer every completion with this HTTP status (500–599) at once, as a server whose
    /// engine died while its HTTP server lives: `/metrics` keeps answering (and says idle).
    /// For testing what a router does with such a replica.
    #[arg(long, value_name = "STATUS", value_parser = server_error)]
    fail_status: Option<hyper::StatusCode>,
}

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err("must be a whole number >= 1".into()),
    }
}

fn server_error(s: &str) -> Result<hyper::StatusCode, String> {
    match s.parse::<u16>().map(hyper::StatusCode::from_u16) {
        Ok(Ok(status)) if status.is_server_error() => Ok(status),
        _ => Err("must be an HTTP server error status, 500 to 599".into()),
    }
}

fn lanes(s: &str) -> Result<usize, String> {
    // tokio's semaphore holds at most usize::MAX >> 3 permits; a sane bound gives a clear error.
    match positive(s)? {
        n if n <= 1_000_000 => Ok(n),
        _ => Err("must be at most 1000000".into()),
    }
}

fn millis(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(ms) if ms.is_finite() && ms >= 0.0 => Ok(ms),
        _ => Err("must be a number of milliseconds >= 0".into()),
    }
}

pub fn run(args: Args) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> Result<()> {
    let config = ReplicaConfig {
        model: args.model,
        kv_blocks: args.kv_blocks,
        block_size: args.block_size,
        non_ascii: args.non_ascii,
        lanes: args.lanes,
        prefill_overhead_ms: args.prefill_overhead_ms,
        prefill_ms_per_token: args.prefill_ms_per_token,
        decode_ms_per_token: args.decode_ms_per_token,
    };
    // Signal handlers go in before the start line, so a supervisor that stops the server as
    // soon as it reports ready still gets a clean exit.
    let mut stop = std::pin::pin!(shutdown_signal()?);
    let listener = TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    let publisher = match (&args.kv_events, &args.kv_events_to) {
        (Some(endpoint), _) => {
            let (socket, bound) = kv_events::bind(endpoint).await?;
            Some((kv_events::Publisher::Bound(socket), bound))
        }
        (None, Some(relay)) => Some((
            kv_events::Publisher::ConnectTo(relay.clone()),
            format!("{relay} (connecting)"),
        )),
        (None, None) => None,
    };
    let events = publisher.map(|(publisher, shown)| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let topic = prefixroute_kvevents::schema::topic(&addr.to_string(), &config.model);
        tokio::spawn(kv_events::publish(publisher, topic, rx));
        (tx, shown)
    });
    let (events, bound) = match events {
        Some((tx, bound)) => (Some(tx), Some(bound)),
        None => (None, None),
    };
    let mut server = Server::new(args.name.clone(), config, events)?;
    if let Some(status) = args.fail_status {
        server = server.failing_with(status);
    }
    let server = Arc::new(server);
    eprintln!("fake-server {} listening on http://{addr}", args.name);
    if let Some(bound) = bound {
        eprintln!("fake-server {} publishing KV events on {bound}", args.name);
    }

    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => serve_connection(&server, &graceful, stream),
                Err(err) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    eprintln!("fake-server {}: accept failed: {err}", args.name);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            () = &mut stop => break,
        }
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(DRAIN) => {}
    }
    eprintln!("fake-server {} stopped", args.name);
    Ok(())
}

fn serve_connection(server: &Arc<Server>, graceful: &GracefulShutdown, stream: TcpStream) {
    // Stream chunks are small and latency is what clients measure.
    let _ = stream.set_nodelay(true);
    let server = Arc::clone(server);
    let service = service_fn(move |request| routes::handle(Arc::clone(&server), request));
    // HTTP/1.1 only, like vLLM's uvicorn front end. The timer makes hyper enforce its
    // header-read timeout, so a client that connects and sends nothing cannot pin a socket.
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .serve_connection(TokioIo::new(stream), service);
    let connection = graceful.watch(connection);
    tokio::spawn(async move {
        // Clients hanging up mid-request is routine for a load test; nothing to report.
        let _ = connection.await;
    });
}

#[cfg(unix)]
fn shutdown_signal() -> Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut terminate = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    })
}

#[cfg(not(unix))]
fn shutdown_signal() -> Result<impl Future<Output = ()>> {
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}
