use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use prost::Message;

use super::headers::{parse_file, parse_variable};
use super::model::{container_id, request, Context};
use super::proto::collector::ExportProfilesServiceRequest;
use super::proto::common::{any_value, KeyValue};
use super::proto::profiles as otlp;
use super::queue::{Backoff, Encoded, Shared};
use super::tls::TlsMaterial;
use super::transport::{compressed_frame, http_outcome, Outcome, Transport};
use super::*;
use crate::mode::Mode;
use crate::output::test_profile::{key, python, sample_profile};
use crate::stack::{ProcessDetails, ProcessLabels, Profile, SampleStack, ThreadState, Timeline, Weight, MAX_EVENTS};

const CGROUP: &str = "/system.slice/docker-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope";

fn context(service_name: &ServiceName) -> Context<'_> {
    Context { service_name, host_name: "testhost" }
}

fn build(pieces: &[Profile], service_name: &ServiceName) -> (ExportProfilesServiceRequest, u64) {
    let pieces: Vec<Arc<Profile>> = pieces.iter().map(|piece| Arc::new(copy(piece))).collect();
    let built = request(&pieces, &context(service_name), None);
    // What a collector reads: the request through the wire format.
    let decoded = ExportProfilesServiceRequest::decode(&built.message.encode_to_vec()[..]).unwrap();
    assert_eq!(decoded, built.message);
    (decoded, built.samples)
}

fn copy(profile: &Profile) -> Profile {
    let mut copy = profile.next_period();
    copy.absorb(profile);
    copy
}

fn string_attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes.iter().find(|kv| kv.key == key).and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
        any_value::Value::StringValue(text) => Some(text.clone()),
        any_value::Value::IntValue(number) => Some(number.to_string()),
        _ => None,
    })
}

/// The value of a dictionary attribute, as text.
fn dictionary_attribute(request: &ExportProfilesServiceRequest, index: i32) -> (String, String) {
    let dictionary = request.dictionary.as_ref().unwrap();
    let attribute = &dictionary.attribute_table[index as usize];
    let value = match attribute.value.as_ref().and_then(|value| value.value.as_ref()) {
        Some(any_value::Value::StringValue(text)) => text.clone(),
        Some(any_value::Value::IntValue(number)) => number.to_string(),
        _ => String::new(),
    };
    (dictionary.string_table[attribute.key_strindex as usize].clone(), value)
}

fn total(request: &ExportProfilesServiceRequest) -> i64 {
    request.resource_profiles.iter().flat_map(|r| &r.scope_profiles).flat_map(|s| &s.profiles).flat_map(|p| &p.samples).flat_map(|s| &s.values).sum()
}

#[test]
fn every_table_starts_with_its_zero_value_and_holds_no_duplicates() {
    let (request, samples) = build(&[sample_profile()], &ServiceName::Exe);
    assert_eq!(samples, 15);
    let d = request.dictionary.as_ref().unwrap();
    assert_eq!(d.string_table[0], "");
    assert_eq!(d.mapping_table[0], otlp::Mapping::default());
    assert_eq!(d.location_table[0], otlp::Location::default());
    assert_eq!(d.function_table[0], otlp::Function::default());
    assert_eq!(d.link_table, vec![otlp::Link::default()]);
    assert_eq!(d.attribute_table[0], otlp::KeyValueAndUnit::default());
    assert_eq!(d.stack_table[0], otlp::Stack::default());
    assert_eq!(d.string_table.iter().collect::<HashSet<_>>().len(), d.string_table.len());
    assert_eq!(d.location_table.iter().map(|l| format!("{l:?}")).collect::<HashSet<_>>().len(), d.location_table.len());
    assert_eq!(d.function_table.iter().map(|f| format!("{f:?}")).collect::<HashSet<_>>().len(), d.function_table.len());
    assert_eq!(d.stack_table.iter().map(|s| s.location_indices.clone()).collect::<HashSet<_>>().len(), d.stack_table.len());
    // app's two threads share one stack; busy;loop has its own: two, after the zero stack.
    assert_eq!(d.stack_table.len(), 3);
    // 5 locations of app, 2 of busy;loop (main/_start share an address but not a name).
    assert_eq!(d.location_table.len(), 1 + 7);
    // Two files and the kernel.
    assert_eq!(d.mapping_table.len(), 1 + 3);
}

