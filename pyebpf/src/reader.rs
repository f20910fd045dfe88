//! The ring-buffer reader: a thread of its own that drains the kernel's `SAMPLES` ring buffer into
//! batches and hands them to the consumer (resolving, symbolizing, aggregating) through a channel,
//! so a slow consumer step (a cold DWARF parse can take seconds) never leaves the ring buffer full.
//!
//! The thread sleeps until there is work: the eBPF program wakes it once a batch is pending or the
//! last wakeup is older than a latency bound ([`wakeup_latency`], [`URGENT_LATENCY`]), so an idle
//! host never wakes it; the consumer wakes it (an eventfd) to drain at once or to stop.
//!
//! Batches are raw record bytes in buffers that travel back to the reader once consumed, so the
//! steady state allocates nothing. What the consumer has not taken is bounded ([`MAX_QUEUED_BYTES`]
//! or a few ring buffers' worth): beyond that the reader drops the batch and counts its records as
//! lost, rather than block (which would let the ring buffer overflow silently) or grow unbounded.

use std::mem::offset_of;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use aya::maps::{MapData, RingBuf};
use pyebpf_common::{
    record_kind, OffCpuEnd, ProcessEvent, PyFrameRecord, SampleRecord, TaskCapture, TaskRecord, WaitingTasks, MAX_KERNEL_FRAMES, MAX_TASKS, MAX_USER_FRAMES,
    STACK_SNAPSHOT_MAX,
};

/// How long records wait in the ring buffer at most while more keep coming, at `frequency_hz`:
/// about [`BATCH_PERIODS`] sampling periods, from [`MIN_WAKEUP_LATENCY`] to [`MAX_WAKEUP_LATENCY`]
/// (the kernel wakes the reader at the first record this long after its last wakeup). Each wake-up
/// costs the reader and the consumer tens of microseconds, more than resolving a sample of a hot
/// loop, and a batch resolved at once finds the caches warm: a busy host wakes them once a batch
/// of samples, not at every sample, and at the rates fleets run at (19 to 99 Hz) every 1 to 2 s.
/// Short enough that a process's samples are resolved while it runs (its code objects are read
/// from it; a process in its first second has the urgent bound).
pub fn wakeup_latency(frequency_hz: u64) -> Duration {
    let periods = Duration::from_nanos(BATCH_PERIODS.saturating_mul(1_000_000_000) / frequency_hz.max(1));
    periods.clamp(MIN_WAKEUP_LATENCY, MAX_WAKEUP_LATENCY)
}

/// Sampling periods a batch spans, within the bounds below.
const BATCH_PERIODS: u64 = 100;
const MIN_WAKEUP_LATENCY: Duration = Duration::from_millis(250);
const MAX_WAKEUP_LATENCY: Duration = Duration::from_secs(2);

/// The same for a sample of a process userspace does not know yet, or of a Python thread it has
/// not registered: a short-lived process must be attached, and a new thread registered, while they
/// run.
pub const URGENT_LATENCY: Duration = Duration::from_millis(10);

/// Once records came, the reader looks again this many wakeup latencies after unless woken
/// before: the kernel wakes it only at a record, so the last records before a quiet spell would
/// otherwise wait for the next. After a look that finds nothing, it sleeps until woken.
const LOOK_AGAIN_LATENCIES: u32 = 2;

/// Record bytes waiting for the consumer at most, unless four ring buffers' worth is more: 10 to
/// 20 s of typical samples at 99 Hz on 2 CPUs (stack copies of 6 to 7 KB), and with pyebpf's own
/// 30-odd MB still within a 64 MB budget.
const MAX_QUEUED_BYTES: usize = 24 << 20;

/// Batches the channel holds at most (the byte bound usually binds first).
const MAX_QUEUED_BATCHES: usize = 4096;

/// Consumed buffers kept for reuse at most, and their capacity in all: a burst that queued many or
/// large batches (the start of a host-wide run, while processes are attached) does not leave its
/// memory held for the rest of the run. A steady batch is tens to hundreds of KiB.
const MAX_SPARE_BATCHES: usize = 16;
const MAX_SPARE_BYTES: usize = 2 << 20;

