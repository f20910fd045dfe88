//! `record --otlp`: every export period, one OTLP `ExportProfilesServiceRequest` holding every
//! process profiled in it, pushed to an OpenTelemetry Collector or Pyroscope.
//!
//! The sampling loop only hands over its period profiles ([`Exporter::add`], [`Exporter::end_period`]);
//! a thread of the exporter's own encodes them ([`model`]) into a bounded queue of requests
//! ([`queue`]) and sends them in order over gRPC or HTTP/protobuf ([`transport`]), retrying what
//! may succeed later. Nothing the collector does (or does not do) holds the sampling back.

mod exporter;
mod headers;
mod model;
mod proto;
mod queue;
#[cfg(test)]
mod tests;
mod tls;
mod transport;

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

pub use exporter::Exporter;
pub use headers::Headers;

/// The variable `--otlp` falls back to (empty: no export), so the service unit can set it.
pub const ENDPOINT_VARIABLE: &str = "PYEBPF_OTLP_ENDPOINT";

/// The HTTP path of OTLP profiles when the endpoint's URL has none.
pub const DEFAULT_HTTP_PATH: &str = "/v1development/profiles";

/// The gRPC method requests are sent to.
const GRPC_PATH: &str = "/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export";

/// Why an export could not start.
#[derive(Debug, thiserror::Error)]
pub enum OtlpError {
    #[error("bad OTLP endpoint {0:?}: {1}")]
    Endpoint(String, &'static str),
    #[error("{source_name}: {reason}")]
    Headers { source_name: String, reason: String },
    #[error("cannot read {path}: {cause}")]
    Read { path: PathBuf, cause: std::io::Error },
    #[error("{path}: {reason}")]
    Pem { path: PathBuf, reason: String },
    #[error("TLS: {0}")]
    Tls(String),
    #[error("cannot start the OTLP exporter: {0}")]
    Start(std::io::Error),
}

/// How requests travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    Http,
}

/// Where requests go: `grpc://`, `grpcs://`, `http://` or `https://` with a host and port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub protocol: Protocol,
    pub tls: bool,
    /// `host:port`.
    pub authority: String,
    pub host: String,
    /// The HTTP path (with HTTP), `/` and up.
    pub path: String,
}

impl Endpoint {
    /// Parses `SCHEME://HOST[:PORT][/PATH]`; a gRPC endpoint has no path. Without a port, gRPC
    /// uses 4317, HTTP 4318 and HTTPS 443 (a collector behind a TLS-terminating proxy).
    pub fn parse(text: &str) -> Result<Endpoint, OtlpError> {
        let bad = |reason| OtlpError::Endpoint(text.to_string(), reason);
        let (scheme, rest) = text.split_once("://").ok_or_else(|| bad("expected grpc://, grpcs://, http:// or https://"))?;
        let (protocol, tls, default_port) = match scheme.to_ascii_lowercase().as_str() {
            "grpc" => (Protocol::Grpc, false, 4317),
            "grpcs" => (Protocol::Grpc, true, 4317),
            "http" => (Protocol::Http, false, 4318),
            "https" => (Protocol::Http, true, 443),
            _ => return Err(bad("expected grpc://, grpcs://, http:// or https://")),
        };
        let (authority, path) = rest.find('/').map_or((rest, ""), |slash| rest.split_at(slash));
        let parsed: http::uri::Authority = authority.parse().map_err(|_| bad("not a HOST:PORT"))?;
        if authority.contains('@') || parsed.host().is_empty() {
            return Err(bad("not a HOST:PORT"));
        }
        if protocol == Protocol::Grpc && !matches!(path, "" | "/") {
            return Err(bad("a gRPC endpoint has no path"));
        }
        if path.contains(['?', '#']) {
            return Err(bad("a query or fragment is not allowed"));
        }
        // `http` leaves a port that is not a u16 out rather than refusing it.
        let has_port = authority.rsplit_once(']').map_or(authority, |(_, after)| after).contains(':');
        let port = match parsed.port_u16() {
            Some(port) => port,
            None if has_port => return Err(bad("the port is not a number from 0 to 65535")),
            None => default_port,
        };
        let host = parsed.host().to_string();
        let path = if matches!(path, "" | "/") { DEFAULT_HTTP_PATH.to_string() } else { path.to_string() };
        Ok(Endpoint { protocol, tls, authority: format!("{host}:{port}"), host, path })
    }

