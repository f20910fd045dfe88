//! The profile model every stage shares: resolved frames, samples and their counts.
//! Frames are stored innermost first, as the kernel and pprof order them.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hashbrown::hash_map::EntryRef;
use hashbrown::HashMap;

use crate::mode::Mode;

mod per_frame;
mod timeline;

pub use per_frame::PerFrame;
pub use timeline::{Event, Timeline, MAX_EVENTS};

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
    /// An asyncio task (`--async-aware`), by name: above the frames of its coroutine.
    Task(Arc<str>),
}

/// What a thread was doing: running, or off CPU and why (from the task state it left the CPU in
/// and the kernel and native frames it waited in).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ThreadState {
    #[default]
    OnCpu,
    /// Preempted while runnable: waiting for a CPU.
    Runqueue,
    Sleep,
    /// A futex or another lock.
    Lock,
    /// Reading, writing, polling: waiting on a file, socket or pipe.
    Io,
    /// Waiting to take the GIL.
    Gil,
    /// Off CPU for another reason (waiting for a child or a signal, a page fault).
    Other,
    /// Not a thread: an asyncio task suspended in `await` (`--async-aware`), while its thread was
    /// captured.
    TaskWait,
}

impl ThreadState {
    /// The label value (`thread_state` in pprof), also the name after `[off-cpu ` in stacks.
    pub fn name(self) -> &'static str {
        match self {
            ThreadState::OnCpu => "on-cpu",
            ThreadState::Runqueue => "runqueue",
            ThreadState::Sleep => "sleep",
            ThreadState::Lock => "lock",
            ThreadState::Io => "io",
            ThreadState::Gil => "gil",
            ThreadState::Other => "other",
            ThreadState::TaskWait => "task-wait",
        }
    }

    pub fn off_cpu(self) -> bool {
        self != ThreadState::OnCpu
    }
}

/// What an aggregated stack adds up to: the samples and intervals that had it, and the time they
/// stand for in nanoseconds (a sample, its period; an off-CPU interval, its length).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Weight {
    pub samples: u64,
    pub ns: u64,
}

impl std::ops::AddAssign for Weight {
    fn add_assign(&mut self, other: Weight) {
        self.samples += other.samples;
        self.ns = self.ns.saturating_add(other.ns);
    }
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
    pub state: ThreadState,
}

/// Where a process runs: its PID inside its own PID namespace (when that is not the host's) and
/// its cgroup path (which names the container, for most container runtimes).
#[derive(Clone, Debug, Default)]
pub struct ProcessLabels {
    pub ns_pid: Option<u32>,
    pub cgroup: Option<Arc<str>>,
    /// What `record --otlp` names the process by, read with the labels; not part of the labels'
    /// identity (stacks are told apart by PID and labels already, and hashing it per sample
    /// would cost for nothing).
    pub details: Option<Arc<ProcessDetails>>,
}

impl PartialEq for ProcessLabels {
    fn eq(&self, other: &Self) -> bool {
        self.ns_pid == other.ns_pid && self.cgroup == other.cgroup
    }
}

impl Eq for ProcessLabels {}

impl Hash for ProcessLabels {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.ns_pid.hash(state);
        self.cgroup.hash(state);
    }
}

/// A process as OTLP resources describe it, read at its first sample (`record --otlp` only).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessDetails {
    /// `/proc/PID/exe`'s target.
    pub exe: Option<Arc<str>>,
    /// The value of `--service-name env:VAR` in the process's initial environment.
    pub env_value: Option<Arc<str>>,
    /// The CPython version (`3.12.1`), for a Python process pyebpf reads.
    pub python_version: Option<Arc<str>>,
}

/// A frame's index in its profile's [`FrameTable`].
pub type FrameId = u32;

/// Whether two slices of plain values are equal. `==` on them calls the C library's `memcmp`,
/// which musl's (the static binary's) runs a byte at a time, on stacks of kilobytes: there they
/// are compared whole, in vector registers. glibc's is faster than that.
pub fn same_values<T: Copy + Eq>(a: &[T], b: &[T]) -> bool {
    if cfg!(target_env = "musl") {
        a.len() == b.len() && a.iter().zip(b).fold(true, |same, (x, y)| same & (x == y))
    } else {
        a == b
    }
}

/// Every distinct frame of a recording, once: stacks are slices of ids into it.
#[derive(Clone, Debug)]
pub struct FrameTable {
    frames: Vec<Frame>,
    /// Ids by their frame's hash; the frame itself is kept only in `frames`.
    ids: hashbrown::HashTable<FrameId>,
    hasher: hashbrown::DefaultHashBuilder,
    generation: u64,
}