#[test]
fn stacks_are_leaf_first_and_locations_say_what_ran_there() {
    let (request, _) = build(&[sample_profile()], &ServiceName::Exe);
    let d = request.dictionary.as_ref().unwrap();
    let app =
        request.resource_profiles.iter().find(|r| string_attribute(&r.resource.as_ref().unwrap().attributes, "process.pid").as_deref() == Some("100")).unwrap();
    let sample = &app.scope_profiles[0].profiles[0].samples[0];
    let stack = &d.stack_table[sample.stack_index as usize].location_indices;
    let describe = |index: &i32| {
        let location = &d.location_table[*index as usize];
        let (key, kind) = dictionary_attribute(&request, location.attribute_indices[0]);
        assert_eq!(key, "profile.frame.type");
        let Some(line) = location.lines.first() else { return (String::new(), kind, 0) };
        let function = &d.function_table[line.function_index as usize];
        (d.string_table[function.name_strindex as usize].clone(), kind, line.line)
    };
    let frames: Vec<_> = stack.iter().map(describe).collect();
    assert_eq!(
        frames,
        [
            ("do_syscall_64".to_string(), "kernel".to_string(), 0),
            // Not symbolized: an address in its mapping, no line.
            (String::new(), "native".to_string(), 0),
            ("Worker.compute".to_string(), "cpython".to_string(), 14),
            ("main".to_string(), "cpython".to_string(), 33),
            ("_start".to_string(), "native".to_string(), 42),
        ]
    );
    // A Python function: its file and first line; no mapping.
    let python = &d.location_table[stack[2] as usize];
    assert_eq!(python.mapping_index, 0);
    let function = &d.function_table[python.lines[0].function_index as usize];
    assert_eq!((d.string_table[function.filename_strindex as usize].as_str(), function.start_line), ("/srv/work.py", 10));
    assert_eq!(function.system_name_strindex, function.name_strindex);
    // A native frame: its file's mapping and build id, the address in the process.
    let native = &d.location_table[stack[1] as usize];
    assert_eq!(native.address, 0x7f00_0000_0234);
    let mapping = &d.mapping_table[native.mapping_index as usize];
    assert_eq!((mapping.memory_start, mapping.file_offset), (0x7f00_0000_0000, 0x1000));
    assert_eq!(d.string_table[mapping.filename_strindex as usize], "/usr/lib/libfoo.so");
    assert_eq!(
        dictionary_attribute(&request, mapping.attribute_indices[0]),
        ("process.executable.build_id.gnu".to_string(), "build-id-of-libfoo.so".to_string())
    );
}

#[test]
fn samples_carry_their_thread_and_the_values_add_up_to_the_profile() {
    let (request, _) = build(&[sample_profile()], &ServiceName::Exe);
    assert_eq!(total(&request), 15);
    let d = request.dictionary.as_ref().unwrap();
    let profile = &request.resource_profiles.iter().find(|r| r.scope_profiles[0].profiles[0].samples.len() == 2).unwrap().scope_profiles[0].profiles[0];
    assert_eq!(d.string_table[profile.sample_type.unwrap().type_strindex as usize], "samples");
    assert_eq!(d.string_table[profile.period_type.unwrap().unit_strindex as usize], "nanoseconds");
    assert_eq!((profile.period, profile.duration_nano, profile.time_unix_nano), (10_000_000, 2_000_000_000, 1_700_000_000_000_000_000));
    assert_eq!(profile.profile_id.len(), 16);
    let threads: Vec<Vec<(String, String)>> =
        profile.samples.iter().map(|s| s.attribute_indices.iter().map(|&i| dictionary_attribute(&request, i)).collect()).collect();
    assert_eq!(threads[0], [("thread.id".to_string(), "100".to_string()), ("thread.name".to_string(), "app".to_string())]);
    assert_eq!(profile.samples.iter().map(|s| s.values[0]).collect::<Vec<_>>(), [7, 3]);
    assert_eq!(profile.samples[0].stack_index, profile.samples[1].stack_index);
    // Each process its own profile id.
    let ids: HashSet<_> = request.resource_profiles.iter().map(|r| r.scope_profiles[0].profiles[0].profile_id.clone()).collect();
    assert_eq!(ids.len(), 2);
}

