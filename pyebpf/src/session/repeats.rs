//! Samples that repeat one resolved before: a thread in a hot loop sends the same record (the
//! same Python frames with the same code identities and instructions, the same native and kernel
//! addresses) many times a period. Such a record is resolved once; its repeats are counted with
//! the stack resolved then, each with its own time and weight.
//!
//! The key is everything resolution reads from the record, so what a sample proves at sample
//! time (each Python frame's code identity) stays in it. The innermost user address is kept
//! apart: the merge reads only its level's traits, so a record differing only there, at an
//! address whose level has the same traits, resolves to the same stack, but for that level's own
//! frames where the stack shows them (a hot C function's hundreds of addresses); where the merge
//! put Python frames in its place (the interpreter's eval loop), to the very same stack.
//! What resolution reads outside the record is covered by invalidation: the frame table (the
//! whole cache goes with it), a process forgotten or whose Python state changed (its entries go,
//! through its epoch), native entries looked up again (all of them, or a process's found in no
//! mapping: the entries that read one). A record with a stack copy is keyed by
//! what the copy unwound to (unwinding reads nothing else of it), so only unwinding is done
//! again. Records with asyncio tasks, or off CPU, bypass the cache: their resolution keeps state
//! of its own.

use std::hash::{BuildHasher, Hasher};

use hashbrown::{DefaultHashBuilder, HashMap, HashTable};
use pyebpf_common::{origin, PyFrameRecord, SampleRecord};

use super::native::{LeafLevel, LeafUse, NativeUse};
use crate::native_ids::LevelTraits;
use crate::stack::{same_values, FrameId};
use crate::stats::SampleCounts;
use crate::unwind::Unwound;

/// Entries kept at most, and the bytes of their keys and stacks: past either, the cache starts
/// afresh (a loop that fills it in one period gains little from it). A 100-deep Python stack's
/// entry is about 5 KiB; the bytes bound keeps the cache a small part of the 64 MB budget.
const MAX_ENTRIES: usize = 4096;
const MAX_BYTES: usize = 8 << 20;
/// Processes whose epoch is kept at most: beyond, every entry goes with the epochs.
const MAX_EPOCHS: usize = 65_536;

/// What a record's innermost user address must be for an entry to hold for it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LeafMatch {
    /// An address whose level has these traits; where the stack shows its frames, they go at
    /// `shown_at` of the entry's frames (which lack them).
    Alike { traits: LevelTraits, shown_at: Option<u32> },
    /// Any (there is none, or native frames were not read).
    Any,
}

/// A resolved sample, kept for its repeats.
struct Entry {
    /// The identity's hash, without the innermost user address.
    hash: u64,
    leaf: LeafMatch,
    pid: u32,
    /// The process's epoch and Python state when it was resolved: either changed, it is stale.
    epoch: u32,
    python_state: u64,
    key: Box<[u8]>,
    frames: Box<[FrameId]>,
    truncated: bool,
    /// The per-sample counters its resolution added, added again for each repeat.
    counts: SampleCounts,
    /// Its native stack read a level found in no mapping.
    unmapped: bool,
}

/// What a repeat is counted with.
pub struct Resolved<'a> {
    pub frames: &'a [FrameId],
    /// Where the repeat's leaf level's frames go in `frames`, and they.
    pub leaf: Option<(usize, &'a [FrameId])>,
    pub truncated: bool,
    pub counts: SampleCounts,
}

/// The first-stage cache of resolved samples, by record identity.
pub struct Repeats {
    enabled: bool,
    hasher: DefaultHashBuilder,
    entries: HashTable<Entry>,
    bytes: usize,
    epochs: HashMap<u32, u32>,
}

/// A record's identity, as slices of the record: hashed and compared in place, copied only when
/// kept. The innermost user address is apart from the rest.
struct Identity<'r> {
    fixed: [u8; FIXED_LEN],
    parts: [&'r [u8]; 4],
    leaf: Option<u64>,
}

/// tgid, tid, the user stack's and frame bases' lengths, kernel_len, user_status, origin, whether
/// the user stack was unwound from a copy, user_sp, comm, and the Python capture's tstate, frame,
/// marker_gen, marker_position, status, frames_len.
const FIXED_LEN: usize = 8 * 4 + 8 + 16 + 3 * 8 + 3 * 4;

