//! The floor of a body-routing proxy-wasm filter: what Envoy spends on any wasm filter that
//! holds the headers, buffers the body, reads it once and sets the override-host header (the
//! work prefixroute cannot avoid), with no routing decision: the byte sum of the body picks
//! one of the addresses in the plugin configuration (a JSON list of "ip:port" strings).
//! `bench/cpu_ab.py` measures it beside Envoy without a filter and the real plugin.
//!
//! Built with `FLOOR_SHARED_GETS=n` / `FLOOR_SHARED_SETS=m` in the environment, each request
//! also makes `n` `get_shared_data` and `m` `set_shared_data` calls on 200-byte values (over
//! eight keys), so that `cpu_ab.py --floor-variant` prices a shared-data call in Envoy itself.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

const HEADER: &str = "x-gateway-destination-endpoint";
const SHARED_GETS: usize = count(option_env!("FLOOR_SHARED_GETS"));
const SHARED_SETS: usize = count(option_env!("FLOOR_SHARED_SETS"));

/// A decimal count from the build environment (0 when unset).
const fn count(text: Option<&str>) -> usize {
    let Some(text) = text else { return 0 };
    let bytes = text.as_bytes();
    let (mut n, mut i) = (0, 0);
    while i < bytes.len() {
        assert!(
            bytes[i].is_ascii_digit(),
            "FLOOR_SHARED_GETS/SETS: not a number"
        );
        n = n * 10 + (bytes[i] - b'0') as usize;
        i += 1;
    }
    n
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root(Vec::new())) });
}}

struct Root(Vec<String>);

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        let text = String::from_utf8_lossy(&config);
        // `["127.0.0.1:9000", ...]` without a JSON parser: the quoted strings in order.
        self.0 = text
            .split('"')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect();
        size == 0 || !self.0.is_empty()
    }

    fn create_http_context(&self, _: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter(self.0.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Filter(Vec<String>);

impl Context for Filter {}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        self.set_http_request_header(HEADER, None);
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        for i in 0..SHARED_GETS.max(SHARED_SETS) {
            let key = [
                "floor/0", "floor/1", "floor/2", "floor/3", "floor/4", "floor/5", "floor/6",
                "floor/7",
            ][i % 8];
            let (value, cas) = if i < SHARED_GETS {
                self.get_shared_data(key)
            } else {
                (None, None)
            };
            if i < SHARED_SETS || (i < SHARED_GETS && value.is_none()) {
                let value = value.unwrap_or_else(|| vec![7; 200]);
                let _ = self.set_shared_data(key, Some(&value), cas);
            }
        }
        let sum: usize = body.iter().map(|&b| usize::from(b)).sum();
        if let Some(address) = self.0.get(sum % self.0.len().max(1)) {
            self.set_http_request_header(HEADER, Some(address));
        }
        Action::Continue
    }
}
