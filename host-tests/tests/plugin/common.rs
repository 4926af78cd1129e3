//! Helpers shared by the tests: configurations, metrics pages, request bodies, scraping.

use host_tests::{CalloutReply, Exchange, Host, HostOptions, Request, Vm};
use serde_json::{json, Value};

pub const DEST: &str = "x-gateway-destination-endpoint";

/// A host running the real plugin; fails with the "build it first" message when it is missing.
pub fn host() -> Host {
    Host::prefixroute().unwrap_or_else(|e| panic!("{e:?}"))
}

pub fn host_with(options: HostOptions) -> Host {
    Host::with_options(options).unwrap_or_else(|e| panic!("{e:?}"))
}

pub fn name(i: usize) -> String {
    format!("replica-{i}")
}

pub fn address(i: usize) -> String {
    format!("10.1.{}.{}:8000", i / 200, i % 200 + 1)
}

/// A configuration with `n` endpoints; `extra` fields are merged in.
pub fn config(n: usize, extra: Value) -> Value {
    let endpoints: Vec<Value> = (0..n)
        .map(|i| json!({"name": name(i), "address": address(i)}))
        .collect();
    let mut c = json!({"endpoints": endpoints, "block_size": 16, "seed": 7});
    if let (Some(c), Value::Object(extra)) = (c.as_object_mut(), extra) {
        for (k, v) in extra {
            c.insert(k, v);
        }
    }
    c
}

pub fn configured(host: &Host, config: &Value) -> Vm {
    host.configured_vm(config.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("{e:?}"))
}

/// Which endpoint an address belongs to.
pub fn endpoint_of(addr: &str) -> usize {
    (0..1024)
        .find(|&i| address(i) == addr)
        .unwrap_or_else(|| panic!("{addr:?} is not a configured address"))
}

/// The chosen endpoint: the first address of the single destination header the request went
/// upstream with (the rest are its failover endpoints, see [`destinations`]).
pub fn destination(x: &Exchange) -> String {
    destinations(x)[0].clone()
}

/// Every address of the single destination header, chosen first.
pub fn destinations(x: &Exchange) -> Vec<String> {
    let values = x.upstream_values(DEST);
    assert_eq!(
        values.len(),
        1,
        "exactly one destination header: {:?}",
        x.upstream
    );
    values[0].split(',').map(str::to_string).collect()
}

pub fn page(waiting: f64, running: f64, kv: f64) -> String {
    format!(
        "# TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n\
         vllm:num_requests_running{{model_name=\"m\"}} {running}\n\
         vllm:kv_cache_usage_perc{{model_name=\"m\"}} {kv}\n"
    )
}

pub fn chat_body(system: &str, user: &str) -> Vec<u8> {
    json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user}
        ],
        "max_tokens": 16
    })
    .to_string()
    .into_bytes()
}

pub fn tenant_prompt(t: usize) -> String {
    format!("You are the assistant of tenant {t}. ").repeat(12)
}

/// Ticks `vm` and answers every callout it makes with `reply(endpoint)`. Returns the endpoints
/// scraped.
pub fn tick_and_answer(vm: &mut Vm, mut reply: impl FnMut(usize) -> CalloutReply) -> Vec<usize> {
    vm.tick().unwrap();
    answer_all(vm, &mut reply)
}

pub fn answer_all(vm: &mut Vm, reply: &mut impl FnMut(usize) -> CalloutReply) -> Vec<usize> {
    let mut scraped = Vec::new();
    for c in vm.pending_callouts() {
        let e = endpoint_of(&c.headers.get_str(":authority").expect(":authority"));
        scraped.push(e);
        vm.answer_callout(c.token, reply(e)).unwrap();
    }
    scraped
}

/// Sends a chat request, answers it and finishes it; returns the endpoint it went to.
pub fn route(vm: &mut Vm, body: &[u8]) -> usize {
    let rt = vm.round_trip(&Request::chat(body.to_vec())).unwrap();
    endpoint_of(&destination(&rt.exchange))
}
