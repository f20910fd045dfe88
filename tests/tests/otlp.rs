//! `pyebpf record --otlp` (issue 32) against a real OpenTelemetry Collector (`tests/otlp.rs`):
//! every period reaches it as OTLP profiles whose content is the pprof file's, over HTTP, gRPC,
//! TLS and mutual TLS, with each process's resource attributes (its container's id too); a
//! collector that goes away gets what it missed when it comes back; one that refuses, hangs or
//! presents a certificate of another CA costs nothing of the recording.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use pyebpf_tests::otlp::{otelcol_prefix, pprof_traces, Collector, ContainerCgroup, Export, Frame, Resource, Silent, Sink, Tls, Trace};
use pyebpf_tests::{debian_python, pyebpf_command, pyenv_python, script, signal_masks, wait_after_signal, wait_for_file, Killed, Sent};

/// The workload: one thread spending 60/30/10% of its time in three functions.
const SCRIPT: &str = "sampling_proportions.py";
const FUNCTIONS: [&str; 3] = ["sixty_percent", "thirty_percent", "ten_percent"];
/// Native frames every CPython's main thread runs under, named by their symbols.
const NATIVE_NAMES: [&str; 7] = ["_PyEval_EvalFrameDefault", "PyEval_EvalCode", "Py_RunMain", "Py_BytesMain", "main", "__libc_start_main", "_start"];

/// Sends the known profile of `scripts/otlp_send.py` to `url`; asserts it was answered 200.
fn send_known_profile(url: &str, pid: u32, ca: Option<&Path>) {
    let mut send = Command::new(otelcol_prefix().join("venv/bin/python"));
    send.arg(script("otlp_send.py")).arg(url).arg(pid.to_string());
    if let Some(ca) = ca {
        send.arg("--ca").arg(ca);
    }
    let output = send.output().unwrap();
    assert!(output.status.success(), "otlp_send.py {url} failed: {}", String::from_utf8_lossy(&output.stderr));
}

/// The harness itself: a profile sent to the collector (plain and TLS) reaches the sink whole,
/// decoded frame by frame; the collector stops and starts again on its ports.
#[test]
fn the_collector_passes_a_known_profile_to_the_sink() {
    let tls = Tls::new();
    for tls in [None, Some(&tls)] {
        let sink = Sink::start();
        let mut collector = Collector::start(&sink, tls);
        send_known_profile(&collector.http_url(), 4242, tls.map(|tls| tls.ca.as_path()));
        collector.stop();
        collector.restart();
        send_known_profile(&collector.http_url(), 4343, tls.map(|tls| tls.ca.as_path()));
        let requests = sink.wait_requests(2, Duration::from_secs(10));
        assert_eq!(requests.len(), 2, "{requests:?}\n{}", collector.log());
        for (request, pid) in requests.iter().zip([4242, 4343]) {
            assert_eq!((request.status, request.path.as_str()), (200, "/v1development/profiles"), "{request:?}");
            assert_eq!(request.content_encoding.as_deref(), Some("gzip"), "the collector's exporter compresses");
            let [resource] = &request.resources[..] else { panic!("{request:?}") };
            assert_eq!(resource.pid(), Some(pid));
            assert_eq!(resource.string("service.name"), Some("otlp-send"));
            let [profile] = &resource.profiles[..] else { panic!("{resource:?}") };
            assert_eq!(profile.sample_type, ("samples".to_string(), "count".to_string()));
            let [sample] = &profile.samples[..] else { panic!("{profile:?}") };
            assert_eq!((sample.value(), sample.count, sample.thread_name.as_deref()), (7, 1, Some("sender")));
            assert_eq!(sample.thread_id, Some(serde_json::json!(pid)));
            let frames: Vec<(&str, &str, &str, i64, i64)> =
                sample.stack.iter().map(|f| (f.kind(), f.name(), f.file.as_deref().unwrap_or(""), f.start_line, f.line)).collect();
            assert_eq!(frames, [("kernel", "leaf_k", "", 0, 0), ("native", "native_fn", "", 0, 0), ("cpython", "py_fn", "send.py", 10, 12)]);
        }
    }
}

/// A Python running [`SCRIPT`], with what the tests compare its resource attributes to.
struct Workload {
    child: Killed,
    _dir: tempfile::TempDir,
    /// `sys.version`'s first word (`3.11.7`, `3.15.0a3`).
    version: String,
    /// The target of /proc/PID/exe.
    exe: PathBuf,
    comm: String,
}

impl Workload {
    fn start(python: &Path, env: &[(&str, &str)]) -> Workload {
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("ready");
        let child = Command::new(python).arg(script(SCRIPT)).arg(&ready).envs(env.iter().copied()).stdin(Stdio::null()).spawn().unwrap();
        let child = Killed(child);
        wait_for_file(&ready, &format!("{SCRIPT} under {}", python.display()));
        let version = Command::new(python).args(["-c", "import sys; print(sys.version.split()[0])"]).output().unwrap();
        let pid = child.pid();
        Workload {
            version: String::from_utf8_lossy(&version.stdout).trim().to_string(),
            exe: std::fs::read_link(format!("/proc/{pid}/exe")).unwrap(),
            comm: std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap().trim().to_string(),
            child,
            _dir: dir,
        }
    }

