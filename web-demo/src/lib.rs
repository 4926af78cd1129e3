//! prefixroute-web-demo: the browser page's bridge to `prefixroute-core`.
//!
//! The page writes no routing logic of its own. The trace comes from
//! [`TraceSpec::generate`], every decision from the simulator's [`Simulation::step`] (which
//! calls core's router's `pick` and `commit` and serves the request on the simulator's vLLM
//! replica model), and the comparison table from [`prefixroute_sim::simulation::simulate`] on
//! the same trace for every policy. This crate only *reads* core's state and shapes it into
//! JSON for the page: which block hashes each replica caches, which group a block belongs to,
//! what the router believes each replica holds.
//!
//! [`Demo`] is plain Rust (tested natively with `cargo test -p prefixroute-web-demo`); the
//! `#[wasm_bindgen]` wrapper [`WebDemo`] turns its results into JSON strings and its errors
//! into JavaScript exceptions.

use std::collections::HashMap;

use prefixroute_core::config::{IndexMode, Policy};
use prefixroute_core::index::PrefixStore;
use prefixroute_sim::simulation::{replica_names, SimConfig, Simulation, Step};
use prefixroute_sim::summary::{max_over_mean, natural_key};
use prefixroute_sim::trace::{to_jsonl, TraceRecord, TraceShape, TraceSpec};
use serde::Deserialize;
use serde_json::{json, Value};
use wasm_bindgen::prelude::*;

/// Limits that keep one browser tab responsive. Core accepts more; the page does not need it.
/// (The page draws one cell per cache block: at most 16 × 1024.)
pub const MAX_REQUESTS: usize = 2000;
pub const MAX_REPLICAS: usize = 16;
pub const MAX_CACHE_BLOCKS: usize = 1024;
pub const MAX_TENANTS: usize = 256;
pub const MAX_PROMPT_WORDS: usize = 2000;
pub const MAX_LANES: usize = 256;

/// Group index of a block hash shared by more than one group (e.g. the common system prompt
/// of the `conversations` shape).
pub const SHARED_GROUP: i64 = -1;

/// What the page sends: a trace spec and a simulator configuration, both core's own types
/// (so every field and default is core's).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    #[serde(default)]
    pub trace: TraceSpec,
    #[serde(default)]
    pub sim: SimConfig,
}

/// Core's defaults and choices, for the page's controls.
pub fn defaults() -> Value {
    let shapes: Vec<Value> = TraceShape::ALL
        .iter()
        .map(|s| serde_json::to_value(s).unwrap_or(Value::Null))
        .collect();
    json!({
        "trace": TraceSpec::default(),
        "sim": SimConfig::default(),
        "policies": Policy::ALL.iter().map(|p| p.name()).collect::<Vec<_>>(),
        // What each policy's score is made of, so the page never keeps its own copy.
        "policy_scorers": Policy::ALL
            .iter()
            .map(|p| (p.name().to_string(), json!(p.scorers())))
            .collect::<serde_json::Map<_, _>>(),
        "predicting": Policy::ALL
            .iter()
            .filter(|p| p.predicts())
            .map(|p| p.name())
            .collect::<Vec<_>>(),
        "shapes": shapes,
        "limits": {
            "requests": MAX_REQUESTS,
            "replicas": MAX_REPLICAS,
            "cache_blocks": MAX_CACHE_BLOCKS,
            "tenants": MAX_TENANTS,
            "prompt_words": MAX_PROMPT_WORDS,
            "lanes": MAX_LANES,
        },
    })
}

