//! `pyebpf record --otlp` (issue 32) against a real OpenTelemetry Collector.

use std::process::Command;

use pyebpf_tests::otlp::{otelcol_prefix, Collector, Sink, Tls};
use pyebpf_tests::script;

/// Sends the known profile of `scripts/otlp_send.py` to `url`; asserts it was answered 200.
fn send_known_profile(url: &str, pid: u32, ca: Option<&std::path::Path>) {
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
        let requests = sink.wait_requests(2, std::time::Duration::from_secs(10));
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
            let frames: Vec<(&str, &str, &str, i64)> = sample.stack.iter().map(|f| (f.kind(), f.name(), f.file.as_deref().unwrap_or(""), f.line)).collect();
            assert_eq!(frames, [("kernel", "leaf_k", "", 0), ("native", "native_fn", "", 0), ("cpython", "py_fn", "send.py", 12)]);
        }
    }
}
