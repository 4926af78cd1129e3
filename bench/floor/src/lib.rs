//! The floor of a body-routing proxy-wasm filter: what Envoy spends on any wasm filter that
//! holds the headers, buffers the body, reads it once and sets the override-host header (the
//! work prefixroute cannot avoid), with no routing decision: the byte sum of the body picks
//! one of the addresses in the plugin configuration (a JSON list of "ip:port" strings).
//! `bench/cpu_ab.py` measures it beside Envoy without a filter and the real plugin.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

const HEADER: &str = "x-gateway-destination-endpoint";

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
        let sum: usize = body.iter().map(|&b| usize::from(b)).sum();
        if let Some(address) = self.0.get(sum % self.0.len().max(1)) {
            self.set_http_request_header(HEADER, Some(address));
        }
        Action::Continue
    }
}
