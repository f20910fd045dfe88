//! The profile model every stage shares: resolved frames, samples and their counts.
//! Frames are stored innermost first, as the kernel and pprof order them.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use hashbrown::HashMap;

/// A loaded file in a process's address space (one executable mapping of `/proc/PID/maps`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Module {
    /// Path as the process sees it (`/usr/lib/libc.so.6`), or a pseudo name (`[vdso]`).
    pub path: Arc<str>,
    /// Start and end of the mapping in the process.
    pub start: u64,
    pub limit: u64,
    /// File offset of `start`.
    pub file_offset: u64,
    /// GNU build ID as lowercase hex, where the ELF has one.
    pub build_id: Option<Arc<str>>,
}

/// A user-space native frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NativeFrame {
    /// Address in the process (return addresses already adjusted to the call instruction).
    pub addr: u64,
    pub module: Option<Arc<Module>>,
    /// Demangled function name, where known.
    pub symbol: Option<Arc<str>>,
    /// Source file and line from DWARF, where present.
    pub file: Option<Arc<str>>,
    pub line: Option<u32>,
}

/// A kernel frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelFrame {
    pub addr: u64,
    pub symbol: Option<Arc<str>>,
}

/// A Python function activation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PythonFrame {
    pub qualname: Arc<str>,
    pub filename: Arc<str>,
    /// `co_firstlineno`.
    pub first_line: u32,
    /// The line being executed; 0 where it could not be computed.
    pub line: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Frame {
    Native(NativeFrame),
    Kernel(KernelFrame),
    Python(PythonFrame),
}

/// Everything that tells one sample's stack apart: the labels pprof keeps plus the frames.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StackKey {
    pub pid: u32,
    pub tid: u32,
    pub comm: Arc<str>,
    /// Innermost first.
    pub frames: Vec<Frame>,
    /// The Python chain was cut at the first frame that could not be proven; the frames kept
    /// are exact, the callers beyond them are missing.
    pub truncated: bool,
    /// Where the process runs (container labels), when known.
    pub labels: Option<Arc<ProcessLabels>>,
}

/// Where a process runs: its PID inside its own PID namespace (when that is not the host's) and
/// its cgroup path (which names the container, for most container runtimes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ProcessLabels {
    pub ns_pid: Option<u32>,
    pub cgroup: Option<Arc<str>>,
}

/// A frame's index in its profile's [`FrameTable`].
pub type FrameId = u32;

/// Every distinct frame of a recording, once: stacks are slices of ids into it.
#[derive(Clone, Debug, Default)]
pub struct FrameTable {
    frames: Vec<Frame>,
    ids: HashMap<Frame, FrameId>,
}

impl FrameTable {
    /// The frame's id, added if new.
    pub fn intern(&mut self, frame: Frame) -> FrameId {
        if let Some(&id) = self.ids.get(&frame) {
            return id;
        }
        let id = self.frames.len() as FrameId;
        self.frames.push(frame.clone());
        self.ids.insert(frame, id);
        id
    }

    pub fn frame(&self, id: FrameId) -> &Frame {
        &self.frames[id as usize]
    }

    pub fn len(&self) -> usize {
        self.frames.len()
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }
}

/// One aggregated stack as kept: the labels plus the frames' ids, innermost first.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StoredStack {
    pid: u32,
    tid: u32,
    comm: Arc<str>,
    frames: Box<[FrameId]>,
    truncated: bool,
    labels: Option<Arc<ProcessLabels>>,
}

/// A sample's stack as resolved, borrowing everything: what is looked up (without allocating)
/// in the aggregated stacks.
#[derive(Debug, Clone, Copy)]
pub struct SampleStack<'a> {
    pub pid: u32,
    pub tid: u32,
    pub comm: &'a Arc<str>,
    pub frames: &'a [FrameId],
    pub truncated: bool,
    pub labels: Option<&'a Arc<ProcessLabels>>,
}

impl Hash for SampleStack<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The same fields, in the same order, as StoredStack's Hash.
        self.pid.hash(state);
        self.tid.hash(state);
        self.comm.hash(state);
        self.frames.hash(state);
        self.truncated.hash(state);
        self.labels.map(|labels| &**labels).hash(state);
    }
}

impl Hash for StoredStack {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_sample().hash(state)
    }
}

impl StoredStack {
    fn as_sample(&self) -> SampleStack<'_> {
        SampleStack {
            pid: self.pid,
            tid: self.tid,
            comm: &self.comm,
            frames: &self.frames,
            truncated: self.truncated,
            labels: self.labels.as_ref(),
        }
    }
}

impl hashbrown::Equivalent<StoredStack> for SampleStack<'_> {
    fn equivalent(&self, key: &StoredStack) -> bool {
        self.pid == key.pid
            && self.tid == key.tid
            && self.truncated == key.truncated
            && self.frames == &*key.frames
            && (Arc::ptr_eq(self.comm, &key.comm) || self.comm == &key.comm)
            && self.labels.map(|labels| &**labels) == key.labels.as_deref()
    }
}

/// One aggregated stack as the output writers read it: labels and frames from the interned tables.
#[derive(Debug, Clone, Copy)]
pub struct Stack<'a> {
    pub pid: u32,
    pub tid: u32,
    pub comm: &'a str,
    pub frames: Frames<'a>,
    pub truncated: bool,
    pub labels: Option<&'a ProcessLabels>,
}

