//! The host's ABI itself, with small hand-written modules: statuses, memory, shared data, stubs.

use std::sync::Arc;

use host_tests::{Host, HostOptions, LogLevel, Plugin, Status, Vm};

use crate::common;

const MODULE: &str = r#"
(module
  (import "env" "proxy_grpc_call" (func $grpc (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_made_up_call" (func $made_up (param i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_open" (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "env" "proxy_get_shared_data" (func $get (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_shared_data" (func $set (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_current_time_nanoseconds" (func $now (param i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "clock_time_get" (func $clock (param i32 i64 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "key")
  (data (i32.const 32) "hello\n")
  ;; iovec for fd_write: {ptr 32, len 6}
  (data (i32.const 200) "\20\00\00\00\06\00\00\00")
  (global $next (mut i32) (i32.const 4096))
  (func (export "proxy_on_memory_allocate") (param $n i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $next))
    (global.set $next (i32.add (global.get $next) (local.get $n)))
    (local.get $p))
  (func (export "grpc") (result i32)
    (call $grpc (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0)
                (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 300)))
  (func (export "made_up") (result i32) (call $made_up (i32.const 1)))
  (func (export "path_open") (result i32)
    (call $path_open (i32.const 3) (i32.const 0) (i32.const 16) (i32.const 3) (i32.const 0)
                     (i64.const 0) (i64.const 0) (i32.const 0) (i32.const 300)))
  (func (export "set") (param $cas i32) (result i32)
    (call $set (i32.const 16) (i32.const 3) (i32.const 32) (i32.const 5) (local.get $cas)))
  ;; value pointer at 100, size at 104, cas at 108
  (func (export "get") (result i32)
    (call $get (i32.const 16) (i32.const 3) (i32.const 100) (i32.const 104) (i32.const 108)))
  (func (export "load") (param $at i32) (result i32) (i32.load (local.get $at)))
  (func (export "load8") (param $at i32) (result i32) (i32.load8_u (local.get $at)))
  (func (export "log_out_of_bounds") (result i32)
    (call $log (i32.const 2) (i32.const 65530) (i32.const 100)))
  (func (export "log_bad_level") (result i32)
    (call $log (i32.const 9) (i32.const 32) (i32.const 5)))
  (func (export "stdout") (result i32)
    (call $fd_write (i32.const 1) (i32.const 200) (i32.const 1) (i32.const 208)))
  (func (export "bad_fd") (result i32)
    (call $fd_write (i32.const 7) (i32.const 200) (i32.const 1) (i32.const 208)))
  ;; both clocks into 400 / 408, returns the second errno
  (func (export "clocks") (result i32)
    (drop (call $now (i32.const 400)))
    (call $clock (i32.const 0) (i64.const 1) (i32.const 408)))
  (func (export "load64") (param $at i32) (result i64) (i64.load (local.get $at)))
)
"#;

fn test_host() -> Host {
    let wasm = wat::parse_str(MODULE).expect("valid WAT");
    let plugin = Plugin::from_bytes(&wasm).expect("the host links any import of env / WASI");
    Host::new(Arc::new(plugin), HostOptions::default())
}

fn call(vm: &mut Vm, name: &'static str) -> i32 {
    vm.call_export::<(), i32>(name, ()).unwrap().unwrap()
}

fn load(vm: &mut Vm, at: i32) -> i32 {
    vm.call_export::<i32, i32>("load", at).unwrap().unwrap()
}

#[test]
fn imports_the_host_does_not_implement_answer_a_status_instead_of_failing_to_link() {
    let host = test_host();
    let mut vm = host.vm().unwrap();
    assert_eq!(call(&mut vm, "grpc"), Status::Unimplemented.code());
    assert_eq!(call(&mut vm, "made_up"), Status::Unimplemented.code());
    assert_eq!(call(&mut vm, "path_open"), 52, "WASI ENOSYS");
    let unimplemented: Vec<&str> = vm
        .capture()
        .unimplemented
        .iter()
        .map(|(_, n)| n.as_str())
        .collect();
    assert_eq!(
        unimplemented,
        ["proxy_grpc_call", "proxy_made_up_call", "path_open"]
    );
    assert!(vm.trapped().is_none());
}

#[test]
fn shared_data_round_trips_through_guest_memory_with_cas_tokens() {
    let host = test_host();
    let (mut a, mut b) = (host.vm().unwrap(), host.vm().unwrap());
    assert_eq!(call(&mut a, "get"), Status::NotFound.code());
    assert_eq!(
        a.call_export::<i32, i32>("set", 12345).unwrap(),
        Some(0),
        "CAS is ignored on a missing key"
    );
    // The other VM (another worker) reads what the first wrote.
    assert_eq!(call(&mut b, "get"), 0);
    let (ptr, size, cas) = (load(&mut b, 100), load(&mut b, 104), load(&mut b, 108));
    assert_eq!(size, 5);
    assert_ne!(ptr, 0);
    let value: Vec<u8> = (0..size)
        .map(|i| {
            b.call_export::<i32, i32>("load8", ptr + i)
                .unwrap()
                .unwrap() as u8
        })
        .collect();
    assert_eq!(value, b"hello");
    assert_eq!(b.call_export::<i32, i32>("set", cas + 1).unwrap(), Some(8));
    assert_eq!(b.call_export::<i32, i32>("set", cas).unwrap(), Some(0));
    assert_eq!(
        a.call_export::<i32, i32>("set", cas).unwrap(),
        Some(Status::CasMismatch.code()),
        "a stale token loses"
    );
    // Costs: the value crossed the boundary once in each direction per call.
    let costs = b.costs(0).total;
    assert_eq!(costs.shared_bytes_in, 5);
    assert_eq!(costs.shared_bytes_out, 10);
    assert_eq!(costs.calls("proxy_on_memory_allocate"), 1);
    assert_eq!(host.shared().keys("prefixroute"), vec![b"key".to_vec()]);
}

#[test]
fn bad_pointers_and_arguments_are_statuses_not_traps() {
    let host = test_host();
    let mut vm = host.vm().unwrap();
    assert_eq!(
        call(&mut vm, "log_out_of_bounds"),
        Status::InvalidMemoryAccess.code()
    );
    assert_eq!(call(&mut vm, "log_bad_level"), Status::BadArgument.code());
    assert_eq!(call(&mut vm, "bad_fd"), 8, "EBADF");
    assert!(vm.trapped().is_none());
}

#[test]
fn stdout_becomes_info_log_lines_and_clocks_follow_the_host_clock() {
    let host = test_host();
    let mut vm = host.vm().unwrap();
    assert_eq!(call(&mut vm, "stdout"), 0);
    assert_eq!(load(&mut vm, 208), 6, "bytes written");
    let logs = &vm.capture().logs;
    assert_eq!(logs.len(), 1);
    assert_eq!(
        (logs[0].level, logs[0].message.as_str()),
        (LogLevel::Info, "hello")
    );
    host.clock().set_ms(1_234_567);
    assert_eq!(call(&mut vm, "clocks"), 0);
    let ns = |vm: &mut Vm, at| vm.call_export::<i32, i64>("load64", at).unwrap().unwrap();
    assert_eq!(ns(&mut vm, 400), 1_234_567_000_000);
    assert_eq!(ns(&mut vm, 408), 1_234_567_000_000);
}

#[test]
fn the_plugin_links_only_proxy_wasm_and_wasi_and_never_calls_a_stub() {
    let host = common::host();
    let imports = host.plugin().imports();
    assert!(imports
        .iter()
        .all(|(m, _)| m == "env" || m == "wasi_snapshot_preview1"));
    assert!(imports.iter().any(|(_, n)| n == "proxy_grpc_call"));
    // A whole session: configure, scrape, route, fall back, finish.
    let mut vm = common::configured(&host, &common::config(3, serde_json::json!({})));
    common::tick_and_answer(&mut vm, |_| {
        host_tests::CalloutReply::ok(common::page(1.0, 1.0, 0.2))
    });
    common::route(&mut vm, &common::chat_body("system", "question"));
    vm.round_trip(&host_tests::Request::new("GET", "/v1/models", Vec::new()))
        .unwrap();
    assert_eq!(vm.capture().unimplemented, Vec::<(String, String)>::new());
    assert!(vm.trapped().is_none());
}

#[test]
fn shared_data_is_separate_per_vm_id() {
    let host = test_host();
    let mut a = host.vm_with_id("first").unwrap();
    let mut b = host.vm_with_id("second").unwrap();
    let mut a2 = host.vm_with_id("first").unwrap();
    assert_eq!(a.call_export::<i32, i32>("set", 0).unwrap(), Some(0));
    assert_eq!(call(&mut b, "get"), Status::NotFound.code());
    assert_eq!(call(&mut a2, "get"), 0);
    assert_eq!(host.shared().keys("first").len(), 1);
    assert!(host.shared().keys("second").is_empty());
}

const FILTER: &str = r#"
(module
  (import "env" "proxy_send_local_response" (func $reply (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_pairs" (func $pairs (param i32 i32 i32) (result i32)))
  (import "env" "proxy_replace_header_map_value" (func $replace (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "denied")
  (data (i32.const 32) "no")
  ;; one pair, x-why: test
  (data (i32.const 64) "\01\00\00\00\05\00\00\00\04\00\00\00x-why\00test\00")
  (data (i32.const 96) "x-late")
  (global $next (mut i32) (i32.const 4096))
  (func (export "proxy_on_memory_allocate") (param $n i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $next))
    (global.set $next (i32.add (global.get $next) (local.get $n)))
    (local.get $p))
  ;; Reads all request headers, then answers 403 itself.
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
    (i32.store (i32.const 300) (call $pairs (i32.const 0) (i32.const 200) (i32.const 204)))
    (i32.store (i32.const 304)
      (call $reply (i32.const 403) (i32.const 16) (i32.const 6) (i32.const 32) (i32.const 2)
                   (i32.const 64) (i32.const 23) (i32.const -1)))
    (i32.const 1))
  ;; Tries to set a request header in the response phase, after the headers left.
  (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32)
    (i32.store (i32.const 308)
      (call $replace (i32.const 0) (i32.const 96) (i32.const 6) (i32.const 32) (i32.const 2)))
    (i32.const 0))
  (func (export "load") (param $at i32) (result i32) (i32.load (local.get $at)))
)
"#;

#[test]
fn local_replies_header_pairs_and_late_header_writes_follow_envoy() {
    let wasm = wat::parse_str(FILTER).unwrap();
    let host = Host::new(
        Arc::new(Plugin::from_bytes(&wasm).unwrap()),
        HostOptions::default(),
    );
    let mut vm = host.vm().unwrap();
    vm.start(b"").unwrap();
    let x = vm
        .send(&host_tests::Request::new("GET", "/x", Vec::new()))
        .unwrap();
    let reply = x.local_reply.expect("a local reply");
    assert_eq!((reply.status_code, reply.details.as_str()), (403, "denied"));
    assert_eq!(reply.body, b"no");
    assert_eq!(reply.headers.get_str("x-why").as_deref(), Some("test"));
    assert!(
        x.upstream.is_none() && !x.stalled,
        "answered locally, nothing upstream"
    );
    assert_eq!(vm.capture().local_replies.len(), 1);
    // proxy_get_header_map_pairs returned the 4 request headers, serialised.
    assert_eq!((load(&mut vm, 300), load(&mut vm, 304)), (0, 0));
    let request = host_tests::Headers::from_pairs([
        (":method", "GET"),
        (":path", "/x"),
        (":authority", "gateway.local"),
        (":scheme", "http"),
    ]);
    assert_eq!(load(&mut vm, 204) as usize, request.serialize().len());
    // Writing a request header once it has left: BadArgument, not a trap.
    vm.response_headers(
        x.id,
        host_tests::Headers::from_pairs([(":status", "403")]),
        true,
    )
    .unwrap();
    assert_eq!(load(&mut vm, 308), Status::BadArgument.code());
    let op = vm.capture().header_ops.last().unwrap().clone();
    assert_eq!(
        (op.key.as_str(), op.status),
        ("x-late", Status::BadArgument)
    );
}