    fn pid(&self) -> u32 {
        self.child.pid()
    }
}

/// The three interpreters of the acceptance: pyenv's 3.11 and 3.13 (whose `_PyRuntime` is in
/// `libpython3.13.so`), Debian's 3.15; each with `PYEBPF_TEST_SERVICE=svc-VERSION` in its
/// environment.
fn three_workloads() -> Vec<Workload> {
    [pyenv_python("3.11.7"), pyenv_python("3.13.0"), debian_python("3.15")]
        .iter()
        .map(|python| {
            let service = format!("svc-{}", python.file_name().unwrap().to_string_lossy());
            Workload::start(python, &[("PYEBPF_TEST_SERVICE", &service)])
        })
        .collect()
}

/// `pyebpf record ARGS -o DIR/profile.pb.gz`: its output and the pprof file.
struct Recording {
    output: Output,
    stderr: String,
    pprof: PathBuf,
    _dir: tempfile::TempDir,
}

fn record(args: &[&str], env: &[(&str, &str)]) -> Recording {
    let dir = tempfile::tempdir().unwrap();
    let pprof = dir.path().join("profile.pb.gz");
    let output = pyebpf_command().arg("record").args(args).arg("-o").arg(&pprof).envs(env.iter().copied()).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    Recording { output, stderr, pprof, _dir: dir }
}

impl Recording {
    fn assert_success(&self) -> &Self {
        assert!(self.output.status.success(), "pyebpf record failed ({}):\n{}", self.output.status, self.stderr);
        self
    }
}

/// The summary line `otlp: N periods sent to URL (M samples), R retries, D dropped, F refused`.
#[derive(Debug)]
struct Summary {
    sent: u64,
    url: String,
    samples: u64,
    retries: u64,
    dropped: u64,
    refused: u64,
}

/// The number just before the first of `labels` in `line`.
fn number_before(line: &str, labels: &[&str]) -> Option<u64> {
    labels.iter().find_map(|label| line.split_once(label)?.0.split(|c: char| !c.is_ascii_digit()).rfind(|w| !w.is_empty())?.parse().ok())
}

fn summary(stderr: &str) -> Summary {
    let line = stderr
        .lines()
        .map(|line| line.trim_start().trim_start_matches("pyebpf: "))
        .find(|line| line.starts_with("otlp: ") && line.contains(" sent to "))
        .unwrap_or_else(|| panic!("no `otlp: N periods sent to URL ...` summary:\n{stderr}"));
    let field = |labels: &[&str]| number_before(line, labels).unwrap_or_else(|| panic!("no {labels:?} in `{line}`"));
    let url = line.split_once(" sent to ").unwrap().1.split_whitespace().next().unwrap_or_default().to_string();
    Summary {
        sent: field(&[" periods sent", " period sent"]),
        url,
        samples: field(&[" samples)", " sample)"]),
        retries: field(&[" retries", " retry"]),
        dropped: field(&[" dropped"]),
        refused: field(&[" refused"]),
    }
}

/// The lines of pyebpf's own OTLP complaints.
fn otlp_complaints(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|line| line.starts_with("pyebpf: otlp: ")).collect()
}

/// Every resource of `pid` in what the sink got, with the request it came in.
fn resources_of(requests: &[Export], pid: u32) -> Vec<&Resource> {
    requests.iter().flat_map(|request| &request.resources).filter(|resource| resource.pid() == Some(pid)).collect()
}

/// The samples of `resources` in the profiles that count samples (`samples/count`), each with its
/// count as the weight.
fn counted_samples<'a>(resources: &[&'a Resource]) -> Vec<&'a pyebpf_tests::otlp::Sample> {
    resources.iter().flat_map(|r| &r.profiles).filter(|p| p.sample_type.1 == "count").flat_map(|p| &p.samples).collect()
}

/// One request per period, in order: its profiles share the period's start and duration, each
/// period starts where the one before ended, each but the last lasts `period_s`, and together they
/// cover the recording's `duration_s` (to a tenth of a second).
fn check_periods(requests: &[Export], period_s: f64, duration_s: f64) {
    let spans: Vec<(u64, u64)> = requests
        .iter()
        .map(|request| {
            let spans: HashSet<(u64, u64)> = request.resources.iter().flat_map(|r| &r.profiles).map(|p| (p.time_unix_nano, p.duration_nano)).collect();
            assert_eq!(spans.len(), 1, "a request's profiles span different times: {spans:?}");
            spans.into_iter().next().unwrap()
        })
        .collect();
    let seconds = |ns: u64| ns as f64 / 1e9;
    for pair in spans.windows(2) {
        let gap = seconds(pair[1].0) - seconds(pair[0].0 + pair[0].1);
        assert!(gap.abs() < 0.05, "periods do not follow each other ({gap:.3} s between): {spans:?}");
        assert!((seconds(pair[0].1) - period_s).abs() < 0.1, "a period of {:.3} s, not {period_s} s: {spans:?}", seconds(pair[0].1));
    }
    let covered: f64 = spans.iter().map(|&(_, duration)| seconds(duration)).sum();
    assert!((covered - duration_s).abs() < 0.1, "the periods cover {covered:.3} s of a {duration_s} s recording: {spans:?}");
}

