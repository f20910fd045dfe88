//! gzip-compressed pprof (`profile.proto`), as read by `go tool pprof`, Pyroscope and speedscope.
//!
//! Each sample carries its process and thread as labels (`pid`, `tid`, `comm`), so the `COMM (PID)`
//! root frame of the collapsed format is not needed. Python frames become locations without a
//! mapping, one per (code object, line); kernel frames live in a `[kernel.kallsyms]` mapping and are
//! named `SYMBOL_[k]` so they stand out in `-top` and `-traces`. Outside `--mode cpu`, each sample
//! is also labelled with its `thread_state` (on-cpu, or why it waited), and carries the time it
//! stands for as `cpu`, `off_cpu` and (wall mode) `wall` nanoseconds.

use std::collections::HashMap;
use std::io::{self, Write};
use std::sync::Arc;

use flate2::write::GzEncoder;
use flate2::Compression;
use prost::Message;

use crate::mode::Mode;
use crate::stack::{Frame, FrameId, KernelFrame, Module, NativeFrame, PerFrame, Profile, PythonFrame, Stack, Weight};

use super::{kernel_name, native_name, task_name};

#[allow(clippy::all)]
mod proto {
    include!(concat!(env!("OUT_DIR"), "/perftools.profiles.rs"));
}

/// Where kernel text lives on x86-64 and arm64; the mapping only groups kernel locations.
const KERNEL_START: u64 = 0xffff_8000_0000_0000;
const KERNEL_MAPPING_NAME: &str = "[kernel.kallsyms]";

pub(super) fn write(profile: &Profile, out: &mut impl Write) -> io::Result<()> {
    let encoded = build(profile).encode_to_vec();
    let mut gzip = GzEncoder::new(out, Compression::default());
    gzip.write_all(&encoded)?;
    gzip.finish()?;
    Ok(())
}

fn build(profile: &Profile) -> proto::Profile {
    let mut builder = Builder { frame_locations: PerFrame::for_table(&profile.frames), ..Builder::default() };
    // Index 0 of the string table must be the empty string.
    builder.string("");
    let values = Values::of(profile.mode);
    let sample_type: Vec<proto::ValueType> = values.types().iter().map(|(kind, unit)| builder.value_type(kind, unit)).collect();
    let cpu = builder.value_type("cpu", "nanoseconds");
    let period = to_i64(profile.period_ns());
    let mut keys: Vec<_> = profile.stacks().collect();
    // A stable sample order keeps the file the same for the same profile.
    keys.sort_by_key(|(key, _)| (key.pid, key.tid, key.state));
    let sample = keys.into_iter().map(|(key, weight)| builder.sample(&key, values.of_sample(&key, weight), profile.mode != Mode::Cpu)).collect();
    // Readers show the last sample type unless told: wall time in wall mode.
    let default_sample_type = sample_type.last().map_or(0, |last| last.r#type);
    proto::Profile {
        sample_type,
        default_sample_type,
        sample,
        time_nanos: profile.start_unix_ns,
        duration_nanos: profile.duration_ns,
        period_type: Some(cpu),
        period,
        mapping: builder.mappings_by_address(),
        location: builder.locations,
        function: builder.functions,
        string_table: builder.strings,
        ..Default::default()
    }
}

/// The values each sample carries, by mode: `samples/count` and the time it stands for.
enum Values {
    /// `cpu/nanoseconds` (cpu and gil modes).
    Cpu,
    /// `off_cpu/nanoseconds`.
    OffCpu,
    /// `cpu`, `off_cpu` and `wall` nanoseconds: a sample counts in cpu and wall, an off-CPU
    /// interval in off_cpu and wall, so each thread's wall time is its cpu plus off_cpu time.
    Wall,
}

impl Values {
    fn of(mode: Mode) -> Values {
        match mode {
            Mode::Cpu | Mode::Gil => Values::Cpu,
            Mode::OffCpu => Values::OffCpu,
            Mode::Wall => Values::Wall,
        }
    }

    fn types(&self) -> &'static [(&'static str, &'static str)] {
        match self {
            Values::Cpu => &[("samples", "count"), ("cpu", "nanoseconds")],
            Values::OffCpu => &[("samples", "count"), ("off_cpu", "nanoseconds")],
            Values::Wall => &[("samples", "count"), ("cpu", "nanoseconds"), ("off_cpu", "nanoseconds"), ("wall", "nanoseconds")],
        }
    }

    fn of_sample(&self, key: &Stack<'_>, weight: Weight) -> Vec<i64> {
        let (samples, ns) = (to_i64(weight.samples), to_i64(weight.ns));
        match self {
            Values::Cpu | Values::OffCpu => vec![samples, ns],
            Values::Wall if key.state.off_cpu() => vec![samples, 0, ns, ns],
            Values::Wall => vec![samples, ns, 0, ns],
        }
    }
}

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum MappingKey {
    Module(Arc<Module>),
    Kernel,
}

