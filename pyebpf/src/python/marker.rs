//! Marker chains (CPython 3.15). For a thread whose marker pyebpf may write (see
//! `cpython::marker`), it *establishes* a chain now and then: it reads the thread's current frame
//! `F` and the marker's sequence number, points the marker at `F`, reads the frames from `F`
//! rootward (down to the previous chain's marker, whose tail is already proven), then reads the
//! sequence number again. Unchanged, it proves `F` did not return while its ancestors were read,
//! so they are exactly the frames that stay frozen until `F` returns; from then on, `k` returns of
//! the marker frame move the marker `k` positions up that chain and the sequence number by `k`.
//! The eBPF program checks marker and sequence against the chain's addresses (`PY_MARKERS`) and
//! stops its walk there; a sample that joined a chain takes its proven tail from here.

use std::collections::VecDeque;

use pyebpf_common::{py_status, MarkerChain, SampleRecord, MARKER_POSITIONS, MARKER_REESTABLISH_FRAMES, MAX_PY_FRAMES};

use super::frames::{Memory, PyItem, Resolver};
use crate::chain::LinkReader;
use crate::cpython::PyError;
use crate::kernel_maps::KernelMaps;
use crate::ktime::monotonic_ns;
use crate::merge::PyStackItem;
use crate::stack::{FrameCarry, FrameTable};
use crate::stats::Stats;

/// And at most this often per thread (by the sample's clock, in ns), so a thread whose calls come
/// and go costs little.
const ESTABLISH_INTERVAL_NS: u64 = 10_000_000;
/// A thread whose chain failed to read this many times in a row gets no more marker writes: its
/// memory is damaged or hostile (a race ends in `Ok(None)` and does not count).
const MAX_ESTABLISH_FAILURES: u32 = 3;
/// Chains kept per thread at most, newest first: samples still in flight when a chain is replaced
/// (a consumer that fell behind) may have joined an older one. A thread's samples reach the ring
/// buffer in the order taken, so a replaced chain is dropped once a sample of the thread taken
/// after the replacement (and this margin, for records written from another CPU) is read.
const CHAINS_KEPT: usize = 64;
const REPLACED_MARGIN_NS: u64 = 10_000_000;

/// A chain pyebpf proved when it wrote the marker, innermost (the marker frame) first.
pub(super) struct EstablishedChain {
    pub(super) gen: u64,
    /// The marker's sequence number when the marker was pointed at `addrs[0]`.
    seq_base: u64,
    pub(super) addrs: Vec<u64>,
    /// The resolved frame at each position (`None`: a frame Python's own view leaves out).
    items: Vec<Option<PyItem>>,
    /// When the eBPF program stopped joining it (`CLOCK_MONOTONIC`), once a newer one is tried.
    replaced_ns: Option<u64>,
}

/// Part of a chain, innermost first: frame addresses and what each resolved to.
type ChainPart = (Vec<u64>, Vec<Option<PyItem>>);

/// A registered thread: its thread state, and the marker chains proven for it.
pub(super) struct Thread {
    pub(super) tstate: u64,
    /// When the eBPF program was told of it (`CLOCK_MONOTONIC`): samples taken since knew it.
    pub(super) registered_ns: u64,
    chains: VecDeque<EstablishedChain>,
    /// When the last establishment ended (`CLOCK_MONOTONIC`): samples taken before it say nothing
    /// of the chain it set, which they could not join.
    established_ns: Option<u64>,
    /// Establishments in a row whose reads failed.
    failures: u32,
}

impl Thread {
    pub(super) fn new(tstate: u64, registered_ns: u64) -> Self {
        Thread { tstate, registered_ns, chains: VecDeque::new(), established_ns: None, failures: 0 }
    }

    fn chain(&self, gen: u64) -> Option<&EstablishedChain> {
        self.chains.iter().find(|c| c.gen == gen)
    }