#[test]
fn pieces_of_a_period_add_up_and_wall_time_is_in_nanoseconds_with_states() {
    let mut wall = Profile::new(100);
    wall.mode = Mode::Wall;
    let mut waiting = key(7, 8, "py", vec![python("wait", "/w.py", 1, 2)]);
    waiting.state = ThreadState::Lock;
    wall.add_weighted(waiting.clone(), Weight { samples: 1, ns: 250_000_000 });
    wall.add(key(7, 8, "py", vec![python("run", "/w.py", 5, 6)]), 3);
    let mut second = wall.next_period();
    second.add_weighted(waiting, Weight { samples: 2, ns: 500_000_000 });
    let (request, samples) = build(&[wall, second], &ServiceName::Exe);
    assert_eq!(samples, 6);
    assert_eq!(total(&request), 750_000_000 + 30_000_000);
    let profile = &request.resource_profiles[0].scope_profiles[0].profiles[0];
    assert_eq!(request.dictionary.as_ref().unwrap().string_table[profile.sample_type.unwrap().type_strindex as usize], "wall");
    // The same stack of the same thread in both pieces is one sample.
    assert_eq!(profile.samples.len(), 2);
    let states: HashSet<String> = profile
        .samples
        .iter()
        .flat_map(|s| s.attribute_indices.iter().map(|&i| dictionary_attribute(&request, i)))
        .filter(|(k, _)| k == "thread.state")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(states, HashSet::from(["lock".to_string(), "on-cpu".to_string()]));
}

fn described_profile() -> Profile {
    let mut profile = Profile::new(100);
    let details = ProcessDetails { exe: Some("/usr/bin/python3.12".into()), env_value: Some("checkout".into()), python_version: Some("3.12.1".into()) };
    let labels = ProcessLabels { ns_pid: None, cgroup: Some(CGROUP.into()), details: Some(Arc::new(details)) };
    let mut stack = key(42, 42, "python3", vec![python("main", "/app.py", 1, 2)]);
    stack.labels = Some(Arc::new(labels));
    stack.truncated = true;
    profile.add(stack, 1);
    profile
}

#[test]
fn resources_name_the_process_its_runtime_container_and_service() {
    let resource = |service: ServiceName| {
        let (request, _) = build(&[described_profile()], &service);
        request.resource_profiles[0].resource.clone().unwrap().attributes
    };
    let attributes = resource(ServiceName::Exe);
    for (key, value) in [
        ("process.pid", "42"),
        ("process.executable.name", "python3.12"),
        ("process.executable.path", "/usr/bin/python3.12"),
        ("process.runtime.name", "cpython"),
        ("process.runtime.version", "3.12.1"),
        ("host.name", "testhost"),
        ("container.id", "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"),
        ("service.name", "python3.12"),
    ] {
        assert_eq!(string_attribute(&attributes, key).as_deref(), Some(value), "{key}");
    }
    assert_eq!(string_attribute(&resource(ServiceName::Env("SERVICE".into())), "service.name").as_deref(), Some("checkout"));
    assert_eq!(string_attribute(&resource(ServiceName::Cgroup), "service.name").as_deref(), Some(CGROUP.rsplit('/').next().unwrap()));
    assert_eq!(string_attribute(&resource(ServiceName::Literal("api".into())), "service.name").as_deref(), Some("api"));
    // Without details: the comm names the executable, and no runtime is claimed.
    let (request, _) = build(&[sample_profile()], &ServiceName::Env("SERVICE".into()));
    let attributes = &request.resource_profiles[0].resource.as_ref().unwrap().attributes;
    assert_eq!(string_attribute(attributes, "service.name").as_deref(), Some("app"));
    assert_eq!(string_attribute(attributes, "process.runtime.name"), None);
    let scope = request.resource_profiles[0].scope_profiles[0].scope.as_ref().unwrap();
    assert_eq!(scope.name, "pyebpf");
}

#[test]
fn a_cut_python_chain_is_marked_as_in_pprof() {
    let (request, _) = build(&[described_profile()], &ServiceName::Exe);
    let sample = &request.resource_profiles[0].scope_profiles[0].profiles[0].samples[0];
    let attributes: Vec<_> = sample.attribute_indices.iter().map(|&i| dictionary_attribute(&request, i)).collect();
    assert!(attributes.contains(&("python_chain".to_string(), "truncated".to_string())), "{attributes:?}");
}