/// The samples the sink got, of every process: (with frames, without any).
fn counted(requests: &[Export]) -> (u64, u64) {
    let samples = counted_samples(&requests.iter().flat_map(|r| &r.resources).collect::<Vec<_>>());
    let without: u64 = samples.iter().filter(|s| s.stack.is_empty()).map(|s| s.value()).sum();
    (samples.iter().map(|s| s.value()).sum::<u64>() - without, without)
}

/// The processes whose samples with frames differ between the sink and the file: (pid, at the
/// sink, in the file), for a failure's message.
fn differences(requests: &[Export], traces: &[Trace]) -> Vec<(Option<u32>, u64, u64)> {
    let mut counts: std::collections::BTreeMap<Option<u32>, (u64, u64)> = Default::default();
    for resource in requests.iter().flat_map(|r| &r.resources) {
        let samples = counted_samples(&[resource]);
        counts.entry(resource.pid()).or_default().0 += samples.iter().filter(|s| !s.stack.is_empty()).map(|s| s.value()).sum::<u64>();
    }
    for trace in traces {
        counts.entry(trace.pid()).or_default().1 += trace.count;
    }
    counts.into_iter().filter(|(_, (sink, file))| sink != file).map(|(pid, (sink, file))| (pid, sink, file)).collect()
}

/// Every sample of the file reached the collector, once, and it got no other: those with frames
/// are the ones `go tool pprof` shows of the file (it leaves out samples without a location),
/// those without are the summary's `samples without frames`; the summary counts them all.
fn assert_same_samples(requests: &[Export], traces: &[Trace], summary: &Summary, stderr: &str) {
    let (with_frames, without) = counted(requests);
    let in_file: u64 = traces.iter().map(|t| t.count).sum();
    let unresolved =
        stderr.lines().find_map(|line| line.split_once("samples without frames: ")?.1.split(|c: char| !c.is_ascii_digit()).next()?.parse::<u64>().ok());
    assert!(
        with_frames == in_file && Some(without) == unresolved && summary.samples == with_frames + without,
        "{summary:?}: {with_frames} samples with frames at the collector, {in_file} in the file; {without} without frames, {unresolved:?} \
         unresolved in the summary; (pid, at the collector, in the file) where they differ: {:?}",
        differences(requests, traces)
    );
}

/// Samples of `pid` in the sink's counting profiles: all, and those with each of [`FUNCTIONS`].
fn sink_counts(requests: &[Export], pid: u32) -> (u64, Vec<u64>) {
    let samples = counted_samples(&resources_of(requests, pid));
    let with = |name: &str| samples.iter().filter(|s| s.stack.iter().any(|f| f.name() == name)).map(|s| s.value()).sum();
    (samples.iter().map(|s| s.value()).sum(), FUNCTIONS.iter().map(|name| with(name)).collect())
}

/// The same of the pprof file's samples.
fn pprof_counts(traces: &[Trace], pid: u32) -> (u64, Vec<u64>) {
    let of_pid: Vec<&Trace> = traces.iter().filter(|t| t.pid() == Some(pid)).collect();
    let with = |name: &str| of_pid.iter().filter(|t| t.frames.iter().any(|f| f == name)).map(|t| t.count).sum();
    (of_pid.iter().map(|t| t.count).sum(), FUNCTIONS.iter().map(|name| with(name)).collect())
}

fn share(part: u64, whole: u64) -> f64 {
    100.0 * part as f64 / whole.max(1) as f64
}

/// The line of `def NAME` in the workload's script.
fn def_line(name: &str) -> i64 {
    let text = std::fs::read_to_string(script(SCRIPT)).unwrap();
    text.lines().position(|line| line.starts_with(&format!("def {name}("))).unwrap() as i64 + 1
}

