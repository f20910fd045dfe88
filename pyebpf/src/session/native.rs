//! A sample's native stack: kernel frames, user frames unwound from the stack copy where the
//! sample has one (else the kernel's frame-pointer walk), symbolized, and the Python stack merged
//! in by stack address.

use hashbrown::{HashMap, HashSet};
use pyebpf_common::{user_status, SampleRecord};

use crate::bpf::UnwindMode;
use crate::kernel_maps::KernelMaps;
use crate::maps::MapsCache;
use crate::merge::{python_frames, Merged, Merger, NativeStack};
use crate::native_ids::{IdLevel, LevelTraits, NativeIds};
use crate::python::PyItem;
use crate::stack::{Frame, FrameCarry, FrameId, FrameTable};
use crate::stats::Stats;
use crate::symbolize::Symbolizer;
use crate::unwind::{Snapshot, StackUnwinder, Unwound};

/// Frame-pointer walks of a process that must hold beside its copies before it stays on frame
/// pointers (`--unwind auto`): a walk through code without frame pointers sometimes holds by chance.
const WALKS_TO_TRUST: u32 = 8;

/// How a sample's innermost user address figured in its stack: what its repeats must match. The
/// merge reads only a level's traits, so any address whose level has the same traits is merged
/// alike: a repeat at another address of a C function has the same stack but for that level's
/// frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeafUse {
    /// Its level's frames are `at..at + len` of the stack.
    Shown { at: usize, len: usize, traits: LevelTraits },
    /// The merge put Python frames in its place (the eval loop's thousands of addresses, mostly).
    Hidden(LevelTraits),
    /// There is none, or native frames were not read (`--no-native`, a sample with Python frames).
    Unread,
}

/// What a sample's stack read of its native levels: what its repeats must match, and whether it
/// read a level found in no mapping that its process's upkeep looks up again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NativeUse {
    pub leaf: LeafUse,
    pub unmapped: bool,
}

/// A process's level at an innermost user address, as [`NativeStacks::know_leaf`] found it.
#[derive(Clone, Copy)]
pub enum KnownLeaf {
    Level(IdLevel),
    /// In an eval loop found before: its traits, with no frames of its own.
    EvalLoop(LevelTraits),
}

/// What is known of a process's level at an innermost user address, without a look-up.
#[derive(Clone, Copy)]
pub struct LeafLevel<'a> {
    pub traits: LevelTraits,
    /// Its frames, where it was resolved before (an address found in an eval loop has none).
    pub frames: Option<&'a [FrameId]>,
}

/// Turns the native part of samples into frames, caching what it learns per process and file.
pub struct NativeStacks {
    symbolizer: Symbolizer,
    ids: NativeIds,
    unwinder: StackUnwinder,
    unwind: UnwindMode,
    /// Python frames only (`--no-native`), where the sample has them.
    no_native: bool,
    /// Whether unwinding's CPU time is counted (`--stats`): two clock reads a sample, each a
    /// system call.
    timed: bool,
    /// Processes whose stacks the eBPF program copies (`--unwind auto`).
    copying: HashSet<u32>,
    /// `--unwind auto`: processes whose frame-pointer walks held (reached their root, or start
    /// code beside a copy), and how many times; trusted to stay on frame pointers at
    /// [`WALKS_TO_TRUST`].
    walks_held: HashMap<u32, u32>,
    levels: Vec<IdLevel>,
    merger: Merger,
    /// The stack being built, innermost first.
    frames: Vec<FrameId>,
    /// The sample's user stack unwound from its copy ahead of the rest ([`Self::unwind_ahead`]).
    unwound: Option<Unwound>,
}

impl NativeStacks {
    pub fn new(unwind: UnwindMode, no_native: bool, native_lines: bool, timed: bool) -> Self {
        NativeStacks {
            symbolizer: Symbolizer::new(native_lines),
            ids: NativeIds::default(),
            unwinder: StackUnwinder::new(),
            unwind,
            no_native,
            timed,
            copying: HashSet::new(),
            walks_held: HashMap::new(),
            levels: Vec::new(),
            merger: Merger::default(),
            frames: Vec::new(),
            unwound: None,
        }
    }