    /// Whether a sample that walked this far should have a new chain established now.
    fn due(&self, record: &SampleRecord) -> bool {
        let joined_near_leaf = record.py.status & py_status::JOINED != 0 && record.py.frames_len <= MARKER_REESTABLISH_FRAMES;
        // A chain deeper than the kernel walks could only be proven by reading all of it here.
        let too_deep = record.py.status & py_status::TOO_DEEP != 0;
        let settled = self.established_ns.is_none_or(|at| record.time_ns >= at.saturating_add(ESTABLISH_INTERVAL_NS));
        !joined_near_leaf && !too_deep && settled && self.failures < MAX_ESTABLISH_FAILURES
    }

    /// Marks the newest chain replaced now, and drops those no sample still in flight can have
    /// joined: replaced before `record` (of this thread) was taken.
    fn replace_chain(&mut self, record: &SampleRecord, now_ns: u64) {
        self.chains.retain(|chain| chain.replaced_ns.is_none_or(|at| at.saturating_add(REPLACED_MARGIN_NS) > record.time_ns));
        if let Some(newest) = self.chains.front_mut() {
            newest.replaced_ns.get_or_insert(now_ns);
        }
    }

    pub(super) fn clear(&mut self) {
        self.chains.clear();
    }

    pub(super) fn carry_frames(&mut self, carry: &mut FrameCarry<'_>) {
        for item in self.chains.iter_mut().flat_map(|chain| chain.items.iter_mut().flatten()) {
            if let PyStackItem::Frame(id) = item {
                *id = carry.carry(*id);
            }
        }
    }
}

/// Appends the proven rest of the chain a sample joined (of its `thread`, where registered); false
/// when the walk ended on something unproven. `task_at` is set to where in `items` the frame at
/// `task_frame` ends.
pub(super) fn complete_chain(
    thread: Option<&Thread>,
    record: &SampleRecord,
    task_frame: Option<u64>,
    task_at: &mut Option<usize>,
    items: &mut Vec<PyItem>,
    stats: &mut Stats,
) -> bool {
    let py = &record.py;
    if py.status & py_status::COMPLETE != 0 {
        return true;
    }
    if py.status & py_status::JOINED == 0 {
        return false;
    }
    let Some(chain) = thread.and_then(|thread| thread.chain(py.marker_gen)) else { return false };
    let from = py.marker_position as usize + 1;
    let tail = chain.items.get(from..).unwrap_or_default();
    stats.frames_joined += tail.len() as u64;
    stats.marker_joins += 1;
    for (item, addr) in tail.iter().zip(&chain.addrs[from..]) {
        items.extend(item);
        if task_frame == Some(*addr) && task_at.is_none() {
            *task_at = Some(items.len());
        }
    }
    true
}

/// Establishes a new marker chain for the sampled thread when the kernel had to walk far; true
/// when `gen` was used.
pub(super) fn maybe_establish<M: Memory>(
    resolver: &mut Resolver<M>,
    thread: &mut Thread,
    record: &SampleRecord,
    gen: u64,
    kernel: &mut dyn KernelMaps,
    stats: &mut Stats,
    frames: &mut FrameTable,
) -> bool {
    // A sample in another thread state of the thread (a subinterpreter's) says nothing of the
    // registered one, whose marker this would move.
    let tstate = thread.tstate;
    if record.py.tstate != tstate || !thread.due(record) || !resolver.py.marker_writable(tstate) || !resolver.py.decoded_frames() {
        return false;
    }
    // While the marker moves, the eBPF program must not join the old chain: a marker moved by
    // returns of the new marker frame could land on an address the old chain also holds.
    kernel.remove_marker_chain(record.tid);
    thread.replace_chain(record, monotonic_ns());
    let established = establish(resolver, thread, gen, frames);
    thread.failures = if established.is_err() { thread.failures + 1 } else { 0 };
    let used_gen = match established {
        Ok(Some(chain)) => {
            let value = chain.kernel_value();
            thread.chains.truncate(CHAINS_KEPT - 1);
            thread.chains.push_front(chain);
            stats.markers_established += 1;
            if let Err(err) = kernel.set_marker_chain(record.tid, &value) {
                log::debug!("tid {}: {err}", record.tid);
            }
            true
        }
        Ok(None) => {
            stats.marker_races += 1;
            false
        }
        Err(err) => {
            log::debug!("pid {} tid {}: marker not established: {err}", resolver.pid(), record.tid);
            stats.marker_races += 1;
            false
        }
    };
    thread.established_ns = Some(monotonic_ns());
    used_gen
}

