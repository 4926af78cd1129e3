//! The proxy process: the compiled plugin, and what all its VM instances share (shared data,
//! stats, the clock). Each [`Vm`] it creates stands for one Envoy worker (or the main thread).

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use wasmtime::{Config, Engine, InstancePre, Module, Store};

use crate::abi::LogLevel;
use crate::clock::Clock;
use crate::imports;
use crate::shared::SharedStore;
use crate::state::VmState;
use crate::stats::Stats;
use crate::vm::Vm;

/// What Envoy's configuration would say about the plugin's environment.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// Shared data is per `vm_id`.
    pub vm_id: String,
    pub plugin_name: String,
    pub root_id: String,
    /// Clusters `proxy_http_call` may target; any other is `BadArgument`, as in Envoy.
    pub clusters: Vec<String>,
    /// Envoy ≥ 1.35's `allow_on_headers_stop_iteration`: without it a filter that pauses in
    /// the request headers never sees the body.
    pub allow_on_headers_stop_iteration: bool,
    /// Envoy's per-stream buffer limit (the listener's `per_connection_buffer_limit_bytes`): a
    /// filter that keeps pausing past it gets Envoy's own 413 local reply. `None`: unlimited.
    /// Default 8 MiB, as in the project's reference Envoy configuration (Envoy's own default
    /// is 1 MiB).
    pub buffer_limit_bytes: Option<usize>,
    /// The clock's start (ms since the epoch).
    pub start_ms: u64,
    /// What WASI `environ_get` returns (Envoy: the plugin's configured environment, none here).
    pub env: Vec<(String, String)>,
    /// What `proxy_get_log_level` reports.
    pub log_level: LogLevel,
    /// Seed of WASI `random_get` (deterministic, so runs repeat exactly).
    pub seed: u64,
    /// A callback that runs longer than this many instructions traps (a runaway loop fails a
    /// test instead of hanging it).
    pub fuel_per_callback: u64,
}

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            vm_id: "prefixroute".into(),
            plugin_name: "prefixroute".into(),
            root_id: String::new(),
            clusters: vec!["prefixroute_metrics".into()],
            allow_on_headers_stop_iteration: true,
            buffer_limit_bytes: Some(8 << 20),
            // 2023-11-14: far from 0, which the plugin reads as "never".
            start_ms: 1_700_000_000_000,
            env: Vec::new(),
            log_level: LogLevel::Info,
            seed: 0x5eed,
            fuel_per_callback: 20_000_000_000,
        }
    }
}

/// What the fuel of a [`Plugin`]'s callbacks counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fuel {
    /// Wasm instructions executed: one per operator (none for `nop`, `drop` and block
    /// markers), a `memory.copy` or `memory.fill` one however many bytes it moves.
    Instructions,
    /// The same plus one per byte a `memory.copy`, `memory.fill` or `memory.init` moves
    /// (wasmtime's default): the difference is the bytes the guest moved in bulk.
    InstructionsAndBulkBytes,
}

/// A compiled plugin module with its linker, ready to instantiate any number of times.
pub struct Plugin {
    module: Module,
    pre: InstancePre<VmState>,
    path: Option<PathBuf>,
}

