//! The sampling clocks' state on each CPU, shared by the eBPF programs and userspace.

/// One CPU's place in its sampling clock. The perf event ticks `Config::ticks_per_slot` times per
/// period asked for (a slot), and the eBPF program samples at one tick of each slot, so that the
/// instants sampled are spread over every phase of any cycle the sampled code has, rather than
/// repeating one phase of it as a clock at exact multiples of its period does.
///
/// With 2 ticks a slot the tick is chosen along a Kronecker sequence (the slot's index times the
/// golden ratio, from a random start). From [`ClockSlot::DRAWN_FROM`] ticks a slot that sequence
/// has cycles it resonates with (at 99 Hz a 26.4 ms loop was sampled 21 points off its true split
/// in a 4 s run): the samples of a few slots in a row fall on one phase of such a cycle. So there
/// each block of slots samples every tick once, in an order drawn at random: a cycle of a whole
/// slot is still seen at every tick, and no cycle is seen at one phase slot after slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ClockSlot {
    /// Ticks seen in the current slot.
    pub tick: u32,
    /// The tick of the current slot that samples.
    pub target: u32,
    /// Where the Kronecker sequence is: a fraction of one, in units of 2^-32.
    pub phase: u32,
    /// Set at the CPU's first tick, which draws where the sequence starts.
    pub started: u32,
    /// Samples this CPU has taken: the clock thread moves only the clocks of CPUs that sample.
    pub taken: u64,
    /// The ticks the current block has not sampled yet, a bit each (drawn targets only).
    pub left: u32,
    pub _pad: u32,
}

impl ClockSlot {
    /// The golden ratio's fractional part, in units of 2^-32: the step from slot to slot.
    pub const STEP: u32 = 0x9E37_79B9;
    /// From this many ticks a slot, targets are drawn (see [`ClockSlot`]).
    pub const DRAWN_FROM: u32 = 3;
    /// Ticks a slot that a drawn target can name.
    pub const MAX_DRAWN_TICKS: u32 = 32;

    /// The tick, of `ticks_per_slot`, that samples at `phase`.
    pub fn target(phase: u32, ticks_per_slot: u32) -> u32 {
        ((u64::from(phase) * u64::from(ticks_per_slot)) >> 32) as u32
    }

    /// Starts a slot of `ticks_per_slot` ticks (at least 1): chooses the tick that samples.
    /// `random` is a fresh random word.
    #[inline(always)]
    pub fn start_slot(&mut self, ticks_per_slot: u32, random: u32) {
        self.tick = 0;
        if !(Self::DRAWN_FROM..=Self::MAX_DRAWN_TICKS).contains(&ticks_per_slot) {
            self.phase = self.phase.wrapping_add(Self::STEP);
            self.target = Self::target(self.phase, ticks_per_slot);
            return;
        }
        let block = u32::MAX >> (Self::MAX_DRAWN_TICKS - ticks_per_slot);
        if self.left & block == 0 {
            self.left = block;
        }
        let left = self.left & block;
        // The how-manieth of the ticks left samples.
        let mut nth = random % left.count_ones().max(1);
        for tick in 0..Self::MAX_DRAWN_TICKS {
            if tick >= ticks_per_slot {
                break;
            }
            if left & (1 << tick) != 0 {
                if nth == 0 {
                    self.target = tick;
                    self.left = left & !(1 << tick);
                    return;
                }
                nth -= 1;
            }
        }
    }
}

/// The timer clock divides each period into this many slots, and samples in one of them (see
/// [`ClockSlot`]), at a uniform instant within it.
pub const TICK_SLOTS: u32 = 4;

/// One CPU's timer clock, the value of the `TICKS` map (the eBPF crate's clock; `T` is the
/// kernel's `struct bpf_timer` there, 16 opaque bytes to userspace).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Tick<T> {
    pub timer: T,
    /// When the current period began (`bpf_ktime_get_ns`).
    pub period_start_ns: u64,
    /// Which slot of its period each sample falls in, drawn in blocks.
    pub slot: ClockSlot,
    /// [`tick_status`]: whether this CPU's clock started, for userspace to check.
    pub status: u64,
}

/// Where a CPU's timer clock is, as its start left it (`status` of the eBPF crate's `Tick`).
pub mod tick_status {
    /// Not started (the start hook did not run on this CPU).
    pub const NOT_STARTED: u64 = 0;
    pub const STARTED: u64 = 1;
    /// The kernel refused the timer (older kernels have no pinned or absolute BPF timers).
    pub const FAILED: u64 = 2;
    /// The timer could not be set again: the clock stopped.
    pub const STOPPED: u64 = 3;
}
