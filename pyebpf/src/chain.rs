//! Resolving a thread's interpreter frame chain with few remote reads.
//!
//! A sample gives the innermost frame address (captured by the eBPF program); the chain behind it is
//! followed through `previous` pointers in the target's memory, one remote read per frame when
//! nothing is cached. Two caches cut that down:
//!
//! - **Marker (3.15).** After each sample pyebpf writes the innermost frame's address into the
//!   thread's `last_profiled_frame`. When the interpreter pops exactly that frame it moves the marker
//!   to the parent and bumps `last_profiled_frame_seq`, so at the next sample every frame from the
//!   marker rootward is still the frame pyebpf saw: only the frames above it are read. The marker is
//!   trusted when it sits in the cached chain at the depth the sequence number says it moved to
//!   (a reused frame address or another profiler's write breaks that) and the marker frame itself
//!   still has the cached code object and parent.
//! - **Address batch (3.13/3.14, and 3.15 when the marker misses).** The cached chain predicts the
//!   addresses of the frames behind any frame it contains; they are all fetched in one vectored read,
//!   and each is accepted only where the fresh `previous` pointers actually lead to it. The result is
//!   as exact as an uncached walk, with one remote read instead of one per frame.

use std::collections::{HashMap, HashSet};

/// What the walk needs of one `_PyInterpreterFrame`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLink {
    pub addr: u64,
    pub previous: u64,
    /// `f_executable` with tag bits cleared.
    pub code: u64,
    pub instr_ptr: u64,
    pub kind: LinkKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// A frame running a code object.
    Code,
    /// An entry frame: it ends the segment of one interpreter activation.
    Entry,
    /// Any other frame the interpreter keeps for itself (shims, incomplete frames).
    Internal,
}

/// Reads frames from the target process.
pub trait LinkReader {
    type Error;
    fn read_link(&mut self, addr: u64) -> Result<FrameLink, Self::Error>;
    /// Reads several frames in one remote read, in order; may return fewer than asked (a read that
    /// failed part way stops the list).
    fn read_links(&mut self, addrs: &[u64]) -> Result<Vec<FrameLink>, Self::Error>;
}

#[derive(Debug, thiserror::Error)]
pub enum ChainError<E> {
    #[error("frame chain loops back to frame {0:#x}")]
    Cycle(u64),
    #[error("frame chain deeper than {0} frames")]
    TooDeep(usize),
    #[error(transparent)]
    Read(E),
}

/// `last_profiled_frame` and its sequence number as the eBPF program read them at the sample.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Marker {
    pub frame: u64,
    pub seq: u64,
}

/// What the kernel captured of the thread at the sample.
#[derive(Clone, Copy, Debug, Default)]
pub struct Capture {
    pub frame: u64,
    /// The leaf frame's code object and instruction pointer, 0 where they were not read.
    pub leaf_code: u64,
    pub leaf_instr_ptr: u64,
    pub marker: Option<Marker>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheMode {
    Off,
    AddressBatch,
    /// The marker first, the address batch where it misses.
    Marker,
}

/// The chain resolved at a thread's previous sample.
#[derive(Debug, Default)]
pub struct CachedChain {
    links: Vec<FrameLink>,
    positions: HashMap<u64, usize>,
    /// The marker's sequence number at that sample.
    seq: u64,
}

impl CachedChain {
    pub fn new(links: Vec<FrameLink>, seq: u64) -> Self {
        let positions = links.iter().enumerate().map(|(i, l)| (l.addr, i)).collect();
        CachedChain { links, positions, seq }
    }

    /// The position of the frame the marker points to, if the marker can be trusted.
    fn marker_anchor(&self, marker: Marker) -> Option<usize> {
        let position = *self.positions.get(&marker.frame)?;
        (marker.seq.wrapping_sub(self.seq) == position as u64).then_some(position)
    }