#[derive(PartialEq, Eq, Hash)]
struct FunctionKey {
    name: i64,
    filename: i64,
    start_line: i64,
}

#[derive(PartialEq, Eq, Hash)]
struct LocationKey {
    mapping_id: u64,
    address: u64,
    function_id: u64,
    line: i64,
}

/// The profile's tables, each entry added once and referred to by id (strings by index).
#[derive(Default)]
struct Builder {
    strings: Vec<String>,
    string_index: HashMap<String, i64>,
    mappings: Vec<proto::Mapping>,
    mapping_ids: HashMap<MappingKey, u64>,
    functions: Vec<proto::Function>,
    function_ids: HashMap<FunctionKey, u64>,
    locations: Vec<proto::Location>,
    location_ids: HashMap<LocationKey, u64>,
    /// The location of each frame of the profile's table met so far.
    frame_locations: PerFrame<u64>,
}

impl Builder {
    /// Readers take the first mapping for the main binary (`go tool pprof` prints it as `File:`).
    /// Executables load below their shared libraries and the kernel lies above all, so address
    /// order puts an executable first.
    fn mappings_by_address(&mut self) -> Vec<proto::Mapping> {
        let mut mappings = std::mem::take(&mut self.mappings);
        mappings.sort_by_key(|mapping| mapping.memory_start);
        mappings
    }

    fn string(&mut self, text: &str) -> i64 {
        if let Some(&index) = self.string_index.get(text) {
            return index;
        }
        let index = self.strings.len() as i64;
        self.strings.push(text.to_owned());
        self.string_index.insert(text.to_owned(), index);
        index
    }

