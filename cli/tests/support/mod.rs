//! Shared by the HTTP tests: a `prefixroute fake-server` child process on 127.0.0.1 and a tiny
//! blocking HTTP/1.1 client. The client is hand-written on std's TcpStream so the tests check
//! what actually goes over the wire (status line, headers, chunked SSE) with no client library
//! smoothing it over.
#![allow(dead_code)] // each test binary uses a different part

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prefixroute_core::metrics::{parse_vllm, ServerMetrics, DEFAULT_PREFIX};

pub const BIN: &str = env!("CARGO_BIN_EXE_prefixroute");

/// A running fake server; killed when dropped, so a failing test leaves no process behind.
pub struct FakeServer {
    child: Child,
    pub port: u16,
    /// stderr lines after the start line, collected by a thread so the pipe never fills.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl FakeServer {
    /// Starts `fake-server --port 0 --name NAME EXTRA...` and reads the port from its start line.
    pub fn start(name: &str, extra: &[&str]) -> FakeServer {
        let mut child = Command::new(BIN)
            .args(["fake-server", "--port", "0", "--name", name])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn fake-server");
        let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
        let mut first = String::new();
        stderr.read_line(&mut first).expect("read start line");
        let prefix = format!("fake-server {name} listening on http://127.0.0.1:");
        let port = first
            .trim_end()
            .strip_prefix(&prefix)
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("unexpected start line {first:?}"));
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        FakeServer { child, port, log }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn get(&self, path: &str) -> Reply {
        http(self.port, "GET", path, None)
    }

    pub fn post(&self, path: &str, body: &str) -> Reply {
        http(self.port, "POST", path, Some(body))
    }

    /// `/metrics` through core's parser, as a router would read it.
    pub fn metrics(&self) -> ServerMetrics {
        let page = self.get("/metrics");
        assert_eq!(page.status, 200);
        parse_vllm(&page.body, DEFAULT_PREFIX, None).expect("metrics parse with core")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit by itself; None if it is still running after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// One request on a fresh connection (`Connection: close`, so the response ends at EOF).
pub fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> Reply {
    http_with(port, method, path, &[], body)
}

/// [`http`] with extra request headers.
pub fn http_with(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Reply {
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let body = body.unwrap_or("");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{extra}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read response");
    parse_response(&raw)
}

pub fn parse_response(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw);
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {text:?}"));
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().split(' ').nth(1).unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    Reply {
        status: status.parse().unwrap(),
        body: if chunked {
            dechunk(rest)
        } else {
            rest.to_string()
        },
        headers,
    }
}

fn dechunk(mut rest: &str) -> String {
    let mut body = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n").expect("chunk size line");
        let size = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
        if size == 0 {
            return body;
        }
        body.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
}

/// This test binary's scratch directory, inside cargo's `CARGO_TARGET_TMPDIR` (the target
/// directory's `tmp`, so test runs leave nothing in the system's temp dir) and named after the
/// binary (each has its own), emptied the first time this process asks for it.
pub fn scratch_dir() -> std::path::PathBuf {
    static FRESH: std::sync::Once = std::sync::Once::new();
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(env!("CARGO_CRATE_NAME"));
    FRESH.call_once(|| {
        let _ = std::fs::remove_dir_all(&dir);
    });
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A path in this test binary's scratch directory.
pub fn temp(name: &str) -> std::path::PathBuf {
    scratch_dir().join(name)
}

/// A free TCP port on 127.0.0.1 (bound and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process killed (and reaped) when dropped, so a failing test leaves none behind.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `prefixroute serve` (which becomes Envoy) on free ports; killed when dropped.
pub struct Served {
    _child: Killed,
    pub port: u16,
    pub admin: u16,
    /// Envoy's output.
    pub log: std::path::PathBuf,
    /// The temp dir (`TMPDIR`) `prefixroute serve` and its Envoy were given, empty when they
    /// started.
    pub tmpdir: std::path::PathBuf,
}

impl Served {
    /// Envoy's process id (`prefixroute serve` execs Envoy).
    pub fn pid(&self) -> u32 {
        self._child.0.id()
    }
}

/// Stops (`STOP`) or resumes (`CONT`) a process: a gateway frozen as a loaded one is, so what a
/// client writes meanwhile is waiting in the socket when it reads again.
pub fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// Starts `prefixroute serve --listen … --admin … ARGS` and waits until Envoy is ready.
pub fn serve<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Served {
    let (port, admin) = (free_port(), free_port());
    let log = temp(&format!("envoy-{port}.log"));
    let file = std::fs::File::create(&log).unwrap();
    let tmpdir = temp(&format!("tmp-{port}"));
    std::fs::create_dir_all(&tmpdir).unwrap();
    let child = Command::new(BIN)
        .env("TMPDIR", &tmpdir)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin", &format!("127.0.0.1:{admin}")])
        .args(args)
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
        .expect("spawn prefixroute serve");
    let served = Served {
        _child: Killed(child),
        port,
        admin,
        log,
        tmpdir,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(TcpStream::connect(("127.0.0.1", admin)).is_ok()
        && http(admin, "GET", "/ready", None).status == 200)
    {
        assert!(
            Instant::now() < deadline,
            "Envoy not ready; see {}",
            served.log.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    served
}