fn check_limits(settings: &Settings) -> Result<(), String> {
    let checks = [
        ("requests", settings.trace.requests, 1, MAX_REQUESTS),
        ("replicas", settings.sim.replicas, 1, MAX_REPLICAS),
        (
            "cache blocks",
            settings.sim.cache_blocks,
            1,
            MAX_CACHE_BLOCKS,
        ),
        ("tenants", settings.trace.tenants, 1, MAX_TENANTS),
        (
            "prompt words",
            settings.trace.prompt_words,
            0,
            MAX_PROMPT_WORDS,
        ),
        (
            "question words",
            settings.trace.question_words,
            0,
            MAX_PROMPT_WORDS,
        ),
        ("slots", settings.sim.timing.lanes, 1, MAX_LANES),
    ];
    for (name, value, min, max) in checks {
        if value < min || value > max {
            return Err(format!(
                "{name} must be in {min}..={max} in the demo, got {value}"
            ));
        }
    }
    Ok(())
}

/// Generates a trace with core's generator.
pub fn generate_trace(spec: &TraceSpec) -> Result<Vec<TraceRecord>, String> {
    spec.generate().map_err(|e| format!("trace: {e}"))
}

fn hex(hash: u64) -> String {
    format!("{hash:016x}")
}

/// One replica's lanes at an instant (core's `ReplicaSim::waiting` / `running`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lanes {
    pub waiting: usize,
    pub running: usize,
}

/// A simulation in progress plus what the page needs to draw it.
pub struct Demo {
    trace: Vec<TraceRecord>,
    config: SimConfig,
    sim: Simulation,
    names: Vec<String>,
    groups: Vec<String>,
    group_index: HashMap<String, usize>,
    /// Block hash → group index (or [`SHARED_GROUP`]), from every request's chains.
    block_group: HashMap<u64, i64>,
    /// Prompt tokens served from cache and queried so far (sums of core's `Served`), for the
    /// hit-rate curve without recomputing the whole report after every request.
    cached_tokens: u64,
    prompt_tokens: u64,
}

impl Demo {
    /// Generates the trace and prepares the simulation.
    pub fn new(settings: Settings) -> Result<Demo, String> {
        check_limits(&settings)?;
        let trace = generate_trace(&settings.trace)?;
        Demo::from_trace(trace, settings.sim)
    }

    pub fn from_json(settings_json: &str) -> Result<Demo, String> {
        let settings: Settings =
            serde_json::from_str(settings_json).map_err(|e| format!("settings: {e}"))?;
        Demo::new(settings)
    }

    /// Simulates a given trace (e.g. one read from a JSONL file).
    pub fn from_trace(trace: Vec<TraceRecord>, config: SimConfig) -> Result<Demo, String> {
        let sim = Simulation::new(&trace, config).map_err(|e| e.to_string())?;
        let mut groups: Vec<String> = Vec::new();
        for record in &trace {
            if !groups.contains(&record.group) {
                groups.push(record.group.clone());
            }
        }
        groups.sort_by_key(|g| natural_key(g));
        let group_index: HashMap<String, usize> = groups
            .iter()
            .enumerate()
            .map(|(i, g)| (g.clone(), i))
            .collect();
        let mut block_group: HashMap<u64, i64> = HashMap::new();
        for request in sim.requests() {
            let g = group_index[&request.group] as i64;
            for hash in request.hashes.iter() {
                block_group
                    .entry(hash)
                    .and_modify(|owner| {
                        if *owner != g {
                            *owner = SHARED_GROUP;
                        }
                    })
                    .or_insert(g);
            }
        }
        Ok(Demo {
            names: replica_names(config.replicas),
            trace,
            config,
            sim,
            groups,
            group_index,
            block_group,
            cached_tokens: 0,
            prompt_tokens: 0,
        })
    }

    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    pub fn simulation(&self) -> &Simulation {
        &self.sim
    }

    pub fn trace(&self) -> &[TraceRecord] {
        &self.trace
    }

    fn group_of(&self, hash: u64) -> i64 {
        self.block_group.get(&hash).copied().unwrap_or(SHARED_GROUP)
    }