#[test]
fn a_period_too_large_for_one_request_is_split_by_process() {
    let mut profile = sample_profile();
    for pid in 1000..1040 {
        profile.add(key(pid, pid, "worker", vec![python("work", &format!("/srv/w{pid}.py"), 1, 2)]), 2);
    }
    let pieces = [Arc::new(profile)];
    let service = ServiceName::Exe;
    let whole = super::exporter::encode(&pieces, &context(&service), usize::MAX);
    assert_eq!(whole.len(), 1);
    let parts = super::exporter::encode(&pieces, &context(&service), whole[0].body.len() / 3);
    assert!((3..=4).contains(&parts.len()), "{} parts", parts.len());
    assert_eq!(parts.iter().map(|part| part.samples).sum::<u64>(), whole[0].samples);
    assert_eq!(parts.iter().map(|part| part.ends_period).collect::<Vec<_>>(), [vec![false; parts.len() - 1], vec![true]].concat());
    let mut pids = Vec::new();
    for part in &parts {
        let request = ExportProfilesServiceRequest::decode(&part.body[..]).unwrap();
        assert_eq!(request.dictionary.as_ref().unwrap().string_table[0], "");
        pids.extend(super::model::pids(&request));
    }
    let mut unique = pids.clone();
    unique.dedup();
    assert_eq!((pids.len(), unique.len()), (42, 42), "each process in one part");
}

#[test]
fn container_ids_come_from_the_runtimes_cgroup_names() {
    let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    for path in [
        format!("/docker/{id}"),
        format!("/system.slice/docker-{id}.scope"),
        format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-{id}.scope"),
        format!("/kubepods/besteffort/pod1234/{id}"),
        format!("/machine.slice/libpod-{id}.scope/container"),
        format!("/system.slice/crio-{id}.scope"),
    ] {
        assert_eq!(container_id(&path), Some(id), "{path}");
    }
    for path in ["/user.slice/user-0.slice/session-1.scope", "/", "", &format!("/docker/{}", &id[1..])] {
        assert_eq!(container_id(path), None, "{path}");
    }
}

#[test]
fn endpoints_parse_with_their_defaults() {
    let http = Endpoint::parse("http://127.0.0.1:4318").unwrap();
    assert_eq!((http.protocol, http.tls, http.to_string()), (Protocol::Http, false, "http://127.0.0.1:4318/v1development/profiles".to_string()));
    let path = Endpoint::parse("https://collector.example/otlp/v1development/profiles").unwrap();
    assert_eq!(path.to_string(), "https://collector.example:443/otlp/v1development/profiles");
    let grpc = Endpoint::parse("grpcs://[::1]:4317").unwrap();
    assert_eq!((grpc.protocol, grpc.tls, grpc.authority.as_str(), grpc.uri()), (Protocol::Grpc, true, "[::1]:4317", "https://[::1]:4317".to_string()));
    assert_eq!(Endpoint::parse("grpc://otel").unwrap().to_string(), "grpc://otel:4317");
    for bad in ["127.0.0.1:4317", "ftp://x:1", "grpc://x:1/path", "http://", "http://user@x:1", "http://x:99999", "http://x:1/p?q=1", "grpc//x"] {
        assert!(Endpoint::parse(bad).is_err(), "{bad} accepted");
    }
}

#[test]
fn the_endpoint_falls_back_to_the_variable_and_empty_is_none() {
    // The only test that reads or sets the variable.
    std::env::set_var(ENDPOINT_VARIABLE, "http://from-env:4318");
    let shown = |given: Option<&str>| endpoint(given).unwrap().map(|endpoint| endpoint.to_string());
    assert_eq!(shown(None).as_deref(), Some("http://from-env:4318/v1development/profiles"));
    assert_eq!(shown(Some(" ")).as_deref(), Some("http://from-env:4318/v1development/profiles"));
    assert_eq!(shown(Some("grpc://flag:1")).as_deref(), Some("grpc://flag:1"));
    std::env::set_var(ENDPOINT_VARIABLE, "");
    assert_eq!(shown(None), None);
    assert_eq!(shown(Some("")), None);
    std::env::remove_var(ENDPOINT_VARIABLE);
    assert!(endpoint(Some("nonsense")).is_err());
}

