//! The real parts the OTLP tests export to: an OpenTelemetry Collector (core, built by `cargo xtask
//! setup`) with its OTLP receiver on free ports, over TLS or not, forwarding every profiles request
//! with its `otlphttp` exporter to a sink (`scripts/otlp_sink.py`) that decodes it with the official
//! `opentelemetry-proto` package and writes what it got as JSON lines; a test CA; an endpoint that
//! accepts connections and never answers; and `go tool pprof -traces`, read per sample.

use std::collections::HashMap;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::{script, wait_for_file, xtask_env, Killed};

/// The collector's and the sink's prefix (`PYEBPF_OTELCOL`), checked to hold both.
pub fn otelcol_prefix() -> PathBuf {
    let prefix = PathBuf::from(xtask_env("PYEBPF_OTELCOL"));
    for part in [COLLECTOR, VENV_PYTHON] {
        assert!(
            prefix.join(part).exists(),
            "{} is missing: `cargo xtask setup` builds the OpenTelemetry Collector and the sink's Python environment there",
            prefix.join(part).display()
        );
    }
    prefix
}

const COLLECTOR: &str = "bin/otelcol-profiles";
const VENV_PYTHON: &str = "venv/bin/python";

/// A free TCP port of 127.0.0.1 (free when this returns: a test binary runs one test at a time).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Waits up to `limit` until something accepts connections on `port`.
fn wait_listening(port: u16, limit: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// The sink: an OTLP/HTTP profiles endpoint on a free port of 127.0.0.1, killed when dropped.
pub struct Sink {
    _child: Killed,
    pub port: u16,
    out: PathBuf,
    _dir: tempfile::TempDir,
}

impl Sink {
    /// A sink answering every request 200.
    pub fn start() -> Sink {
        Sink::with_args(&[])
    }

    /// A sink answering every request `status` with a google.rpc.Status carrying `message`, as a
    /// collector refusing the data does.
    pub fn refusing(status: u16, message: &str) -> Sink {
        Sink::with_args(&["--status", &status.to_string(), "--message", message])
    }

    fn with_args(args: &[&str]) -> Sink {
        let python = otelcol_prefix().join(VENV_PYTHON);
        let dir = tempfile::tempdir().unwrap();
        let (ready, out) = (dir.path().join("ready"), dir.path().join("requests.jsonl"));
        let child = Command::new(&python).arg(script("otlp_sink.py")).arg(&ready).arg(&out).args(args).stdin(Stdio::null()).spawn().unwrap();
        let child = Killed(child);
        wait_for_file(&ready, "the OTLP sink");
        let port = std::fs::read_to_string(&ready).unwrap().trim().parse().unwrap();
        Sink { _child: child, port, out, _dir: dir }
    }

    /// Its URL, as pyebpf's `--otlp` takes it (the default path is the sink's).
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every request it got so far, in order (a line it is still writing is left for later).
    pub fn requests(&self) -> Vec<Export> {
        let text = std::fs::read_to_string(&self.out).unwrap();
        let complete = text.rfind('\n').map_or("", |end| &text[..end]);
        complete.lines().map(|line| serde_json::from_str(line).unwrap_or_else(|err| panic!("sink line {line:.300}: {err}"))).collect()
    }

    /// Waits up to `limit` until it got at least `count` requests; returns them.
    pub fn wait_requests(&self, count: usize, limit: Duration) -> Vec<Export> {
        let started = Instant::now();
        loop {
            let requests = self.requests();
            if requests.len() >= count || started.elapsed() > limit {
                return requests;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// One request the sink got (see `scripts/otlp_sink.py` for the fields).
#[derive(Deserialize, Debug)]
pub struct Export {
    pub status: u16,
    pub path: String,
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
    #[serde(default)]
    pub headers: HashMap<String, String>,
    #[serde(default)]
    pub resources: Vec<Resource>,
    pub totals: Option<Totals>,
    pub error: Option<String>,
}

#[derive(Deserialize, Debug, Default, Clone, Copy)]
pub struct Totals {
    pub resources: u64,
    pub samples: u64,
    pub values: u64,
}

#[derive(Deserialize, Debug)]
pub struct Resource {
    pub attributes: HashMap<String, serde_json::Value>,
    pub profiles: Vec<Profile>,
}

impl Resource {
    /// The string value of resource attribute `key`.
    pub fn string(&self, key: &str) -> Option<&str> {
        self.attributes.get(key)?.as_str()
    }

    /// `process.pid`.
    pub fn pid(&self) -> Option<u32> {
        self.attributes.get("process.pid")?.as_u64().map(|pid| pid as u32)
    }
}

#[derive(Deserialize, Debug)]
pub struct Profile {
    /// `[type, unit]`, e.g. `["samples", "count"]`.
    pub sample_type: (String, String),
    pub period_type: (String, String),
    pub period: i64,
    pub time_unix_nano: u64,
    pub duration_nano: u64,
    pub samples: Vec<Sample>,
}

/// The samples of one thread with one stack, merged: values added up, `count` of them.
#[derive(Deserialize, Debug)]
pub struct Sample {
    pub thread_id: Option<serde_json::Value>,
    pub thread_name: Option<String>,
    pub attributes: HashMap<String, serde_json::Value>,
    pub values: Vec<i64>,
    pub count: u64,
    /// Timestamps they carry: one per event counted.
    pub events: u64,
    /// Each had as many timestamps as values (or none), in order, within its profile's time.
    pub timestamps_ok: bool,
    pub stack: Vec<Frame>,
}

impl Sample {
    /// Their values added up: the sample count where the profile counts samples.
    pub fn value(&self) -> u64 {
        self.values.first().copied().unwrap_or(0) as u64
    }
}

/// A frame, as the sink read it from the stack's location: `kind` is its `profile.frame.type`.
#[derive(Deserialize, Debug, Clone)]
pub struct Frame {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub name: Option<String>,
    pub file: Option<String>,
    pub start_line: i64,
    pub line: i64,
}

impl Frame {
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }

    pub fn kind(&self) -> &str {
        self.kind.as_deref().unwrap_or("")
    }
}

/// A test CA, a server certificate it signed for 127.0.0.1 and localhost, a client certificate it
/// signed, and a second CA that signed nothing of them, made with the `openssl` command in a
/// folder of their own.
pub struct Tls {
    _dir: tempfile::TempDir,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    pub wrong_ca: PathBuf,
}

impl Tls {
    pub fn new() -> Tls {
        let dir = tempfile::tempdir().unwrap();
        let path = |name: &str| dir.path().join(name);
        let extensions = |usage: &str, names: &str| {
            format!("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n{names}")
        };
        std::fs::write(path("server.ext"), extensions("serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost\n")).unwrap();
        std::fs::write(path("client.ext"), extensions("clientAuth", "")).unwrap();
        for name in ["ca", "wrong-ca"] {
            openssl(
                &["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2", "-subj", &format!("/CN=pyebpf test {name}")],
                &[("-keyout", &path(&format!("{name}.key"))), ("-out", &path(&format!("{name}.pem")))],
            );
        }
        for (name, subject) in [("server", "/CN=127.0.0.1"), ("client", "/CN=pyebpf test client")] {
            openssl(
                &["req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", subject],
                &[("-keyout", &path(&format!("{name}.key"))), ("-out", &path(&format!("{name}.csr")))],
            );
            openssl(
                &["x509", "-req", "-days", "2", "-CAcreateserial"],
                &[
                    ("-in", &path(&format!("{name}.csr"))),
                    ("-CA", &path("ca.pem")),
                    ("-CAkey", &path("ca.key")),
                    ("-extfile", &path(&format!("{name}.ext"))),
                    ("-out", &path(&format!("{name}.pem"))),
                ],
            );
        }
        Tls {
            ca: path("ca.pem"),
            cert: path("server.pem"),
            key: path("server.key"),
            client_cert: path("client.pem"),
            client_key: path("client.key"),
            wrong_ca: path("wrong-ca.pem"),
            _dir: dir,
        }
    }
}

impl Default for Tls {
    fn default() -> Self {
        Tls::new()
    }
}

/// Runs `openssl ARGS` with `(option, file)` pairs after them; panics with its output if it fails.
fn openssl(args: &[&str], files: &[(&str, &Path)]) {
    let mut command = Command::new("openssl");
    command.args(args);
    for (option, file) in files {
        command.arg(option).arg(file);
    }
    let output = command.output().expect("the openssl command is missing (`cargo xtask setup` installs it)");
    assert!(output.status.success(), "openssl {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
}

/// A real OpenTelemetry Collector: its OTLP receiver on free ports of 127.0.0.1 (gRPC and HTTP, TLS
/// with a [`Tls`]), its profiles pipeline exporting with `otlphttp` to a [`Sink`] without retries
/// or queue, so what reaches the sink is what the collector accepted. Stopped when dropped.
pub struct Collector {
    child: Option<Child>,
    pub grpc_port: u16,
    pub http_port: u16,
    tls: bool,
    config: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Collector {
    pub fn start(sink: &Sink, tls: Option<&Tls>) -> Collector {
        Collector::start_with(sink, tls, false)
    }

    /// One that takes only clients with a certificate of the test CA (mutual TLS).
    pub fn start_mutual(sink: &Sink, tls: &Tls) -> Collector {
        Collector::start_with(sink, Some(tls), true)
    }

    fn start_with(sink: &Sink, tls: Option<&Tls>, mutual: bool) -> Collector {
        let dir = tempfile::tempdir().unwrap();
        let (grpc_port, http_port) = (free_port(), free_port());
        let tls_block = tls.map_or(String::new(), |tls| {
            let client_ca = if mutual { format!("\n          client_ca_file: {}", tls.ca.display()) } else { String::new() };
            format!("\n        tls:\n          cert_file: {}\n          key_file: {}{client_ca}", tls.cert.display(), tls.key.display())
        });
        let config = format!(
            "receivers:\n  otlp:\n    protocols:\n      grpc:\n        endpoint: 127.0.0.1:{grpc_port}{tls_block}\n      http:\n        endpoint: 127.0.0.1:{http_port}{tls_block}\n\
             exporters:\n  otlphttp:\n    endpoint: http://127.0.0.1:{}\n    compression: gzip\n    retry_on_failure:\n      enabled: false\n    sending_queue:\n      enabled: false\n\
             service:\n  telemetry:\n    metrics:\n      level: none\n  pipelines:\n    profiles:\n      receivers: [otlp]\n      exporters: [otlphttp]\n",
            sink.port
        );
        let config_path = dir.path().join("config.yaml");
        std::fs::write(&config_path, config).unwrap();
        let log = dir.path().join("collector.log");
        let mut collector = Collector { child: None, grpc_port, http_port, tls: tls.is_some(), config: config_path, log, _dir: dir };
        collector.restart();
        collector
    }

    /// Starts it again (after [`Collector::stop`]) on the same ports; waits until both listen.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "the collector is running");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = Command::new(otelcol_prefix().join(COLLECTOR))
            .arg(format!("--config={}", self.config.display()))
            .arg("--feature-gates=+service.profilesSupport")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let started = Instant::now();
        for port in [self.grpc_port, self.http_port] {
            let left = Duration::from_secs(30).saturating_sub(started.elapsed());
            assert!(wait_listening(port, left), "the collector does not listen on {port} after 30 s:\n{}", self.log());
        }
    }

    /// Stops it with SIGTERM, as a collector is shut down, and waits until it exited.
    pub fn stop(&mut self) {
        let mut child = self.child.take().expect("the collector is not running");
        // SAFETY: kill takes a pid and a signal; the child is not reaped yet.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let started = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                panic!("the collector did not stop within 20 s of SIGTERM:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn scheme(&self, plain: &str, secure: &str) -> String {
        if self.tls {
            secure.to_string()
        } else {
            plain.to_string()
        }
    }

    /// `http://127.0.0.1:PORT` (`https://` with TLS), for `--otlp`.
    pub fn http_url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme("http", "https"), self.http_port)
    }

    /// `grpc://127.0.0.1:PORT` (`grpcs://` with TLS), for `--otlp`.
    pub fn grpc_url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme("grpc", "grpcs"), self.grpc_port)
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// An endpoint that accepts connections and never answers (nor reads): a collector that hangs.
/// Closed when dropped.
pub struct Silent {
    pub port: u16,
    stop: Arc<AtomicBool>,
    accepted: Arc<std::sync::Mutex<usize>>,
}

impl Silent {
    pub fn start() -> Silent {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(std::sync::Mutex::new(0));
        let (thread_stop, thread_accepted) = (stop.clone(), accepted.clone());
        std::thread::spawn(move || {
            let mut held = Vec::new();
            while !thread_stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        held.push(stream);
                        *thread_accepted.lock().unwrap() += 1;
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Silent { port, stop, accepted }
    }

    /// How many connections it accepted.
    pub fn accepted(&self) -> usize {
        *self.accepted.lock().unwrap()
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A cgroup named as container runtimes name theirs (`pyebpf-test-<64 hex>.scope`, the id
/// random), made at the root of the cgroup v2 hierarchy: a process moved into it is, for pyebpf, a
/// process of that container. Removed when dropped (after its processes ended).
pub struct ContainerCgroup {
    pub id: String,
    pub path: PathBuf,
}

impl ContainerCgroup {
    pub fn new() -> ContainerCgroup {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        // `ID PARENT DEV ROOT MOUNT_POINT OPTIONS ... - TYPE SOURCE SUPER_OPTIONS`
        let mount = mountinfo
            .lines()
            .find(|line| line.split_once(" - ").is_some_and(|(_, after)| after.starts_with("cgroup2 ")))
            .and_then(|line| line.split_whitespace().nth(4))
            .unwrap_or_else(|| panic!("no cgroup v2 hierarchy is mounted: the test puts a process in a container's cgroup there"));
        let mut random = [0u8; 32];
        std::fs::File::open("/dev/urandom").unwrap().read_exact(&mut random).unwrap();
        let id: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let path = Path::new(mount).join(format!("pyebpf-test-{id}.scope"));
        std::fs::create_dir(&path).unwrap_or_else(|err| panic!("cannot make the cgroup {}: {err}", path.display()));
        ContainerCgroup { id, path }
    }

    /// Moves process `pid` into it.
    pub fn add(&self, pid: u32) {
        let procs = self.path.join("cgroup.procs");
        std::fs::write(&procs, pid.to_string()).unwrap_or_else(|err| panic!("cannot move {pid} into {}: {err}", procs.display()));
    }
}

impl Default for ContainerCgroup {
    fn default() -> Self {
        ContainerCgroup::new()
    }
}

impl Drop for ContainerCgroup {
    fn drop(&mut self) {
        let started = Instant::now();
        // A process just killed may leave it a moment later.
        while std::fs::remove_dir(&self.path).is_err() && started.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// One sample of `go tool pprof -traces -sample_index=samples`: its labels, count and function
/// names leaf first.
#[derive(Debug)]
pub struct Trace {
    pub labels: HashMap<String, String>,
    pub count: u64,
    pub frames: Vec<String>,
}

impl Trace {
    pub fn pid(&self) -> Option<u32> {
        self.labels.get("pid")?.parse().ok()
    }
}

/// The samples of a pprof file, as `go tool pprof -traces -sample_index=samples` prints them.
pub fn pprof_traces(profile: &Path) -> Vec<Trace> {
    let output = Command::new("go")
        .args(["tool", "pprof", "-traces", "-sample_index=samples"])
        .arg(profile)
        .output()
        .expect("go tool pprof (golang-go) must be installed: `cargo xtask setup` installs it");
    assert!(output.status.success(), "go tool pprof -traces {} failed: {}", profile.display(), String::from_utf8_lossy(&output.stderr));
    let text = String::from_utf8_lossy(&output.stdout);
    text.split("-----------+-------------------------------------------------------").skip(1).filter_map(parse_trace).collect()
}

/// One block of `-traces`: `   key:  value` lines, then `COUNT   LEAF` and one line per caller.
fn parse_trace(block: &str) -> Option<Trace> {
    let mut trace = Trace { labels: HashMap::new(), count: 0, frames: Vec::new() };
    for line in block.lines().filter(|line| !line.trim().is_empty()) {
        let trimmed = line.trim_start();
        let first = trimmed.split_whitespace().next().unwrap_or_default();
        if trace.frames.is_empty() {
            if let Some(key) = first.strip_suffix(':').filter(|_| trace.count == 0) {
                trace.labels.insert(key.to_string(), trimmed[first.len()..].trim().to_string());
            } else if let Ok(count) = first.parse() {
                trace.count = count;
                trace.frames.push(trimmed[first.len()..].trim().to_string());
            }
        } else {
            trace.frames.push(trimmed.to_string());
        }
    }
    (trace.count > 0).then_some(trace)
}
