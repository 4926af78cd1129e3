//! prefixroute-kvevents: vLLM's KV-cache events, and the truth they give the router.
//!
//! [`schema`] reads and writes the events as vLLM publishes them (msgpack batches in ZMQ
//! multipart messages); [`truth`] turns one server's events into the router's own block hashes
//! (the dual-key map) and survives lost messages; [`feed`] keeps every server's truth and the
//! log of changes the plugin fetches (core's `feed` page format). Pure: the sockets are in the
//! CLI (`prefixroute kv-events`, `prefixroute fake-server --kv-events`).

pub mod feed;
pub mod schema;
pub mod truth;