impl Default for FrameTable {
    fn default() -> Self {
        static GENERATIONS: AtomicU64 = AtomicU64::new(1);
        FrameTable {
            frames: Vec::new(),
            ids: hashbrown::HashTable::new(),
            hasher: hashbrown::DefaultHashBuilder::default(),
            generation: GENERATIONS.fetch_add(1, Ordering::Relaxed),
        }
    }
}

impl FrameTable {
    /// The frame's id, added if new.
    pub fn intern(&mut self, frame: Frame) -> FrameId {
        let FrameTable { frames, ids, hasher, .. } = self;
        let hash = hasher.hash_one(&frame);
        if let Some(&id) = ids.find(hash, |&id| frames[id as usize] == frame) {
            return id;
        }
        let id = frames.len() as FrameId;
        frames.push(frame);
        ids.insert_unique(hash, id, |&id| hasher.hash_one(&frames[id as usize]));
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

    /// Which table this is: ids kept outside it are valid only in the table of their generation
    /// (and its clones).
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

/// Moves frames from one table into a new one, each once: a new period starts with only the
/// frames still in use (those the resolver's caches hold), so a long recording does not keep the
/// frames of every process that ever ran.
pub struct FrameCarry<'a> {
    from: &'a FrameTable,
    to: &'a mut FrameTable,
    /// The new id of each old one carried so far (`FrameId::MAX`: not yet).
    moved: Vec<FrameId>,
}

impl<'a> FrameCarry<'a> {
    pub fn new(from: &'a FrameTable, to: &'a mut FrameTable) -> Self {
        FrameCarry { from, to, moved: vec![FrameId::MAX; from.len()] }
    }

    /// `id`'s frame's id in the new table.
    pub fn carry(&mut self, id: FrameId) -> FrameId {
        let moved = &mut self.moved[id as usize];
        if *moved == FrameId::MAX {
            *moved = self.to.intern(self.from.frame(id).clone());
        }
        *moved
    }

    pub fn new_generation(&self) -> u64 {
        self.to.generation()
    }
}

/// One aggregated stack as kept (or an off-CPU capture held until its interval ends): the labels
/// plus the frames' ids, innermost first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredStack {
    pid: u32,
    tid: u32,
    comm: Arc<str>,
    frames: Box<[FrameId]>,
    truncated: bool,
    labels: Option<Arc<ProcessLabels>>,
    state: ThreadState,
}

/// An aggregated stack's weight and, with a timeline, the events it is made of (see
/// [`Timeline`]).
#[derive(Debug, Default)]
struct Counted {
    weight: Weight,
    events: Vec<Event>,
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
    pub state: ThreadState,
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
        self.state.hash(state);
    }
}

impl Hash for StoredStack {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_sample().hash(state)
    }
}

impl StoredStack {
    /// An owned copy of `sample`.
    pub(crate) fn from_sample(sample: &SampleStack<'_>) -> Self {
        StoredStack {
            pid: sample.pid,
            tid: sample.tid,
            comm: sample.comm.clone(),
            frames: sample.frames.into(),
            truncated: sample.truncated,
            labels: sample.labels.cloned(),
            state: sample.state,
        }
    }

    /// The frame ids, to move them into another period's frame table.
    pub(crate) fn frames_mut(&mut self) -> &mut [FrameId] {
        &mut self.frames
    }

    pub(crate) fn as_sample(&self) -> SampleStack<'_> {
        SampleStack {
            pid: self.pid,
            tid: self.tid,
            comm: &self.comm,
            frames: &self.frames,
            truncated: self.truncated,
            labels: self.labels.as_ref(),
            state: self.state,
        }
    }
}

