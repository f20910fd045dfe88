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

/// Where in its period the timer clock samples, period after period: each period is cut into
/// [`Strata::COUNT`] strata and samples at a uniform instant within one of them, and each block of
/// that many periods samples every stratum once. The order within a block is what keeps a cycle
/// from being seen at a few phases: the periods a whole number `m` apart (those that see one
/// phase of a cycle of `m` periods) fall each in a different run of `m` strata, for every `m` that
/// divides the block, so a cycle of one, two or four periods is sampled evenly over its phases
/// rather than by chance. The order is drawn for each block: the period's index times a random
/// odd step from a random start, its bits then flipped by a random binary tree (Owen's
/// scrambling), so no cycle is seen at one phase block after block, as it is by a fixed order or
/// a Kronecker walk.
///
/// Simulated over 4 s runs at 199 Hz of a 60/30/10 split (`timer_clock`'s tests), the share
/// sampled strayed a fifth to a third as far as random instants' (0.34 to 0.6 points against 1.73) at
/// cycles of one, two and four periods, and at worst 1.2 times as far (2.0 to 2.1 points, the
/// cycle depending on the draw) over cycles from a tenth of a period to 30 periods. Blocks of 4 periods in a
/// drawn order, before it, strayed 1.5 points at two periods: which slots a block's odd periods
/// got was left to chance.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Strata {
    /// Periods of the current block sampled so far.
    pub index: u32,
    /// The block's random start and step (odd), in strata.
    pub start: u32,
    pub step: u32,
    /// The block's random bits: bit `2^k - 1 + p` flips bit `k` (from the top) of strata whose
    /// `k` bits above it are `p`.
    pub flips: u32,
}

impl Strata {
    const BITS: u32 = 5;
    /// Strata a period is cut into, and periods a block.
    pub const COUNT: u32 = 1 << Self::BITS;

    /// The stratum the next period samples; `random` gives fresh random words, drawn only at
    /// the first period of a block.
    #[inline(always)]
    pub fn next(&mut self, mut random: impl FnMut() -> u32) -> u32 {
        if self.index == 0 || self.index >= Self::COUNT {
            self.index = 0;
            self.flips = random();
            let order = random();
            self.start = order % Self::COUNT;
            self.step = ((order >> Self::BITS) % Self::COUNT) | 1;
        }
        let ordered = (self.start + self.step * self.index) % Self::COUNT;
        self.index += 1;
        self.scramble(ordered)
    }

    /// Flips each bit of `stratum` by the block's bit for the bits above it.
    #[inline(always)]
    fn scramble(&self, stratum: u32) -> u32 {
        let mut scrambled = 0;
        for k in 0..Self::BITS {
            let bit = Self::BITS - 1 - k;
            let above = stratum >> (bit + 1);
            let flip = (self.flips >> ((1 << k) - 1 + above)) & 1;
            scrambled |= (((stratum >> bit) & 1) ^ flip) << bit;
        }
        scrambled
    }
}

/// One CPU's timer clock, the value of the `TICKS` map (the eBPF crate's clock; `T` is the
/// kernel's `struct bpf_timer` there, 16 opaque bytes to userspace).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Tick<T> {
    pub timer: T,
    /// When the current period began (`bpf_ktime_get_ns`).
    pub period_start_ns: u64,
    /// Which stratum of its period each sample falls in.
    pub strata: Strata,
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
