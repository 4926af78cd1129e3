//! End-to-end tests of the prefixroute plugin (the real `.wasm`) on the deterministic host, and
//! tests of the host's ABI itself. One test binary, so the module is compiled (or loaded from
//! the compile cache) once.

mod common;

mod abi;
mod config;
mod corpus;
mod destination;
mod differential;
mod discovery;
mod lifecycle;
mod outlier;
mod scrape;
mod workers;