/// A stack's frames, innermost first.
#[derive(Debug, Clone, Copy)]
pub struct Frames<'a> {
    ids: &'a [FrameId],
    table: &'a FrameTable,
}

impl<'a> Frames<'a> {
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &'a Frame> + ExactSizeIterator + 'a {
        let table = self.table;
        self.ids.iter().map(move |&id| table.frame(id))
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Aggregated samples of one recording: each distinct frame once in [`Profile::frames`], each
/// distinct stack once with its count.
#[derive(Debug, Default)]
pub struct Profile {
    pub frames: FrameTable,
    counts: HashMap<StoredStack, u64>,
    /// Sampling frequency per CPU, in Hz.
    pub frequency_hz: u64,
    /// Wall-clock start (ns since the Unix epoch) and length of the recording.
    pub start_unix_ns: i64,
    pub duration_ns: i64,
    /// Collapsed output starts each stack at the process's container (`--group-by container`).
    pub group_by_container: bool,
}

impl Profile {
    pub fn new(frequency_hz: u64) -> Self {
        Profile { frequency_hz, ..Default::default() }
    }

    /// An empty profile for the next period of a recording: the same settings, and the same frame
    /// table, so frame ids the resolver keeps stay valid.
    pub fn next_period(&self) -> Profile {
        Profile { frames: self.frames.clone(), group_by_container: self.group_by_container, ..Profile::new(self.frequency_hz) }
    }

    /// Adds an owned stack, interning its frames.
    pub fn add(&mut self, key: StackKey, count: u64) {
        let frames: Vec<FrameId> = key.frames.into_iter().map(|frame| self.frames.intern(frame)).collect();
        let sample = SampleStack {
            pid: key.pid,
            tid: key.tid,
            comm: &key.comm,
            frames: &frames,
            truncated: key.truncated,
            labels: key.labels.as_ref(),
        };
        self.add_sample(sample, count);
    }

    /// Adds a resolved sample; allocates only for a stack not seen before.
    pub fn add_sample(&mut self, sample: SampleStack<'_>, count: u64) {
        if let Some(total) = self.counts.get_mut(&sample) {
            *total += count;
            return;
        }
        let stored = StoredStack {
            pid: sample.pid,
            tid: sample.tid,
            comm: sample.comm.clone(),
            frames: sample.frames.into(),
            truncated: sample.truncated,
            labels: sample.labels.cloned(),
        };
        self.counts.insert(stored, count);
    }

    /// Every aggregated stack with its count, in no particular order.
    pub fn stacks(&self) -> impl Iterator<Item = (Stack<'_>, u64)> {
        self.counts.iter().map(|(stored, &count)| {
            let stack = Stack {
                pid: stored.pid,
                tid: stored.tid,
                comm: &stored.comm,
                frames: Frames { ids: &stored.frames, table: &self.frames },
                truncated: stored.truncated,
                labels: stored.labels.as_deref(),
            };
            (stack, count)
        })
    }

    /// Distinct stacks.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Nanoseconds of CPU time one sample stands for.
    pub fn period_ns(&self) -> u64 {
        1_000_000_000 / self.frequency_hz.max(1)
    }

    pub fn total_samples(&self) -> u64 {
        self.counts.values().sum()
    }

    /// Distinct processes sampled.
    pub fn processes(&self) -> usize {
        self.counts.keys().map(|stored| stored.pid).collect::<std::collections::HashSet<_>>().len()
    }

    /// The profile with Python frames aggregated per function (`--function`): line numbers are
    /// dropped, so stacks that differed only in the executing lines become one.
    pub fn by_function(&self) -> Profile {
        let mut merged = Profile {
            frequency_hz: self.frequency_hz,
            start_unix_ns: self.start_unix_ns,
            duration_ns: self.duration_ns,
            group_by_container: self.group_by_container,
            ..Default::default()
        };
        let mut ids = Vec::new();
        for (stored, &count) in &self.counts {
            ids.clear();
            for &id in &stored.frames {
                let mut frame = self.frames.frame(id).clone();
                if let Frame::Python(python) = &mut frame {
                    python.line = 0;
                }
                ids.push(merged.frames.intern(frame));
            }
            merged.add_sample(SampleStack { frames: &ids, ..stored.as_sample() }, count);
        }
        merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn python(line: u32) -> Frame {
        Frame::Python(PythonFrame { qualname: "work".into(), filename: "/w.py".into(), first_line: 3, line })
    }

    #[test]
    fn by_function_merges_stacks_that_differ_only_in_lines() {
        let key = |line| StackKey { pid: 1, tid: 1, comm: "python3".into(), frames: vec![python(line), python(20)], truncated: false, labels: None };
        let mut profile = Profile::new(99);
        profile.add(key(4), 2);
        profile.add(key(5), 3);
        let merged = profile.by_function();
        assert_eq!(merged.frequency_hz, 99);
        assert_eq!(merged.len(), 1);
        let (key, count) = merged.stacks().next().unwrap();
        assert_eq!(count, 5);
        assert!(key.frames.iter().all(|f| matches!(f, Frame::Python(p) if p.line == 0 && p.first_line == 3)));
    }
}