    /// Names, groups and the trace at a glance.
    pub fn info(&self) -> Value {
        let requests: Vec<Value> = self
            .sim
            .requests()
            .iter()
            .map(|r| {
                json!({
                    "t": r.t,
                    "group": r.group,
                    "tokens": r.hashes.total_tokens(),
                    "blocks": r.hashes.total_blocks(),
                })
            })
            .collect();
        json!({
            "replicas": self.names,
            "groups": self.groups,
            "config": self.config,
            "requests": requests,
        })
    }

    /// The request at `index` as the router is about to see it: its block hashes (with the
    /// group that owns each), how many leading blocks the router *believes* each replica holds
    /// (its index), and how many each replica's cache *really* would reuse (vLLM's lookup).
    pub fn request_view(&self, index: usize) -> Option<Value> {
        let request = self.sim.requests().get(index)?;
        let hashes = &request.hashes;
        let block_size = hashes.block_size.max(1);
        let router = self.sim.router();
        let chains: Vec<Value> = hashes
            .chains
            .iter()
            .zip(&hashes.tokens)
            .map(|(chain, &tokens)| {
                // The server caches full blocks only; the router also hashes the partial tail.
                let full = (tokens / block_size).min(chain.len());
                let blocks: Vec<Value> = chain
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| json!({"hash": hex(h), "group": self.group_of(h), "full": i < full}))
                    .collect();
                let belief: Vec<usize> = (0..self.config.replicas)
                    .map(|e| router.store().longest_match(e, chain))
                    .collect();
                let caches = self.sim.replicas().iter().map(|r| &r.cache);
                // What vLLM's lookup would reuse for this prompt (capped so that the last token
                // is computed), and the leading blocks the cache holds at all (the same lookup,
                // uncapped).
                let server: Vec<usize> = caches
                    .clone()
                    .map(|c| c.lookup(&chain[..full], tokens))
                    .collect();
                let held: Vec<usize> = caches
                    .map(|c| c.lookup(&chain[..full], usize::MAX))
                    .collect();
                // Believed full blocks the cache no longer holds: the index is a belief.
                let stale: Vec<usize> = belief
                    .iter()
                    .zip(&held)
                    .map(|(&b, &h)| b.min(full).saturating_sub(h))
                    .collect();
                json!({
                    "tokens": tokens,
                    "full_blocks": full,
                    "blocks": blocks,
                    "belief_match": belief,
                    "server_match": server,
                    "server_held": held,
                    "stale_blocks": stale,
                })
            })
            .collect();
        Some(json!({
            "index": index,
            "t": request.t,
            "group": request.group,
            "group_index": self.group_index.get(&request.group).copied().unwrap_or(0),
            "tokens": hashes.total_tokens(),
            "blocks": hashes.total_blocks(),
            "block_size": block_size,
            "output_tokens": request.output_tokens,
            "chains": chains,
        }))
    }

    /// Each replica's lanes at `now_ms`, counting the first `steps` served requests.
    pub fn lanes_at(&self, now_ms: f64) -> Vec<Lanes> {
        self.sim
            .replicas()
            .iter()
            .map(|r| Lanes {
                waiting: r.waiting(now_ms),
                running: r.running(now_ms),
            })
            .collect()
    }

    /// Every replica now: cached blocks (most recently used first) with their groups, the
    /// router's belief size, server-side hit/query counters (tokens), lanes and requests.
    pub fn replicas_view(&self) -> Value {
        let steps = self.sim.steps();
        let now_ms = steps.last().map_or(0.0, |s| s.t * 1000.0);
        let lanes = self.lanes_at(now_ms);
        let mut requests = vec![0usize; self.config.replicas];
        for step in steps {
            requests[step.decision.endpoint] += 1;
        }
        let views: Vec<Value> = self
            .sim
            .replicas()
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let blocks: Vec<u64> = r.cache.blocks().collect();
                json!({
                    "name": self.names[i],
                    "capacity": r.cache.capacity_blocks(),
                    "used": r.cache.used_blocks(),
                    "blocks": blocks.iter().map(|&h| hex(h)).collect::<Vec<_>>(),
                    "groups": blocks.iter().map(|&h| self.group_of(h)).collect::<Vec<_>>(),
                    "hit_tokens": r.cache.hit_tokens(),
                    "query_tokens": r.cache.query_tokens(),
                    "belief_blocks": self.sim.router().store().len(i),
                    "requests": requests[i],
                    "lanes": r.timing().lanes,
                    "waiting": lanes[i].waiting,
                    "running": lanes[i].running,
                })
            })
            .collect();
        json!(views)
    }

    pub fn is_done(&self) -> bool {
        self.sim.is_done()
    }

    pub fn steps_done(&self) -> usize {
        self.sim.steps().len()
    }

    /// Fleet hit rate so far (tokens): the same ratio as core's report, from the sums of what
    /// each replica served.
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }

    /// Core's step, plus the running token sums.
    fn run_one(&mut self) -> Option<Step> {
        let step = self.sim.step()?.clone();
        self.cached_tokens += step.served.cached_tokens as u64;
        self.prompt_tokens += step.served.prompt_tokens as u64;
        Some(step)
    }

    /// Runs the next request and explains it; `None` when the trace is exhausted.
    pub fn step(&mut self) -> Option<Value> {
        let index = self.sim.steps().len();
        let request = self.request_view(index)?;
        // The replicas' lanes as the request arrives: the queue the router scores.
        let seen = self.lanes_at(self.sim.requests()[index].t * 1000.0);
        let step = self.run_one()?;
        Some(self.step_view(&step, request, &seen))
    }

    fn step_view(&self, step: &Step, request: Value, seen: &[Lanes]) -> Value {
        let report = self.sim.report();
        json!({
            "step": step,
            "explanation": step.explain(&self.names),
            "request": request,
            "queue_seen": seen.iter().map(|l| l.waiting).collect::<Vec<_>>(),
            "replicas": self.replicas_view(),
            "hit_rate": self.hit_rate(),
            "report": report,
            "done": self.sim.is_done(),
        })
    }

    /// Runs up to `n` requests. Returns the fleet hit rate after each (for the chart) and the
    /// full view of the last one, so a fast run draws once instead of every step.
    pub fn advance(&mut self, n: usize) -> Value {
        let mut light = Vec::new();
        let mut last = Value::Null;
        for k in 0..n {
            if self.sim.is_done() {
                break;
            }
            if k + 1 == n || self.sim.steps().len() + 1 == self.sim.requests().len() {
                if let Some(view) = self.step() {
                    light.push(
                        json!({"index": view["step"]["index"], "hit_rate": view["hit_rate"]}),
                    );
                    last = view;
                }
            } else if let Some(step) = self.run_one() {
                light.push(json!({"index": step.index, "hit_rate": self.hit_rate()}));
            }
        }
        json!({"steps": light, "last": last, "done": self.sim.is_done()})
    }

    /// Core's report of the steps run so far.
    pub fn report(&self) -> Value {
        json!(self.sim.report())
    }

    /// Every policy of core on this same trace and fleet, for the table and the chart: core's
    /// `simulate` (new → run → report), keeping the steps for the hit rate after each request.
    pub fn compare(&self) -> Result<Value, String> {
        let mut rows = Vec::new();
        for policy in Policy::ALL {
            let mut config = self.config;
            config.router.policy = policy;
            let mut sim = Simulation::new(&self.trace, config).map_err(|e| e.to_string())?;
            sim.run();
            let report = sim.report();
            let mut hits = 0usize;
            let mut queries = 0usize;
            let series: Vec<f64> = sim
                .steps()
                .iter()
                .map(|s| {
                    hits += s.served.cached_tokens;
                    queries += s.served.prompt_tokens;
                    if queries == 0 {
                        0.0
                    } else {
                        hits as f64 / queries as f64
                    }
                })
                .collect();
            rows.push(json!({
                "policy": policy.name(),
                "max_over_mean": max_over_mean(&report.requests_per_replica),
                "report": report,
                "hit_series": series,
            }));
        }
        Ok(json!(rows))
    }

    /// The selected policy on this trace twice, side by side: with the router's own belief
    /// (`approximate`) and with the belief the replicas' KV events give (`precise`), each with
    /// how often its belief was wrong about the replica it chose.
    pub fn beliefs(&self) -> Result<Value, String> {
        let mut rows = Vec::new();
        for index in [IndexMode::Approximate, IndexMode::Precise] {
            let config = SimConfig {
                index,
                ..self.config
            };
            let mut sim = Simulation::new(&self.trace, config).map_err(|e| e.to_string())?;
            sim.run();
            rows.push(json!({
                "index": index.name(),
                "report": sim.report(),
                "check": sim.belief_check(),
            }));
        }
        Ok(json!(rows))
    }

    /// The trace as JSONL, for `prefixroute simulate trace.jsonl`.
    pub fn trace_jsonl(&self) -> String {
        to_jsonl(&self.trace)
    }
}

