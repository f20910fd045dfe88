//! One export period's profiles as one `ExportProfilesServiceRequest`: a `ResourceProfiles` per
//! process (its attributes as OpenTelemetry's semantic conventions name them), one `Profile` of
//! one sample type each, and one dictionary for the whole request where every string, mapping,
//! location, function, attribute and stack is kept once and index 0 of each table is its zero
//! value.
//!
//! The sample type follows the mode, as pprof's last value does: `samples/count` in cpu and gil
//! modes (each sample stands for one period of CPU time), `off_cpu/nanoseconds` and
//! `wall/nanoseconds` otherwise, with `thread.state` telling the waits apart. Stacks are leaf
//! first; every location says what ran there in `profile.frame.type` (`cpython`, `native`,
//! `kernel`), and has a line only where a function is known (a native or kernel address no
//! symbol names is left to the backend, with its mapping's file and build id). A sample (one per
//! stack, thread and state) has one value per event (an on-CPU sample, an interval off CPU) with
//! its timestamp, where the recording kept them all ([`Timeline`]), else their sum alone; its
//! `thread.name` is the thread's own, where known.

use std::collections::hash_map::RandomState;
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::path::Path;
use std::sync::Arc;

use hashbrown::HashMap;

use crate::mode::Mode;
use crate::output::task_name;
use crate::stack::{
    Event, Frame, FrameId, FrameTable, KernelFrame, Module, NativeFrame, PerFrame, ProcessDetails, Profile, PythonFrame, Stack, Timeline, Weight,
};

use super::proto::common::{any_value, AnyValue, InstrumentationScope, KeyValue};
use super::proto::profiles as otlp;
use super::proto::{collector, resource};
use super::ServiceName;

/// Where kernel text lives on x86-64 and arm64, as the pprof writer maps it.
const KERNEL_START: u64 = 0xffff_8000_0000_0000;
const KERNEL_MAPPING_NAME: &str = "[kernel.kallsyms]";

/// What every resource shares.
pub(super) struct Context<'a> {
    pub service_name: &'a ServiceName,
    pub host_name: &'a str,
}

/// A period's request, and what it holds.
pub(super) struct Request {
    pub message: collector::ExportProfilesServiceRequest,
    pub samples: u64,
}

/// The request for the period made of `pieces` (consecutive profiles of the same recording),
/// of every process, or of those in `only`.
pub(super) fn request(pieces: &[Arc<Profile>], context: &Context<'_>, only: Option<&[u32]>) -> Request {
    let mut dictionary = Dictionary::new();
    let mut processes: BTreeMap<u32, Process> = BTreeMap::new();
    let mut samples = 0;
    let names = thread_names(pieces);
    let timed = !untimed(pieces);
    for piece in pieces {
        dictionary.start_piece(&piece.frames);
        let values = Values::of_mode(piece.mode);
        let mut stacks: Vec<_> = piece.timed_stacks().collect();
        // A stable order makes the same request of the same profile (the dictionary's order too).
        stacks.sort_by_key(|(stack, ..)| (stack.pid, stack.tid, stack.state));
        for (stack, weight, events) in stacks {
            if only.is_some_and(|only| only.binary_search(&stack.pid).is_err()) {
                continue;
            }
            samples += weight.samples;
            let process = processes.entry(stack.pid).or_insert_with(|| Process::of(&stack));
            let thread_name = names.get(&(stack.pid, stack.tid)).copied().unwrap_or(stack.comm);
            // As pprof labels them: every mode but cpu tells states apart.
            let key = dictionary.sample_key(&stack, thread_name, piece.mode != Mode::Cpu);
            process.values.entry(key).or_default().add(values, weight, events.filter(|_| timed));
        }
    }
    let first = pieces.first().map(|piece| &**piece);
    let time = Time {
        start_unix_ns: pieces.iter().map(|piece| piece.start_unix_ns).filter(|&start| start > 0).min().unwrap_or(0),
        duration_ns: pieces.iter().map(|piece| piece.duration_ns.max(0) as u64).sum(),
        period_ns: first.map_or(0, Profile::period_ns),
        values: Values::of_mode(first.map_or(Mode::Cpu, |piece| piece.mode)),
    };
    let resource_profiles = processes.into_iter().map(|(pid, process)| process.into_resource(pid, &time, context, &mut dictionary)).collect();
    Request { message: collector::ExportProfilesServiceRequest { resource_profiles, dictionary: Some(dictionary.finish()) }, samples }
}