/// What reached the sink of `workload` is what the pprof file holds of it (each function's share
/// within a point, the samples within 2%), under one resource per request whose attributes
/// describe it, with its thread named and its frames typed.
fn check_process(requests: &[Export], traces: &[Trace], workload: &Workload, service: Option<&str>) {
    let pid = workload.pid();
    let label = format!("{} (pid {pid})", workload.exe.display());
    for request in requests {
        let count = request.resources.iter().filter(|r| r.pid() == Some(pid)).count();
        assert!(count <= 1, "{label}: {count} resources in one request");
    }
    let resources = resources_of(requests, pid);
    assert!(!resources.is_empty(), "{label}: no resource reached the collector");
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();
    let exe_name = workload.exe.file_name().unwrap().to_string_lossy().into_owned();
    for resource in &resources {
        let expected = [
            ("process.executable.name", exe_name.as_str()),
            ("process.executable.path", workload.exe.to_str().unwrap()),
            ("process.runtime.name", "cpython"),
            ("process.runtime.version", workload.version.as_str()),
            ("host.name", hostname.as_str()),
        ];
        for (key, value) in expected {
            assert_eq!(resource.string(key), Some(value), "{label}: resource attribute {key}: {:?}", resource.attributes);
        }
        let name = resource.string("service.name").unwrap_or_default();
        assert!(service.map_or(!name.is_empty(), |service| name == service), "{label}: service.name {name:?}, expected {service:?}");
    }
    let samples = counted_samples(&resources);
    assert!(!samples.is_empty(), "{label}: no profile with a `count` sample type: {:?}", resources[0].profiles.first().map(|p| &p.sample_type));
    for sample in &samples {
        assert_eq!(sample.thread_id, Some(serde_json::json!(pid)), "{label}: thread.id of the main thread");
        assert_eq!(sample.thread_name.as_deref(), Some(workload.comm.as_str()), "{label}: thread.name");
        // In cpu mode each event is one sample: a timestamp for each.
        assert!(
            sample.timestamps_ok && sample.events == sample.value(),
            "{label}: {} timestamps for {} samples, in order: {}",
            sample.events,
            sample.value(),
            sample.timestamps_ok
        );
    }
    let (sink_total, sink_with) = sink_counts(requests, pid);
    let (pprof_total, pprof_with) = pprof_counts(traces, pid);
    let context = format!("{label}: sink {sink_with:?} of {sink_total}, pprof {pprof_with:?} of {pprof_total}");
    eprintln!("{context}");
    assert!(pprof_total >= 200, "{context}: too few samples");
    assert!(sink_total.abs_diff(pprof_total) * 50 <= pprof_total, "{context}: the collector got other samples than the file");
    for ((name, sink), pprof) in FUNCTIONS.iter().zip(&sink_with).zip(&pprof_with) {
        let (at_sink, in_file) = (share(*sink, sink_total), share(*pprof, pprof_total));
        assert!((at_sink - in_file).abs() <= 1.0, "{context}: {name} has {at_sink:.1}% at the collector, {in_file:.1}% in the file");
    }
    check_python_frames(&samples, &label);
}

/// Frames of the workload's script are `cpython`, with their function's start line and the line
/// they ran; its interpreter's frames named in [`NATIVE_NAMES`] are `native`.
fn check_python_frames(samples: &[&pyebpf_tests::otlp::Sample], label: &str) {
    let frames: Vec<&Frame> = samples.iter().flat_map(|s| &s.stack).collect();
    let script_path = script(SCRIPT).display().to_string();
    let python: Vec<&&Frame> = frames.iter().filter(|f| f.file.as_deref() == Some(script_path.as_str())).collect();
    assert!(!python.is_empty(), "{label}: no frame of {script_path}");
    let wrong: Vec<&&&Frame> = python.iter().filter(|f| f.kind() != "cpython").take(5).collect();
    assert!(wrong.is_empty(), "{label}: frames of the script not typed cpython: {wrong:?}");
    for name in FUNCTIONS {
        let start = def_line(name);
        let of = python.iter().filter(|f| f.name() == name).collect::<Vec<_>>();
        assert!(!of.is_empty(), "{label}: no frame of {name}");
        let wrong: Vec<_> = of.iter().filter(|f| f.start_line != start || !(start..=start + 1).contains(&f.line)).take(5).collect();
        assert!(wrong.is_empty(), "{label}: {name} starts at {start} and calls on the next line: {wrong:?}");
    }
    // (The script has a `main` too.)
    let native: Vec<&&Frame> = frames.iter().filter(|f| NATIVE_NAMES.contains(&f.name()) && !f.file.as_deref().unwrap_or("").ends_with(".py")).collect();
    assert!(!native.is_empty(), "{label}: none of {NATIVE_NAMES:?} among the frames");
    let wrong: Vec<&&&Frame> = native.iter().filter(|f| f.kind() != "native").take(5).collect();
    assert!(wrong.is_empty(), "{label}: interpreter frames not typed native: {wrong:?}");
}

