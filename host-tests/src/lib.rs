//! A deterministic proxy-wasm host for the prefixroute plugin.
//!
//! Real Envoy proves the plugin works; this host proves *why*, request by request, and counts
//! what each request costs exactly. It implements the host side of proxy-wasm ABI 0.2.1 and the
//! WASI preview1 calls a `wasm32-wasip1` cdylib needs, on wasmtime, with Envoy's semantics where
//! the ABI leaves room:
//!
//! * [`Host`]: the proxy process: the compiled plugin and what its VMs share
//!   ([`SharedStore`], [`Stats`], [`Clock`]).
//! * [`Vm`]: one instance (one Envoy worker): drives the lifecycle (start, configure, ticks,
//!   streams, callouts) and records what the guest did ([`Capture`]) and what it cost
//!   ([`Costs`]).
//! * Imports the plugin links but the host does not implement answer `Unimplemented` (12), or
//!   `ENOSYS` for WASI; they never fail to link.
//!
//! Nothing here reads the wall clock or real randomness, so fuel counts repeat exactly.

pub mod abi;
pub mod capture;
pub mod clock;
pub mod costs;
pub mod execution;
mod host;
mod imports;
pub mod shared;
mod state;
pub mod stats;
mod vm;

pub mod bench;

pub use abi::{Action, Headers, LogLevel, MapType, Status};
pub use capture::{Callout, Capture, HeaderOp, HeaderOpKind, LocalReply, LogLine, MetricOp};
pub use clock::Clock;
pub use costs::{ContextCosts, Costs};
pub use host::{locate_plugin, Fuel, Host, HostOptions, Plugin};
pub use shared::SharedStore;
pub use state::StreamState;
pub use stats::{Metric, Stats};
pub use vm::{CalloutReply, Chunks, Exchange, Request, RoundTrip, Vm};