/// Whether the period went past the bound of events kept: it is sent without timestamps.
pub(super) fn untimed(pieces: &[Arc<Profile>]) -> bool {
    pieces.iter().any(|piece| piece.timeline.as_ref().is_some_and(|timeline| timeline.overflowed()))
}

/// Each thread's own name, the latest of the period's (pieces are in order).
fn thread_names(pieces: &[Arc<Profile>]) -> HashMap<(u32, u32), &str> {
    pieces.iter().filter_map(|piece| piece.timeline.as_deref()).flat_map(Timeline::thread_names).collect()
}

/// The processes of a request, in order.
pub(super) fn pids(request: &collector::ExportProfilesServiceRequest) -> Vec<u32> {
    let pid = |resource: &otlp::ResourceProfiles| {
        let attributes = &resource.resource.as_ref()?.attributes;
        match attributes.iter().find(|kv| kv.key == "process.pid")?.value.as_ref()?.value.as_ref()? {
            any_value::Value::IntValue(pid) => u32::try_from(*pid).ok(),
            _ => None,
        }
    };
    request.resource_profiles.iter().filter_map(pid).collect()
}

/// The one value each sample carries, by mode.
#[derive(Clone, Copy)]
enum Values {
    Samples,
    OffCpuNs,
    WallNs,
}

impl Values {
    fn of_mode(mode: Mode) -> Values {
        match mode {
            Mode::Cpu | Mode::Gil => Values::Samples,
            Mode::OffCpu => Values::OffCpuNs,
            Mode::Wall => Values::WallNs,
        }
    }

    fn of(self, weight: Weight) -> i64 {
        let value = match self {
            Values::Samples => weight.samples,
            Values::OffCpuNs | Values::WallNs => weight.ns,
        };
        i64::try_from(value).unwrap_or(i64::MAX)
    }

    fn sample_type(self) -> (&'static str, &'static str) {
        match self {
            Values::Samples => ("samples", "count"),
            Values::OffCpuNs => ("off_cpu", "nanoseconds"),
            Values::WallNs => ("wall", "nanoseconds"),
        }
    }
}

/// When the period ran and what its values mean.
struct Time {
    start_unix_ns: i64,
    duration_ns: u64,
    period_ns: u64,
    values: Values,
}

/// One process's samples in the period: its description, and each distinct (stack, thread,
/// state)'s value.
struct Process {
    comm: Arc<str>,
    cgroup: Option<Arc<str>>,
    details: Option<Arc<ProcessDetails>>,
    values: HashMap<SampleKey, Tally>,
}

/// What a sample adds up to: its value, and while every stack it is made of has all its events
/// (see `Profile::timed_stacks`), each event's value and time.
#[derive(Default)]
struct Tally {
    value: i64,
    /// (Unix ns, value), in the order counted.
    events: Vec<(i64, i64)>,
    untimed: bool,
}

impl Tally {
    fn add(&mut self, values: Values, weight: Weight, events: Option<&[Event]>) {
        self.value += values.of(weight);
        match events {
            Some(events) if !self.untimed => self.events.extend(events.iter().map(|event| (event.unix_ns, values.of(Weight { samples: 1, ns: event.ns })))),
            _ => {
                self.untimed = true;
                self.events = Vec::new();
            }
        }
    }

    fn timed(&self) -> bool {
        !self.untimed && !self.events.is_empty()
    }