impl<'r> Identity<'r> {
    /// `unwound`: the user stack as unwound from the record's copy.
    fn of(record: &'r SampleRecord, unwound: Option<&'r Unwound>) -> Identity<'r> {
        let mut fixed = [0u8; FIXED_LEN];
        let py = &record.py;
        let (user, bases) = match unwound {
            Some(unwound) => (&unwound.addrs[..], &unwound.frame_bases[..]),
            None => (
                &record.user_stack[..(record.user_len as usize).min(record.user_stack.len())],
                &record.user_frame_bases[..(record.frame_bases_len as usize).min(record.user_frame_bases.len())],
            ),
        };
        let copied = u32::from(unwound.is_some());
        let words32 = [record.tgid, record.tid, user.len() as u32, bases.len() as u32, record.kernel_len, record.user_status, record.origin, copied];
        let words64 = [record.user_sp, py.tstate, py.frame, py.marker_gen];
        let tail32 = [py.marker_position, py.status, py.frames_len];
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            fixed[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        words32.iter().for_each(|word| put(&word.to_ne_bytes()));
        words64.iter().for_each(|word| put(&word.to_ne_bytes()));
        put(&record.comm);
        tail32.iter().for_each(|word| put(&word.to_ne_bytes()));
        let kernel = &record.kernel_stack[..(record.kernel_len as usize).min(record.kernel_stack.len())];
        let python = &record.py_frames[..(py.frames_len as usize).min(record.py_frames.len())];
        let (leaf, callers) = match user.split_first() {
            Some((&leaf, callers)) => (Some(leaf), callers),
            None => (None, user),
        };
        Identity { fixed, parts: [words_bytes(callers), words_bytes(bases), words_bytes(kernel), frames_bytes(python)], leaf }
    }

    fn len(&self) -> usize {
        FIXED_LEN + self.parts.iter().map(|part| part.len()).sum::<usize>()
    }

    fn hash(&self, hasher: &DefaultHashBuilder) -> u64 {
        let mut state = hasher.build_hasher();
        state.write(&self.fixed);
        for part in self.parts {
            // Lengths are in `fixed`: the parts cannot shift into one another.
            state.write(part);
        }
        state.finish()
    }

    fn matches(&self, key: &[u8]) -> bool {
        if key.len() != self.len() || !same_values(&key[..FIXED_LEN], &self.fixed) {
            return false;
        }
        let mut rest = &key[FIXED_LEN..];
        self.parts.iter().all(|part| {
            let (head, tail) = rest.split_at(part.len());
            rest = tail;
            same_values(head, part)
        })
    }

    fn to_key(&self) -> Box<[u8]> {
        let mut key = Vec::with_capacity(self.len());
        key.extend_from_slice(&self.fixed);
        for part in self.parts {
            key.extend_from_slice(part);
        }
        key.into_boxed_slice()
    }
}

fn words_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: u64s are plain bytes; the slice covers exactly the words' memory.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), size_of_val(words)) }
}

fn frames_bytes(frames: &[PyFrameRecord]) -> &[u8] {
    // SAFETY: PyFrameRecord is repr(C) plain data with explicit padding, so every byte is set.
    unsafe { std::slice::from_raw_parts(frames.as_ptr().cast(), size_of_val(frames)) }
}

/// Where a record's resolution goes in the cache, once resolved.
pub struct Slot {
    hash: u64,
    pid: u32,
    epoch: u32,
    python_state: u64,
    key: Box<[u8]>,
}

impl Repeats {
    /// `PYEBPF_TEST_NO_REPEAT_CACHE` set: every sample is resolved (tests compare both ways).
    pub fn new() -> Self {
        let enabled = std::env::var_os("PYEBPF_TEST_NO_REPEAT_CACHE").is_none();
        Repeats { enabled, hasher: DefaultHashBuilder::default(), entries: HashTable::new(), bytes: 0, epochs: HashMap::new() }
    }

    /// A cache that keeps nothing: every sample is resolved.
    #[cfg(test)]
    pub fn disabled() -> Self {
        Repeats { enabled: false, ..Repeats::new() }
    }

    /// Whether the record's resolution reads nothing but its identity (with its copy's unwinding,
    /// where it has one) and state kept per process.
    fn cacheable(&self, record: &SampleRecord, unwound: Option<&Unwound>) -> bool {
        let tasks = &record.tasks;
        let copy_unwound = record.stack_len == 0 || unwound.is_some();
        self.enabled && record.origin == origin::ON_CPU && copy_unwound && tasks.len == 0 && tasks.status == 0 && tasks.frames_len == 0
    }