#[test]
fn service_name_rules() {
    assert_eq!(ServiceName::parse("exe"), Ok(ServiceName::Exe));
    assert_eq!(ServiceName::parse("cgroup"), Ok(ServiceName::Cgroup));
    assert_eq!(ServiceName::parse("env:OTEL_SERVICE_NAME"), Ok(ServiceName::Env("OTEL_SERVICE_NAME".into())));
    assert_eq!(ServiceName::parse("=api"), Ok(ServiceName::Literal("api".into())));
    for bad in ["", "env:", "env:A=B", "name", "Exe"] {
        assert!(ServiceName::parse(bad).is_err(), "{bad} accepted");
    }
}

#[test]
fn headers_from_a_file_and_a_variable() {
    let file = parse_file("# tenant\n\nX-Scope-OrgID: team-a\nauthorization: Bearer abc:def\n").unwrap();
    assert_eq!(
        file.iter().map(|(n, v)| (n.as_str(), v.to_str().unwrap())).collect::<Vec<_>>(),
        [("x-scope-orgid", "team-a"), ("authorization", "Bearer abc:def")]
    );
    assert!(parse_file("no colon here").unwrap_err().starts_with("line 1"));
    assert!(parse_file("content-type: text/plain").is_err());
    let variable = parse_variable("api-key=a%3Db,x-tenant = t1 ,").unwrap();
    assert_eq!(variable.iter().map(|(n, v)| (n.as_str(), v.to_str().unwrap())).collect::<Vec<_>>(), [("api-key", "a=b"), ("x-tenant", "t1")]);
    assert!(parse_variable("a=%zz").is_err());
    assert!(parse_variable("bad name=1").is_err());
    // A value's secret never shows in the error.
    assert!(!parse_variable("key=secret\n1").unwrap_err().contains("secret"));
}

#[test]
fn http_answers_are_delivered_refused_or_retried() {
    assert_eq!(http_outcome(http::StatusCode::OK, None, true, &[]), Outcome::Delivered { warning: None });
    let refused = http_outcome(http::StatusCode::BAD_REQUEST, None, false, b"bad profile\n");
    assert_eq!(refused, Outcome::Refused("HTTP 400 Bad Request: bad profile".into()));
    let busy = http_outcome(http::StatusCode::TOO_MANY_REQUESTS, Some(Duration::from_secs(3)), false, b"");
    assert!(matches!(busy, Outcome::Retry { after: Some(after), .. } if after == Duration::from_secs(3)));
    for status in [502, 503, 504] {
        assert!(matches!(http_outcome(http::StatusCode::from_u16(status).unwrap(), None, false, b""), Outcome::Retry { .. }));
    }
    assert!(matches!(http_outcome(http::StatusCode::UNAUTHORIZED, None, false, b""), Outcome::Refused(_)));
    let partial = super::proto::collector::ExportProfilesServiceResponse {
        partial_success: Some(super::proto::collector::ExportProfilesPartialSuccess { rejected_profiles: 2, error_message: "too old".into() }),
    };
    assert_eq!(http_outcome(http::StatusCode::OK, None, true, &partial.encode_to_vec()), Outcome::Refused("2 profiles rejected: too old".into()));
    // A hostile answer is cut short.
    let long = vec![b'x'; 10_000];
    assert!(matches!(http_outcome(http::StatusCode::BAD_REQUEST, None, false, &long), Outcome::Refused(text) if text.len() < 400));
}

#[test]
fn grpc_codes_are_refused_or_retried() {
    use super::transport::grpc_outcome;
    assert!(matches!(grpc_outcome(&tonic::Status::invalid_argument("bad")), Outcome::Refused(text) if text == "gRPC InvalidArgument: bad"));
    assert!(matches!(grpc_outcome(&tonic::Status::unavailable("later")), Outcome::Retry { .. }));
    // RESOURCE_EXHAUSTED is retried only when the server says when (RetryInfo in the details).
    assert!(matches!(grpc_outcome(&tonic::Status::resource_exhausted("full")), Outcome::Refused(_)));
    let retry_info = [0x0a, 0x02, 0x08, 0x02]; // RetryInfo { retry_delay: { seconds: 2 } }
    let mut any = vec![0x0a, 40];
    any.extend_from_slice(b"type.googleapis.com/google.rpc.RetryInfo");
    any.extend_from_slice(&[0x12, retry_info.len() as u8]);
    any.extend_from_slice(&retry_info);
    let mut details = vec![0x08, 8, 0x1a, any.len() as u8];
    details.extend_from_slice(&any);
    let busy = tonic::Status::with_details(tonic::Code::ResourceExhausted, "slow down", details.into());
    assert_eq!(grpc_outcome(&busy), Outcome::Retry { cause: "gRPC ResourceExhausted: slow down".into(), after: Some(Duration::from_secs(2)) });
}

