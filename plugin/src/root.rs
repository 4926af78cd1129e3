//! The root context: one per VM instance (each Envoy worker, plus the main thread). It owns the
//! scheduler, loads the configuration, ticks (heartbeat, reaping, scrape leases) and receives the
//! scrape callouts' responses.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, MapType};

use crate::abi;
use crate::host::{self, HostShared, Metrics};
use crate::http::Filter;
use crate::scheduler::{DiscoveryOutcome, Scheduler};
use crate::settings::{load_config, next_tick_ms, FIRST_TICK_MS};

pub type SharedScheduler = Rc<RefCell<Scheduler<HostShared>>>;

/// Drains the scheduler's events into Envoy stats.
pub fn flush(scheduler: &mut Scheduler<HostShared>, metrics: &RefCell<Metrics>) {
    let events = scheduler.events();
    if events.is_empty() {
        return;
    }
    if let Ok(mut m) = metrics.try_borrow_mut() {
        m.record(events, scheduler.stat_names());
    }
    scheduler.clear_events();
}

/// Headers the scheduler lends out, owned, so the callout is sent without its borrow.
fn owned(headers: Vec<(&str, &str)>) -> Vec<(String, String)> {
    headers
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Sends a bodiless callout (a GET) through `cluster`; the token, or the host's refusal.
fn send(
    cluster: &str,
    headers: &[(String, String)],
    timeout_ms: u64,
) -> Result<u32, proxy_wasm::types::Status> {
    let headers: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    proxy_wasm::hostcalls::dispatch_http_call(
        cluster,
        headers,
        None,
        vec![],
        Duration::from_millis(timeout_ms),
    )
}

pub struct PluginRoot {
    scheduler: Option<SharedScheduler>,
    metrics: Rc<RefCell<Metrics>>,
    /// Warn about an unusable scrape cluster once, not every tick.
    dispatch_warned: bool,
    /// The discovery is failing and that was logged: say it again only once it recovers.
    discovery_warned: bool,
    /// The KV feed cannot be fetched and that was logged.
    feed_warned: bool,
    /// The tick period last asked of the host (0: none yet).
    tick_period_ms: u64,
}

impl PluginRoot {
    pub fn new(_context_id: u32) -> Self {
        PluginRoot {
            scheduler: None,
            metrics: Rc::new(RefCell::new(Metrics::default())),
            dispatch_warned: false,
            discovery_warned: false,
            feed_warned: false,
            tick_period_ms: 0,
        }
    }

    /// Asks the host for `period` unless that is the period already asked for.
    fn set_tick_period(&mut self, period: u64) {
        if period == self.tick_period_ms {
            return;
        }
        self.tick_period_ms = period;
        if abi::set_tick_period_ms(u32::try_from(period).unwrap_or(u32::MAX)).is_err() {
            host::warn("prefixroute: the host refused a tick period; metrics will not be scraped");
        }
    }

    /// Sends the discovery callout when this instance holds its lease.
    fn discover(&mut self, scheduler: &SharedScheduler, now: u64) {
        let (cluster, timeout, headers) = {
            let Ok(mut e) = scheduler.try_borrow_mut() else {
                return;
            };
            if !e.claim_discovery(now) {
                flush(&mut e, &self.metrics);
                return;
            }
            let Some(d) = e.config().discovery.as_ref() else {
                return;
            };
            (
                d.cluster.clone(),
                d.timeout_ms,
                owned(e.discovery_headers()),
            )
        };
        let sent = send(&cluster, &headers, timeout);
        let Ok(mut e) = scheduler.try_borrow_mut() else {
            return;
        };
        match sent {
            Ok(token) => e.discovery_sent(token, now),
            Err(status) => {
                e.discovery_not_sent();
                self.warn_discovery(&format!(
                    "cannot send the discovery callout through cluster {cluster:?} (status \
                     {status:?}): does the cluster exist in Envoy's configuration?"
                ));
            }
        }
        flush(&mut e, &self.metrics);
    }

    /// Fetches the relay's KV feed when this instance holds its lease (`index: precise`).
    fn fetch_feed(&mut self, scheduler: &SharedScheduler, now: u64) {
        let (cluster, timeout, path) = {
            let Ok(mut e) = scheduler.try_borrow_mut() else {
                return;
            };
            let Some(path) = e.claim_feed(now) else {
                flush(&mut e, &self.metrics);
                return;
            };
            (
                e.config().kv_events.cluster.clone(),
                e.feed_timeout_ms(),
                path,
            )
        };
        let headers = owned(vec![
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", "prefixroute-kv"),
            (":scheme", "http"),
        ]);
        let sent = send(&cluster, &headers, timeout);
        let Ok(mut e) = scheduler.try_borrow_mut() else {
            return;
        };
        match sent {
            Ok(token) => e.feed_sent(token),
            Err(status) => {
                e.feed_not_sent();
                if !self.feed_warned {
                    self.feed_warned = true;
                    host::warn(&format!(
                        "prefixroute: cannot fetch the KV feed through cluster {cluster:?} \
                         (status {status:?}): routing on the approximate belief"
                    ));
                }
            }
        }
        flush(&mut e, &self.metrics);
    }

    /// Logs a discovery failure once per outage; the last membership stays in use.
    fn warn_discovery(&mut self, what: &str) {
        if !self.discovery_warned {
            self.discovery_warned = true;
            host::warn(&format!(
                "prefixroute: {what}; routing over the last known pool"
            ));
        }
    }

    fn discovered(&mut self, e: &Scheduler<HostShared>, outcome: DiscoveryOutcome) {
        match outcome {
            DiscoveryOutcome::Applied(change) => {
                if self.discovery_warned {
                    self.discovery_warned = false;
                    host::info("prefixroute: the discovery answers again");
                }
                if let Some(change) = change {
                    let pool = e
                        .config()
                        .discovery
                        .as_ref()
                        .map(|d| d.pool_cluster.as_str());
                    host::info(&format!(
                        "prefixroute: pool {:?} has {} members ({} routable): added {:?}, \
                         removed {:?}, changed {:?}",
                        pool.unwrap_or(""),
                        e.endpoints(),
                        e.members().iter().filter(|m| m.routable).count(),
                        change.added,
                        change.removed,
                        change.updated,
                    ));
                }
            }
            DiscoveryOutcome::Failed(status) => self.warn_discovery(&format!(
                "the discovery callout failed (status {})",
                status.map_or_else(|| "none: reset or timeout".to_string(), |s| s.to_string())
            )),
            DiscoveryOutcome::Unusable(why) => self.warn_discovery(&why),
        }
    }

    fn scrape(&mut self, scheduler: &SharedScheduler, now: u64) {
        // Collect the callouts first and dispatch without holding the scheduler borrow.
        let (cluster, timeout, jobs) = {
            let Ok(mut e) = scheduler.try_borrow_mut() else {
                return;
            };
            let due = e.tick(now);
            let jobs: Vec<(usize, Vec<(String, String)>)> = due
                .into_iter()
                .map(|ep| (ep, owned(e.scrape_headers(ep))))
                .collect();
            let scrape = &e.config().scrape;
            (scrape.cluster.clone(), scrape.timeout_ms, jobs)
        };
        for (endpoint, headers) in jobs {
            let sent = send(&cluster, &headers, timeout);
            let Ok(mut e) = scheduler.try_borrow_mut() else {
                continue;
            };
            match sent {
                Ok(token) => e.scrape_sent(token, endpoint, now),
                Err(status) => {
                    e.scrape_not_sent(endpoint);
                    if !self.dispatch_warned {
                        self.dispatch_warned = true;
                        host::warn(&format!(
                            "prefixroute: cannot send scrape callouts through cluster {cluster:?} \
                             (status {status:?}): does the cluster exist in Envoy's configuration?"
                        ));
                    }
                }
            }
        }
        if let Ok(mut e) = scheduler.try_borrow_mut() {
            flush(&mut e, &self.metrics);
        }
    }
}

impl Context for PluginRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(scheduler) = self.scheduler.clone() else {
            return;
        };
        // No headers at all: Envoy reports a reset or connection failure this way.
        let status = if num_headers == 0 {
            None
        } else {
            abi::get_header_string(MapType::HttpCallResponseHeaders, ":status")
                .ok()
                .flatten()
                .and_then(|s| s.trim().parse::<u32>().ok())
        };
        let body = if body_size == 0 {
            Vec::new()
        } else {
            abi::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default()
        };
        let Ok(mut e) = scheduler.try_borrow_mut() else {
            return;
        };
        let now = abi::now_ms();
        if e.is_feed(token_id) {
            let usable = e.feed_done(status, &body, now);
            if !usable && !self.feed_warned {
                self.feed_warned = true;
                host::warn(&format!(
                    "prefixroute: the KV feed answered {status:?} or garbage: endpoints stay on \
                     the approximate belief until it answers"
                ));
            } else if usable {
                self.feed_warned = false;
            }
            flush(&mut e, &self.metrics);
            drop(e);
            // A long poll asks again as soon as its answer is in (when the answer freed the
            // lease; else the tick fetches when it is due).
            self.fetch_feed(&scheduler, now);
            return;
        }
        if e.is_discovery(token_id) {
            let outcome = e.discovery_done(status, &body);
            self.discovered(&e, outcome);
            if !e.awaiting_pool() {
                self.set_tick_period(e.tick_ms());
            }
            flush(&mut e, &self.metrics);
            return;
        }
        if let Some((endpoint, t)) = e.scrape_done(token_id, status, &body, now) {
            let who = format!("{} ({})", e.name(endpoint), e.address(endpoint));
            if t.went_down {
                host::warn(&format!(
                    "prefixroute: endpoint {who} is down after {} failed scrapes; routing around it",
                    e.config().scrape.failures_to_down
                ));
            }
            if t.came_up {
                host::info(&format!(
                    "prefixroute: endpoint {who} answers again; its prefix index was reset"
                ));
            } else if t.forgot {
                host::info(&format!(
                    "prefixroute: endpoint {who} restarted (prefix-cache counters went back); \
                     its prefix index was reset"
                ));
            }
        }
        flush(&mut e, &self.metrics);
    }
}