/// Kernel frames (with `--kernel`) are typed `kernel`, are the leaf end of their stacks, are
/// symbols of /proc/kallsyms, and weigh what the pprof file's `_[k]` frames weigh.
fn check_kernel_frames(requests: &[Export], traces: &[Trace]) {
    let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap();
    let symbols: HashSet<&str> = kallsyms.lines().filter_map(|line| line.split_whitespace().nth(2)).collect();
    let mut at_sink = 0;
    let samples = requests.iter().flat_map(|r| &r.resources).flat_map(|r| &r.profiles).filter(|p| p.sample_type.1 == "count").flat_map(|p| &p.samples);
    for sample in samples {
        let kernel = sample.stack.iter().take_while(|f| f.kind() == "kernel").count();
        assert!(sample.stack[kernel..].iter().all(|f| f.kind() != "kernel"), "kernel frames below user frames: {:?}", sample.stack);
        for frame in &sample.stack[..kernel] {
            let name = frame.name().trim_end_matches("_[k]");
            // eBPF programs (pyebpf's own among them) left /proc/kallsyms when they were unloaded.
            let bpf = name.starts_with("bpf_prog_") || name.starts_with("bpf_trampoline_");
            assert!(symbols.contains(name) || bpf || name.starts_with("0x"), "a kernel frame of no kernel symbol: {frame:?}");
        }
        assert!(sample.stack[kernel..].iter().all(|f| !f.name().ends_with("_[k]")), "`_[k]` frames not typed kernel: {:?}", sample.stack);
        at_sink += kernel as u64 * sample.value();
    }
    let in_file: u64 = traces.iter().map(|t| t.frames.iter().filter(|f| f.ends_with("_[k]")).count() as u64 * t.count).sum();
    assert!(in_file > 0, "no kernel frame in the pprof file of `record -a --kernel`");
    assert!(at_sink.abs_diff(in_file) * 50 <= in_file, "kernel frames weigh {at_sink} at the collector, {in_file} in the file");
}

/// Three Pythons recorded host-wide for 20 s in 5 s periods, exported to the collector at `url`:
/// every period arrives, and each process's content is the file's.
fn three_pythons_reach_the_collector(grpc: bool) {
    let started = Instant::now();
    let sink = Sink::start();
    let collector = Collector::start(&sink, None);
    let url = if grpc { collector.grpc_url() } else { collector.http_url() };
    let workloads = three_workloads();
    // Over gRPC each process is named from its environment; over HTTP by pyebpf's default.
    let service_args: &[&str] = if grpc { &["--service-name", "env:PYEBPF_TEST_SERVICE"] } else { &[] };
    let recording = record(&[&["-a", "--kernel", "-F", "99", "-d", "20", "--otlp-period", "5", "--otlp", &url], service_args].concat(), &[]);
    recording.assert_success();
    let summary = summary(&recording.stderr);
    let requests = sink.wait_requests(summary.sent as usize, Duration::from_secs(10));
    eprintln!("{summary:?}; {} requests at the sink", requests.len());
    assert!(summary.sent >= 4 && requests.len() as u64 == summary.sent, "{summary:?}, {} requests at the sink:\n{}", requests.len(), recording.stderr);
    assert!(summary.url.starts_with(&url), "{summary:?}");
    assert_eq!((summary.dropped, summary.refused), (0, 0), "{summary:?}");
    assert!(otlp_complaints(&recording.stderr).is_empty(), "{}", recording.stderr);
    for request in &requests {
        assert!(request.status == 200 && request.error.is_none(), "{request:?}");
    }
    check_periods(&requests, 5.0, 20.0);
    let traces = pprof_traces(&recording.pprof);
    assert_same_samples(&requests, &traces, &summary, &recording.stderr);
    for workload in &workloads {
        let service = format!("svc-{}", workload.exe.file_name().unwrap().to_string_lossy());
        check_process(&requests, &traces, workload, grpc.then_some(service.as_str()));
    }
    check_kernel_frames(&requests, &traces);
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());
}

#[test]
fn three_pythons_reach_the_collector_over_http() {
    three_pythons_reach_the_collector(false);
}

#[test]
fn three_pythons_reach_the_collector_over_grpc() {
    three_pythons_reach_the_collector(true);
}

/// Seconds of CPU `pid` has used so far (user and system, from /proc/PID/stat).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<u64> = stat.rsplit_once(')').unwrap().1.split_whitespace().skip(11).take(2).map(|f| f.parse().unwrap()).collect();
    // SAFETY: sysconf has no preconditions.
    fields.iter().sum::<u64>() as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// A collector stopped for 15 s in the middle of a 28 s recording in 5 s periods: the periods it