fn js_error(message: impl std::fmt::Display) -> JsError {
    JsError::new(&message.to_string())
}

/// Core's defaults and choices, as JSON: `{trace, sim, policies, shapes, limits}`.
#[wasm_bindgen(js_name = defaults)]
pub fn wasm_defaults() -> String {
    defaults().to_string()
}

/// Core's trace generator: a `TraceSpec` as JSON in, the records as a JSON array out.
#[wasm_bindgen(js_name = generateTrace)]
pub fn wasm_generate_trace(spec_json: &str) -> Result<String, JsError> {
    let spec: TraceSpec = serde_json::from_str(spec_json).map_err(js_error)?;
    let trace = generate_trace(&spec).map_err(js_error)?;
    serde_json::to_string(&trace).map_err(js_error)
}

/// Core's replica names (`replica-0`, …) as a JSON array.
#[wasm_bindgen(js_name = replicaNames)]
pub fn wasm_replica_names(n: usize) -> String {
    json!(replica_names(n)).to_string()
}

/// A simulation the page steps through. Every method returns a JSON string.
#[wasm_bindgen]
pub struct WebDemo {
    inner: Demo,
}

#[wasm_bindgen]
impl WebDemo {
    /// `settings_json`: `{"trace": TraceSpec, "sim": SimConfig}` (core's types; missing
    /// sections take core's defaults).
    #[wasm_bindgen(constructor)]
    pub fn new(settings_json: &str) -> Result<WebDemo, JsError> {
        Demo::from_json(settings_json)
            .map(|inner| WebDemo { inner })
            .map_err(js_error)
    }

