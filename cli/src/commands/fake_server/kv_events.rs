//! The fake server's KV-event publisher, as vLLM's `ZmqEventPublisher`: a ZMQ PUB socket,
//! multipart `[topic, sequence (8 bytes, big-endian), msgpack KVEventBatch]`, the sequence
//! counting from 0 by one per message. Everything the cache changed since the last message
//! goes into the next batch, so a burst costs one message.

use anyhow::{Context, Result};
use bytes::Bytes;
use prefixroute_kvevents::schema::{Event, EventBatch, Message};
use tokio::sync::mpsc::UnboundedReceiver;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

/// Binds `endpoint` (e.g. `tcp://127.0.0.1:5557`); returns the socket and the endpoint it
/// really bound (port 0 picks one).
pub async fn bind(endpoint: &str) -> Result<(PubSocket, String)> {
    let mut socket = PubSocket::new();
    let bound = socket
        .bind(endpoint)
        .await
        .with_context(|| format!("--kv-events {endpoint}: cannot bind"))?;
    Ok((socket, bound.to_string()))
}

/// Where the PUB socket goes: bound here (subscribers connect), or connected to a relay that
/// binds (`prefixroute kv-events --bind`, vLLM's `endpoint: tcp://RELAY:PORT`).
pub enum Publisher {
    Bound(PubSocket),
    ConnectTo(String),
}

/// Publishes until the replica (the channel's sender) goes away. A publisher that connects
/// waits for its relay first; the events of the meantime wait in the channel.
pub async fn publish(
    publisher: Publisher,
    topic: String,
    mut events: UnboundedReceiver<Vec<Event>>,
) {
    let mut socket = match publisher {
        Publisher::Bound(socket) => socket,
        Publisher::ConnectTo(endpoint) => {
            let mut socket = PubSocket::new();
            while let Err(err) = socket.connect(&endpoint).await {
                eprintln!(
                    "fake-server: cannot connect to {endpoint} for KV events: {err}; retrying"
                );
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            // The relay's subscription arrives just after the connection; a PUB socket drops
            // what it sends before (ZMQ's slow joiner), so give it a moment.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            socket
        }
    };
    let mut seq: u64 = 0;
    while let Some(first) = events.recv().await {
        let mut batch = first;
        while let Ok(more) = events.try_recv() {
            batch.extend(more);
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let message = Message {
            topic: topic.clone(),
            seq,
            batch: EventBatch {
                ts,
                events: batch,
                data_parallel_rank: Some(0),
            },
        };
        let frames: Vec<Bytes> = message.encode().into_iter().map(Bytes::from).collect();
        let Ok(zmq) = ZmqMessage::try_from(frames) else {
            continue;
        };
        // PUB never blocks on slow subscribers (it drops for them, as libzmq's high-water
        // mark does); a send error means no subscriber could take it, which is not ours to fix.
        let _ = socket.send(zmq).await;
        seq += 1;
    }
}