impl RootContext for PluginRoot {
    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let raw = abi::get_buffer(
            BufferType::PluginConfiguration,
            0,
            plugin_configuration_size,
        )
        .ok()
        .flatten()
        .unwrap_or_default();
        let config = match load_config(&raw) {
            Ok(c) => c,
            Err(err) => {
                host::error(&format!("prefixroute: invalid configuration: {err}"));
                return false;
            }
        };
        let scheduler = Scheduler::new(HostShared, config);
        let tick = scheduler.tick_ms();
        // A discovered pool is unknown until the first discovery answer: tick fast until
        // then, so the first seconds after a start are routed too.
        self.set_tick_period(if scheduler.awaiting_pool() {
            FIRST_TICK_MS.min(tick)
        } else {
            tick
        });
        let c = scheduler.config();
        let pool = match &c.discovery {
            Some(d) => format!(
                "pool discovered from cluster {:?} via {:?} every {} ms",
                d.pool_cluster, d.cluster, d.interval_ms
            ),
            None => format!("{} endpoints", c.endpoints.len()),
        };
        host::info(&format!(
            "prefixroute: {pool}, policy {}, destination header {}, scrape {} every {} ms \
             via cluster {:?} (tick {} ms, index table 2^{} buckets)",
            c.policy,
            c.destination_header,
            c.scrape.path,
            c.scrape.interval_ms,
            c.scrape.cluster,
            tick,
            scheduler.table_bits(),
        ));
        self.scheduler = Some(Rc::new(RefCell::new(scheduler)));
        true
    }

    fn on_tick(&mut self) {
        if let Some(scheduler) = self.scheduler.clone() {
            let now = abi::now_ms();
            self.scrape(&scheduler, now);
            self.discover(&scheduler, now);
            self.fetch_feed(&scheduler, now);
            let next = scheduler
                .try_borrow()
                .map(|e| next_tick_ms(self.tick_period_ms, e.tick_ms(), e.awaiting_pool()));
            if let Ok(next) = next {
                self.set_tick_period(next);
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Never None: the SDK panics on None.
        Some(Box::new(Filter::new(
            self.scheduler.clone(),
            self.metrics.clone(),
        )))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