    /// The stack resolved for an identical record, or where this one's goes once resolved (None:
    /// it bypasses the cache). `leaf_level`: the process's level at an innermost user address,
    /// where known without a look-up.
    pub fn look_up<'a>(
        &'a self,
        record: &SampleRecord,
        unwound: Option<&Unwound>,
        python_state: u64,
        leaf_level: impl Fn(u64) -> Option<LeafLevel<'a>>,
    ) -> Result<Resolved<'a>, Option<Slot>> {
        if !self.cacheable(record, unwound) {
            return Err(None);
        }
        let identity = Identity::of(record, unwound);
        let hash = identity.hash(&self.hasher);
        let epoch = self.epoch(record.tgid);
        let leaf = identity.leaf.and_then(leaf_level);
        let holds = |entry: &Entry| {
            let leaf_holds = match entry.leaf {
                LeafMatch::Alike { traits, shown_at } => leaf.is_some_and(|leaf| leaf.traits == traits && (shown_at.is_none() || leaf.frames.is_some())),
                LeafMatch::Any => true,
            };
            leaf_holds && entry.hash == hash && entry.epoch == epoch && entry.python_state == python_state && identity.matches(&entry.key)
        };
        match self.entries.find(hash, holds) {
            Some(entry) => {
                let leaf = match (entry.leaf, leaf.and_then(|leaf| leaf.frames)) {
                    (LeafMatch::Alike { shown_at: Some(at), .. }, Some(frames)) => Some((at as usize, frames)),
                    _ => None,
                };
                Ok(Resolved { frames: &entry.frames, leaf, truncated: entry.truncated, counts: entry.counts })
            }
            None => Err(Some(Slot { hash, pid: record.tgid, epoch, python_state, key: identity.to_key() })),
        }
    }

    /// Keeps a record's resolution for its repeats; `native`: what its stack read of its native
    /// levels.
    pub fn keep(&mut self, slot: Slot, frames: &[FrameId], truncated: bool, counts: SampleCounts, native: NativeUse) {
        let (leaf, frames): (LeafMatch, Box<[FrameId]>) = match native.leaf {
            LeafUse::Shown { at, len, traits } => {
                let Some(after) = at.checked_add(len).filter(|&end| end <= frames.len()) else { return };
                let without = frames[..at].iter().chain(&frames[after..]).copied().collect();
                (LeafMatch::Alike { traits, shown_at: Some(at as u32) }, without)
            }
            LeafUse::Hidden(traits) => (LeafMatch::Alike { traits, shown_at: None }, frames.into()),
            LeafUse::Unread => (LeafMatch::Any, frames.into()),
        };
        let bytes = slot.key.len() + size_of_val(&frames[..]);
        if self.entries.len() >= MAX_ENTRIES || self.bytes + bytes > MAX_BYTES {
            self.clear();
        }
        let entry = Entry {
            hash: slot.hash,
            leaf,
            pid: slot.pid,
            epoch: slot.epoch,
            python_state: slot.python_state,
            key: slot.key,
            frames,
            truncated,
            counts,
            unmapped: native.unmapped,
        };
        // A stale entry for the same records is replaced: one for the same traits of the leaf.
        let traits = |leaf: LeafMatch| match leaf {
            LeafMatch::Alike { traits, .. } => Some(traits),
            LeafMatch::Any => None,
        };
        let same_records = |old: &Entry| old.hash == entry.hash && traits(old.leaf) == traits(entry.leaf) && same_values(&old.key, &entry.key);
        match self.entries.find_entry(entry.hash, same_records) {
            Ok(mut old) => {
                self.bytes -= old.get().key.len() + size_of_val(&old.get().frames[..]);
                *old.get_mut() = entry;
            }
            Err(_) => {
                self.entries.insert_unique(entry.hash, entry, |entry| entry.hash);
            }
        }
        self.bytes += bytes;
    }

    fn epoch(&self, pid: u32) -> u32 {
        self.epochs.get(&pid).copied().unwrap_or(0)
    }

    /// What was resolved for `pid` no longer holds.
    pub fn invalidate(&mut self, pid: u32) {
        if self.epochs.len() >= MAX_EPOCHS && !self.epochs.contains_key(&pid) {
            self.clear();
            self.epochs.clear();
        }
        let epoch = self.epochs.entry(pid).or_insert(0);
        *epoch = epoch.wrapping_add(1);
    }

    /// The levels found in no mapping of processes `pids` are looked up again: the entries that
    /// read one go.
    pub fn forget_unmapped(&mut self, pids: &[u32]) {
        if pids.is_empty() {
            return;
        }
        let bytes = &mut self.bytes;
        self.entries.retain(|entry| {
            let stale = entry.unmapped && pids.contains(&entry.pid);
            if stale {
                *bytes -= entry.key.len() + size_of_val(&entry.frames[..]);
            }
            !stale
        });
    }

    /// Forgets every entry (a new frame table, a new mode, native entries dropped).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }
}