    fn value_type(&mut self, kind: &str, unit: &str) -> proto::ValueType {
        proto::ValueType { r#type: self.string(kind), unit: self.string(unit) }
    }

    fn sample(&mut self, key: &Stack<'_>, value: Vec<i64>, state_label: bool) -> proto::Sample {
        let location_id = key.frames.ids().iter().zip(key.frames.iter()).map(|(&id, frame)| self.frame_location(id, frame)).collect();
        let mut label = vec![self.number_label("pid", key.pid.into()), self.number_label("tid", key.tid.into()), self.string_label("comm", key.comm)];
        if let Some(labels) = key.labels {
            if let Some(ns_pid) = labels.ns_pid {
                label.push(self.number_label("ns_pid", ns_pid.into()));
            }
            if let Some(cgroup) = &labels.cgroup {
                label.push(self.string_label("cgroup", cgroup));
            }
        }
        if key.truncated {
            // The Python chain was cut where it could not be proven: callers beyond are missing.
            label.push(self.string_label("python_chain", "truncated"));
        }
        if state_label {
            label.push(self.string_label("thread_state", key.state.name()));
        }
        proto::Sample { location_id, value, label }
    }

    fn number_label(&mut self, name: &str, num: i64) -> proto::Label {
        proto::Label { key: self.string(name), num, ..Default::default() }
    }

    fn string_label(&mut self, name: &str, value: &str) -> proto::Label {
        proto::Label { key: self.string(name), str: self.string(value), ..Default::default() }
    }

    /// The location of frame `id` of the profile's table.
    fn frame_location(&mut self, id: FrameId, frame: &Frame) -> u64 {
        if let Some(known) = self.frame_locations.get(id) {
            return known;
        }
        let location = self.location(frame);
        self.frame_locations.remember(id, location);
        location
    }

    fn location(&mut self, frame: &Frame) -> u64 {
        let key = match frame {
            Frame::Native(native) => self.native_location(native),
            Frame::Kernel(kernel) => self.kernel_location(kernel),
            Frame::Python(python) => self.python_location(python),
            Frame::Task(name) => LocationKey { mapping_id: 0, address: 0, function_id: self.function(&task_name(name), "", 0), line: 0 },
        };
        if let Some(&id) = self.location_ids.get(&key) {
            return id;
        }
        let id = self.locations.len() as u64 + 1;
        self.locations.push(proto::Location {
            id,
            mapping_id: key.mapping_id,
            address: key.address,
            line: vec![proto::Line { function_id: key.function_id, line: key.line, column: 0 }],
            is_folded: false,
        });
        self.location_ids.insert(key, id);
        id
    }

    fn native_location(&mut self, frame: &NativeFrame) -> LocationKey {
        let mapping_id = frame.module.as_ref().map_or(0, |module| self.mapping(MappingKey::Module(module.clone())));
        let filename = frame.file.as_deref().unwrap_or("");
        LocationKey { mapping_id, address: frame.addr, function_id: self.function(&native_name(frame), filename, 0), line: frame.line.map_or(0, i64::from) }
    }

    fn kernel_location(&mut self, frame: &KernelFrame) -> LocationKey {
        LocationKey { mapping_id: self.mapping(MappingKey::Kernel), address: frame.addr, function_id: self.function(&kernel_name(frame), "", 0), line: 0 }
    }

    fn python_location(&mut self, frame: &PythonFrame) -> LocationKey {
        LocationKey {
            mapping_id: 0,
            address: 0,
            function_id: self.function(&frame.qualname, &frame.filename, frame.first_line.into()),
            line: frame.line.into(),
        }
    }

    fn function(&mut self, name: &str, filename: &str, start_line: i64) -> u64 {
        let key = FunctionKey { name: self.string(name), filename: self.string(filename), start_line };
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        self.functions.push(proto::Function { id, name: key.name, system_name: key.name, filename: key.filename, start_line });
        self.function_ids.insert(key, id);
        id
    }

    fn mapping(&mut self, key: MappingKey) -> u64 {
        if let Some(&id) = self.mapping_ids.get(&key) {
            return id;
        }
        let id = self.mappings.len() as u64 + 1;
        let mapping = match &key {
            MappingKey::Module(module) => proto::Mapping {
                id,
                memory_start: module.start,
                memory_limit: module.limit,
                file_offset: module.file_offset,
                filename: self.string(&module.path),
                build_id: self.string(module.build_id.as_deref().unwrap_or("")),
                // Every location carries its function (a symbol or `MODULE+0xOFFSET`), which stops
                // readers from trying to symbolize the file again on their machine.
                has_functions: true,
                ..Default::default()
            },
            MappingKey::Kernel => proto::Mapping {
                id,
                memory_start: KERNEL_START,
                memory_limit: u64::MAX,
                filename: self.string(KERNEL_MAPPING_NAME),
                has_functions: true,
                ..Default::default()
            },
        };
        self.mappings.push(mapping);
        self.mapping_ids.insert(key, id);
        id
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::process::Command;

    use super::super::test_profile::sample_profile;
    use super::*;

    #[test]
    fn tables_are_deduplicated_and_values_scaled_by_the_period() {
        let profile = build(&sample_profile());
        let mut strings = profile.string_table.clone();
        assert_eq!(strings[0], "");
        strings.sort();
        strings.dedup();
        assert_eq!(strings.len(), profile.string_table.len(), "string table has duplicates");
        assert_eq!(profile.period, 10_000_000);
        // app's two threads share their frames: 5 locations, plus leaf_fn and main of busy;loop.
        assert_eq!(profile.location.len(), 7);
        assert_eq!(profile.mapping.len(), 3);
        let thread_101 = profile.sample.iter().find(|s| s.label.iter().any(|l| l.num == 101)).unwrap();
        assert_eq!(thread_101.value, vec![3, 30_000_000]);
    }

    /// Runs `go tool pprof` (Debian's golang-go) on a written profile: an independent reader.
    fn go_pprof(view: &str, file: &Path) -> String {
        let output = Command::new("go")
            .args(["tool", "pprof", view])
            .arg(file)
            .output()
            .expect("`go` is needed for this test: install Debian's golang-go (`apt-get install golang-go`)");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "go tool pprof {view} failed: {stderr}\n{stdout}");
        stdout
    }

    #[test]
    fn go_tool_pprof_reads_functions_lines_and_counts() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("profile.pb.gz");
        crate::output::write_profile(&sample_profile(), &file, crate::output::OutputFormat::Pprof, &crate::output::Rendering::default()).unwrap();

        let raw = go_pprof("-raw", &file);
        assert!(raw.contains("samples/count cpu/nanoseconds"), "{raw}");
        assert!(raw.contains("Period: 10000000"), "{raw}");
        // Threads are separate samples; their counts and labels show.
        for expected in [
            "7   70000000",
            "3   30000000",
            "5   50000000",
            "Worker.compute /srv/work.py:14",
            "main /srv/work.py:33",
            "libfoo.so+0x1234",
            "do_syscall_64_[k]",
            "leaf_fn /src/app.c:42",
            "comm:[app]",
            "pid:[100]",
            "tid:[101]",
            "/usr/lib/libfoo.so",
            "build-id-of-libfoo.so",
            "[kernel.kallsyms]",
        ] {
            assert!(raw.contains(expected), "`go tool pprof -raw` lacks {expected:?}:\n{raw}");
        }

        let top = go_pprof("-top", &file);
        let flat = |function: &str| {
            top.lines()
                .find(|line| line.split_whitespace().last() == Some(function))
                .unwrap_or_else(|| panic!("`go tool pprof -top` lacks {function}:\n{top}"))
                .split_whitespace()
                .next()
                .unwrap()
                .to_owned()
        };
        // -top shows cpu time: 10 samples × 10 ms in the kernel leaf, 5 × 10 ms in leaf_fn.
        assert_eq!(flat("do_syscall_64_[k]"), "100ms");
        assert_eq!(flat("leaf_fn"), "50ms");
        assert!(top.contains("Worker.compute"), "{top}");
        assert!(top.starts_with("File: app\n"), "the main binary should head the report:\n{top}");
    }
}