/// missed are sent again when it is back, and every sample of the file reaches it, once.
#[test]
fn periods_a_stopped_collector_missed_arrive_when_it_is_back() {
    let sink = Sink::start();
    let mut collector = Collector::start(&sink, None);
    let workload = Workload::start(&debian_python("3.13"), &[]);
    let dir = tempfile::tempdir().unwrap();
    let pprof = dir.path().join("profile.pb.gz");
    let url = collector.http_url();
    let child = pyebpf_command()
        .args(["record", "-a", "-F", "99", "-d", "28", "--otlp-period", "5", "--otlp", &url, "-o"])
        .arg(&pprof)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(6));
    collector.stop();
    let stopped_at = sink.requests().len();
    std::thread::sleep(Duration::from_secs(15));
    collector.restart();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "pyebpf record failed ({}):\n{stderr}", output.status);
    let summary = summary(&stderr);
    let requests = sink.wait_requests(summary.sent as usize, Duration::from_secs(10));
    eprintln!("{summary:?}; {stopped_at} requests before the stop, {} in all, in {:.1} s", requests.len(), started.elapsed().as_secs_f64());
    assert!(summary.retries > 0, "nothing was retried while the collector was away: {summary:?}");
    assert_eq!((summary.dropped, summary.refused), (0, 0), "{summary:?}\n{stderr}");
    assert!(summary.sent >= 5 && requests.len() as u64 == summary.sent, "{summary:?}, {} requests at the sink", requests.len());
    assert!(requests.iter().all(|r| r.status == 200 && r.error.is_none()), "{requests:?}");
    check_periods(&requests, 5.0, 28.0);
    let traces = pprof_traces(&pprof);
    assert_same_samples(&requests, &traces, &summary, &stderr);
    let (python_at_sink, _) = sink_counts(&requests, workload.pid());
    let (python_in_file, _) = pprof_counts(&traces, workload.pid());
    assert!(python_in_file >= 500 && python_at_sink == python_in_file, "the Python's samples: {python_at_sink} at the collector, {python_in_file} in the file");
}

/// pyebpf exporting straight to an endpoint that refuses every request with 400: one line says
/// so with the endpoint's message, nothing is sent again, and the recording is whole. The
/// requests carry the headers of `--otlp-headers-file` and `PYEBPF_OTLP_HEADERS`.
#[test]
fn a_refusing_endpoint_is_named_once_and_the_recording_goes_on() {
    const MESSAGE: &str = "profiles refused by the test sink: quota exhausted";
    let sink = Sink::refusing(400, MESSAGE);
    let workload = Workload::start(&debian_python("3.15"), &[]);
    let dir = tempfile::tempdir().unwrap();
    let headers = dir.path().join("headers");
    std::fs::write(&headers, "x-test-token: t0k3n\nx-tenant: acceptance\n").unwrap();
    let cpu_before = cpu_seconds(workload.pid());
    let recording = record(
        &["-a", "-F", "99", "-d", "12", "--otlp-period", "3", "--otlp", &sink.url(), "--otlp-headers-file", headers.to_str().unwrap()],
        &[("PYEBPF_OTLP_HEADERS", "x-env-token=a%20b")],
    );
    let cpu = cpu_seconds(workload.pid()) - cpu_before;
    // A refused export is the collector's verdict on data, not a failure of the recording.
    recording.assert_success();
    let complaints = otlp_complaints(&recording.stderr);
    assert_eq!(complaints.len(), 1, "not one `pyebpf: otlp: ` line:\n{}", recording.stderr);
    assert!(complaints[0].contains("400") && complaints[0].contains(MESSAGE), "{}", complaints[0]);
    let summary = summary(&recording.stderr);
    let requests = sink.wait_requests(summary.refused as usize, Duration::from_secs(5));
    eprintln!("{summary:?}; {} requests at the sink; {}", requests.len(), complaints[0]);
    assert!(summary.refused >= 2 && summary.sent == 0, "{summary:?}");
    assert_eq!(requests.len() as u64, summary.refused, "a refused request was sent again: {summary:?}");
    for request in &requests {
        assert!(request.error.is_none(), "the sink could not read a request: {request:?}");
        assert_eq!(request.headers.get("x-test-token").map(String::as_str), Some("t0k3n"), "{:?}", request.headers);
        assert_eq!(request.headers.get("x-tenant").map(String::as_str), Some("acceptance"), "{:?}", request.headers);
        assert_eq!(request.headers.get("x-env-token").map(String::as_str), Some("a b"), "PYEBPF_OTLP_HEADERS: {:?}", request.headers);
        assert!(request.resources.iter().any(|r| r.pid() == Some(workload.pid())), "a request without the Python");
    }
    let (in_file, with) = pprof_counts(&pprof_traces(&recording.pprof), workload.pid());
    let expected = cpu * 99.0;
    eprintln!("{in_file} samples of the Python in the file; its {cpu:.2} s of CPU at 99 Hz are {expected:.0}");
    assert!(
        (in_file as f64 - expected).abs() <= expected * 0.2,
        "{in_file} samples of the Python in the file, where its {cpu:.1} s of CPU at 99 Hz are {expected:.0}"
    );
    assert!(with.iter().sum::<u64>() * 10 >= in_file * 9, "Python frames missing: {with:?} of {in_file}");
}

