//! Unwind rules for the eBPF program: where a process's user stacks have no frame pointers, the
//! program unwinds them itself by rules userspace derived from the call frame information of the
//! code sampled, a page of code at a time. A sample that meets a page without rules (or a rule it
//! cannot apply) is sent with a copy of its stack for userspace to unwind, as before, and that
//! unwind supplies the missing pages. So a hot loop's samples stop carrying 4-16 KiB stack copies.

/// Bytes of code one [`UnwindPage`] covers.
pub const UNWIND_PAGE_SIZE: u64 = 4096;
/// Rows of a page: at most [`UNWIND_PAGE_ROWS`] - [`UNWIND_STRETCH_ROWS`] - 1 are used (a page whose
/// code changes rule more often is left to userspace); the rest are [`unwind_row::PAST_END`], so a
/// scan stops there without a bound of its own.
pub const UNWIND_PAGE_ROWS: usize = 256;
/// A page is searched from the row in force at the start of its stretch of
/// [`UNWIND_STRETCH_SIZE`] bytes, by at most [`UNWIND_STRETCH_ROWS`] rows more: a linear scan the
/// eBPF verifier checks in a few paths, where a binary search makes it follow every outcome.
pub const UNWIND_STRETCH_SIZE: u64 = 32;
pub const UNWIND_STRETCHES: usize = (UNWIND_PAGE_SIZE / UNWIND_STRETCH_SIZE) as usize;
/// Rows that start inside one stretch at most; a stretch with more (a function's prologue of many
/// pushes, say) starts at [`UNWIND_STRETCH_UNKNOWN`], so its samples are left to userspace.
pub const UNWIND_STRETCH_ROWS: usize = 8;
/// A row index past the last used whose whole scan lies past it too: its row is
/// [`unwind_row::PAST_END`], whose kind is [`unwind_row::UNKNOWN`].
pub const UNWIND_STRETCH_UNKNOWN: u8 = (UNWIND_PAGE_ROWS - 1 - UNWIND_STRETCH_ROWS) as u8;
/// Pages of rules held at most, over all processes (allocated as they are added: about 1 KiB each).
pub const MAX_UNWIND_PAGES: u32 = 8192;

/// Which page: a process's, at an address that is a multiple of [`UNWIND_PAGE_SIZE`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UnwindPageKey {
    pub tgid: u32,
    pub _pad: u32,
    pub page: u64,
}

/// The rules of one page of code, as [`unwind_row`] encodes them, by ascending offset; the first
/// row's offset is 0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UnwindPage {
    /// Rows used.
    pub len: u32,
    pub _pad: u32,
    /// For each stretch, the index of the row in force at its start.
    pub stretch_rows: [u8; UNWIND_STRETCHES],
    pub rows: [u32; UNWIND_PAGE_ROWS],
}

/// One row in 32 bits: from `offset` in its page on (to the next row's), how the caller's frame is
/// found. The return address is always at CFA - 8.
pub mod unwind_row {
    /// No rule the program applies: the sample goes to userspace with a stack copy.
    pub const UNKNOWN: u32 = 0;
    /// The stack's root: no caller.
    pub const ROOT: u32 = 1;
    /// CFA = sp + `cfa_words` * 8; rbp unchanged.
    pub const SP: u32 = 2;
    /// CFA = sp + `cfa_words` * 8; the caller's rbp saved at CFA - `bp_words` * 8.
    pub const SP_SAVED_BP: u32 = 3;
    /// CFA = rbp + 16, the caller's rbp saved at rbp.
    pub const FRAME_POINTER: u32 = 4;

    const KIND_SHIFT: u32 = 13;
    const CFA_SHIFT: u32 = 16;
    const BP_SHIFT: u32 = 26;
    /// Largest `cfa_words` and `bp_words` a row holds.
    pub const MAX_CFA_WORDS: u32 = (1 << (BP_SHIFT - CFA_SHIFT)) - 1;
    pub const MAX_BP_WORDS: u32 = (1 << (32 - BP_SHIFT)) - 1;

    /// A row after the last: its offset lies past any in a page.
    pub const PAST_END: u32 = 1 << 12;

    /// A row; `offset` below 4096, `kind` below 8, the words at most their maxima.
    pub const fn encode(offset: u32, kind: u32, cfa_words: u32, bp_words: u32) -> u32 {
        offset | kind << KIND_SHIFT | cfa_words << CFA_SHIFT | bp_words << BP_SHIFT
    }

    pub const fn offset(row: u32) -> u32 {
        row & ((1 << KIND_SHIFT) - 1)
    }

    pub const fn kind(row: u32) -> u32 {
        (row >> KIND_SHIFT) & 7
    }

    pub const fn cfa_words(row: u32) -> u32 {
        (row >> CFA_SHIFT) & MAX_CFA_WORDS
    }

    pub const fn bp_words(row: u32) -> u32 {
        row >> BP_SHIFT
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C) plain data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::UnwindPageKey {}
    // SAFETY: repr(C) plain data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::UnwindPage {}
}
