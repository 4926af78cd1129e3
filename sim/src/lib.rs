//! prefixroute-sim: the fleet around the router, for the CLI, the web demo and the tests.
//!
//! [`replica`] models a vLLM server's prefix cache and lanes; [`simulation`] drives
//! `prefixroute_core`'s router over simulated replicas in simulated time (and the upper bound:
//! one server, unlimited cache); [`trace`] generates the workloads; [`disagg`] prices
//! prefill/decode disaggregation for one request and [`pd`] for a simulated fleet; [`fleet`] makes replicas come and go during a run; [`summary`] holds the percentiles and balance figures every
//! report shares.
//!
//! Like core, pure and deterministic: randomness from seeds, time as numbers.

pub mod disagg;
pub mod fleet;
pub mod pd;
pub mod replica;
pub mod simulation;
pub mod summary;
pub mod trace;