    /// The sample's values and timestamps: one per event in time order, each within the period
    /// (a sample read just after a cut, an interval begun before it); or (`timed` false) its one
    /// value without timestamps.
    fn into_sample(mut self, key: SampleKey, time: &Time, timed: bool) -> otlp::Sample {
        let (values, timestamps_unix_nano) = if !timed {
            (vec![self.value], Vec::new())
        } else {
            self.events.sort_by_key(|&(unix_ns, _)| unix_ns);
            let start = time.start_unix_ns.max(0);
            let end = start.saturating_add(i64::try_from(time.duration_ns).unwrap_or(i64::MAX));
            self.events.iter().map(|&(unix_ns, value)| (value, unix_ns.max(start).min(end) as u64)).unzip()
        };
        otlp::Sample { stack_index: key.stack, attribute_indices: key.attributes, values, timestamps_unix_nano, ..Default::default() }
    }
}

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct SampleKey {
    stack: i32,
    attributes: Vec<i32>,
}

impl Process {
    fn of(stack: &Stack<'_>) -> Process {
        let labels = stack.labels;
        Process {
            comm: Arc::from(stack.comm),
            cgroup: labels.and_then(|labels| labels.cgroup.clone()),
            details: labels.and_then(|labels| labels.details.clone()),
            values: HashMap::new(),
        }
    }

    fn into_resource(self, pid: u32, time: &Time, context: &Context<'_>, dictionary: &mut Dictionary) -> otlp::ResourceProfiles {
        let attributes = self.attributes(pid, context);
        let mut samples: Vec<(SampleKey, Tally)> = self.values.into_iter().collect();
        // A stable order keeps the request the same for the same profile.
        samples.sort_by(|(one, _), (other, _)| one.cmp(other));
        // A profile's samples should all have the same shape: all timed, or none.
        let timed = samples.iter().all(|(_, tally)| tally.timed());
        let (kind, unit) = time.values.sample_type();
        let profile = otlp::Profile {
            sample_type: Some(dictionary.value_type(kind, unit)),
            samples: samples.into_iter().map(|(key, tally)| tally.into_sample(key, time, timed)).collect(),
            time_unix_nano: time.start_unix_ns.max(0) as u64,
            duration_nano: time.duration_ns,
            period_type: Some(dictionary.value_type("cpu", "nanoseconds")),
            period: i64::try_from(time.period_ns).unwrap_or(i64::MAX),
            profile_id: profile_id(),
            ..Default::default()
        };
        let scope = InstrumentationScope { name: "pyebpf".into(), version: env!("CARGO_PKG_VERSION").into(), ..Default::default() };
        otlp::ResourceProfiles {
            resource: Some(resource::Resource { attributes, ..Default::default() }),
            scope_profiles: vec![otlp::ScopeProfiles { scope: Some(scope), profiles: vec![profile], ..Default::default() }],
            ..Default::default()
        }
    }

    /// The resource's attributes, as the semantic conventions name them.
    fn attributes(&self, pid: u32, context: &Context<'_>) -> Vec<KeyValue> {
        let details = self.details.as_deref();
        let exe_path = details.and_then(|details| details.exe.as_deref());
        let exe_name = exe_path.and_then(|path| Path::new(path).file_name()).map_or_else(|| self.comm.to_string(), |name| name.to_string_lossy().into_owned());
        let mut attributes = vec![int_attribute("process.pid", pid.into()), string_attribute("process.executable.name", &exe_name)];
        if let Some(path) = exe_path {
            attributes.push(string_attribute("process.executable.path", path));
        }
        if let Some(version) = details.and_then(|details| details.python_version.as_deref()) {
            attributes.push(string_attribute("process.runtime.name", "cpython"));
            attributes.push(string_attribute("process.runtime.version", version));
        }
        if !context.host_name.is_empty() {
            attributes.push(string_attribute("host.name", context.host_name));
        }
        let container = self.cgroup.as_deref().and_then(container_id);
        if let Some(id) = container {
            attributes.push(string_attribute("container.id", id));
        }
        let service = match context.service_name {
            ServiceName::Exe => None,
            ServiceName::Env(_) => details.and_then(|details| details.env_value.as_deref()).filter(|value| !value.is_empty()).map(str::to_string),
            ServiceName::Cgroup => self.cgroup.as_deref().and_then(|cgroup| cgroup.rsplit('/').find(|part| !part.is_empty())).map(str::to_string),
            ServiceName::Literal(name) => Some(name.clone()),
        };
        attributes.push(string_attribute("service.name", service.as_deref().unwrap_or(&exe_name)));
        attributes
    }
}