/// Records drained from the ring buffer in one go, as sent: each record's bytes, back to back.
#[derive(Default)]
struct RawBatch {
    bytes: Vec<u8>,
    /// The end of each record in `bytes`.
    ends: Vec<usize>,
    /// On an empty batch sent after a drain the consumer asked for: that request's number.
    drained: u64,
}

impl RawBatch {
    fn clear(&mut self) {
        self.bytes.clear();
        self.ends.clear();
        self.drained = 0;
    }

    /// Adds a ring-buffer item: a sample packed (see [`pack_sample`]), any other record as sent. A
    /// sample shorter than its fixed part is malformed, and left out as decoding would.
    fn push(&mut self, item: &[u8]) {
        if kind(item) != Some(record_kind::SAMPLE) {
            self.bytes.extend_from_slice(item);
        } else if item.len() >= SampleRecord::HEADER_LEN {
            pack_sample(item, &mut self.bytes);
        } else {
            return;
        }
        self.ends.push(self.bytes.len());
    }

    fn records(&self) -> impl Iterator<Item = &[u8]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(self.ends.iter().copied()).map(|(start, end)| &self.bytes[start..end])
    }
}

/// What the reader dropped because the consumer was behind.
#[derive(Debug, Default)]
pub struct ReaderDrops {
    pub batches: AtomicU64,
    pub samples: AtomicU64,
    pub events: AtomicU64,
}

/// State shared by the reader thread and the consumer.
struct Shared {
    stop: AtomicBool,
    /// Wakes the reader thread: to drain now, or to stop.
    wake: OwnedFd,
    /// Drains asked for so far (see [`RingReader::drain`]).
    drains: AtomicU64,
    queued_bytes: AtomicUsize,
    /// Buffers sent back for reuse and not yet taken, and their capacity in all.
    spare: AtomicUsize,
    spare_bytes: AtomicUsize,
    drops: ReaderDrops,
}

/// The reader thread, running until dropped.
pub struct RingReader {
    batches: tokio::sync::mpsc::Receiver<RawBatch>,
    recycle: mpsc::Sender<RawBatch>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// The ring buffer, moved to the reader thread; only that thread touches it from then on.
struct OwnedRing(RingBuf<MapData>);

// SAFETY: the ring buffer is its map's fd plus mappings of the kernel's pages, used by one thread
// at a time (created on one, then moved to the reader thread for good).
unsafe impl Send for OwnedRing {}

impl RingReader {
    /// Starts the thread; `ring_bytes` is the ring buffer's size.
    /// `latency`: the kernel's [`wakeup_latency`].
    pub fn start(ring: RingBuf<MapData>, ring_bytes: usize, latency: Duration) -> std::io::Result<RingReader> {
        let (sender, batches) = tokio::sync::mpsc::channel(MAX_QUEUED_BATCHES);
        let (recycle, recycled) = mpsc::channel();
        // SAFETY: eventfd takes a count and flags and returns a new descriptor or -1.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: just created, owned by nothing else.
        let wake = unsafe { OwnedFd::from_raw_fd(wake) };
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            wake,
            drains: AtomicU64::new(0),
            queued_bytes: AtomicUsize::new(0),
            spare: AtomicUsize::new(0),
            spare_bytes: AtomicUsize::new(0),
            drops: ReaderDrops::default(),
        });
        let reader = Reader {
            ring: OwnedRing(ring),
            sender,
            recycled,
            shared: shared.clone(),
            max_queued: MAX_QUEUED_BYTES.max(4 * ring_bytes),
            look_again: latency * LOOK_AGAIN_LATENCIES,
        };
        let thread = std::thread::Builder::new().name("pyebpf-reader".into()).spawn(move || reader.run())?;
        Ok(RingReader { batches, recycle, shared, thread: Some(thread) })
    }

    /// Waits for the next batch, then takes every batch queued into `out` (whose consumed buffers
    /// go back to the reader first). False when the reader has stopped (a poll error).
    pub async fn read(&mut self, out: &mut RecordBatch) -> bool {
        self.give_back(out);
        let Some(first) = self.batches.recv().await else { return false };
        self.take(out, first);
        while let Ok(next) = self.batches.try_recv() {
            self.take(out, next);
        }
        true
    }

    /// Takes everything the kernel sent so far into `out` (as [`Self::read`]): the reader drains
    /// the ring buffer now and marks where that drain ends. For the end of a run, and for a view
    /// that must be current (a refresh of `top`, a period's end). False when the reader has stopped.
    pub async fn drain(&mut self, out: &mut RecordBatch) -> bool {
        self.give_back(out);
        let asked = self.shared.drains.fetch_add(1, Ordering::AcqRel) + 1;
        if signal(self.shared.wake.as_raw_fd()).is_err() {
            return false;
        }
        loop {
            let Some(raw) = self.batches.recv().await else { return false };
            let drained = raw.drained;
            self.take(out, raw);
            if drained >= asked {
                return true;
            }
        }
    }

    /// Batches waiting for the consumer.
    pub fn queued(&self) -> usize {
        self.batches.len()
    }

    pub fn drops(&self) -> &ReaderDrops {
        &self.shared.drops
    }

    fn give_back(&self, out: &mut RecordBatch) {
        for mut raw in out.raw.drain(..) {
            let (spare, spare_bytes) = (&self.shared.spare, &self.shared.spare_bytes);
            let capacity = raw.bytes.capacity();
            if spare.load(Ordering::Relaxed) >= MAX_SPARE_BATCHES || spare_bytes.load(Ordering::Relaxed) + capacity > MAX_SPARE_BYTES {
                continue;
            }
            raw.clear();
            spare.fetch_add(1, Ordering::Relaxed);
            spare_bytes.fetch_add(capacity, Ordering::Relaxed);
            // The reader has stopped when this fails; the buffer just goes.
            let _ = self.recycle.send(raw);
        }
        out.next_raw = 0;
        out.next_record = 0;
    }

    fn take(&self, out: &mut RecordBatch, raw: RawBatch) {
        self.shared.queued_bytes.fetch_sub(raw.bytes.len(), Ordering::Relaxed);
        out.raw.push(raw);
    }
}

