//! prefixroute-core: the routing brain shared by the Envoy plugin, the CLI and the web demo.
//!
//! Data flows through small steps, each its own module:
//! body → prompt ([`request`]) → tokens ([`tokenizer`]) → block hashes ([`hashing`]) →
//! index lookup ([`index`]) → predicted time to first token ([`latency`]) or scores
//! ([`scorer`]) → pick → commit ([`router`]). [`metrics`] reads the servers' Prometheus pages,
//! [`config`] the plugin's configuration, [`discovery`] the pool's members as Envoy's admin
//! interface lists them, [`outlier`] which endpoints answer with server errors.
//!
//! Everything here is pure and deterministic: no threads, files, clocks or sockets, so the
//! same code runs natively, in the proxy-wasm plugin and in the browser. Randomness comes from
//! a seed the caller passes; time comes from the caller as numbers. The fleet around the
//! router (replica model, simulator, traces) is `prefixroute-sim`; Kubernetes InferencePools are
//! `prefixroute-pool`.

pub mod config;
pub mod discovery;
pub mod feed;
pub mod hashing;
pub mod index;
pub mod latency;
pub mod metrics;
pub mod order;
pub mod outlier;
pub mod request;
pub mod router;
pub mod scorer;
pub mod tokenizer;

pub use hashing::{BlockHashes, HashConfig};
pub use index::{PrefixIndex, PrefixStore, Turn};
pub use request::{parse_request, ParsedRequest, RequestError};
pub use router::{Decision, EndpointLoad, Policy, Router, RouterConfig, Weights};
