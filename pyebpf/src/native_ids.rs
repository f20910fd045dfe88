//! Native and kernel stack entries as interned frames, resolved once per address: a sample whose
//! addresses were all seen before costs one hash lookup per entry and allocates nothing.
//!
//! A user address outside every known mapping is forgotten by the resolver's periodic upkeep once
//! older than [`UNMAPPED_RECHECK`], and looked up again at its next sample (a library loaded since
//! may hold it), like [`MapsCache`] re-reads maps; one that could never be code (in the stack, say,
//! where glibc's start code leaves a frame-pointer walk) is not, as no library can map there.

use std::time::{Duration, Instant};

use hashbrown::{HashMap, HashSet};

use crate::maps::MapsCache;
use crate::merge::{in_libc, is_interpreter_frame, is_start_code, NativeLevel};
use crate::stack::{Frame, FrameCarry, FrameId, FrameTable, NativeFrame};
use crate::symbolize::{call_sites, Symbolizer};

/// How long an address found in no mapping is taken as such before it is looked up again.
pub(crate) const UNMAPPED_RECHECK: Duration = Duration::from_millis(100);

/// Frame ids kept at most (in levels); beyond, every cache starts afresh.
const MAX_LEVEL_IDS: usize = 1 << 20;

/// One user stack entry: its frames (one, or several for inlined calls) in [`NativeIds`].
#[derive(Clone, Copy, Debug)]
pub struct IdLevel {
    first: u32,
    len: u32,
    traits: LevelTraits,
    /// When an unmapped entry that may yet turn out to be code was looked up.
    checked_at: Option<Instant>,
}

/// What the merge reads of a level: levels alike in these are merged alike, whatever they name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LevelTraits {
    mapped: bool,
    runs_python: bool,
    start_code: bool,
    in_libc: bool,
}

impl LevelTraits {
    /// The traits of a level of these frames.
    pub fn of(frames: &[NativeFrame]) -> LevelTraits {
        LevelTraits {
            mapped: frames.iter().any(|frame| frame.module.is_some()),
            runs_python: frames.iter().any(is_interpreter_frame),
            start_code: frames.iter().any(is_start_code),
            in_libc: frames.iter().any(in_libc),
        }
    }
}

impl IdLevel {
    pub fn traits(&self) -> LevelTraits {
        self.traits
    }

    /// Whether upkeep will look it up again: it lay in no mapping, where code may be mapped since.
    pub fn awaits_recheck(&self) -> bool {
        self.checked_at.is_some()
    }
}

impl NativeLevel for IdLevel {
    fn is_mapped(&self) -> bool {
        self.traits.mapped
    }

    fn runs_python(&self) -> bool {
        self.traits.runs_python
    }

    fn is_start_code(&self) -> bool {
        self.traits.start_code
    }

    fn in_libc(&self) -> bool {
        self.traits.in_libc
    }
}

/// Resolved entries of each process, by call-site address.
type ProcessLevels = HashMap<u64, IdLevel>;

#[derive(Default)]
pub struct NativeIds {
    user: HashMap<u32, ProcessLevels>,
    /// The processes with unmapped entries, which upkeep looks through (no other).
    with_unmapped: HashSet<u32>,
    /// The frames of every level, back to back.
    level_ids: Vec<FrameId>,
    kernel: HashMap<u64, FrameId>,
    /// Times every process's entries went at once (past the bound): what a sample resolved to
    /// before may resolve otherwise since.
    resets: u64,
}

impl NativeIds {
    /// The frames of a level, innermost first.
    pub fn frames(&self, level: &IdLevel) -> &[FrameId] {
        &self.level_ids[level.first as usize..(level.first + level.len) as usize]
    }

    /// A user stack as `bpf_get_stack` returns it (innermost first), as levels into `out`. Only
    /// the entries not seen before in the process are symbolized (a new leaf, mostly).
    pub fn user_levels(&mut self, symbolizer: &mut Symbolizer, maps: &mut MapsCache, frames: &mut FrameTable, pid: u32, stack: &[u64], out: &mut Vec<IdLevel>) {
        if !self.known_levels(pid, stack, out) {
            self.resolve_user(symbolizer, maps, frames, pid, stack);
            let all_known = self.known_levels(pid, stack, out);
            debug_assert!(all_known, "every entry was just resolved");
        }
    }

    /// The levels of `stack` into `out` when every entry was resolved before.
    fn known_levels(&self, pid: u32, stack: &[u64], out: &mut Vec<IdLevel>) -> bool {
        out.clear();
        let Some(levels) = self.user.get(&pid) else { return stack.is_empty() };
        for site in call_sites(stack) {
            match levels.get(&site) {
                Some(level) => out.push(*level),
                None => return false,
            }
        }
        true
    }