#[test]
fn the_queue_drops_the_oldest_period_past_its_bound() {
    let shared = Shared::new(100, "http://x".into());
    for size in [40, 40, 40] {
        shared.push(Encoded { body: vec![0; size].into(), samples: 1, ends_period: true });
    }
    assert_eq!(shared.totals().dropped, 1);
    // Larger than the whole bound: dropped itself.
    shared.push(Encoded { body: vec![0; 101].into(), samples: 1, ends_period: true });
    assert_eq!(shared.totals().dropped, 2);
}

#[test]
fn backoff_grows_with_jitter_up_to_its_cap() {
    let mut backoff = Backoff::default();
    let delays: Vec<Duration> = (0..12).map(|_| backoff.next()).collect();
    assert!(delays[0] >= Duration::from_millis(250) && delays[0] <= Duration::from_millis(500), "{delays:?}");
    assert!(delays.iter().all(|&delay| delay <= Duration::from_secs(5)), "{delays:?}");
    assert!(delays[11] >= Duration::from_millis(2500), "{delays:?}");
}

/// A one-thread HTTP server answering each request with the next of `answers` (status, body),
/// returning the requests' headers and bodies once done.
/// The requests a fake collector received: head and body of each.
type Received = Vec<(String, Vec<u8>)>;

fn fake_collector(answers: Vec<(u16, &'static str)>) -> (String, std::thread::JoinHandle<Received>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    let thread = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for (status, body) in answers {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let (mut head, mut length) = (String::new(), 0);
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = value.trim().parse().unwrap();
                }
                head.push_str(&line);
                if line == "\r\n" {
                    break;
                }
            }
            let mut payload = vec![0; length];
            reader.read_exact(&mut payload).unwrap();
            seen.push((head, payload));
            let mut stream = stream;
            write!(stream, "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len()).unwrap();
        }
        seen
    });
    (format!("http://{address}"), thread)
}

fn options(endpoint: &str) -> OtlpOptions {
    OtlpOptions {
        endpoint: Endpoint::parse(endpoint).unwrap(),
        period: Duration::from_secs(60),
        tls: TlsFiles::default(),
        headers: Headers(parse_variable("x-tenant=t1").unwrap()),
        queue_bytes: 1 << 20,
        flush_timeout: Duration::from_secs(10),
        service_name: ServiceName::Exe,
        host_name: "testhost".into(),
    }
}

#[test]
fn a_busy_collector_gets_the_period_on_a_later_try_and_a_refusal_is_counted() {
    let (endpoint, server) = fake_collector(vec![(503, "busy"), (503, "busy"), (200, ""), (400, "no thanks")]);
    let exporter = Exporter::start(options(&endpoint)).unwrap();
    for _ in 0..2 {
        exporter.add(Arc::new(sample_profile()));
        exporter.end_period();
    }
    let totals = exporter.join();
    assert_eq!((totals.periods_sent, totals.samples_sent, totals.retries, totals.refused, totals.dropped), (1, 15, 2, 1, 0), "{totals:?}");
    let requests = server.join().unwrap();
    let (head, body) = &requests[2];
    assert!(head.starts_with("POST /v1development/profiles HTTP/1.1\r\n"), "{head}");
    for header in ["content-type: application/x-protobuf", "content-encoding: gzip", "x-tenant: t1"] {
        assert!(head.to_ascii_lowercase().contains(header), "{head}");
    }
    let mut decoded = Vec::new();
    flate2::read::GzDecoder::new(&body[..]).read_to_end(&mut decoded).unwrap();
    let request = ExportProfilesServiceRequest::decode(&decoded[..]).unwrap();
    assert_eq!(total(&request), 15);
}

#[test]
fn an_unreachable_collector_is_retried_until_the_flush_timeout_and_the_rest_dropped() {
    // A port nothing listens on: bound, then closed.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut options = options(&format!("grpc://127.0.0.1:{port}"));
    options.flush_timeout = Duration::from_secs(1);
    let exporter = Exporter::start(options).unwrap();
    exporter.add(Arc::new(sample_profile()));
    exporter.end_period();
    let started = std::time::Instant::now();
    let totals = exporter.join();
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    assert_eq!((totals.periods_sent, totals.dropped), (0, 1), "{totals:?}");
    assert!(totals.retries >= 1, "{totals:?}");
}