impl Plugin {
    fn engine(fuel: Fuel) -> wasmtime::Result<Engine> {
        let mut config = Config::new();
        // Fuel is how instructions are counted (and how runaway guests are stopped).
        config.consume_fuel(true);
        // Wasmtime prices `memory.copy` and `memory.fill` per byte moved (since 2026; one
        // before). V8, which runs the plugin in Envoy, lowers each to one native memmove or
        // memset, so a per-byte price counted a 64 KB copy as 64k instructions. The count here
        // is of instructions, each bulk operation one; the cost table counts the bytes apart.
        let mut cost = wasmtime::OperatorCost::new();
        if fuel == Fuel::Instructions {
            cost.variable.memory_copy_per_byte = 0;
            cost.variable.memory_fill_per_byte = 0;
            cost.variable.memory_init_per_byte = 0;
        }
        config.operator_cost(cost);
        // `PREFIXROUTE_PERF_MAP=1`: wasmtime writes /tmp/perf-<pid>.map, so `perf record` of
        // a run attributes time to the guest's functions (see examples/profile.rs). Off by
        // default: the fuel counts do not depend on it.
        if std::env::var_os("PREFIXROUTE_PERF_MAP").is_some_and(|v| v == "1") {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        Engine::new(&config)
    }

    /// Compiles a module from `.wasm` bytes.
    pub fn from_bytes(bytes: &[u8]) -> wasmtime::Result<Plugin> {
        let engine = Self::engine(Fuel::Instructions)?;
        Self::from_module(Module::new(&engine, bytes)?, None)
    }

    fn from_module(module: Module, path: Option<PathBuf>) -> wasmtime::Result<Plugin> {
        let linker = imports::linker(&module)?;
        let pre = linker.instantiate_pre(&module)?;
        Ok(Plugin { module, pre, path })
    }

    /// Compiles the module at `path`. Cranelift in a debug build takes ~12 s for the plugin,
    /// once per test binary; so the compiled code is cached next to the `.wasm`, keyed by the
    /// module's bytes and the engine's compatibility hash (a different wasmtime, or different
    /// settings, never loads a stale artefact).
    pub fn from_file(path: &Path) -> wasmtime::Result<Plugin> {
        Self::from_file_counting(path, Fuel::Instructions)
    }

    /// [`Plugin::from_file`] with fuel that counts `fuel`.
    pub fn from_file_counting(path: &Path, fuel: Fuel) -> wasmtime::Result<Plugin> {
        let bytes = std::fs::read(path)
            .map_err(|e| wasmtime::format_err!("cannot read {}: {e}", path.display()))?;
        let engine = Self::engine(fuel)?;
        let mut hasher = std::hash::DefaultHasher::new();
        bytes.hash(&mut hasher);
        engine.precompile_compatibility_hash().hash(&mut hasher);
        let cache = path
            .parent()
            .unwrap_or(Path::new("."))
            .join("host-tests-cache")
            .join(format!("{:016x}.cwasm", hasher.finish()));
        if cache.is_file() {
            // SAFETY: the file was written by `Module::serialize` below, in a directory of the
            // build's own target tree, under a name that pins the exact module and engine.
            if let Ok(module) = unsafe { Module::deserialize_file(&engine, &cache) } {
                return Self::from_module(module, Some(path.to_path_buf()));
            }
        }
        let module = Module::new(&engine, &bytes)?;
        if let Ok(compiled) = module.serialize() {
            // Best effort, and atomic: parallel test binaries may race to write it.
            let tmp = cache.with_extension(format!("tmp{}", std::process::id()));
            let written = cache
                .parent()
                .map(std::fs::create_dir_all)
                .transpose()
                .and_then(|_| std::fs::write(&tmp, compiled))
                .and_then(|()| std::fs::rename(&tmp, &cache));
            if written.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
        }
        Self::from_module(module, Some(path.to_path_buf()))
    }

    /// The prefixroute plugin, located (see [`locate_plugin`]) and compiled once per process.
    pub fn prefixroute() -> wasmtime::Result<Arc<Plugin>> {
        Self::prefixroute_counting(Fuel::Instructions)
    }

    /// [`Plugin::prefixroute`] with fuel that counts `fuel` (compiled once per process each).
    pub fn prefixroute_counting(fuel: Fuel) -> wasmtime::Result<Arc<Plugin>> {
        type Compiled = OnceLock<Result<Arc<Plugin>, String>>;
        static PLUGINS: [Compiled; 2] = [OnceLock::new(), OnceLock::new()];
        PLUGINS[fuel as usize]
            .get_or_init(|| {
                let path = locate_plugin()?;
                Plugin::from_file_counting(&path, fuel)
                    .map(Arc::new)
                    .map_err(|e| format!("{e:?}"))
            })
            .clone()
            .map_err(wasmtime::Error::msg)
    }

    pub fn module(&self) -> &Module {
        &self.module
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// `(module, name)` of every import.
    pub fn imports(&self) -> Vec<(String, String)> {
        self.module
            .imports()
            .map(|i| (i.module().to_string(), i.name().to_string()))
            .collect()
    }
}

const BUILD: &str = "CARGO_TARGET_DIR=/tmp/target-host plugin/build.sh";

/// Finds `prefixroute_plugin.wasm`: `$PREFIXROUTE_PLUGIN_WASM`, else
/// `$CARGO_TARGET_DIR/wasm32-wasip1/wasm/`, else `<repo>/target/wasm32-wasip1/wasm/`,
/// else next to the running test binary's target directory. A default-located build older
/// than the plugin's or core's sources is refused: testing yesterday's plugin proves nothing.
pub fn locate_plugin() -> Result<PathBuf, String> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(Path::new("."))
        .to_path_buf();
    if let Some(explicit) = std::env::var_os("PREFIXROUTE_PLUGIN_WASM") {
        let path = PathBuf::from(explicit);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "PREFIXROUTE_PLUGIN_WASM={} does not exist; build it first with `cd {} && {BUILD}`",
                path.display(),
                repo.display()
            ))
        };
    }
    let artifact = Path::new("wasm32-wasip1/wasm/prefixroute_plugin.wasm");
    let mut candidates = Vec::new();
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        candidates.push(PathBuf::from(dir).join(artifact));
    }
    candidates.push(repo.join("target").join(artifact));
    // The test binary lives in <target>/debug/deps/: its target directory is an ancestor.
    if let Ok(exe) = std::env::current_exe() {
        candidates.extend(exe.ancestors().skip(1).take(3).map(|d| d.join(artifact)));
    }
    let Some(found) = candidates.iter().find(|p| p.is_file()) else {
        let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
        return Err(format!(
            "prefixroute_plugin.wasm not found (looked in: {}); build it first with \
             `cd {} && {BUILD}`, or point PREFIXROUTE_PLUGIN_WASM at it",
            looked.join(", "),
            repo.display()
        ));
    };
    let built = mtime(found).unwrap_or(SystemTime::UNIX_EPOCH);
    if let Some((newer, _)) = newest_source(&repo).filter(|(_, t)| *t > built) {
        return Err(format!(
            "{} is older than {}: rebuild it first with `cd {} && {BUILD}` \
             (or set PREFIXROUTE_PLUGIN_WASM to use a build on purpose)",
            found.display(),
            newer.display(),
            repo.display()
        ));
    }
    Ok(found.clone())
}

