//! prefixroute as an Envoy proxy-wasm HTTP filter: a thin glue over `prefixroute-core`.
//!
//! The decision logic that is not proxy-wasm-specific lives in pure modules that build and
//! test natively: [`codec`] (shared-data value layouts), [`shared`] (the CAS key-value
//! abstraction), [`store`] (the prefix index in shared data), [`window`] (how far its stamps reach), [`ledger`] (per-worker
//! in-flight requests, prefill work and what was learned from first bytes), [`pbstruct`] (Struct configurations), [`scrape`] (scrape lease and results), [`fallback`], [`settings`],
//! [`stats`] and [`scheduler`], which ties them together. The proxy-wasm contexts (`root`,
//! `http`) and the raw host calls (`abi`, `host`) are compiled for wasm only.
//!
//! See `plugin/README.md` for the design, the shared-data layout and the Envoy configuration.

pub mod codec;
pub mod fallback;
pub mod ledger;
pub mod pbstruct;
pub mod scheduler;
pub mod scrape;
pub mod settings;
pub mod shared;
pub mod stats;
pub mod store;
pub mod window;

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(target_arch = "wasm32")]
mod host;
#[cfg(target_arch = "wasm32")]
mod http;
#[cfg(target_arch = "wasm32")]
mod root;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    // Installs the SDK's panic hook, so a panic (which would be a bug) is logged before the VM
    // traps; `failure_policy: FAIL_RELOAD` then replaces the VM.
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| Box::new(root::PluginRoot::new(context_id)));
}}