#[test]
fn a_connection_failure_names_its_cause() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let endpoint = Endpoint::parse(&format!("http://127.0.0.1:{port}")).unwrap();
    let outcome = runtime.block_on(async {
        let mut transport = Transport::new(&endpoint, &TlsMaterial::default(), &Headers::default()).unwrap();
        transport.send(bytes::Bytes::from_static(b""), Duration::from_secs(5)).await
    });
    assert!(matches!(&outcome, Outcome::Retry { cause, .. } if cause.contains("refused")), "{outcome:?}");
}

/// 1.7e18 ns since the epoch, when CLOCK_MONOTONIC read 5 s.
const START_UNIX_NS: i64 = 1_700_000_000_000_000_000;
const START_MONOTONIC_NS: u64 = 5_000_000_000;

/// A period of 2 s from [`START_UNIX_NS`] whose events are kept (at most `limit`).
fn timed_profile(mode: Mode, limit: usize) -> Profile {
    let mut profile = Profile::new(100);
    profile.mode = mode;
    (profile.start_unix_ns, profile.duration_ns) = (START_UNIX_NS, 2_000_000_000);
    profile.timeline = Some(Box::new(Timeline::with_offset(START_UNIX_NS - START_MONOTONIC_NS as i64, limit)));
    profile
}

/// Counts one event of thread `tid` (named `thread_name` by the kernel) of process 7 `app`, in
/// `function`, `after_ns` after the period's start (before it, if negative).
fn add_event(profile: &mut Profile, tid: u32, thread_name: &str, function: &str, after_ns: i64, ns: u64) {
    let frames = [profile.frames.intern(python(function, "/w.py", 1, 2))];
    let comm: Arc<str> = "app".into();
    let sample = SampleStack { pid: 7, tid, comm: &comm, frames: &frames, truncated: false, labels: None, state: ThreadState::OnCpu };
    let mut kernel_comm = [0u8; 16];
    kernel_comm[..thread_name.len()].copy_from_slice(thread_name.as_bytes());
    profile.name_thread(7, tid, &kernel_comm);
    profile.add_event(sample, Weight { samples: 1, ns }, START_MONOTONIC_NS.saturating_add_signed(after_ns));
}

fn samples_of(request: &ExportProfilesServiceRequest) -> Vec<&otlp::Sample> {
    request.resource_profiles.iter().flat_map(|r| &r.scope_profiles).flat_map(|s| &s.profiles).flat_map(|p| &p.samples).collect()
}

fn encode(pieces: Vec<Profile>) -> ExportProfilesServiceRequest {
    let pieces: Vec<Arc<Profile>> = pieces.into_iter().map(Arc::new).collect();
    let built = request(&pieces, &context(&ServiceName::Exe), None);
    ExportProfilesServiceRequest::decode(&built.message.encode_to_vec()[..]).unwrap()
}

#[test]
fn each_event_has_its_value_and_timestamp_in_time_order_within_the_period() {
    for (mode, ns) in [(Mode::Cpu, 10_000_000), (Mode::Wall, 3_000)] {
        let mut first = timed_profile(mode, MAX_EVENTS);
        // One read just after the cut, counted in this period though sampled before it.
        for (function, after_ns) in [("run", 1_500_000_000), ("run", 100_000_000), ("idle", 200_000_000), ("run", -1_000)] {
            add_event(&mut first, 10, "app", function, after_ns, ns);
        }
        let mut second = first.next_period();
        (second.start_unix_ns, second.duration_ns) = (START_UNIX_NS + 2_000_000_000, 1_000_000_000);
        add_event(&mut second, 10, "app", "run", 2_500_000_000, ns);
        let request = encode(vec![first, second]);
        let samples = samples_of(&request);
        assert_eq!(samples.len(), 2);
        let period = START_UNIX_NS as u64..=START_UNIX_NS as u64 + 3_000_000_000;
        for sample in &samples {
            assert_eq!(sample.values.len(), sample.timestamps_unix_nano.len());
            assert!(sample.timestamps_unix_nano.is_sorted());
            assert!(sample.timestamps_unix_nano.iter().all(|t| period.contains(t)), "{:?}", sample.timestamps_unix_nano);
        }
        let run = samples.iter().find(|s| s.values.len() == 4).expect("run's four events, from both pieces");
        let each = if mode == Mode::Cpu { 1 } else { ns as i64 };
        assert_eq!(run.values, [each; 4]);
        assert_eq!(run.timestamps_unix_nano[0], START_UNIX_NS as u64, "before the start: at the start");
        assert_eq!(run.timestamps_unix_nano[3], START_UNIX_NS as u64 + 2_500_000_000);
        // What the aggregated value was.
        assert_eq!(total(&request), 5 * each);
    }
}