    fn previous_of(&self, position: usize) -> u64 {
        self.links.get(position + 1).map_or(0, |l| l.addr)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Marker: it was the leaf, only the leaf frame was read. Batch: one batch read the whole chain.
    Hit,
    /// Marker: found below new frames. Batch: the batch read part of the chain.
    PartialHit,
    Miss,
}

/// The chain of one sample, innermost first.
#[derive(Debug)]
pub struct Walk {
    pub links: Vec<FrameLink>,
    /// The leaf frame no longer ran the code the kernel saw: only the leaf is exact.
    pub moved: bool,
    pub frames_read: u64,
    pub frames_reused: u64,
    /// How each cache the mode allows fared; `None` where it was not consulted.
    pub marker: Option<CacheOutcome>,
    pub batch: Option<CacheOutcome>,
}

/// Follows the chain from the captured frame, using `cached` as `mode` allows.
pub fn walk_chain<R: LinkReader>(
    reader: &mut R,
    capture: &Capture,
    cached: Option<&CachedChain>,
    mode: CacheMode,
    max_depth: usize,
) -> Result<Walk, ChainError<R::Error>> {
    let mut walk = Walk { links: Vec::new(), moved: false, frames_read: 0, frames_reused: 0, marker: None, batch: None };
    let mut seen = HashSet::new();
    let cached = cached.filter(|_| mode != CacheMode::Off);
    let mut anchor = match (mode, cached, capture.marker) {
        (CacheMode::Marker, Some(chain), Some(marker)) if marker.frame != 0 => chain.marker_anchor(marker),
        _ => None,
    };
    if mode == CacheMode::Marker {
        walk.marker = Some(CacheOutcome::Miss);
    }
    let mut batch_stopped_at = None;
    let mut batched = false;
    let mut addr = capture.frame;
    while addr != 0 {
        check_next(&seen, addr, walk.links.len(), max_depth)?;
        if let (Some(position), Some(chain)) = (anchor, cached) {
            if chain.links[position].addr == addr {
                anchor = None;
                let link = read_one(reader, addr, &mut walk)?;
                seen.insert(addr);
                walk.links.push(link);
                let expected = chain.links[position];
                if link.code == expected.code
                    && link.previous == chain.previous_of(position)
                    && reuse_tail(&mut walk, &mut seen, &chain.links[position + 1..], max_depth)
                {
                    walk.marker = Some(if walk.links.len() - walk.frames_reused as usize == 1 {
                        CacheOutcome::Hit
                    } else {
                        CacheOutcome::PartialHit
                    });
                    break;
                }
                addr = link.previous;
                continue;
            }
        }
        // Before a trusted marker is reached, frames are read one by one: a batch could run past it.
        if let (false, None, Some(chain)) = (batched, anchor, cached) {
            if let Some(&position) = chain.positions.get(&addr) {
                batched = true;
                let predicted: Vec<u64> = chain.links[position..].iter().map(|l| l.addr).collect();
                let fetched = reader.read_links(&predicted).map_err(ChainError::Read)?;
                walk.frames_read += fetched.len() as u64;
                for link in fetched {
                    if link.addr != addr || addr == 0 {
                        break;
                    }
                    check_next(&seen, addr, walk.links.len(), max_depth)?;
                    seen.insert(addr);
                    walk.links.push(link);
                    addr = link.previous;
                }
                batch_stopped_at = Some(addr);
                continue;
            }
        }
        let link = read_one(reader, addr, &mut walk)?;
        seen.insert(addr);
        walk.links.push(link);
        addr = link.previous;
    }
    if cached.is_some() && walk.marker != Some(CacheOutcome::Hit) && walk.marker != Some(CacheOutcome::PartialHit) {
        walk.batch = Some(match batch_stopped_at {
            Some(0) => CacheOutcome::Hit,
            Some(_) => CacheOutcome::PartialHit,
            None => CacheOutcome::Miss,
        });
    }
    apply_kernel_leaf(&mut walk, capture);
    Ok(walk)
}

fn check_next<E>(seen: &HashSet<u64>, addr: u64, depth: usize, max_depth: usize) -> Result<(), ChainError<E>> {
    if seen.contains(&addr) {
        return Err(ChainError::Cycle(addr));
    }
    if depth >= max_depth {
        return Err(ChainError::TooDeep(max_depth));
    }
    Ok(())
}

fn read_one<R: LinkReader>(reader: &mut R, addr: u64, walk: &mut Walk) -> Result<FrameLink, ChainError<R::Error>> {
    walk.frames_read += 1;
    reader.read_link(addr).map_err(ChainError::Read)
}

/// Appends the cached frames behind a trusted marker. Refuses (and appends nothing) where they
/// would repeat a frame already walked or exceed the depth limit.
fn reuse_tail(walk: &mut Walk, seen: &mut HashSet<u64>, tail: &[FrameLink], max_depth: usize) -> bool {
    if walk.links.len() + tail.len() > max_depth || tail.iter().any(|l| seen.contains(&l.addr)) {
        return false;
    }
    seen.extend(tail.iter().map(|l| l.addr));
    walk.links.extend_from_slice(tail);
    walk.frames_reused += tail.len() as u64;
    true
}

/// The kernel read the leaf at the sample itself: its code and instruction pointer are exact even
/// when the thread moved on before userspace read the chain.
fn apply_kernel_leaf(walk: &mut Walk, capture: &Capture) {
    if capture.leaf_code == 0 {
        return;
    }
    let kernel_leaf = FrameLink {
        addr: capture.frame,
        previous: 0,
        code: capture.leaf_code,
        instr_ptr: capture.leaf_instr_ptr,
        kind: LinkKind::Code,
    };
    match walk.links.first_mut() {
        Some(leaf) if leaf.code == capture.leaf_code => leaf.instr_ptr = capture.leaf_instr_ptr,
        Some(leaf) => {
            walk.moved = true;
            *leaf = FrameLink { previous: leaf.previous, ..kernel_leaf };
        }
        None => {
            walk.moved = true;
            walk.links.push(kernel_leaf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread's frames in memory, with the interpreter's marker rules.
    #[derive(Default)]
    struct FakeThread {
        frames: HashMap<u64, FrameLink>,
        current: u64,
        marker: Marker,
        calls: u64,
    }

    impl FakeThread {
        fn push(&mut self, addr: u64, code: u64) {
            let link = FrameLink { addr, previous: self.current, code, instr_ptr: code * 10, kind: LinkKind::Code };
            self.frames.insert(addr, link);
            self.current = addr;
        }

        fn pop(&mut self) {
            let popped = self.frames.remove(&self.current).unwrap();
            if self.marker.frame == popped.addr {
                self.marker = Marker { frame: popped.previous, seq: self.marker.seq + 1 };
            }
            self.current = popped.previous;
        }

        fn capture(&self) -> Capture {
            let leaf = self.frames[&self.current];
            Capture { frame: self.current, leaf_code: leaf.code, leaf_instr_ptr: leaf.instr_ptr, marker: Some(self.marker) }
        }

        fn codes(walk: &Walk) -> Vec<u64> {
            walk.links.iter().map(|l| l.code).collect()
        }
    }

    impl LinkReader for FakeThread {
        type Error = String;
        fn read_link(&mut self, addr: u64) -> Result<FrameLink, String> {
            self.calls += 1;
            self.frames.get(&addr).copied().ok_or_else(|| format!("no frame at {addr:#x}"))
        }
        fn read_links(&mut self, addrs: &[u64]) -> Result<Vec<FrameLink>, String> {
            self.calls += 1;
            Ok(addrs.iter().map_while(|a| self.frames.get(a).copied()).collect())
        }
    }

    fn deep_thread(depth: u64) -> FakeThread {
        let mut t = FakeThread::default();
        for i in 1..=depth {
            t.push(0x1000 * i, i);
        }
        t
    }

    /// Walks like the profiler does: resolve, then move the marker to the leaf and cache the chain.
    fn sample(t: &mut FakeThread, cache: &mut Option<CachedChain>, mode: CacheMode) -> Walk {
        t.calls = 0;
        let capture = t.capture();
        let walk = walk_chain(t, &capture, cache.as_ref(), mode, 1000).unwrap();
        t.marker.frame = capture.frame;
        *cache = Some(CachedChain::new(walk.links.clone(), capture.marker.unwrap().seq));
        walk
    }

    #[test]
    fn uncached_walk_reads_every_frame() {
        let mut t = deep_thread(50);
        let walk = sample(&mut t, &mut None, CacheMode::Off);
        assert_eq!(FakeThread::codes(&walk), (1..=50).rev().collect::<Vec<_>>());
        assert_eq!((t.calls, walk.frames_read), (50, 50));
    }

    #[test]
    fn address_batch_reads_a_known_chain_at_once() {
        let mut t = deep_thread(50);
        let mut cache = None;
        sample(&mut t, &mut cache, CacheMode::AddressBatch);
        t.pop();
        t.push(0xdead0000, 99);
        let walk = sample(&mut t, &mut cache, CacheMode::AddressBatch);
        let mut expected: Vec<u64> = (1..=49).rev().collect();
        expected.insert(0, 99);
        assert_eq!(FakeThread::codes(&walk), expected);
        assert_eq!(t.calls, 2, "one read for the new leaf, one batch for the rest");
        assert_eq!(walk.batch, Some(CacheOutcome::Hit));
    }

    #[test]
    fn address_batch_follows_fresh_pointers_not_the_cache() {
        let mut t = deep_thread(10);
        let mut cache = None;
        sample(&mut t, &mut cache, CacheMode::AddressBatch);
        // Same addresses, different frames below the leaf: the batch must not trust the old chain.
        for _ in 0..5 {
            t.pop();
        }
        t.push(0x3000 + 0x1000, 77);
        t.frames.get_mut(&0x4000).unwrap().previous = 0x2000;
        t.push(0x5000, 88);
        let walk = sample(&mut t, &mut cache, CacheMode::AddressBatch);
        assert_eq!(FakeThread::codes(&walk), [88, 77, 2, 1]);
        assert_eq!(walk.batch, Some(CacheOutcome::PartialHit));
    }

    #[test]
    fn marker_at_the_leaf_reads_one_frame() {
        let mut t = deep_thread(400);
        let mut cache = None;
        sample(&mut t, &mut cache, CacheMode::Marker);
        let walk = sample(&mut t, &mut cache, CacheMode::Marker);
        assert_eq!(walk.marker, Some(CacheOutcome::Hit));
        assert_eq!(FakeThread::codes(&walk), (1..=400).rev().collect::<Vec<_>>());
        assert_eq!((t.calls, walk.frames_reused), (1, 399));
    }

    #[test]
    fn marker_moved_by_pops_is_found_below_new_frames() {
        let mut t = deep_thread(20);
        let mut cache = None;
        sample(&mut t, &mut cache, CacheMode::Marker);
        t.pop();
        t.pop();
        t.push(0x13000, 55);
        let walk = sample(&mut t, &mut cache, CacheMode::Marker);
        assert_eq!(walk.marker, Some(CacheOutcome::PartialHit));
        let mut expected: Vec<u64> = (1..=18).rev().collect();
        expected.insert(0, 55);
        assert_eq!(FakeThread::codes(&walk), expected);
        assert_eq!(t.calls, 2);
    }

    #[test]
    fn marker_at_a_reused_address_is_not_trusted() {
        let mut t = deep_thread(10);
        let mut cache = None;
        sample(&mut t, &mut cache, CacheMode::Marker);
        // Another profiler points the marker at a cached address without the sequence moving.
        t.marker.frame = 0x5000;
        let walk = sample(&mut t, &mut cache, CacheMode::Marker);
        assert_eq!(walk.marker, Some(CacheOutcome::Miss));
        assert_eq!(FakeThread::codes(&walk), (1..=10).rev().collect::<Vec<_>>());
    }

    #[test]
    fn leaf_that_moved_on_keeps_the_kernel_capture() {
        let mut t = deep_thread(3);
        let mut capture = t.capture();
        capture.leaf_code = 42;
        let walk = walk_chain(&mut t, &capture, None, CacheMode::Off, 100).unwrap();
        assert!(walk.moved);
        assert_eq!(FakeThread::codes(&walk), [42, 2, 1]);
    }

    #[test]
    fn cycles_and_depth_are_bounded() {
        let mut t = deep_thread(3);
        t.frames.get_mut(&0x1000).unwrap().previous = 0x3000;
        let capture = t.capture();
        assert!(matches!(walk_chain(&mut t, &capture, None, CacheMode::Off, 100), Err(ChainError::Cycle(0x3000))));
        let mut t = deep_thread(30);
        let capture = t.capture();
        assert!(matches!(walk_chain(&mut t, &capture, None, CacheMode::Off, 10), Err(ChainError::TooDeep(10))));
    }
}