    pub fn info(&self) -> String {
        self.inner.info().to_string()
    }

    /// The next request, before routing (`null` when done).
    #[wasm_bindgen(js_name = nextRequest)]
    pub fn next_request(&self) -> String {
        self.inner
            .request_view(self.inner.steps_done())
            .unwrap_or(Value::Null)
            .to_string()
    }

    /// Routes and serves the next request (`null` when done).
    pub fn step(&mut self) -> String {
        self.inner.step().unwrap_or(Value::Null).to_string()
    }

    /// Routes up to `n` requests; `{steps: [{index, hit_rate}], last, done}`.
    pub fn advance(&mut self, n: usize) -> String {
        self.inner.advance(n).to_string()
    }

    pub fn replicas(&self) -> String {
        self.inner.replicas_view().to_string()
    }

    pub fn report(&self) -> String {
        self.inner.report().to_string()
    }

    pub fn compare(&self) -> Result<String, JsError> {
        self.inner
            .compare()
            .map(|v| v.to_string())
            .map_err(js_error)
    }

    pub fn beliefs(&self) -> Result<String, JsError> {
        self.inner
            .beliefs()
            .map(|v| v.to_string())
            .map_err(js_error)
    }

    #[wasm_bindgen(js_name = traceJsonl)]
    pub fn trace_jsonl(&self) -> String {
        self.inner.trace_jsonl()
    }