fn mtime(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).ok()?.modified().ok()
}

/// The most recently modified source file the plugin is built from.
fn newest_source(repo: &Path) -> Option<(PathBuf, SystemTime)> {
    let mut files = Vec::new();
    for dir in ["plugin/src", "core/src"] {
        collect_rs(&repo.join(dir), &mut files);
    }
    files.push(repo.join("plugin/Cargo.toml"));
    files.push(repo.join("core/Cargo.toml"));
    files
        .into_iter()
        .filter_map(|f| mtime(&f).map(|t| (f, t)))
        .max_by_key(|(_, t)| *t)
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect_rs(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs" || e == "json") {
            out.push(path);
        }
    }
}

/// One proxy process running the plugin: VMs created from it share shared data, stats and
/// the clock, like Envoy workers with the same `vm_id`.
pub struct Host {
    plugin: Arc<Plugin>,
    options: Arc<HostOptions>,
    shared: SharedStore,
    stats: Stats,
    clock: Clock,
    tokens: Arc<AtomicU32>,
    vms: AtomicU32,
}

impl Host {
    pub fn new(plugin: Arc<Plugin>, options: HostOptions) -> Host {
        Host {
            clock: Clock::new(options.start_ms),
            plugin,
            options: Arc::new(options),
            shared: SharedStore::new(),
            stats: Stats::default(),
            tokens: Arc::new(AtomicU32::new(1)),
            vms: AtomicU32::new(0),
        }
    }

    /// The prefixroute plugin with default options.
    pub fn prefixroute() -> wasmtime::Result<Host> {
        Ok(Host::new(Plugin::prefixroute()?, HostOptions::default()))
    }

    pub fn with_options(options: HostOptions) -> wasmtime::Result<Host> {
        Ok(Host::new(Plugin::prefixroute()?, options))
    }

    pub fn options(&self) -> &HostOptions {
        &self.options
    }

    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    pub fn shared(&self) -> &SharedStore {
        &self.shared
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// A new VM instance (a new worker): instantiated and initialised, not started.
    pub fn vm(&self) -> wasmtime::Result<Vm> {
        self.vm_with_id(&self.options.vm_id)
    }

    /// A VM of another plugin configuration in the same process: its shared data is the
    /// namespace `vm_id`, invisible to VMs with another id.
    pub fn vm_with_id(&self, vm_id: &str) -> wasmtime::Result<Vm> {
        let index = self.vms.fetch_add(1, Ordering::SeqCst);
        let state = VmState::new(
            self.options.clone(),
            self.shared.clone(),
            self.stats.clone(),
            self.clock.clone(),
            self.tokens.clone(),
            index,
            vm_id.to_string(),
        );
        let mut store = Store::new(self.plugin.module.engine(), state);
        store.set_fuel(self.options.fuel_per_callback)?;
        let instance = self.plugin.pre.instantiate(&mut store)?;
        let memory = instance.get_memory(&mut store, "memory");
        let allocate = ["proxy_on_memory_allocate", "malloc"]
            .into_iter()
            .find_map(|name| instance.get_typed_func::<i32, i32>(&mut store, name).ok());
        let s = store.data_mut();
        s.memory = memory;
        s.allocate = allocate;
        let mut vm = Vm::new(store, instance, index);
        vm.initialize()?;
        Ok(vm)
    }

    /// A new VM started and configured with `configuration`; an error if the plugin refuses it.
    pub fn configured_vm(&self, configuration: &[u8]) -> wasmtime::Result<Vm> {
        let mut vm = self.vm()?;
        if !vm.configure(configuration)? {
            let logs: Vec<&str> = vm
                .capture()
                .logs
                .iter()
                .map(|l| l.message.as_str())
                .collect();
            wasmtime::bail!("the plugin refused its configuration; logs: {logs:?}");
        }
        Ok(vm)
    }
}