/// An endpoint that accepts connections and never answers: SIGTERM ends the recording within the
/// flush timeout (3 s) and 5 s more, and the file is whole.
#[test]
fn a_collector_that_never_answers_delays_the_end_by_the_flush_timeout_at_most() {
    let silent = Silent::start();
    let workload = Workload::start(&debian_python("3.13"), &[]);
    let dir = tempfile::tempdir().unwrap();
    let pprof = dir.path().join("profile.pb.gz");
    let url = format!("http://127.0.0.1:{}", silent.port);
    let child = pyebpf_command()
        .args(["record", "-a", "-F", "99", "--otlp", &url, "--otlp-period", "2", "--otlp-flush-timeout", "3", "-o"])
        .arg(&pprof)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let at_start = signal_masks(child.id());
    std::thread::sleep(Duration::from_secs(6));
    let sent = Sent { name: "SIGTERM", signal: libc::SIGTERM, after_ms: 6000, at_start };
    let signalled = Instant::now();
    // SAFETY: kill takes a pid and a signal; the child is not reaped yet.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let output = wait_after_signal(child, &sent, Duration::from_secs(3 + 5));
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    eprintln!("ended {:.1} s after SIGTERM; {} connections accepted", signalled.elapsed().as_secs_f64(), silent.accepted());
    assert!(output.status.success(), "pyebpf record failed ({}):\n{stderr}", output.status);
    assert!(silent.accepted() >= 1, "pyebpf never connected to {url}:\n{stderr}");
    let summary = summary(&stderr);
    assert!(summary.sent == 0 && summary.dropped >= 1, "{summary:?}\n{stderr}");
    let (in_file, _) = pprof_counts(&pprof_traces(&pprof), workload.pid());
    assert!(in_file >= 100, "{in_file} samples of the Python in the file:\n{stderr}");
}

/// Over TLS, with the collector's CA: HTTPS and gRPC deliver. With another CA: one line says the
/// certificate is not trusted, and nothing is delivered.
#[test]
fn tls_delivers_with_the_collectors_ca_and_names_a_wrong_one() {
    let tls = Tls::new();
    let sink = Sink::start();
    let collector = Collector::start(&sink, Some(&tls));
    let workload = Workload::start(&debian_python("3.13"), &[]);
    let pid = workload.pid().to_string();
    let ca = tls.ca.to_str().unwrap();
    for url in [collector.http_url(), collector.grpc_url()] {
        let before = sink.requests().len();
        // The service named on the command line, for every process.
        let recording = record(&["-p", &pid, "-d", "4", "--otlp-period", "2", "--otlp", &url, "--otlp-ca", ca, "--service-name", "=tls-test"], &[]);
        recording.assert_success();
        let summary = summary(&recording.stderr);
        let requests = sink.wait_requests(before + summary.sent as usize, Duration::from_secs(10));
        eprintln!("{url}: {summary:?}");
        assert!(summary.sent >= 2 && (summary.dropped, summary.refused) == (0, 0), "{url}: {summary:?}\n{}", recording.stderr);
        assert_eq!(requests.len() - before, summary.sent as usize, "{url}");
        let (at_sink, _) = sink_counts(&requests[before..], workload.pid());
        assert!(at_sink >= 100, "{url}: {at_sink} samples of the Python reached the collector");
        let services: HashSet<Option<&str>> = requests[before..].iter().flat_map(|r| &r.resources).map(|r| r.string("service.name")).collect();
        assert_eq!(services, HashSet::from([Some("tls-test")]), "{url}: service.name with --service-name =tls-test");
    }
    let delivered = sink.requests().len();
    for url in [collector.http_url(), collector.grpc_url()] {
        let wrong_ca = tls.wrong_ca.to_str().unwrap();
        let recording = record(&["-p", &pid, "-d", "3", "--otlp-period", "1", "--otlp", &url, "--otlp-ca", wrong_ca, "--otlp-flush-timeout", "2"], &[]);
        recording.assert_success();
        // One line names the certificate, however many periods it stopped; the periods it cost
        // may have a line of their own.
        let complaints = otlp_complaints(&recording.stderr);
        let tls_lines: Vec<&&str> = complaints.iter().filter(|line| ["certificate", "tls"].iter().any(|word| line.to_lowercase().contains(word))).collect();
        assert_eq!(tls_lines.len(), 1, "{url}: not one `pyebpf: otlp: ` line about the certificate:\n{}", recording.stderr);
        let summary = summary(&recording.stderr);
        eprintln!("{url} with another CA: {summary:?}; {complaints:?}");
        assert_eq!(summary.sent, 0, "{url}: {summary:?}");
    }
    let requests = sink.requests();
    assert_eq!(requests.len(), delivered, "requests reached the collector through a certificate of another CA");
    assert!(requests.iter().all(|r| r.status == 200 && r.error.is_none()), "{requests:?}");
}

