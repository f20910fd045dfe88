//! Where the always-on runs send their profiles: the OpenTelemetry Collector the OTLP tests use
//! (`cargo xtask setup` builds it), its OTLP receiver on a free gRPC port, forwarding each profiles
//! request with its `otlphttp` exporter to `tests/scripts/otlp_sink.py`, which decodes it with the
//! official `opentelemetry-proto` package and appends one JSON line per request. The exporter has no
//! queue, so a request the collector acknowledged is already in the sink's file.

use std::collections::BTreeSet;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::super::measure::threads_cpu_ns;
use super::FLUSH_TIMEOUT_S;

/// The collector and the sink count as quiet under this share of a core (a Go runtime at rest
/// wakes a few times a second).
const QUIET_SHARE: f64 = 0.002;

pub struct Receiver {
    sink: Child,
    collector: Child,
    pub grpc_port: u16,
    requests: PathBuf,
    collector_log: PathBuf,
}

/// What one run delivered: requests, samples, and which of the workload's processes showed
/// Python frames.
#[derive(Default)]
pub struct Delivered {
    pub requests: usize,
    pub refused: usize,
    pub samples: u64,
    pub python_samples: u64,
    /// Workload processes with at least one sample carrying a Python frame.
    pub python_pids: BTreeSet<u32>,
}

impl Delivered {
    pub fn to_json(&self) -> Value {
        json!({
            "requests": self.requests, "refused": self.refused, "samples": self.samples,
            "python_samples": self.python_samples, "python_processes": self.python_pids.len(),
        })
    }
}

impl Receiver {
    pub fn start(root: &Path, out: &Path) -> Result<Receiver> {
        let prefix = crate::otelcol::ensure_built(root)?;
        let (ready, requests) = (out.join("always_on-sink.ready"), out.join("always_on-requests.jsonl"));
        let _ = std::fs::remove_file(&ready);
        let _ = std::fs::remove_file(&requests);
        let mut sink = Command::new(prefix.join("venv/bin/python"))
            .arg(root.join("tests/scripts/otlp_sink.py"))
            .arg(&ready)
            .arg(&requests)
            .stdin(Stdio::null())
            .spawn()
            .context("start the OTLP sink")?;
        let sink_port: u16 = match wait_for(|| std::fs::read_to_string(&ready).ok()?.trim().parse().ok(), Duration::from_secs(30)) {
            Some(port) => port,
            None => {
                let _ = sink.kill();
                let _ = sink.wait();
                bail!("the OTLP sink (tests/scripts/otlp_sink.py) did not start within 30 s");
            }
        };
        let grpc_port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let config = out.join("always_on-collector.yaml");
        std::fs::write(&config, collector_config(grpc_port, sink_port))?;
        let collector_log = out.join("always_on-collector.log");
        let log = std::fs::File::create(&collector_log)?;
        let collector = Command::new(prefix.join(crate::otelcol::BINARY))
            .arg(format!("--config={}", config.display()))
            .arg("--feature-gates=+service.profilesSupport")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("start the OpenTelemetry Collector")?;
        let receiver = Receiver { sink, collector, grpc_port, requests, collector_log };
        if wait_for(|| TcpStream::connect(("127.0.0.1", grpc_port)).ok(), Duration::from_secs(30)).is_none() {
            bail!("the collector does not listen on {grpc_port} after 30 s:\n{}", receiver.collector_log());
        }
        Ok(receiver)
    }

    /// How far the sink's file is: a run's requests are those after its mark.
    pub fn mark(&self) -> u64 {
        std::fs::metadata(&self.requests).map(|m| m.len()).unwrap_or(0)
    }

    /// What arrived after `mark` of profiles that began at `since_ns` (Unix time) or later,
    /// counting Python frames of the processes `pids` only. A request the sink was slow to take
    /// can land in the next run's part of the file (its sender gave up and retried, or exited):
    /// its profiles' time says whose it is.
    pub fn delivered_since(&self, mark: u64, since_ns: u64, pids: &[u32]) -> Result<Delivered> {
        let bytes = std::fs::read(&self.requests).context("read the sink's requests")?;
        let text = String::from_utf8_lossy(bytes.get(usize::try_from(mark)?..).unwrap_or_default());
        let mut delivered = Delivered::default();
        for line in text.lines().filter(|line| !line.trim().is_empty()) {
            let request: Value = serde_json::from_str(line).with_context(|| format!("sink line {line:.200}"))?;
            if began_before(&request, since_ns) {
                continue;
            }
            delivered.requests += 1;
            if request["status"] != 200 || !request["error"].is_null() {
                delivered.refused += 1;
            }
            for resource in request["resources"].as_array().into_iter().flatten() {
                count_resource(resource, pids, &mut delivered);
            }
        }
        Ok(delivered)
    }