fn string_attribute(key: &str, value: &str) -> KeyValue {
    KeyValue { key: key.into(), value: Some(AnyValue { value: Some(any_value::Value::StringValue(value.into())) }), ..Default::default() }
}

fn int_attribute(key: &str, value: i64) -> KeyValue {
    KeyValue { key: key.into(), value: Some(AnyValue { value: Some(any_value::Value::IntValue(value)) }), ..Default::default() }
}

/// The container a cgroup path names: a component (or its last `-` part, `.scope` aside) of 64
/// hex digits, as Docker, containerd, CRI-O and Podman name theirs.
pub(super) fn container_id(cgroup: &str) -> Option<&str> {
    cgroup.rsplit('/').find_map(|component| {
        let name = component.strip_suffix(".scope").unwrap_or(component);
        let id = name.rsplit(['-', ':']).next()?;
        (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
    })
}

/// 16 random bytes, never all zero (an invalid id): std's hasher keys come from the OS's
/// randomness, and each new `RandomState` differs.
fn profile_id() -> Vec<u8> {
    let high = RandomState::new().hash_one(0u8);
    let low = RandomState::new().hash_one(1u8) | 1;
    let mut id = high.to_le_bytes().to_vec();
    id.extend_from_slice(&low.to_le_bytes());
    id
}

/// An attribute's value in the dictionary.
#[derive(Clone, PartialEq, Eq, Hash)]
enum AttributeValue {
    Int(i64),
    Str(String),
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum MappingKey {
    Module(Arc<Module>),
    Kernel,
}

#[derive(PartialEq, Eq, Hash)]
struct FunctionKey {
    name: i32,
    filename: i32,
    start_line: i64,
}

#[derive(PartialEq, Eq, Hash)]
struct LocationKey {
    mapping: i32,
    address: u64,
    function: i32,
    line: i64,
    frame_type: i32,
}

/// The request's shared tables, each entry once; index 0 of each is its zero value.
struct Dictionary {
    strings: Vec<String>,
    string_index: HashMap<String, i32>,
    mappings: Vec<otlp::Mapping>,
    mapping_index: HashMap<MappingKey, i32>,
    functions: Vec<otlp::Function>,
    function_index: HashMap<FunctionKey, i32>,
    locations: Vec<otlp::Location>,
    location_index: HashMap<LocationKey, i32>,
    attributes: Vec<otlp::KeyValueAndUnit>,
    attribute_index: HashMap<(i32, AttributeValue), i32>,
    stacks: Vec<otlp::Stack>,
    stack_index: HashMap<Vec<i32>, i32>,
    /// The location of each frame of the piece's table met so far.
    frame_locations: PerFrame<i32>,
    /// `profile.frame.type`'s attribute for Python, native and kernel frames.
    frame_types: FrameTypes,
    /// A scratch list of a stack's locations.
    scratch: Vec<i32>,
}

#[derive(Clone, Copy, Default)]
struct FrameTypes {
    cpython: i32,
    native: i32,
    kernel: i32,
}

/// An index into a table of at most `i32::MAX` entries; past that, the zero value (an absurd
/// request, which a collector refuses anyway).
fn index_of(len: usize) -> i32 {
    i32::try_from(len).unwrap_or(0)
}

impl Dictionary {
    fn new() -> Dictionary {
        let mut dictionary = Dictionary {
            strings: Vec::new(),
            string_index: HashMap::new(),
            mappings: vec![otlp::Mapping::default()],
            mapping_index: HashMap::new(),
            functions: vec![otlp::Function::default()],
            function_index: HashMap::new(),
            locations: vec![otlp::Location::default()],
            location_index: HashMap::new(),
            attributes: vec![otlp::KeyValueAndUnit::default()],
            attribute_index: HashMap::new(),
            stacks: vec![otlp::Stack::default()],
            stack_index: HashMap::new(),
            frame_locations: PerFrame::default(),
            frame_types: FrameTypes::default(),
            scratch: Vec::new(),
        };
        dictionary.string("");
        dictionary.stack_index.insert(Vec::new(), 0);
        dictionary.frame_types =
            FrameTypes { cpython: dictionary.frame_type("cpython"), native: dictionary.frame_type("native"), kernel: dictionary.frame_type("kernel") };
        dictionary
    }

    /// The stacks that follow are of a profile with this frame table.
    fn start_piece(&mut self, frames: &FrameTable) {
        self.frame_locations = PerFrame::for_table(frames);
    }

    fn finish(self) -> otlp::ProfilesDictionary {
        otlp::ProfilesDictionary {
            mapping_table: self.mappings,
            location_table: self.locations,
            function_table: self.functions,
            link_table: vec![otlp::Link::default()],
            string_table: self.strings,
            attribute_table: self.attributes,
            stack_table: self.stacks,
        }
    }

    fn string(&mut self, text: &str) -> i32 {
        if let Some(&index) = self.string_index.get(text) {
            return index;
        }
        let index = index_of(self.strings.len());
        self.strings.push(text.to_owned());
        self.string_index.insert(text.to_owned(), index);
        index
    }

    fn value_type(&mut self, kind: &str, unit: &str) -> otlp::ValueType {
        otlp::ValueType { type_strindex: self.string(kind), unit_strindex: self.string(unit) }
    }

    fn attribute(&mut self, key: &str, value: AttributeValue) -> i32 {
        let key_strindex = self.string(key);
        if let Some(&index) = self.attribute_index.get(&(key_strindex, value.clone())) {
            return index;
        }
        let any = match &value {
            AttributeValue::Int(number) => any_value::Value::IntValue(*number),
            AttributeValue::Str(text) => any_value::Value::StringValue(text.clone()),
        };
        let index = index_of(self.attributes.len());
        self.attributes.push(otlp::KeyValueAndUnit { key_strindex, value: Some(AnyValue { value: Some(any) }), unit_strindex: 0 });
        self.attribute_index.insert((key_strindex, value), index);
        index
    }

    /// The stack's index and the sample's attributes: the thread, and where they tell samples
    /// apart, its state and a cut Python chain.
    fn sample_key(&mut self, stack: &Stack<'_>, thread_name: &str, with_state: bool) -> SampleKey {
        let mut locations = std::mem::take(&mut self.scratch);
        locations.clear();
        locations.extend(stack.frames.ids().iter().zip(stack.frames.iter()).map(|(&id, frame)| self.frame_location(id, frame)));
        let stack_index = match self.stack_index.get(&locations) {
            Some(&index) => index,
            None => {
                let index = index_of(self.stacks.len());
                self.stacks.push(otlp::Stack { location_indices: locations.clone() });
                self.stack_index.insert(locations.clone(), index);
                index
            }
        };
        self.scratch = locations;
        let mut attributes =
            vec![self.attribute("thread.id", AttributeValue::Int(stack.tid.into())), self.attribute("thread.name", AttributeValue::Str(thread_name.into()))];
        if with_state {
            attributes.push(self.attribute("thread.state", AttributeValue::Str(stack.state.name().into())));
        }
        if stack.truncated {
            // The Python chain was cut where it could not be proven, as pprof labels it.
            attributes.push(self.attribute("python_chain", AttributeValue::Str("truncated".into())));
        }
        SampleKey { stack: stack_index, attributes }
    }

    /// The location of frame `id` of the piece's table.
    fn frame_location(&mut self, id: FrameId, frame: &Frame) -> i32 {
        if let Some(known) = self.frame_locations.get(id) {
            return known;
        }
        let index = self.location(frame);
        self.frame_locations.remember(id, index);
        index
    }

    fn location(&mut self, frame: &Frame) -> i32 {
        let key = match frame {
            Frame::Python(python) => self.python_location(python),
            Frame::Task(name) => {
                LocationKey { mapping: 0, address: 0, function: self.function(&task_name(name), "", 0), line: 0, frame_type: self.frame_types.cpython }
            }
            Frame::Native(native) => self.native_location(native),
            Frame::Kernel(kernel) => self.kernel_location(kernel),
        };
        if let Some(&index) = self.location_index.get(&key) {
            return index;
        }
        let index = index_of(self.locations.len());
        // A frame without a function (a native or kernel address no symbol names) has no line:
        // a backend can still symbolize it from its mapping's file and build id.
        let lines = if key.function == 0 { Vec::new() } else { vec![otlp::Line { function_index: key.function, line: key.line, column: 0 }] };
        self.locations.push(otlp::Location { mapping_index: key.mapping, address: key.address, lines, attribute_indices: vec![key.frame_type] });
        self.location_index.insert(key, index);
        index
    }

    fn frame_type(&mut self, kind: &str) -> i32 {
        self.attribute("profile.frame.type", AttributeValue::Str(kind.into()))
    }

    fn python_location(&mut self, frame: &PythonFrame) -> LocationKey {
        LocationKey {
            mapping: 0,
            address: 0,
            function: self.function(&frame.qualname, &frame.filename, frame.first_line.into()),
            line: frame.line.into(),
            frame_type: self.frame_types.cpython,
        }
    }

    /// A native frame at its address in the process (as in pprof), in its file's mapping; with
    /// its symbol's function where it has one.
    fn native_location(&mut self, frame: &NativeFrame) -> LocationKey {
        let mapping = frame.module.as_ref().map_or(0, |module| self.mapping(MappingKey::Module(module.clone())));
        let function = match &frame.symbol {
            Some(symbol) => self.function(symbol, frame.file.as_deref().unwrap_or(""), 0),
            None => 0,
        };
        LocationKey { mapping, address: frame.addr, function, line: frame.line.map_or(0, i64::from), frame_type: self.frame_types.native }
    }

    fn kernel_location(&mut self, frame: &KernelFrame) -> LocationKey {
        let function = frame.symbol.as_deref().map_or(0, |symbol| self.function(symbol, "", 0));
        LocationKey { mapping: self.mapping(MappingKey::Kernel), address: frame.addr, function, line: 0, frame_type: self.frame_types.kernel }
    }

    fn function(&mut self, name: &str, filename: &str, start_line: i64) -> i32 {
        let key = FunctionKey { name: self.string(name), filename: self.string(filename), start_line };
        if let Some(&index) = self.function_index.get(&key) {
            return index;
        }
        let index = index_of(self.functions.len());
        self.functions.push(otlp::Function { name_strindex: key.name, system_name_strindex: key.name, filename_strindex: key.filename, start_line });
        self.function_index.insert(key, index);
        index
    }

    fn mapping(&mut self, key: MappingKey) -> i32 {
        if let Some(&index) = self.mapping_index.get(&key) {
            return index;
        }
        let mapping = match &key {
            MappingKey::Module(module) => {
                let build_id = module.build_id.as_deref().map(|id| self.attribute("process.executable.build_id.gnu", AttributeValue::Str(id.into())));
                otlp::Mapping {
                    memory_start: module.start,
                    memory_limit: module.limit,
                    file_offset: module.file_offset,
                    filename_strindex: self.string(&module.path),
                    attribute_indices: build_id.into_iter().collect(),
                }
            }
            MappingKey::Kernel => {
                otlp::Mapping { memory_start: KERNEL_START, memory_limit: u64::MAX, filename_strindex: self.string(KERNEL_MAPPING_NAME), ..Default::default() }
            }
        };
        let index = index_of(self.mappings.len());
        self.mappings.push(mapping);
        self.mapping_index.insert(key, index);
        index
    }
}