/// A collector that takes only clients with a certificate of its CA: pyebpf's `--otlp-cert` and
/// `--otlp-key` get the periods in; without them, one line names the refused handshake and
/// nothing is delivered.
#[test]
fn mutual_tls_delivers_with_the_client_certificate_only() {
    let tls = Tls::new();
    let sink = Sink::start();
    let collector = Collector::start_mutual(&sink, &tls);
    let workload = Workload::start(&debian_python("3.13"), &[]);
    let pid = workload.pid().to_string();
    let url = collector.http_url();
    let (ca, cert, key) = (tls.ca.to_str().unwrap(), tls.client_cert.to_str().unwrap(), tls.client_key.to_str().unwrap());
    let without = record(&["-p", &pid, "-d", "2", "--otlp-period", "1", "--otlp", &url, "--otlp-ca", ca, "--otlp-flush-timeout", "2"], &[]);
    without.assert_success();
    let complaints = otlp_complaints(&without.stderr);
    let tls_lines: Vec<&&str> = complaints.iter().filter(|line| ["certificate", "tls"].iter().any(|word| line.to_lowercase().contains(word))).collect();
    assert_eq!(tls_lines.len(), 1, "without a client certificate: not one `pyebpf: otlp: ` line about it:\n{}", without.stderr);
    assert_eq!(summary(&without.stderr).sent, 0, "{}", without.stderr);
    assert!(sink.requests().is_empty(), "a request reached the collector without a client certificate");
    let with = record(&["-p", &pid, "-d", "3", "--otlp-period", "1", "--otlp", &url, "--otlp-ca", ca, "--otlp-cert", cert, "--otlp-key", key], &[]);
    with.assert_success();
    let summary = summary(&with.stderr);
    eprintln!("without: {complaints:?}; with: {summary:?}");
    assert!(summary.sent >= 2 && (summary.dropped, summary.refused) == (0, 0), "{summary:?}\n{}", with.stderr);
    let requests = sink.wait_requests(summary.sent as usize, Duration::from_secs(10));
    let (at_sink, _) = sink_counts(&requests, workload.pid());
    assert!(requests.len() as u64 == summary.sent && at_sink >= 50, "{} requests, {at_sink} samples of the Python reached the collector", requests.len());
}

/// A Python in a container's cgroup has its id as `container.id`, and with `--service-name
/// cgroup` the cgroup's name as its service; a Python of the host has no `container.id`.
#[test]
fn a_python_in_a_containers_cgroup_carries_its_id() {
    let cgroup = ContainerCgroup::new();
    let sink = Sink::start();
    let collector = Collector::start(&sink, None);
    let contained = Workload::start(&debian_python("3.13"), &[]);
    cgroup.add(contained.pid());
    let host = Workload::start(&debian_python("3.15"), &[]);
    let recording = record(&["-a", "-d", "3", "--otlp-period", "1", "--otlp", &collector.http_url(), "--service-name", "cgroup"], &[]);
    recording.assert_success();
    let summary = summary(&recording.stderr);
    let requests = sink.wait_requests(summary.sent as usize, Duration::from_secs(10));
    let contained_resources = resources_of(&requests, contained.pid());
    let host_resources = resources_of(&requests, host.pid());
    assert!(!contained_resources.is_empty() && !host_resources.is_empty(), "{summary:?}: a Python is missing at the collector");
    let scope = format!("pyebpf-test-{}.scope", cgroup.id);
    for resource in contained_resources {
        assert_eq!(resource.string("container.id"), Some(cgroup.id.as_str()), "{:?}", resource.attributes);
        assert_eq!(resource.string("service.name"), Some(scope.as_str()), "{:?}", resource.attributes);
    }
    for resource in host_resources {
        assert_eq!(resource.string("container.id"), None, "a process of the host: {:?}", resource.attributes);
        assert!(!resource.string("service.name").unwrap_or_default().is_empty(), "{:?}", resource.attributes);
    }
    drop(contained);
}

/// Without `-d`, `-o` or `--otlp-period` (60 s), SIGTERM after 3 s ends the recording and sends
/// its partial period: one request spanning those seconds, with the Python in it.
#[test]
fn sigterm_sends_the_partial_period() {
    let sink = Sink::start();
    let collector = Collector::start(&sink, None);
    let workload = Workload::start(&debian_python("3.15"), &[]);
    let child = pyebpf_command().args(["record", "-a", "--otlp", &collector.grpc_url()]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let at_start = signal_masks(child.id());
    std::thread::sleep(Duration::from_secs(3));
    let sent = Sent { name: "SIGTERM", signal: libc::SIGTERM, after_ms: 3000, at_start };
    // SAFETY: kill takes a pid and a signal; the child is not reaped yet.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let output = wait_after_signal(child, &sent, Duration::from_secs(15));
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "pyebpf record failed ({}):\n{stderr}", output.status);
    let summary = summary(&stderr);
    let requests = sink.wait_requests(1, Duration::from_secs(10));
    assert!(summary.sent == 1 && requests.len() == 1, "{summary:?}, {} requests at the sink:\n{stderr}", requests.len());
    let durations: HashSet<u64> = requests[0].resources.iter().flat_map(|r| &r.profiles).map(|p| p.duration_nano).collect();
    let seconds: Vec<f64> = durations.iter().map(|&ns| ns as f64 / 1e9).collect();
    assert!(seconds.len() == 1 && (1.5..=3.5).contains(&seconds[0]), "the partial period lasts {seconds:?} s of a 3 s run");
    let (at_sink, _) = sink_counts(&requests, workload.pid());
    assert!(at_sink >= 50, "{at_sink} samples of the Python in the partial period");
}