    /// Unwinds the sample's stack copy, if it has one, before the rest of its resolution: what it
    /// unwinds to, not the copy's bytes (which change with every local), keys its repeats. Not
    /// with `--no-native`, which unwinds only samples without a Python stack. Hands the eBPF
    /// program the unwind rules learnt since the last sample.
    pub fn unwind_ahead(&mut self, record: &SampleRecord, maps: &mut MapsCache, kernel: &mut dyn KernelMaps, stats: &mut Stats) {
        self.unwound = (record.stack_len > 0 && !self.no_native).then(|| unwind_copy(&mut self.unwinder, maps, record, stats, self.timed));
        if record.user_status & user_status::RULES_UNWOUND != 0 {
            stats.rules_unwound_samples += 1;
            // The rules stay only while the process maps the files they came from where it did.
            self.unwinder.follow_process(maps, record.tgid);
        }
        let updates = self.unwinder.take_page_updates();
        if !updates.is_empty() {
            kernel.update_unwind_pages(updates);
        }
    }

    /// The user stack [`Self::unwind_ahead`] unwound for the sample.
    pub fn unwound(&self) -> Option<&Unwound> {
        self.unwound.as_ref()
    }

    /// The sample's innermost user address and the process's level there, the level resolved
    /// first where the address is new to the process, so that a sample like one resolved before
    /// but for that address (a new instruction of a hot C function) repeats it. After
    /// [`Self::unwind_ahead`] for the sample.
    pub fn know_leaf(&mut self, record: &SampleRecord, maps: &mut MapsCache, table: &mut FrameTable) -> Option<(u64, KnownLeaf)> {
        let leaf = match &self.unwound {
            Some(unwound) => unwound.addrs.first().copied(),
            None => (record.user_len > 0).then_some(record.user_stack[0]),
        };
        let leaf = leaf.filter(|_| !self.no_native)?;
        let pid = record.tgid;
        if let Some(level) = self.ids.known_level(pid, leaf) {
            return Some((leaf, KnownLeaf::Level(level)));
        }
        // An address in an eval loop found before is known without a look-up.
        if let Some(frame) = self.symbolizer.eval_loop_frame(pid, leaf) {
            return Some((leaf, KnownLeaf::EvalLoop(LevelTraits::of(&[frame]))));
        }
        self.ids.user_levels(&mut self.symbolizer, maps, table, pid, &[leaf], &mut self.levels);
        self.ids.known_level(pid, leaf).map(|level| (leaf, KnownLeaf::Level(level)))
    }