    /// `pid`'s level at `site`, if it was resolved before.
    pub fn known_level(&self, pid: u32, site: u64) -> Option<IdLevel> {
        self.user.get(&pid)?.get(&site).copied()
    }

    /// Symbolizes the entries of `stack` not resolved before.
    fn resolve_user(&mut self, symbolizer: &mut Symbolizer, maps: &mut MapsCache, frames: &mut FrameTable, pid: u32, stack: &[u64]) {
        self.enforce_bound();
        let levels = self.user.entry(pid).or_default();
        let mut sites: Vec<u64> = call_sites(stack).filter(|site| !levels.contains_key(site)).collect();
        sites.sort_unstable();
        sites.dedup();
        // Where every site is known without a look-up (a new address of a function resolved
        // before), the batch look-up's set-up is most of the cost.
        let known: Option<Vec<_>> = sites.iter().map(|&site| symbolizer.known_site(maps, pid, site)).collect();
        let resolved = known.unwrap_or_else(|| symbolizer.site_levels(maps, pid, &sites));
        let snapshot = maps.latest(pid);
        for (site, native) in sites.into_iter().zip(resolved) {
            let traits = LevelTraits::of(&native);
            let recheck = !traits.mapped && !snapshot.is_some_and(|maps| maps.never_code_at(site));
            let level = IdLevel { first: self.level_ids.len() as u32, len: native.len() as u32, traits, checked_at: recheck.then(Instant::now) };
            if recheck {
                self.with_unmapped.insert(pid);
            }
            self.level_ids.extend(native.into_iter().map(|frame| frames.intern(Frame::Native(frame))));
            levels.insert(site, level);
        }
    }

    /// A kernel stack (innermost first) as frame ids appended to `out`.
    pub fn kernel_frames(&mut self, symbolizer: &mut Symbolizer, frames: &mut FrameTable, stack: &[u64], out: &mut Vec<FrameId>) {
        let start = out.len();
        for site in call_sites(stack) {
            match self.kernel.get(&site) {
                Some(&id) => out.push(id),
                None => {
                    out.truncate(start);
                    self.enforce_bound();
                    for frame in symbolizer.kernel_frames(stack) {
                        let addr = frame.addr;
                        let id = frames.intern(Frame::Kernel(frame));
                        self.kernel.insert(addr, id);
                        out.push(id);
                    }
                    return;
                }
            }
        }
    }

    /// Forgets entries found in no mapping more than [`UNMAPPED_RECHECK`] ago, so their next sample
    /// looks them up again: periodic work, kept off the per-sample path. Returns the processes
    /// that had such entries.
    pub fn expire_unmapped(&mut self) -> Vec<u32> {
        let mut expired = Vec::new();
        self.with_unmapped.retain(|pid| {
            let Some(levels) = self.user.get_mut(pid) else { return false };
            let known = levels.len();
            let mut unmapped_left = false;
            levels.retain(|_, level| {
                let keep = level.checked_at.is_none_or(|at| at.elapsed() < UNMAPPED_RECHECK);
                unmapped_left |= keep && level.checked_at.is_some();
                keep
            });
            if levels.len() != known {
                expired.push(*pid);
            }
            unmapped_left
        });
        expired
    }

    pub fn resets(&self) -> u64 {
        self.resets
    }

    /// Drops what was resolved in `pid`'s address space (it exited or replaced its program).
    pub fn forget_process(&mut self, pid: u32) {
        self.user.remove(&pid);
        self.with_unmapped.remove(&pid);
    }

    /// Moves the frames of the levels still known into a new table, compacting the level frames
    /// (those of forgotten processes go).
    pub fn carry_frames(&mut self, carry: &mut FrameCarry<'_>) {
        let mut level_ids = Vec::with_capacity(self.level_ids.len());
        for level in self.user.values_mut().flat_map(|levels| levels.values_mut()) {
            let first = level_ids.len() as u32;
            let frames = &self.level_ids[level.first as usize..(level.first + level.len) as usize];
            level_ids.extend(frames.iter().map(|&id| carry.carry(id)));
            level.first = first;
        }
        self.level_ids = level_ids;
        for id in self.kernel.values_mut() {
            *id = carry.carry(*id);
        }
    }

    /// Forgets every frame id (they belong to a table that is gone); entries are resolved again.
    pub fn clear(&mut self) {
        self.user.clear();
        self.with_unmapped.clear();
        self.level_ids.clear();
        self.kernel.clear();
    }

    /// Starts afresh when the levels' frames grow past their bound (processes come and go).
    fn enforce_bound(&mut self) {
        if self.level_ids.len() > MAX_LEVEL_IDS {
            self.user.clear();
            self.with_unmapped.clear();
            self.level_ids.clear();
            self.resets += 1;
        }
        if self.kernel.len() > MAX_LEVEL_IDS {
            self.kernel.clear();
            self.resets += 1;
        }
    }
}
