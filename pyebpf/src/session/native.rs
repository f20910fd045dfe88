//! A sample's native stack: kernel frames, user frames unwound from the stack copy where the
//! sample has one (else the kernel's frame-pointer walk), symbolized, and the Python stack merged
//! in by stack address.

use hashbrown::HashSet;
use pyebpf_common::{user_status, SampleRecord};

use crate::bpf::UnwindMode;
use crate::kernel_maps::KernelMaps;
use crate::maps::MapsCache;
use crate::merge::{python_frames, Merged, Merger, NativeStack};
use crate::native_ids::{IdLevel, NativeIds};
use crate::python::PyItem;
use crate::stack::{FrameCarry, FrameId, FrameTable};
use crate::stats::Stats;
use crate::symbolize::Symbolizer;
use crate::unwind::{Snapshot, StackUnwinder, Unwound};

/// Turns the native part of samples into frames, caching what it learns per process and file.
pub struct NativeStacks {
    symbolizer: Symbolizer,
    ids: NativeIds,
    unwinder: StackUnwinder,
    unwind: UnwindMode,
    /// Python frames only (`--no-native`), where the sample has them.
    no_native: bool,
    /// Processes whose stacks the eBPF program copies (`--unwind auto`).
    copying: HashSet<u32>,
    levels: Vec<IdLevel>,
    merger: Merger,
    /// The stack being built, innermost first.
    frames: Vec<FrameId>,
    /// The sample's user stack unwound from its copy ahead of the rest ([`Self::unwind_ahead`]).
    unwound: Option<Unwound>,
}

impl NativeStacks {
    pub fn new(unwind: UnwindMode, no_native: bool) -> Self {
        NativeStacks {
            symbolizer: Symbolizer::new(),
            ids: NativeIds::default(),
            unwinder: StackUnwinder::new(),
            unwind,
            no_native,
            copying: HashSet::new(),
            levels: Vec::new(),
            merger: Merger::default(),
            frames: Vec::new(),
            unwound: None,
        }
    }

    /// Unwinds the sample's stack copy, if it has one, before the rest of its resolution: what it
    /// unwinds to, not the copy's bytes (which change with every local), keys its repeats. Not
    /// with `--no-native`, which unwinds only samples without a Python stack.
    pub fn unwind_ahead(&mut self, record: &SampleRecord, maps: &mut MapsCache, stats: &mut Stats) {
        self.unwound = (record.stack_len > 0 && !self.no_native).then(|| unwind_copy(&mut self.unwinder, maps, record, stats));
    }

    /// The user stack [`Self::unwind_ahead`] unwound for the sample.
    pub fn unwound(&self) -> Option<&Unwound> {
        self.unwound.as_ref()
    }

    /// The sample's whole stack, innermost first: kernel frames, then user frames with the Python
    /// stack merged in, where the sample has one. After [`Self::unwind_ahead`] for the sample.
    pub fn stack(
        &mut self,
        record: &SampleRecord,
        python: Option<&[PyItem]>,
        maps: &mut MapsCache,
        kernel: &mut dyn KernelMaps,
        stats: &mut Stats,
        table: &mut FrameTable,
    ) -> &mut Vec<FrameId> {
        let out = &mut self.frames;
        out.clear();
        if let (true, Some(python)) = (self.no_native, python) {
            out.extend(python_frames(python).copied());
            return out;
        }
        let kernel_len = (record.kernel_len as usize).min(record.kernel_stack.len());
        self.ids.kernel_frames(&mut self.symbolizer, table, &record.kernel_stack[..kernel_len], out);
        // Unwound from the stack copy where the sample has one (done ahead, but with --no-native),
        // else the kernel's frame-pointer walk.
        if self.unwound.is_none() && record.stack_len > 0 {
            self.unwound = Some(unwind_copy(&mut self.unwinder, maps, record, stats));
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
        let walk_breaks = match &unwound {
            None => breaks_before_start(self.unwind, record, &stack, addrs),
            // Copied because the process was not known yet: the walk sent beside the copy is
            // judged by what the copy unwinds to.
            Some(unwound) => self.unwind == UnwindMode::Auto && !self.copying.contains(&record.tgid) && walk_falls_short(record, &unwound.addrs),
        };
        if walk_breaks && self.copying.insert(record.tgid) {
            if let Err(err) = kernel.copy_stacks_of(record.tgid) {
                log::debug!("process {}: stacks stay frame-pointer unwound: {err}", record.tgid);
            }
        }
        let ids = &self.ids;
        if let Some(python) = python {
            self.merger.merge(&stack, python, |piece| match piece {
                Merged::Native(level) => out.extend_from_slice(ids.frames(level)),
                Merged::Python(&id) => out.push(id),
            });
        } else {
            for level in &self.levels[..stack.trusted_levels()] {
                out.extend_from_slice(ids.frames(level));
            }
        }
        out
    }

    /// Drops what is known of `pid`'s address space, and stops copying its stacks.
    pub fn forget(&mut self, pid: u32, kernel: &mut dyn KernelMaps) {
        self.symbolizer.forget_process(pid);
        self.ids.forget_process(pid);
        self.unwinder.forget_process(pid);
        if self.copying.remove(&pid) {
            kernel.stop_copying_stacks_of(pid);
        }
    }

    /// A new sampler copies no stacks yet.
    pub fn forget_copying(&mut self) {
        self.copying.clear();
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

/// Whether the frame-pointer walk sent beside a sample's copy differs from the copy's unwind, or
/// stops short of it before its own depth limit: the process needs copies.
fn walk_falls_short(record: &SampleRecord, unwound: &[u64]) -> bool {
    let walk = &record.user_stack[..(record.user_len as usize).min(record.user_stack.len())];
    !unwound.starts_with(walk) || (walk.len() < unwound.len() && walk.len() < record.user_stack.len())
}

/// A sample's user stack unwound from its copy, with what it cost counted in `stats`.
fn unwind_copy(unwinder: &mut StackUnwinder, maps: &mut MapsCache, record: &SampleRecord, stats: &mut Stats) -> Unwound {
    let stack = &record.stack_tail[..(record.stack_len as usize).min(record.stack_tail.len())];
    let started = thread_cpu_ns();
    let unwound = unwinder.unwind(maps, record.tgid, &Snapshot { ip: record.user_stack[0], sp: record.user_sp, bp: record.user_bp, stack });
    stats.count_unwind(&unwound, stack.len(), record.user_status & user_status::SNAPSHOT_FULL != 0, thread_cpu_ns().saturating_sub(started));
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