#[test]
fn thread_name_is_the_threads_own_and_the_latest() {
    let mut profile = timed_profile(Mode::Cpu, MAX_EVENTS);
    add_event(&mut profile, 10, "app", "run", 1, 10_000_000);
    add_event(&mut profile, 11, "worker", "run", 2, 10_000_000);
    add_event(&mut profile, 11, "worker-x", "run", 3, 10_000_000);
    let request = encode(vec![profile]);
    let names: HashSet<(String, String)> = samples_of(&request)
        .iter()
        .map(|sample| {
            let attributes: Vec<_> = sample.attribute_indices.iter().map(|&i| dictionary_attribute(&request, i)).collect();
            (attributes[0].1.clone(), attributes[1].1.clone())
        })
        .collect();
    assert_eq!(names, HashSet::from([("10".to_string(), "app".to_string()), ("11".to_string(), "worker-x".to_string())]));
    // The process keeps its own name.
    let resource = request.resource_profiles[0].resource.as_ref().unwrap();
    assert_eq!(string_attribute(&resource.attributes, "process.executable.name").as_deref(), Some("app"));
}

#[test]
fn past_the_bound_the_whole_period_goes_without_timestamps_and_the_next_has_them_again() {
    let mut first = timed_profile(Mode::Cpu, 3);
    add_event(&mut first, 10, "app", "run", 1, 10_000_000);
    add_event(&mut first, 10, "app", "run", 2, 10_000_000);
    // The bound spans the pieces of a period: the second piece goes past it.
    let mut second = first.next_period();
    add_event(&mut second, 10, "app", "idle", 3, 10_000_000);
    add_event(&mut second, 11, "app", "run", 4, 10_000_000);
    let mut next_period = second.next_period();
    assert!(second.timeline.as_ref().unwrap().overflowed());
    let request = encode(vec![first, second]);
    assert!(samples_of(&request).iter().all(|sample| sample.timestamps_unix_nano.is_empty() && sample.values.len() == 1));
    assert_eq!(total(&request), 4);

    next_period.timeline.as_mut().unwrap().restart_bound();
    add_event(&mut next_period, 10, "app", "run", 5, 10_000_000);
    let request = encode(vec![next_period]);
    assert_eq!(samples_of(&request)[0].timestamps_unix_nano.len(), 1);
}

#[test]
fn untimed_periods_are_said_after_the_totals() {
    let totals = OtlpTotals { endpoint: "http://c:4318".into(), untimed: 2, ..OtlpTotals::default() };
    assert!(totals.to_string().ends_with(", 0 refused, 2 periods without timestamps (over 2000000 events)"), "{totals}");
}

#[test]
fn a_grpc_message_is_framed_again_gzip_compressed_and_anything_else_is_left_alone() {
    let message: Vec<u8> = (0..5000u32).flat_map(|i| (i % 97).to_le_bytes()).collect();
    let mut framed = vec![0];
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(&message);
    let frame = compressed_frame(&framed).expect("one uncompressed message");
    assert_eq!(frame[0], 1, "the compressed flag");
    let length = u32::from_be_bytes(frame[1..5].try_into().unwrap()) as usize;
    assert_eq!(length, frame.len() - 5);
    assert!(length < message.len() / 4, "{length} bytes compressed of {}", message.len());
    let mut unpacked = Vec::new();
    flate2::read::GzDecoder::new(&frame[5..]).read_to_end(&mut unpacked).unwrap();
    assert_eq!(unpacked, message);

    let mut compressed_already = framed.clone();
    compressed_already[0] = 1;
    assert_eq!(compressed_frame(&compressed_already), None);
    assert_eq!(compressed_frame(&framed[..framed.len() - 1]), None, "a length that is not the message's");
    assert_eq!(compressed_frame(&framed[..3]), None);
}
