//! `record --otlp`: what each stack's aggregated weight is made of, event by event, and each
//! thread's own name, kept beside the counts (only while exporting) for OTLP samples to carry
//! `timestamps_unix_nano` and `thread.name`; the other outputs never read it.

use std::sync::Arc;

use hashbrown::HashMap;

use super::{Profile, SampleStack, Stack, Weight};
use crate::process::comm_to_string;

/// The most events an export period keeps (16 bytes each: about 32 MB).
pub const MAX_EVENTS: usize = 2_000_000;

/// One counted event: a sample or an interval off CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// When it was sampled, or its thread left the CPU (an interval; a thread blocked since before
    /// the recording: the end), in ns since the Unix epoch.
    pub unix_ns: i64,
    /// The time it stands for, as its weight counts it.
    pub ns: u64,
}

/// The events of a profile's stacks, within a bound shared by the pieces of an export period.
#[derive(Debug)]
pub struct Timeline {
    /// `CLOCK_REALTIME` − `CLOCK_MONOTONIC` (the clock of the records' times), read once: a
    /// clock step during the run must not reorder events.
    offset_ns: i64,
    limit: usize,
    /// Events kept in the export period so far, this piece's and the earlier pieces' (each with
    /// its stack, in the profile's counts).
    kept: usize,
    /// Each thread's latest `comm` (pid, tid): the kernel's name of the thread itself.
    thread_names: HashMap<(u32, u32), Arc<str>>,
    /// This piece had an event past the bound: its events are gone.
    overflowed: bool,
}

impl Timeline {
    pub fn new(limit: usize) -> Timeline {
        let offset_ns = clock_ns(libc::CLOCK_REALTIME) - clock_ns(libc::CLOCK_MONOTONIC);
        Timeline::with_offset(offset_ns, limit)
    }

    pub(crate) fn with_offset(offset_ns: i64, limit: usize) -> Timeline {
        Timeline { offset_ns, limit, kept: 0, thread_names: HashMap::new(), overflowed: false }
    }

    /// An empty timeline for the next piece of the same export period (past the bound too, if
    /// this one is).
    pub fn next_piece(&self) -> Timeline {
        Timeline { kept: self.kept, ..Timeline::with_offset(self.offset_ns, self.limit) }
    }

    /// A new export period starts: the bound is whole again.
    pub fn restart_bound(&mut self) {
        self.kept = 0;
    }

    fn keep(&mut self, monotonic_ns: u64, ns: u64) -> Kept {
        if self.kept >= self.limit {
            // The period is sent without timestamps (as a profile's samples should all have the
            // same shape): what was kept of this piece is of no use.
            return match std::mem::replace(&mut self.overflowed, true) {
                false => Kept::Overflowed,
                true => Kept::Dropped,
            };
        }
        self.kept += 1;
        Kept::Event(Event { unix_ns: (monotonic_ns as i64).saturating_add(self.offset_ns), ns })
    }

    /// Whether events of the export period (of this piece or an earlier one) went past the bound.
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    fn name_thread(&mut self, pid: u32, tid: u32, comm: &[u8]) {
        let name = comm.split(|&byte| byte == 0).next().unwrap_or_default();
        if self.thread_names.get(&(pid, tid)).is_none_or(|known| known.as_bytes() != name) {
            self.thread_names.insert((pid, tid), comm_to_string(comm).into());
        }
    }

    /// The threads sampled, (pid, tid), with their own names.
    pub fn thread_names(&self) -> impl Iterator<Item = ((u32, u32), &str)> {
        self.thread_names.iter().map(|(&thread, name)| (thread, &**name))
    }
}

/// What became of an event.
enum Kept {
    Event(Event),
    /// Past the bound, as the events before it: they are of no use.
    Overflowed,
    Dropped,
}

impl Profile {
    /// Adds a resolved sample that happened (or began) at `monotonic_ns`: with a timeline, its
    /// event is kept too.
    pub fn add_event(&mut self, sample: SampleStack<'_>, weight: Weight, monotonic_ns: u64) {
        let kept = self.timeline.as_mut().map_or(Kept::Dropped, |timeline| timeline.keep(monotonic_ns, weight.ns));
        let counted = self.counted(&sample);
        counted.weight += weight;
        match kept {
            Kept::Event(event) => counted.events.push(event),
            Kept::Overflowed => self.counts.values_mut().for_each(|counted| counted.events = Vec::new()),
            Kept::Dropped => {}
        }
    }

    /// With a timeline, notes the name (`comm`) the kernel gives thread `tid` of `pid` now.
    pub fn name_thread(&mut self, pid: u32, tid: u32, comm: &[u8]) {
        if let Some(timeline) = &mut self.timeline {
            timeline.name_thread(pid, tid, comm);
        }
    }

    /// Every aggregated stack with its weight and, where every sample of it was kept as an event,
    /// its events in the order they were counted.
    pub fn timed_stacks(&self) -> impl Iterator<Item = (Stack<'_>, Weight, Option<&[Event]>)> {
        let timed = self.timeline.as_ref().is_some_and(|timeline| !timeline.overflowed);
        self.counts.iter().map(move |(stored, counted)| {
            let (weight, events) = (counted.weight, &counted.events[..]);
            // A stack also added without a time (not through `add_event`) is not all there.
            let events = (timed && !events.is_empty() && events.len() as u64 == weight.samples).then_some(events);
            (self.stack(stored), weight, events)
        })
    }
}

fn clock_ns(clock: libc::clockid_t) -> i64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills the timespec it is given.
    if unsafe { libc::clock_gettime(clock, &mut now) } != 0 {
        return 0;
    }
    now.tv_sec * 1_000_000_000 + now.tv_nsec
}