impl EstablishedChain {
    /// What the eBPF program is told of the chain.
    fn kernel_value(&self) -> MarkerChain {
        let mut value = MarkerChain { gen: self.gen, seq_base: self.seq_base, len: self.addrs.len().min(MARKER_POSITIONS) as u32, ..Default::default() };
        for (slot, addr) in value.addrs.iter_mut().zip(&self.addrs) {
            *slot = *addr;
        }
        value
    }

    /// The proven tail from the position the marker is at now, if it sits where its frames'
    /// returns put it.
    fn tail_at(&self, seq: u64, marker: u64) -> Option<ChainPart> {
        let position = usize::try_from(seq.wrapping_sub(self.seq_base)).ok()?;
        (self.addrs.get(position) == Some(&marker)).then(|| (self.addrs[position + 1..].to_vec(), self.items[position + 1..].to_vec()))
    }
}

/// The protocol in the module comment. `Ok(None)`: the thread moved while it was read.
fn establish<M: Memory>(resolver: &mut Resolver<M>, thread: &Thread, gen: u64, frames: &mut FrameTable) -> Result<Option<EstablishedChain>, PyError> {
    let tstate = thread.tstate;
    let before = resolver.py.read_marker_state(tstate)?;
    if before.current_frame == 0 {
        return Ok(None);
    }
    // The previous chain's marker, if it sits where its frames' returns put it: its tail is proven.
    let anchor = thread.chains.front().and_then(|chain| chain.tail_at(before.seq, before.marker));
    let anchor_addr = anchor.as_ref().map(|_| before.marker);
    // Read once before writing: a thread whose frames cannot be read (damaged or hostile memory)
    // never gets a write. The reads after the write are what prove the chain.
    check_chain(resolver, before.current_frame, anchor_addr)?;
    resolver.py.set_last_profiled_frame(tstate, before.current_frame)?;
    let Some((mut addrs, mut items)) = read_chain(resolver, before.current_frame, anchor_addr, frames)? else { return Ok(None) };
    let after = resolver.py.read_marker_state(tstate)?;
    if after.seq != before.seq || after.marker != before.current_frame {
        return Ok(None);
    }
    if let (Some((tail_addrs, tail_items)), Some(&last)) = (anchor, addrs.last()) {
        if Some(last) == anchor_addr {
            addrs.extend(tail_addrs);
            items.extend(tail_items);
        }
    }
    Ok(Some(EstablishedChain { gen, seq_base: before.seq, addrs, items, replaced_ns: None }))
}

/// The frames from `addr` rootward, resolved, down to the root or to `stop_at` (included);
/// `Ok(None)` where the chain loops or runs past the walk's depth (it moved while read).
fn read_chain<M: Memory>(resolver: &mut Resolver<M>, mut addr: u64, stop_at: Option<u64>, frames: &mut FrameTable) -> Result<Option<ChainPart>, PyError> {
    let mut addrs = Vec::new();
    let mut items = Vec::new();
    while addr != 0 {
        if addrs.len() >= MAX_PY_FRAMES || addrs.contains(&addr) {
            return Ok(None);
        }
        let link = resolver.py.read_link(addr)?;
        let version = if link.kind.runs_code() { resolver.py.code_version(link.code)? } else { 0 };
        addrs.push(addr);
        items.push(resolver.resolve_link(&link, version, frames)?);
        if Some(addr) == stop_at {
            break;
        }
        addr = link.previous;
    }
    Ok(Some((addrs, items)))
}

/// Errs unless the chain from `addr` reads to its root (or to `stop_at`) within the walk's depth.
fn check_chain<M: Memory>(resolver: &mut Resolver<M>, mut addr: u64, stop_at: Option<u64>) -> Result<(), PyError> {
    let mut walked = 0;
    while addr != 0 && Some(addr) != stop_at {
        if walked >= MAX_PY_FRAMES {
            return Err(PyError::Chain(format!("longer than {MAX_PY_FRAMES} frames, or looping")));
        }
        addr = resolver.py.read_link(addr)?.previous;
        walked += 1;
    }
    Ok(())
}