    fn scheme(&self) -> &'static str {
        match (self.protocol, self.tls) {
            (Protocol::Grpc, false) => "grpc",
            (Protocol::Grpc, true) => "grpcs",
            (Protocol::Http, false) => "http",
            (Protocol::Http, true) => "https",
        }
    }

    /// The URI requests are made to: `http(s)://HOST:PORT/PATH`, and for gRPC the channel's
    /// origin (`http(s)://HOST:PORT`).
    fn uri(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        match self.protocol {
            Protocol::Grpc => format!("{scheme}://{}", self.authority),
            Protocol::Http => format!("{scheme}://{}{}", self.authority, self.path),
        }
    }
}

/// As given, with the default path filled in: `http://127.0.0.1:4318/v1development/profiles`.
impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.protocol {
            Protocol::Grpc => write!(f, "{}://{}", self.scheme(), self.authority),
            Protocol::Http => write!(f, "{}://{}{}", self.scheme(), self.authority, self.path),
        }
    }
}

/// What `service.name` each process gets (`--service-name`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ServiceName {
    /// The executable's name.
    #[default]
    Exe,
    /// A variable of the process's environment, else the executable's name.
    Env(String),
    /// The last component of the process's cgroup path, else the executable's name.
    Cgroup,
    /// The same name for every process.
    Literal(String),
}

impl ServiceName {
    pub fn parse(text: &str) -> Result<ServiceName, String> {
        match text {
            "exe" => Ok(ServiceName::Exe),
            "cgroup" => Ok(ServiceName::Cgroup),
            _ => {
                if let Some(name) = text.strip_prefix('=') {
                    return Ok(ServiceName::Literal(name.to_string()));
                }
                match text.strip_prefix("env:") {
                    Some(var) if !var.is_empty() && !var.contains(['=', '\0']) => Ok(ServiceName::Env(var.to_string())),
                    _ => Err("expected exe, env:VAR, cgroup or =NAME".to_string()),
                }
            }
        }
    }

    /// The environment variable to read of each process, if any.
    pub fn env_var(&self) -> Option<&str> {
        match self {
            ServiceName::Env(var) => Some(var),
            _ => None,
        }
    }
}

/// Client TLS files, PEM.
#[derive(Clone, Debug, Default)]
pub struct TlsFiles {
    /// Roots to trust instead of the system's.
    pub ca: Option<PathBuf>,
    /// A client certificate (chain) and its key.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// Everything an export needs, as the command line and environment give it.
#[derive(Clone, Debug)]
pub struct OtlpOptions {
    pub endpoint: Endpoint,
    pub period: Duration,
    pub tls: TlsFiles,
    pub headers: Headers,
    /// The most bytes of encoded requests that wait to be sent.
    pub queue_bytes: usize,
    /// How long the end of the run waits for the queue to be delivered.
    pub flush_timeout: Duration,
    pub service_name: ServiceName,
    /// `host.name` of every resource.
    pub host_name: String,
}

/// The endpoint to export to: `--otlp`, else [`ENDPOINT_VARIABLE`] when set and not empty (an
/// empty `--otlp ''`, as a unit's unset variable gives, is no endpoint either).
pub fn endpoint(given: Option<&str>) -> Result<Option<Endpoint>, OtlpError> {
    let not_empty = |value: &String| !value.trim().is_empty();
    let from_env = std::env::var(ENDPOINT_VARIABLE).ok().filter(not_empty);
    match given.map(str::to_string).filter(not_empty).or(from_env) {
        Some(text) => Endpoint::parse(text.trim()).map(Some),
        None => Ok(None),
    }
}

/// This host's name, as `uname` gives it.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|name| name.trim().to_string()).unwrap_or_default()
}

/// What `record --otlp` delivered.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OtlpTotals {
    /// Where to, as the summary shows it.
    pub endpoint: String,
    /// Periods the collector accepted, and the samples in them.
    pub periods_sent: u64,
    pub samples_sent: u64,
    /// Attempts that failed and were tried again (a connection failure, a busy collector).
    pub retries: u64,
    /// Periods never delivered: dropped from a full queue, or still queued at the end.
    pub dropped: u64,
    /// Periods the collector refused for good (or in part).
    pub refused: u64,
    /// Periods sent without timestamps: more events than [`crate::stack::MAX_EVENTS`].
    pub untimed: u64,
}

/// `otlp: 4 periods sent to URL (1234 samples), 3 retries, 0 dropped, 0 refused`: scripts and
/// tests read these words. Periods sent without timestamps are said after them, if any.
impl fmt::Display for OtlpTotals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "otlp: {} periods sent to {} ({} samples), {} retries, {} dropped, {} refused",
            self.periods_sent, self.endpoint, self.samples_sent, self.retries, self.dropped, self.refused
        )?;
        if self.untimed > 0 {
            write!(f, ", {} periods without timestamps (over {} events)", self.untimed, crate::stack::MAX_EVENTS)?;
        }
        Ok(())
    }
}