    /// The level [`Self::know_leaf`] found.
    pub fn leaf_level(&self, known: KnownLeaf) -> LeafLevel<'_> {
        match known {
            KnownLeaf::Level(level) => LeafLevel { traits: level.traits(), frames: Some(self.ids.frames(&level)) },
            KnownLeaf::EvalLoop(traits) => LeafLevel { traits, frames: None },
        }
    }

    /// The sample's whole stack, innermost first: kernel frames, then user frames with the Python
    /// stack merged in, where the sample has one; and how it used the innermost user address.
    /// After [`Self::unwind_ahead`] for the sample.
    pub fn stack(
        &mut self,
        record: &SampleRecord,
        python: Option<&[PyItem]>,
        maps: &mut MapsCache,
        kernel: &mut dyn KernelMaps,
        stats: &mut Stats,
        table: &mut FrameTable,
    ) -> (&mut Vec<FrameId>, NativeUse) {
        if let (true, Some(python)) = (self.no_native, python) {
            self.frames.clear();
            self.frames.extend(python_frames(python).copied());
            return (&mut self.frames, NativeUse { leaf: LeafUse::Unread, unmapped: false });
        }
        // Unwound from the stack copy where the sample has one (done ahead, but with --no-native),
        // else the kernel's frame-pointer walk.
        if self.unwound.is_none() && record.stack_len > 0 {
            self.unwound = Some(unwind_copy(&mut self.unwinder, maps, record, stats, self.timed));
        }
        self.settle_copying(record, maps, kernel, table);
        let out = &mut self.frames;
        out.clear();
        let kernel_len = (record.kernel_len as usize).min(record.kernel_stack.len());
        self.ids.kernel_frames(&mut self.symbolizer, table, &record.kernel_stack[..kernel_len], out);
        if record.user_status & user_status::KERNEL_IN_SOFTIRQ != 0 {
            drop_clock_frames(table, out);
        }
        let unwound = self.unwound.as_ref();
        let (addrs, bases) = match unwound {
            Some(unwound) => (&unwound.addrs[..], &unwound.frame_bases[..]),
            None => {
                let user_len = (record.user_len as usize).min(record.user_stack.len());
                let bases_len = (record.frame_bases_len as usize).min(record.user_frame_bases.len());
                (&record.user_stack[..user_len], &record.user_frame_bases[..bases_len])
            }
        };
        self.ids.user_levels(&mut self.symbolizer, maps, table, record.tgid, addrs, &mut self.levels);
        let stack = NativeStack { levels: &self.levels, frame_bases: bases, sp: record.user_sp };
        if unwound.is_none() && breaks_before_start(self.unwind, record, &stack, addrs) {
            copy_stacks(&mut self.copying, record.tgid, kernel);
        }
        let ids = &self.ids;
        let leaf = self.levels.first();
        let mut leaf_at = None;
        if let Some(python) = python {
            self.merger.merge(&stack, python, |piece| match piece {
                Merged::Native(level) => {
                    if leaf.is_some_and(|leaf| std::ptr::eq(leaf, level)) {
                        leaf_at = Some(out.len());
                    }
                    out.extend_from_slice(ids.frames(level));
                }
                Merged::Python(&id) => out.push(id),
            });
        } else {
            leaf_at = Some(out.len());
            for level in &self.levels[..stack.trusted_levels()] {
                out.extend_from_slice(ids.frames(level));
            }
        }
        let leaf = match (leaf, leaf_at) {
            (None, _) => LeafUse::Unread,
            (Some(level), Some(at)) => LeafUse::Shown { at, len: ids.frames(level).len(), traits: level.traits() },
            (Some(level), None) => LeafUse::Hidden(level.traits()),
        };
        (out, NativeUse { leaf, unmapped: self.levels.iter().any(IdLevel::awaits_recheck) })
    }

    /// `--unwind auto`, a sample copied because its process was not known yet: the process needs
    /// copies where its frame-pointer walk, sent beside the copy, stops before the stack's root,
    /// as it would alone. A walk that holds is what the sample is told by, as the process's later
    /// samples will be, and counts towards trusting the process's walks. Where the copy unwound
    /// to the root it is the judge: a walk through code without frame pointers can end in the C
    /// library by chance (in `clock_gettime`, called from the interpreter), which by symbols alone
    /// looks like its start code.
    fn settle_copying(&mut self, record: &SampleRecord, maps: &mut MapsCache, kernel: &mut dyn KernelMaps, table: &mut FrameTable) {
        if self.unwind != UnwindMode::Auto || self.copying.contains(&record.tgid) {
            return;
        }
        if self.unwound.is_none() {
            // Sent without a copy: a walk that reached a zero frame pointer holds too.
            if record.user_status & user_status::FP_COMPLETE != 0 {
                self.walk_held(record.tgid);
            }
            return;
        }
        let walk = &record.user_stack[..(record.user_len as usize).min(record.user_stack.len())];
        let bases = &record.user_frame_bases[..(record.frame_bases_len as usize).min(record.user_frame_bases.len())];
        self.ids.user_levels(&mut self.symbolizer, maps, table, record.tgid, walk, &mut self.levels);
        let walk_stack = NativeStack { levels: &self.levels, frame_bases: bases, sp: record.user_sp };
        let breaks = match self.unwound.as_ref().filter(|unwound| unwound.complete) {
            // The copy unwound to the root tells: the walk held if only start code lies past
            // where it left the stack's code (its last trusted entry).
            Some(unwound) => {
                let walk_end = walk_stack.trusted_levels().checked_sub(1).map(|last| walk[last]);
                self.ids.user_levels(&mut self.symbolizer, maps, table, record.tgid, &unwound.addrs, &mut self.levels);
                let copy_stack = NativeStack { levels: &self.levels, frame_bases: &unwound.frame_bases, sp: record.user_sp };
                !walk_end.and_then(|end| unwound.addrs.iter().position(|&addr| addr == end)).is_some_and(|end| copy_stack.only_start_code_past(end))
            }
            None => breaks_before_start(self.unwind, record, &walk_stack, walk),
        };
        if breaks {
            self.walks_held.remove(&record.tgid);
            copy_stacks(&mut self.copying, record.tgid, kernel);
        } else {
            self.walk_held(record.tgid);
            self.unwound = None;
        }
    }

    /// A repeat of a sample resolved before: a walk sent without a copy that reached a zero frame
    /// pointer holds as the first did (a process whose samples all repeat has no other walks).
    /// With `--no-native` walks are not judged, as in [`Self::stack`].
    pub fn settle_repeat(&mut self, record: &SampleRecord) {
        let judged = self.no_native || self.unwind != UnwindMode::Auto || self.copying.contains(&record.tgid);
        if !judged && self.unwound.is_none() && record.user_status & user_status::FP_COMPLETE != 0 {
            self.walk_held(record.tgid);
        }
    }

    /// One more of `pid`'s walks held; counted up to the trust, as a long run would overflow.
    fn walk_held(&mut self, pid: u32) {
        let held = self.walks_held.entry(pid).or_default();
        *held = (*held + 1).min(WALKS_TO_TRUST);
    }

    /// Whether how `pid`'s stacks are unwound is settled after this sample: the process's stacks
    /// are copied, or enough of its walks held. Until then its samples should stay urgent and
    /// copied where their walk broke: one walk that holds may have held by chance (a leaf that
    /// zeroed its frame-pointer register).
    pub fn unwinding_settled(&self, record: &SampleRecord) -> bool {
        self.unwind != UnwindMode::Auto || self.copying.contains(&record.tgid) || self.walks_held.get(&record.tgid).is_some_and(|&held| held >= WALKS_TO_TRUST)
    }

    /// Drops what is known of `pid`'s address space, and stops copying its stacks.
    pub fn forget(&mut self, pid: u32, kernel: &mut dyn KernelMaps) {
        self.symbolizer.forget_process(pid);
        self.ids.forget_process(pid);
        self.unwinder.forget_process(pid);
        self.walks_held.remove(&pid);
        if self.copying.remove(&pid) {
            kernel.stop_copying_stacks_of(pid);
        }
    }

    /// A new sampler copies no stacks yet.
    pub fn forget_copying(&mut self) {
        self.copying.clear();
        self.walks_held.clear();
    }

    /// Forgets unmapped entries due for another look-up; returns the processes that had some.
    pub fn expire_unmapped(&mut self) -> Vec<u32> {
        self.ids.expire_unmapped()
    }

    /// Changes with every drop of all processes' entries at once.
    pub fn resets(&self) -> u64 {
        self.ids.resets()
    }

    pub fn carry_frames(&mut self, carry: &mut FrameCarry<'_>) {
        self.ids.carry_frames(carry);
    }

    pub fn clear_frame_ids(&mut self) {
        self.ids.clear();
    }
}