    /// CPU the collector and the sink have run so far, in ns.
    pub fn cpu_ns(&self) -> u64 {
        [&self.collector, &self.sink].iter().filter_map(|child| threads_cpu_ns(child.id())).sum()
    }

    /// Waits until the collector and the sink are quiet (under [`QUIET_SHARE`] of a core over a
    /// second) so that a window starts with neither still decoding the last run's export, which
    /// a host-wide profiler samples and attaches to; false if they were not within `limit`.
    pub fn settle(&self, limit: Duration) -> bool {
        let start = Instant::now();
        let mut before = self.cpu_ns();
        while start.elapsed() < limit {
            std::thread::sleep(Duration::from_secs(1));
            let now = self.cpu_ns();
            if (now.saturating_sub(before) as f64) < QUIET_SHARE * 1e9 {
                return true;
            }
            before = now;
        }
        false
    }

    pub fn collector_log(&self) -> String {
        std::fs::read_to_string(&self.collector_log).unwrap_or_default()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        for child in [&mut self.collector, &mut self.sink] {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn collector_config(grpc_port: u16, sink_port: u16) -> String {
    format!(
        "receivers:\n  otlp:\n    protocols:\n      grpc:\n        endpoint: 127.0.0.1:{grpc_port}\n\
         exporters:\n  otlphttp:\n    endpoint: http://127.0.0.1:{sink_port}\n    compression: gzip\n    timeout: {FLUSH_TIMEOUT_S}s\n    retry_on_failure:\n      enabled: false\n    sending_queue:\n      enabled: false\n\
         service:\n  telemetry:\n    metrics:\n      level: none\n  pipelines:\n    profiles:\n      receivers: [otlp]\n      exporters: [otlphttp]\n"
    )
}

/// Adds one resource's samples (as the sink merged them) to `delivered`. A sample's weight is its
/// value where the sender counts in values (pyebpf), else its timestamps (the OpenTelemetry
/// profiler sends one timestamp per sample and no values).
fn count_resource(resource: &Value, pids: &[u32], delivered: &mut Delivered) {
    let pid = resource["attributes"]["process.pid"].as_u64().and_then(|pid| u32::try_from(pid).ok());
    for profile in resource["profiles"].as_array().into_iter().flatten() {
        for sample in profile["samples"].as_array().into_iter().flatten() {
            let value = sample["values"][0].as_u64().unwrap_or(0);
            let weight = if value > 0 { value } else { sample["events"].as_u64().unwrap_or(0) };
            delivered.samples += weight;
            if sample["stack"].as_array().into_iter().flatten().any(|frame| frame["type"] == "cpython") {
                delivered.python_samples += weight;
                if let Some(pid) = pid.filter(|pid| pids.contains(pid)) {
                    delivered.python_pids.insert(pid);
                }
            }
        }
    }
}

/// Whether any profile of the sink's `request` began before `since_ns`.
fn began_before(request: &Value, since_ns: u64) -> bool {
    let resources = request["resources"].as_array().into_iter().flatten();
    let profiles = resources.flat_map(|resource| resource["profiles"].as_array().into_iter().flatten());
    profiles.filter_map(|profile| profile["time_unix_nano"].as_u64()).any(|start| start < since_ns)
}

/// Polls `probe` every 50 ms for up to `limit`.
pub fn wait_for<T>(mut probe: impl FnMut() -> Option<T>, limit: Duration) -> Option<T> {
    let started = Instant::now();
    loop {
        if let Some(found) = probe() {
            return Some(found);
        }
        if started.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_weigh_their_values_or_their_timestamps() {
        let python = json!([{ "type": "native" }, { "type": "cpython", "name": "compute" }]);
        let resource = json!({
            "attributes": { "process.pid": 7 },
            "profiles": [{ "time_unix_nano": 10, "samples": [
                { "values": [3], "events": 3, "stack": python },
                { "values": [0], "events": 2, "stack": python },
                { "values": [0], "events": 4, "stack": [{ "type": "native" }] },
            ]}],
        });
        let mut delivered = Delivered::default();
        count_resource(&resource, &[7, 8], &mut delivered);
        assert_eq!((delivered.samples, delivered.python_samples), (9, 5));
        assert_eq!(delivered.python_pids.into_iter().collect::<Vec<_>>(), vec![7]);
        let request = json!({ "resources": [resource] });
        assert!(began_before(&request, 11) && !began_before(&request, 10));
        let mut other = Delivered::default();
        count_resource(&resource, &[8], &mut other);
        assert!(other.python_pids.is_empty());
    }
}
