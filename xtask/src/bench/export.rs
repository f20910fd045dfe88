//! What sending profiles costs (`record --otlp`): 20 busy Python processes under `record -a` at
//! 99 Hz, a period every 5 s, to a local sink that answers every request at once. The export runs
//! on a thread of its own (`pyebpf-otlp`: encoding, compressing, sending); its CPU per period is
//! read from the kernel's per-thread run time, beside what the whole process used per period.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::Bench;

pub const PROCESSES: usize = 20;
pub const HZ: u32 = 99;
pub const PERIOD_S: u32 = 5;
pub const SECONDS: u32 = 40;
/// Interpreters the busy processes run, in turn.
const VERSIONS: [&str; 5] = ["3.11", "3.12", "3.13", "3.14", "3.15"];
const EXPORT_THREAD: &str = "pyebpf-otlp";

/// An HTTP endpoint taking OTLP requests and answering each with an empty success (an empty
/// `ExportProfilesServiceResponse`), so the figures are pyebpf's alone.
const SINK: &str = r#"
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;

pub fn export(bench: &Bench) -> Result<Value> {
    let _targets = (0..PROCESSES).map(|i| bench.spawn_ready(VERSIONS[i % VERSIONS.len()], "sampling_deep.py", &["20"])).collect::<Result<Vec<_>>>()?;
    let (mut sink, port) = start_sink()?;
    let out = bench.out.join("export.pb.gz");
    let (hz, period, seconds) = (HZ.to_string(), PERIOD_S.to_string(), SECONDS.to_string());
    let url = format!("http://127.0.0.1:{port}");
    let mut child = Command::new(&bench.pyebpf)
        .args(["record", "-a", "-F", &hz, "-d", &seconds, "--otlp", &url, "--otlp-period", &period, "-o"])
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("start pyebpf record --otlp")?;
    let (process_ns, export_ns) = follow_cpu(&child);
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().expect("piped"), &mut stderr)?;
    let status = child.wait()?;
    let _ = sink.kill();
    let _ = sink.wait();
    if !status.success() {
        bail!("pyebpf record --otlp failed: {stderr}");
    }
    let periods = periods_sent(&stderr).with_context(|| format!("no `periods sent` in the summary: {stderr}"))?;
    let per_period_ms = |ns: u64| ns as f64 / 1e6 / periods.max(1) as f64;
    let row = json!({
        "processes": PROCESSES, "hz": HZ, "period_s": PERIOD_S, "seconds": SECONDS, "periods": periods,
        "export_ms_per_period": per_period_ms(export_ns), "process_ms_per_period": per_period_ms(process_ns),
        "export_share_of_one_core": export_ns as f64 / 1e9 / f64::from(SECONDS),
        "process_share_of_one_core": process_ns as f64 / 1e9 / f64::from(SECONDS),
    });
    eprintln!("  {row}");
    Ok(row)
}

fn start_sink() -> Result<(Child, u16)> {
    let mut sink = Command::new("/usr/bin/python3.11").args(["-c", SINK]).stdout(Stdio::piped()).spawn().context("start the OTLP sink")?;
    let mut line = String::new();
    BufReader::new(sink.stdout.take().expect("piped")).read_line(&mut line)?;
    let port = line.trim().parse().with_context(|| format!("the sink said {line:?}"))?;
    Ok((sink, port))
}

/// Follows `child` until it exits: the run time of all its threads and of its export thread, as
/// last read (a thread's figures go with it, so they are read every 100 ms).
fn follow_cpu(child: &Child) -> (u64, u64) {
    let (mut process, mut export) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(u64::from(SECONDS) + 60);
    while Instant::now() < deadline {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", child.id())) else { break };
        let (mut all, mut exporting) = (0, 0);
        for task in tasks.flatten() {
            let run_ns: u64 = std::fs::read_to_string(task.path().join("schedstat")).ok().and_then(|s| s.split_whitespace().next()?.parse().ok()).unwrap_or(0);
            all += run_ns;
            if std::fs::read_to_string(task.path().join("comm")).is_ok_and(|comm| comm.trim() == EXPORT_THREAD) {
                exporting += run_ns;
            }
        }
        if all == 0 {
            break;
        }
        (process, export) = (process.max(all), export.max(exporting));
        std::thread::sleep(Duration::from_millis(100));
    }
    (process, export)
}

/// `N` of the summary's `otlp: N periods sent ...`.
fn periods_sent(stderr: &str) -> Option<u64> {
    let line = stderr.lines().find(|line| line.contains("periods sent"))?;
    let before = &line[..line.find(" periods sent")?];
    before.rsplit(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn periods_sent_is_read_from_the_summary() {
        let stderr =
            "pyebpf: wrote 10 samples\n  otlp: 8 periods sent to http://127.0.0.1:1/v1development/profiles (1234 samples), 0 retries, 0 dropped, 0 refused\n";
        assert_eq!(super::periods_sent(stderr), Some(8));
        assert_eq!(super::periods_sent("nothing"), None);
    }
}