/// `--unwind auto`: a frame-pointer walk that reached neither a zero frame pointer nor the C
/// library's start code has the process's later samples carry stack copies.
fn breaks_before_start(unwind: UnwindMode, record: &SampleRecord, stack: &NativeStack<'_, IdLevel>, addrs: &[u64]) -> bool {
    unwind == UnwindMode::Auto && !addrs.is_empty() && record.user_status & user_status::FP_COMPLETE == 0 && !stack.reaches_start_code()
}

/// Kernel symbols of a soft interrupt's entry, and of the interrupt exit that runs it.
const SOFTIRQ_ENTRY: [&str; 2] = ["handle_softirqs", "__do_softirq"];
const IRQ_EXIT: [&str; 4] = ["__irq_exit_rcu", "irq_exit_rcu", "sysvec_apic_timer_interrupt", "asm_sysvec_apic_timer_interrupt"];

/// Drops the timer clock's own frames from a kernel stack read in its soft interrupt (innermost
/// first): those down to the soft interrupt's entry, and the exit of the interrupt that ran it,
/// so the stack is the interrupted code's (none, when it was in user space).
fn drop_clock_frames(table: &FrameTable, out: &mut Vec<FrameId>) {
    let name = |id: FrameId| match table.frame(id) {
        Frame::Kernel(frame) => frame.symbol.as_deref(),
        _ => None,
    };
    let Some(entry) = out.iter().position(|&id| name(id).is_some_and(|name| SOFTIRQ_ENTRY.contains(&name))) else { return };
    let exit = out[entry + 1..].iter().take_while(|&&id| name(id).is_some_and(|name| IRQ_EXIT.contains(&name))).count();
    out.drain(..=entry + exit);
}

/// Has the eBPF program copy `pid`'s stacks from now on, once.
fn copy_stacks(copying: &mut HashSet<u32>, pid: u32, kernel: &mut dyn KernelMaps) {
    if copying.insert(pid) {
        if let Err(err) = kernel.copy_stacks_of(pid) {
            log::debug!("process {pid}: stacks stay frame-pointer unwound: {err}");
        }
    }
}

/// A sample's user stack unwound from its copy, counted in `stats`, with its CPU time if `timed`.
fn unwind_copy(unwinder: &mut StackUnwinder, maps: &mut MapsCache, record: &SampleRecord, stats: &mut Stats, timed: bool) -> Unwound {
    let stack = &record.stack_tail[..(record.stack_len as usize).min(record.stack_tail.len())];
    let started = timed.then(thread_cpu_ns);
    let unwound = unwinder.unwind(maps, record.tgid, &Snapshot { ip: record.user_stack[0], sp: record.user_sp, bp: record.user_bp, stack });
    let cpu_ns = started.map_or(0, |started| thread_cpu_ns().saturating_sub(started));
    stats.count_unwind(&unwound, stack.len(), record.user_status & user_status::SNAPSHOT_FULL != 0, cpu_ns);
    unwound
}

/// CPU time of the calling thread so far: what one step costs, also on a busy host.
fn thread_cpu_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills the timespec it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) } != 0 {
        return 0;
    }
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