    #[wasm_bindgen(js_name = isDone)]
    pub fn is_done(&self) -> bool {
        self.inner.is_done()
    }

    #[wasm_bindgen(js_name = stepsDone)]
    pub fn steps_done(&self) -> usize {
        self.inner.steps_done()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prefixroute_sim::simulation::simulate;

    fn demo(policy: Policy) -> Demo {
        let mut sim = SimConfig::default();
        sim.router.policy = policy;
        Demo::new(Settings {
            trace: TraceSpec::default(),
            sim,
        })
        .unwrap()
    }

    #[test]
    fn settings_take_core_defaults_and_refuse_unknown_sections() {
        let d = Demo::from_json("{}").unwrap();
        assert_eq!(*d.config(), SimConfig::default());
        assert_eq!(d.trace(), TraceSpec::default().generate().unwrap());
        let custom = Demo::from_json(r#"{"trace": {"seed": 7, "requests": 10}}"#).unwrap();
        assert_eq!(custom.trace().len(), 10);
        assert!(Demo::from_json(r#"{"bogus": 1}"#).is_err());
        let err = Demo::from_json(r#"{"trace": {"tenants": 0}}"#)
            .err()
            .unwrap();
        assert!(err.contains("tenants"), "{err}");
        let err = Demo::from_json(r#"{"trace": {"requests": 100000}}"#)
            .err()
            .unwrap();
        assert!(err.contains("requests"), "{err}");
    }

    #[test]
    fn defaults_name_every_policy_and_shape() {
        let d = defaults();
        assert_eq!(d["policies"].as_array().unwrap().len(), Policy::ALL.len());
        assert_eq!(d["policies"][0], "latency", "the default first");
        assert_eq!(d["sim"]["router"]["policy"], "latency");
        assert_eq!(d["shapes"][2], "rag");
        assert_eq!(d["shapes"][3], "unique");
        assert_eq!(d["shapes"][4], "mixed");
        assert_eq!(d["sim"]["router"]["weights"]["prefix"], 3.0);
        assert_eq!(
            d["policy_scorers"]["prefix"],
            json!(["prefix", "queue", "kv_cache", "no_hit_lru"])
        );
        assert_eq!(d["policy_scorers"]["round-robin"], json!([]));
        assert_eq!(d["predicting"], json!(["latency"]));
    }

    #[test]
    fn stepping_matches_core_and_explains_each_decision() {
        let mut d = demo(Policy::Prefix);
        let preview = d.request_view(0).unwrap();
        let first = d.step().unwrap();
        assert_eq!(first["request"], preview);
        assert_eq!(first["step"]["decision"]["cold"], true);
        assert_eq!(
            first["step"]["decision"]["scores"]
                .as_array()
                .unwrap()
                .len(),
            3
        );
        assert!(first["explanation"]
            .as_str()
            .unwrap()
            .starts_with("#0 tenant-"));
        while d.step().is_some() {}
        assert!(d.is_done());
        let report: prefixroute_sim::simulation::SimReport =
            serde_json::from_value(d.report()).unwrap();
        assert_eq!(d.hit_rate(), report.hit_rate);
        let report: prefixroute_sim::simulation::SimReport =
            serde_json::from_value(d.report()).unwrap();
        assert_eq!(
            report,
            simulate(d.trace(), *d.config()).unwrap(),
            "stepping in the demo is core's simulation"
        );
    }

    #[test]
    fn the_two_beliefs_are_cores_two_simulations_and_the_precise_one_is_never_wrong() {
        let mut sim = SimConfig {
            cache_blocks: 20,
            capacity_reported: false,
            ..SimConfig::default()
        };
        sim.router.policy = Policy::Latency;
        let d = Demo::new(Settings {
            trace: TraceSpec::default(),
            sim,
        })
        .unwrap();
        let rows = d.beliefs().unwrap();
        assert_eq!(rows[0]["index"], "approximate");
        assert_eq!(rows[1]["index"], "precise");
        assert_eq!(rows[1]["check"]["wrong"], 0);
        assert!(
            rows[0]["check"]["wrong"].as_u64() > Some(0),
            "{}",
            rows[0]["check"]
        );
        let precise: prefixroute_sim::simulation::SimReport =
            serde_json::from_value(rows[1]["report"].clone()).unwrap();
        let config = SimConfig {
            index: IndexMode::Precise,
            ..*d.config()
        };
        assert_eq!(precise, simulate(d.trace(), config).unwrap());
    }

    #[test]
    fn belief_and_server_matches_come_from_core_state() {
        let mut d = demo(Policy::Prefix);
        let mut saw_hit = false;
        while !d.is_done() {
            let index = d.steps_done();
            let view = d.request_view(index).unwrap();
            let step = d.step().unwrap();
            let endpoint = step["step"]["decision"]["endpoint"].as_u64().unwrap() as usize;
            let chain = &view["chains"][0];
            // The router's belief is what the decision scored.
            assert_eq!(
                chain["belief_match"][endpoint],
                step["step"]["decision"]["scores"][endpoint]["matched_blocks"]
            );
            // The server-side lookup is what the replica then reused.
            let reused = chain["server_match"][endpoint].as_u64().unwrap() as usize;
            let block_size = view["block_size"].as_u64().unwrap() as usize;
            assert_eq!(
                step["step"]["served"]["cached_tokens"].as_u64().unwrap() as usize,
                reused * block_size
            );
            saw_hit |= reused > 0;
        }
        assert!(saw_hit);
    }

    #[test]
    fn a_small_cache_makes_the_belief_stale() {
        // Replicas that do not report their capacity: the router believes 31,250 blocks each.
        let sim = SimConfig {
            cache_blocks: 20,
            capacity_reported: false,
            ..SimConfig::default()
        };
        let mut d = Demo::new(Settings {
            trace: TraceSpec::default(),
            sim,
        })
        .unwrap();
        let mut stale = 0;
        while let Some(view) = d.step() {
            let endpoint = view["step"]["decision"]["endpoint"].as_u64().unwrap() as usize;
            let chain = &view["request"]["chains"][0];
            let held = chain["server_held"][endpoint].as_u64().unwrap();
            let reused = chain["server_match"][endpoint].as_u64().unwrap();
            assert!(reused <= held);
            stale += chain["stale_blocks"][endpoint].as_u64().unwrap();
        }
        assert!(
            stale > 0,
            "a 20-block cache evicts what the router still believes"
        );
        // Bounded by the reported capacity, the belief goes stale far less.
        let reported = SimConfig {
            capacity_reported: true,
            ..sim
        };
        let mut d = Demo::new(Settings {
            trace: TraceSpec::default(),
            sim: reported,
        })
        .unwrap();
        let mut bounded = 0;
        while let Some(view) = d.step() {
            let endpoint = view["step"]["decision"]["endpoint"].as_u64().unwrap() as usize;
            bounded += view["request"]["chains"][0]["stale_blocks"][endpoint]
                .as_u64()
                .unwrap();
        }
        assert!(bounded * 2 < stale, "{bounded} vs {stale}");
        // With room for everything, belief and cache agree.
        let roomy = SimConfig {
            cache_blocks: 1024,
            ..SimConfig::default()
        };
        let mut d = Demo::new(Settings {
            trace: TraceSpec::default(),
            sim: roomy,
        })
        .unwrap();
        while let Some(view) = d.step() {
            let chain = &view["request"]["chains"][0];
            assert!(chain["stale_blocks"]
                .as_array()
                .unwrap()
                .iter()
                .all(|s| s == 0));
        }
    }

    #[test]
    fn lanes_read_back_match_the_queue_core_measured() {
        let spec = TraceSpec {
            hot: Some(0.7),
            rate: 40.0,
            requests: 200,
            ..TraceSpec::default()
        };
        let mut sim = SimConfig::default();
        sim.timing.lanes = 2;
        let mut d = Demo::new(Settings { trace: spec, sim }).unwrap();
        let mut queued = 0;
        while let Some(view) = d.step() {
            let endpoint = view["step"]["decision"]["endpoint"].as_u64().unwrap() as usize;
            assert_eq!(
                view["queue_seen"][endpoint],
                view["step"]["served"]["queue_at_arrival"]
            );
            queued += view["step"]["served"]["queue_at_arrival"].as_u64().unwrap();
            let replicas = view["replicas"].as_array().unwrap();
            for r in replicas {
                assert!(r["running"].as_u64().unwrap() <= 2);
            }
        }
        assert!(queued > 0, "the scenario should queue somewhere");
    }

    #[test]
    fn replicas_view_maps_blocks_to_groups() {
        let mut d = demo(Policy::Prefix);
        d.advance(20);
        let replicas = d.replicas_view();
        let mut cached = 0;
        for r in replicas.as_array().unwrap() {
            let blocks = r["blocks"].as_array().unwrap();
            let groups = r["groups"].as_array().unwrap();
            assert_eq!(blocks.len(), groups.len());
            assert!(blocks.len() <= r["capacity"].as_u64().unwrap() as usize);
            // Tenants share nothing, so every block has one owner.
            assert!(groups.iter().all(|g| g.as_i64().unwrap() >= 0));
            cached += blocks.len();
        }
        assert!(cached > 0);
        // The conversations shape shares one system prompt: those blocks are shared.
        let conv = Demo::new(Settings {
            trace: TraceSpec {
                shape: TraceShape::Conversations,
                ..TraceSpec::default()
            },
            sim: SimConfig::default(),
        })
        .unwrap();
        let first = conv.request_view(0).unwrap();
        assert_eq!(first["chains"][0]["blocks"][0]["group"], SHARED_GROUP);
    }

    #[test]
    fn advance_draws_once_and_records_every_hit_rate() {
        let mut d = demo(Policy::RoundRobin);
        let out = d.advance(10);
        assert_eq!(out["steps"].as_array().unwrap().len(), 10);
        assert_eq!(out["last"]["step"]["index"], 9);
        let rest = d.advance(1000);
        assert_eq!(rest["steps"].as_array().unwrap().len(), 54);
        assert_eq!(rest["done"], true);
        assert_eq!(rest["last"]["step"]["index"], 63);
        assert_eq!(d.advance(5)["steps"].as_array().unwrap().len(), 0);
    }

    #[test]
    fn compare_runs_every_policy_and_prefix_beats_round_robin() {
        let d = demo(Policy::Prefix);
        let rows = d.compare().unwrap();
        let rows = rows.as_array().unwrap();
        assert_eq!(rows.len(), Policy::ALL.len());
        let hit = |name: &str| {
            rows.iter().find(|r| r["policy"] == name).unwrap()["report"]["hit_rate"]
                .as_f64()
                .unwrap()
        };
        assert!(hit("prefix") > hit("round-robin") + 0.3);
        for (row, policy) in rows.iter().zip(Policy::ALL) {
            let mut config = *d.config();
            config.router.policy = policy;
            assert_eq!(row["report"], json!(simulate(d.trace(), config).unwrap()));
            let series = row["hit_series"].as_array().unwrap();
            assert_eq!(series.len(), 64);
            let last = series.last().unwrap().as_f64().unwrap();
            let rate = row["report"]["hit_rate"].as_f64().unwrap();
            assert!((last - rate).abs() < 1e-12, "{last} vs {rate}");
        }
    }

    #[test]
    fn trace_jsonl_round_trips_through_core() {
        let d = demo(Policy::Prefix);
        let parsed = prefixroute_sim::trace::parse_jsonl(&d.trace_jsonl()).unwrap();
        assert_eq!(parsed, d.trace());
    }
}