impl hashbrown::Equivalent<StoredStack> for SampleStack<'_> {
    fn equivalent(&self, key: &StoredStack) -> bool {
        self.pid == key.pid
            && self.tid == key.tid
            && self.truncated == key.truncated
            && self.state == key.state
            && same_values(self.frames, &key.frames)
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
    pub state: ThreadState,
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

    /// The frames' ids in their profile's [`FrameTable`], innermost first.
    pub fn ids(&self) -> &'a [FrameId] {
        self.ids
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Aggregated samples of one recording: each distinct frame once in [`Profile::frames`], each
/// distinct stack once with its weight.
#[derive(Debug, Default)]
pub struct Profile {
    pub frames: FrameTable,
    counts: HashMap<StoredStack, Counted>,
    /// What the weights measure.
    pub mode: Mode,
    /// Sampling frequency per CPU, in Hz.
    pub frequency_hz: u64,
    /// Wall-clock start (ns since the Unix epoch) and length of the recording.
    pub start_unix_ns: i64,
    pub duration_ns: i64,
    /// Collapsed output starts each stack at the process's container (`--group-by container`).
    pub group_by_container: bool,
    /// `record --otlp`: each stack's events and each thread's name.
    pub timeline: Option<Box<Timeline>>,
}

impl Profile {
    pub fn new(frequency_hz: u64) -> Self {
        Profile { frequency_hz, ..Default::default() }
    }

    /// An empty profile for the next period of a recording: the same settings, and an empty frame
    /// table into which the resolver carries the frames it keeps ids of ([`FrameCarry`]).
    pub fn next_period(&self) -> Profile {
        Profile {
            group_by_container: self.group_by_container,
            mode: self.mode,
            timeline: self.timeline.as_ref().map(|timeline| Box::new(timeline.next_piece())),
            ..Profile::new(self.frequency_hz)
        }
    }

    /// Starts a new frame table with the frames of this profile's stacks and those `carry_caches`
    /// carries (the resolver's), dropping the rest.
    pub fn renew_frames(&mut self, carry_caches: impl FnOnce(&mut FrameCarry<'_>)) {
        let old = std::mem::take(&mut self.frames);
        let mut carry = FrameCarry::new(&old, &mut self.frames);
        for (mut stored, counted) in std::mem::take(&mut self.counts) {
            for id in stored.frames.iter_mut() {
                *id = carry.carry(*id);
            }
            self.counts.insert(stored, counted);
        }
        carry_caches(&mut carry);
    }

    /// Adds an owned stack, interning its frames: `count` samples of one period each.
    pub fn add(&mut self, key: StackKey, count: u64) {
        let weight = Weight { samples: count, ns: count * self.period_ns() };
        self.add_weighted(key, weight);
    }

    /// Adds an owned stack with its weight, interning its frames.
    pub fn add_weighted(&mut self, key: StackKey, weight: Weight) {
        let frames: Vec<FrameId> = key.frames.into_iter().map(|frame| self.frames.intern(frame)).collect();
        let sample = SampleStack {
            pid: key.pid,
            tid: key.tid,
            comm: &key.comm,
            frames: &frames,
            truncated: key.truncated,
            labels: key.labels.as_ref(),
            state: key.state,
        };
        self.add_sample(sample, weight);
    }

    /// Adds a resolved sample; allocates only for a stack not seen before.
    pub fn add_sample(&mut self, sample: SampleStack<'_>, weight: Weight) {
        self.counted(&sample).weight += weight;
    }

    /// The stack's counts, found with one hash of it.
    fn counted(&mut self, sample: &SampleStack<'_>) -> &mut Counted {
        match self.counts.entry_ref(sample) {
            EntryRef::Occupied(counted) => counted.into_mut(),
            EntryRef::Vacant(vacant) => vacant.insert_with_key(StoredStack::from_sample(sample), Counted::default()),
        }
    }

    /// Every aggregated stack with its weight, in no particular order.
    pub fn stacks(&self) -> impl Iterator<Item = (Stack<'_>, Weight)> {
        self.counts.iter().map(|(stored, counted)| (self.stack(stored), counted.weight))
    }

    fn stack<'a>(&'a self, stored: &'a StoredStack) -> Stack<'a> {
        Stack {
            pid: stored.pid,
            tid: stored.tid,
            comm: &stored.comm,
            frames: Frames { ids: &stored.frames, table: &self.frames },
            truncated: stored.truncated,
            labels: stored.labels.as_deref(),
            state: stored.state,
        }
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
        self.counts.values().map(|counted| counted.weight.samples).sum()
    }

    /// The time every stack stands for, in nanoseconds.
    pub fn total_ns(&self) -> u64 {
        self.counts.values().map(|counted| counted.weight.ns).fold(0, u64::saturating_add)
    }

    /// Distinct processes sampled.
    pub fn processes(&self) -> usize {
        self.counts.keys().map(|stored| stored.pid).collect::<std::collections::HashSet<_>>().len()
    }

    /// Adds `other`'s stacks to this profile, interning their frames here, and its time: a
    /// period made of several pieces (see `record`'s periods).
    pub fn absorb(&mut self, other: &Profile) {
        if self.start_unix_ns == 0 || (other.start_unix_ns != 0 && other.start_unix_ns < self.start_unix_ns) {
            self.start_unix_ns = other.start_unix_ns;
        }
        self.duration_ns = self.duration_ns.saturating_add(other.duration_ns);
        self.add_counts_of(other, Frame::clone);
    }

    /// Adds every stack of `other` with its weight, each frame made by `frame_of` from `other`'s
    /// and interned here.
    fn add_counts_of(&mut self, other: &Profile, mut frame_of: impl FnMut(&Frame) -> Frame) {
        let mut ids = Vec::new();
        for (stored, counted) in &other.counts {
            ids.clear();
            ids.extend(stored.frames.iter().map(|&id| self.frames.intern(frame_of(other.frames.frame(id)))));
            self.add_sample(SampleStack { frames: &ids, ..stored.as_sample() }, counted.weight);
        }
    }

    /// The profile with Python frames aggregated per function (`--function`): line numbers are
    /// dropped, so stacks that differed only in the executing lines become one.
    pub fn by_function(&self) -> Profile {
        let mut merged = Profile {
            frequency_hz: self.frequency_hz,
            start_unix_ns: self.start_unix_ns,
            duration_ns: self.duration_ns,
            group_by_container: self.group_by_container,
            mode: self.mode,
            ..Default::default()
        };
        merged.add_counts_of(self, |frame| {
            let mut frame = frame.clone();
            if let Frame::Python(python) = &mut frame {
                python.line = 0;
            }
            frame
        });
        merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Python frame of `work` at `line`, for this module's tests and its children's.
    pub(super) fn python(line: u32) -> Frame {
        Frame::Python(PythonFrame { qualname: "work".into(), filename: "/w.py".into(), first_line: 3, line })
    }

    #[test]
    fn by_function_merges_stacks_that_differ_only_in_lines() {
        let key = |line| StackKey {
            pid: 1,
            tid: 1,
            comm: "python3".into(),
            frames: vec![python(line), python(20)],
            truncated: false,
            labels: None,
            state: ThreadState::OnCpu,
        };
        let mut profile = Profile::new(99);
        profile.add(key(4), 2);
        profile.add(key(5), 3);
        let merged = profile.by_function();
        assert_eq!(merged.frequency_hz, 99);
        assert_eq!(merged.len(), 1);
        let (key, weight) = merged.stacks().next().unwrap();
        assert_eq!(weight, Weight { samples: 5, ns: 5 * merged.period_ns() });
        assert!(key.frames.iter().all(|f| matches!(f, Frame::Python(p) if p.line == 0 && p.first_line == 3)));
    }

    #[test]
    fn absorbed_pieces_add_up_to_one_period() {
        let key = |tid, line| StackKey {
            pid: 1,
            tid,
            comm: "python3".into(),
            frames: vec![python(line), python(20)],
            truncated: false,
            labels: None,
            state: ThreadState::OnCpu,
        };
        let mut first = Profile::new(100);
        (first.start_unix_ns, first.duration_ns) = (2_000, 5);
        first.add(key(1, 4), 2);
        first.add(key(2, 4), 1);
        let mut second = first.next_period();
        (second.start_unix_ns, second.duration_ns) = (3_000, 7);
        second.add(key(1, 4), 3);
        second.add(key(1, 5), 1);
        let mut period = first.next_period();
        period.absorb(&first);
        period.absorb(&second);
        assert_eq!((period.start_unix_ns, period.duration_ns), (2_000, 12));
        assert_eq!((period.len(), period.total_samples()), (3, 7));
        // The frames are the period's own, each once.
        assert_eq!(period.frames.len(), 3);
        let thread_1_line_4 = period.stacks().find(|(stack, _)| stack.tid == 1 && stack.frames.iter().next() == Some(&python(4))).unwrap().1;
        assert_eq!(thread_1_line_4.samples, 5);
    }

    #[test]
    fn renewed_frames_keep_the_stacks_and_what_is_carried_and_drop_the_rest() {
        let key = |line| StackKey {
            pid: 1,
            tid: 1,
            comm: "python3".into(),
            frames: vec![python(line), python(20)],
            truncated: false,
            labels: None,
            state: ThreadState::OnCpu,
        };
        let mut profile = Profile::new(99);
        profile.add(key(4), 2);
        let cached = profile.frames.intern(python(30));
        profile.frames.intern(python(40));
        let generation = profile.frames.generation();
        let mut carried = None;
        profile.renew_frames(|carry| carried = Some(carry.carry(cached)));
        assert_ne!(profile.frames.generation(), generation);
        assert_eq!(profile.frames.len(), 3, "the two stack frames and the carried one");
        assert_eq!(profile.frames.frame(carried.unwrap()), &python(30));
        let (stack, weight) = profile.stacks().next().unwrap();
        assert_eq!(weight.samples, 2);
        assert_eq!(stack.frames.iter().cloned().collect::<Vec<_>>(), vec![python(4), python(20)]);
        // Interning again finds the carried frames rather than adding them twice.
        assert_eq!(profile.frames.intern(python(20)), profile.frames.intern(python(20)));
        assert_eq!(profile.frames.len(), 3);
    }
}