impl Drop for RingReader {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.batches.close();
        // A reader that cannot be woken polls on: it is not joined then.
        if signal(self.shared.wake.as_raw_fd()).is_err() {
            return;
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct Reader {
    ring: OwnedRing,
    sender: tokio::sync::mpsc::Sender<RawBatch>,
    recycled: mpsc::Receiver<RawBatch>,
    shared: Arc<Shared>,
    max_queued: usize,
    look_again: Duration,
}

impl Reader {
    fn run(mut self) {
        let fd = self.ring.0.as_raw_fd();
        let wake = self.shared.wake.as_raw_fd();
        let mut batch = RawBatch::default();
        let mut drained = 0;
        let mut timeout = None;
        loop {
            if let Err(err) = wait_readable(fd, wake, timeout) {
                crate::report!("cannot poll the sample ring buffer, no more samples are read: {err}");
                return;
            }
            if self.shared.stop.load(Ordering::Relaxed) {
                return;
            }
            // Read after the wakeup was taken: a drain asked for later wakes the thread again.
            let asked = self.shared.drains.load(Ordering::Acquire);
            drain(&mut self.ring.0, &mut batch);
            timeout = (!batch.ends.is_empty()).then_some(self.look_again);
            if !batch.ends.is_empty() {
                batch = match self.send(batch) {
                    Some(kept) => kept,
                    None => return,
                };
            }
            if asked != drained {
                drained = asked;
                // After the batch, and never dropped: the consumer waits for it.
                if self.sender.blocking_send(RawBatch { drained, ..RawBatch::default() }).is_err() {
                    return;
                }
            }
        }
    }

    /// Sends a batch and returns an empty buffer to fill next; None once the consumer is gone.
    fn send(&mut self, mut batch: RawBatch) -> Option<RawBatch> {
        let queued = self.shared.queued_bytes.load(Ordering::Relaxed);
        if queued + batch.bytes.len() > self.max_queued {
            self.count_dropped(&batch);
            batch.clear();
            return Some(batch);
        }
        let len = batch.bytes.len();
        self.shared.queued_bytes.fetch_add(len, Ordering::Relaxed);
        match self.sender.try_send(batch) {
            Ok(()) => Some(self.take_spare()),
            Err(tokio::sync::mpsc::error::TrySendError::Full(mut batch)) => {
                self.shared.queued_bytes.fetch_sub(len, Ordering::Relaxed);
                self.count_dropped(&batch);
                batch.clear();
                Some(batch)
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => None,
        }
    }

    fn take_spare(&self) -> RawBatch {
        match self.recycled.try_recv() {
            Ok(batch) => {
                self.shared.spare.fetch_sub(1, Ordering::Relaxed);
                self.shared.spare_bytes.fetch_sub(batch.bytes.capacity(), Ordering::Relaxed);
                batch
            }
            Err(_) => RawBatch::default(),
        }
    }

    fn count_dropped(&self, batch: &RawBatch) {
        let drops = &self.shared.drops;
        drops.batches.fetch_add(1, Ordering::Relaxed);
        for record in batch.records() {
            let counter = match kind(record) {
                Some(record_kind::SAMPLE | record_kind::OFF_CPU_END) => &drops.samples,
                // Not samples: the tasks of one sent before.
                Some(record_kind::WAITING_TASKS) => continue,
                _ => &drops.events,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Waits until the ring buffer's fd or the eventfd `wake` is readable, or `timeout` passed (None:
/// no timeout); takes the eventfd's count.
fn wait_readable(fd: RawFd, wake: RawFd, timeout: Option<Duration>) -> std::io::Result<()> {
    let mut poll_fds = [libc::pollfd { fd, events: libc::POLLIN, revents: 0 }, libc::pollfd { fd: wake, events: libc::POLLIN, revents: 0 }];
    let timeout = timeout.map_or(-1, |timeout| timeout.as_millis() as libc::c_int);
    // SAFETY: two valid pollfds for the duration of the call.
    let result = unsafe { libc::poll(poll_fds.as_mut_ptr(), 2, timeout) };
    if result < 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    if poll_fds[1].revents & libc::POLLIN != 0 {
        let mut count = 0u64;
        // SAFETY: an eventfd is read 8 bytes at a time, into `count`; a failed read (EAGAIN) leaves it.
        unsafe { libc::read(wake, &mut count as *mut u64 as *mut libc::c_void, 8) };
    }
    Ok(())
}

/// Wakes the thread polling the eventfd `wake`.
fn signal(wake: RawFd) -> std::io::Result<()> {
    let one = 1u64;
    // SAFETY: an eventfd is written 8 bytes at a time, from `one`.
    if unsafe { libc::write(wake, &one as *const u64 as *const libc::c_void, 8) } == 8 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn drain(ring: &mut RingBuf<MapData>, batch: &mut RawBatch) {
    while let Some(item) = ring.next() {
        batch.push(&item);
    }
}

fn kind(item: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(item.get(..4)?.try_into().ok()?))
}

/// One record of the ring buffer: a sample, or a lifecycle event of a sampled process, in the
/// order they happened.
pub enum Record<'a> {
    Sample(&'a SampleRecord),
    Event(ProcessEvent),
    /// A thread captured as it left the CPU came back.
    OffCpuEnd(OffCpuEnd),
    /// The waiting tasks of the thread of the capture sent before it.
    WaitingTasks(&'a WaitingTasks),
}

/// The records the consumer took in one read, decoded one at a time into a reused sample.
pub struct RecordBatch {
    raw: Vec<RawBatch>,
    next_raw: usize,
    next_record: usize,
    sample: Box<SampleRecord>,
    /// Python frames the previous record wrote: what must be zeroed again before a shorter one.
    sample_dirty: usize,
    waiting: Box<WaitingTasks>,
}

impl Default for RecordBatch {
    fn default() -> Self {
        // SAFETY: all-zero bytes are a valid SampleRecord (plain data).
        let sample = unsafe { Box::<SampleRecord>::new_zeroed().assume_init() };
        // SAFETY: all-zero bytes are a valid WaitingTasks (plain data).
        let waiting = unsafe { Box::<WaitingTasks>::new_zeroed().assume_init() };
        RecordBatch { raw: Vec::new(), next_raw: 0, next_record: 0, sample, sample_dirty: 0, waiting }
    }
}

impl RecordBatch {
    /// A batch of these ring-buffer items, as the reader would hand them over (public for fuzzing).
    pub fn from_items<'i>(items: impl IntoIterator<Item = &'i [u8]>) -> RecordBatch {
        let mut raw = RawBatch::default();
        for item in items {
            raw.push(item);
        }
        RecordBatch { raw: vec![raw], ..RecordBatch::default() }
    }

    /// The next record; malformed ones are skipped.
    #[allow(clippy::should_implement_trait)] // lends from self: not an Iterator
    pub fn next(&mut self) -> Option<Record<'_>> {
        loop {
            let raw = self.raw.get(self.next_raw)?;
            let Some(&end) = raw.ends.get(self.next_record) else {
                self.next_raw += 1;
                self.next_record = 0;
                continue;
            };
            let start = if self.next_record == 0 { 0 } else { raw.ends[self.next_record - 1] };
            self.next_record += 1;
            let item = &raw.bytes[start..end];
            match kind(item) {
                Some(record_kind::SAMPLE) if decode_sample(item, &mut self.sample, &mut self.sample_dirty) => {
                    return Some(Record::Sample(&self.sample));
                }
                Some(record_kind::EXEC | record_kind::EXIT) => {
                    if let Some(event) = decode_plain::<ProcessEvent>(item) {
                        return Some(Record::Event(event));
                    }
                }
                Some(record_kind::OFF_CPU_END) => {
                    if let Some(end) = decode_plain::<OffCpuEnd>(item) {
                        return Some(Record::OffCpuEnd(end));
                    }
                }
                Some(record_kind::WAITING_TASKS) if item.len() == size_of::<WaitingTasks>() => {
                    // SAFETY: exactly one WaitingTasks' bytes, plain data of which any pattern is valid.
                    unsafe { std::ptr::copy_nonoverlapping(item.as_ptr(), &mut *self.waiting as *mut WaitingTasks as *mut u8, item.len()) };
                    return Some(Record::WaitingTasks(&self.waiting));
                }
                _ => {}
            }
        }
    }
}

/// A fixed-size record (`ProcessEvent`, `OffCpuEnd`: plain data of which any bit pattern is valid).
fn decode_plain<T: Copy>(item: &[u8]) -> Option<T> {
    if item.len() != size_of::<T>() {
        return None;
    }
    // SAFETY: exactly one T's bytes; callers pass only plain-data record types.
    Some(unsafe { std::ptr::read_unaligned(item.as_ptr() as *const T) })
}

/// Where the arrays of a sample's fixed part begin (the scalars come before them).
const USER_STACK: usize = offset_of!(SampleRecord, user_stack);
const FRAME_BASES: usize = offset_of!(SampleRecord, user_frame_bases);
const KERNEL_STACK: usize = offset_of!(SampleRecord, kernel_stack);
const TASKS: usize = offset_of!(SampleRecord, tasks);
const TASK_LIST: usize = TASKS + offset_of!(TaskCapture, tasks);

// The parts packing keeps cover the whole fixed part when every array is full.
const _: () = assert!(USER_STACK + MAX_USER_FRAMES * 8 == FRAME_BASES && FRAME_BASES + MAX_USER_FRAMES * 8 == KERNEL_STACK);
const _: () = assert!(KERNEL_STACK + MAX_KERNEL_FRAMES * 8 == TASKS);
const _: () = assert!(TASK_LIST + MAX_TASKS * size_of::<TaskRecord>() == SampleRecord::HEADER_LEN);

/// The parts of a sample's fixed part a packed sample keeps first, whatever the sample: the
/// scalars and the task chain's own fields, where the lengths of the arrays are.
const LENGTH_PARTS: [Range<usize>; 2] = [0..USER_STACK, TASKS..TASK_LIST];

/// The used entries of a sample's three stacks and task chain, as ranges of its fixed part, in the
/// order a packed sample keeps them after [`LENGTH_PARTS`], whose lengths `header` is read for.
fn used_entries(header: &[u8]) -> [Range<usize>; 4] {
    let len_at =
        |offset: usize, max: usize| header.get(offset..offset + 4).map_or(0, |b| u32::from_ne_bytes(b.try_into().unwrap_or_default()) as usize).min(max);
    // Entry 0 of the user stack, the sampled instruction, is read even where no stack was walked.
    let user = len_at(offset_of!(SampleRecord, user_len), MAX_USER_FRAMES).max(1);
    let bases = len_at(offset_of!(SampleRecord, frame_bases_len), MAX_USER_FRAMES);
    let kernel = len_at(offset_of!(SampleRecord, kernel_len), MAX_KERNEL_FRAMES);
    let tasks = len_at(TASKS + offset_of!(TaskCapture, len), MAX_TASKS);
    [
        USER_STACK..USER_STACK + user * 8,
        FRAME_BASES..FRAME_BASES + bases * 8,
        KERNEL_STACK..KERNEL_STACK + kernel * 8,
        TASK_LIST..TASK_LIST + tasks * size_of::<TaskRecord>(),
    ]
}

/// Appends a sample as the consumer takes it: the fixed part sizes its arrays for the deepest
/// stacks (about 4 KiB, mostly unused), and copying records is most of what the reader and the
/// decoding do, so only [`LENGTH_PARTS`] and the [`used_entries`] are kept, then the Python frames
/// and stack copy as sent. `item` holds at least the fixed part.
fn pack_sample(item: &[u8], out: &mut Vec<u8>) {
    for part in LENGTH_PARTS.into_iter().chain(used_entries(item)) {
        out.extend_from_slice(&item[part]);
    }
    out.extend_from_slice(&item[SampleRecord::HEADER_LEN..]);
}

/// Puts a packed sample's fixed part back in place in `header` (a sample's fixed part, of which
/// the array entries past their lengths keep what they held); the bytes of `packed` it took.
fn unpack_header(packed: &[u8], header: &mut [u8]) -> Option<usize> {
    let mut taken = 0;
    let mut take = |part: Range<usize>, header: &mut [u8]| -> Option<()> {
        let bytes = packed.get(taken..taken + part.len())?;
        header.get_mut(part)?.copy_from_slice(bytes);
        taken += bytes.len();
        Some(())
    };
    for part in LENGTH_PARTS {
        take(part, header)?;
    }
    for part in used_entries(header) {
        take(part, header)?;
    }
    Some(taken)
}

/// A sample as packed (see [`pack_sample`]): the used parts of the fixed part, then as many
/// Python frames as it says, then the stack copy it says (into `stack_tail`); the Python frames
/// past those sent are zero. `dirty_frames` is how many the previous record wrote. True when the
/// record is well formed.
fn decode_sample(item: &[u8], sample: &mut SampleRecord, dirty_frames: &mut usize) -> bool {
    // SAFETY: the fixed part of a SampleRecord as bytes; every byte pattern is a valid SampleRecord
    // (plain data).
    let header = unsafe { std::slice::from_raw_parts_mut(sample as *mut SampleRecord as *mut u8, SampleRecord::HEADER_LEN) };
    let Some(header_len) = unpack_header(item, header) else { return false };
    let frames = sample.frames_sent();
    let stack_len = sample.stack_len as usize;
    let frame_bytes = frames * size_of::<PyFrameRecord>();
    if frames > sample.py_frames.len() || stack_len > STACK_SNAPSHOT_MAX || item.len() != header_len + frame_bytes + stack_len {
        return false;
    }
    let (py_bytes, stack) = item[header_len..].split_at(frame_bytes);
    // SAFETY: `frames` fit in `py_frames` (checked), and PyFrameRecord is plain data.
    unsafe { std::ptr::copy_nonoverlapping(py_bytes.as_ptr(), sample.py_frames.as_mut_ptr() as *mut u8, py_bytes.len()) };
    if *dirty_frames > frames {
        // SAFETY: frames..dirty_frames lies within `py_frames`; zero is a valid PyFrameRecord.
        unsafe { std::ptr::write_bytes(sample.py_frames.as_mut_ptr().add(frames), 0, *dirty_frames - frames) };
    }
    *dirty_frames = frames;
    sample.stack_tail[..stack_len].copy_from_slice(stack);
    true
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::wakeup_latency;

    #[test]
    fn a_batch_spans_about_100_periods_within_a_quarter_second_and_two_seconds() {
        assert_eq!(wakeup_latency(19), Duration::from_secs(2));
        assert_eq!(wakeup_latency(49), Duration::from_secs(2));
        assert_eq!(wakeup_latency(99), Duration::from_nanos(100_000_000_000 / 99));
        assert_eq!(wakeup_latency(199), Duration::from_nanos(100_000_000_000 / 199));
        assert_eq!(wakeup_latency(999), Duration::from_millis(250));
        assert_eq!(wakeup_latency(0), Duration::from_secs(2));
    }
}
