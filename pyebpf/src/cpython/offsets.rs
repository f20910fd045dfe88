//! `_Py_DebugOffsets`: the table of structure offsets CPython 3.13+ keeps at the start of
//! `_PyRuntime` for out-of-process readers. Its own layout grew between minor versions (and within
//! 3.15's pre-releases), so each known layout is one table of field positions below. For 3.8 to
//! 3.12, which have no such table, pyebpf brings the offsets itself ([`builtin_offsets`]).

use super::memory::{field_u64, ReadExt, ReadMemory};
use super::PyError;

/// The table is a cookie followed by 64-bit fields; none of the known layouts has more.
const MAX_FIELDS: usize = 128;
/// Largest sizes accepted from a table, as sanity bounds: `_PyRuntime` and interpreter states are
/// a few hundred KiB and are never read whole; the structures read whole or per frame (thread
/// states, frames, code objects, strings) are below 1 KiB in every known release.
const MAX_STATE_SIZE: u64 = 16 << 20;
const MAX_OBJECT_SIZE: u64 = 64 << 10;
/// An offset as the eBPF program's configuration holds it: every offset was checked against a
/// structure size of at most [`MAX_STATE_SIZE`], so it fits.
pub fn narrow(offset: u64) -> u32 {
    offset as u32
}

/// `utf8_length` and `utf8`, which `PyCompactUnicodeObject` adds to `PyASCIIObject`.
const COMPACT_UTF8_FIELDS: u64 = 16;

/// Position (in 64-bit fields, the cookie counting as one) of each field pyebpf reads.
struct Layout {
    free_threaded: usize,
    runtime_size: usize,
    interpreters_head: usize,
    interp_size: usize,
    interp_id: usize,
    interp_next: usize,
    interp_threads_head: usize,
    interp_ceval_gil: usize,
    /// The interpreter's own GIL (`_gil`); `gil_locked` and `gil_holder` are offsets of its fields
    /// in the interpreter state.
    interp_gil: usize,
    gil_locked: usize,
    gil_holder: usize,
    code_object_generation: Option<usize>,
    tstate_size: usize,
    tstate_next: usize,
    tstate_current_frame: usize,
    tstate_last_profiled_frame: Option<usize>,
    tstate_last_profiled_seq: Option<usize>,
    tstate_native_thread_id: usize,
    /// `_status`, whose bits say whether the thread state is the one its thread runs now.
    tstate_status: usize,
    frame_size: usize,
    frame_previous: usize,
    frame_executable: usize,
    frame_instr_ptr: usize,
    frame_owner: usize,
    code_size: usize,
    code_filename: usize,
    code_qualname: usize,
    code_linetable: usize,
    code_firstlineno: usize,
    code_adaptive: usize,
    object_size: usize,
    object_type: usize,
    type_size: usize,
    type_name: usize,
    bytes_size: usize,
    bytes_ob_size: usize,
    bytes_data: usize,
    unicode_size: usize,
    unicode_state: usize,
    unicode_length: usize,
    unicode_ascii_size: usize,
    /// Size of `PyCompactUnicodeObject`, in the table since 3.15; earlier it is the ASCII header
    /// plus `utf8_length` and `utf8`.
    unicode_compact_size: Option<usize>,
    /// Owner values of frames that belong to the interpreter itself (entry frames).
    entry_owner_min: u8,
    /// Tag bits of `f_executable` (a `_PyStackRef` since 3.14).
    executable_tag_mask: u64,
    /// Byte offset of `co_version` in `PyCodeObject`. Not in the debug table: taken from the
    /// version's `cpython/code.h` (default builds) and checked against real interpreters.
    code_version: u64,
    /// What reading asyncio tasks needs (3.14+).
    objects: Option<ObjectLayout>,
}

/// Positions of the fields asyncio task reading uses: coroutines, their frames' value stacks,
/// sets, ints and the task list's links.
struct ObjectLayout {
    frame_stackpointer: usize,
    type_flags: usize,
    set_size: usize,
    set_used: usize,
    set_table: usize,
    set_mask: usize,
    long_size: usize,
    long_tag: usize,
    long_digits: usize,
    gen_size: usize,
    gen_iframe: usize,
    gen_frame_state: usize,
    llist_next: usize,
    /// `gi_frame_state` values (`pycore_frame.h`), renumbered in 3.15: not in the debug table.
    states: FrameStates,
    /// Where a coroutine suspended in `await` keeps the awaited object: this many bytes below
    /// its frame's stack top (3.15 keeps a second value above it). Not in the debug table.
    awaited_below_top: u64,
}

const LAYOUT_3_13: Layout = Layout {
    free_threaded: 2,
    runtime_size: 3,
    interpreters_head: 5,
    interp_size: 6,
    interp_id: 7,
    interp_next: 8,
    interp_threads_head: 9,
    interp_ceval_gil: 14,
    interp_gil: 15,
    gil_locked: 17,
    gil_holder: 18,
    code_object_generation: None,
    tstate_size: 19,
    tstate_next: 21,
    tstate_current_frame: 23,
    tstate_last_profiled_frame: None,
    tstate_last_profiled_seq: None,
    tstate_native_thread_id: 25,
    tstate_status: 27,
    frame_size: 28,
    frame_previous: 29,
    frame_executable: 30,
    frame_instr_ptr: 31,
    frame_owner: 33,
    code_size: 34,
    code_filename: 35,
    code_qualname: 37,
    code_linetable: 38,
    code_firstlineno: 39,
    code_adaptive: 43,
    object_size: 44,
    object_type: 45,
    type_size: 46,
    type_name: 47,
    bytes_size: 64,
    bytes_ob_size: 65,
    bytes_data: 66,
    unicode_size: 67,
    unicode_state: 68,
    unicode_length: 69,
    unicode_ascii_size: 70,
    unicode_compact_size: None,
    entry_owner_min: 3,
    executable_tag_mask: 0,
    code_version: 92,
    objects: None,
};

const LAYOUT_3_14: Layout = Layout {
    free_threaded: 2,
    runtime_size: 3,
    interpreters_head: 5,
    interp_size: 6,
    interp_id: 7,
    interp_next: 8,
    interp_threads_head: 9,
    interp_ceval_gil: 15,
    interp_gil: 16,
    gil_locked: 18,
    gil_holder: 19,
    code_object_generation: Some(20),
    tstate_size: 22,
    tstate_next: 24,
    tstate_current_frame: 26,
    tstate_last_profiled_frame: None,
    tstate_last_profiled_seq: None,
    tstate_native_thread_id: 28,
    tstate_status: 30,
    frame_size: 31,
    frame_previous: 32,
    frame_executable: 33,
    frame_instr_ptr: 34,
    frame_owner: 36,
    code_size: 39,
    code_filename: 40,
    code_qualname: 42,
    code_linetable: 43,
    code_firstlineno: 44,
    code_adaptive: 48,
    object_size: 50,
    object_type: 51,
    type_size: 52,
    type_name: 53,
    bytes_size: 74,
    bytes_ob_size: 75,
    bytes_data: 76,
    unicode_size: 77,
    unicode_state: 78,
    unicode_length: 79,
    unicode_ascii_size: 80,
    unicode_compact_size: None,
    entry_owner_min: 3,
    executable_tag_mask: 3,
    code_version: 92,
    objects: Some(ObjectLayout {
        frame_stackpointer: 37,
        type_flags: 55,
        set_size: 62,
        set_used: 63,
        set_table: 64,
        set_mask: 65,
        long_size: 71,
        long_tag: 72,
        long_digits: 73,
        gen_size: 83,
        gen_iframe: 85,
        gen_frame_state: 86,
        llist_next: 87,
        states: FrameStates { created: -3, suspended: &[-2, -1], yield_from: &[-1], executing: 0 },
        awaited_below_top: 8,
    }),
};

/// 3.15.0b4 and later (b4 inserted `last_profiled_frame_seq`).
const LAYOUT_3_15: Layout = Layout {
    free_threaded: 2,
    runtime_size: 3,
    interpreters_head: 5,
    interp_size: 6,
    interp_id: 7,
    interp_next: 8,
    interp_threads_head: 9,
    interp_ceval_gil: 15,
    interp_gil: 16,
    gil_locked: 18,
    gil_holder: 19,
    code_object_generation: Some(20),
    tstate_size: 22,
    tstate_next: 24,
    tstate_current_frame: 26,
    tstate_last_profiled_frame: Some(28),
    tstate_last_profiled_seq: Some(29),
    tstate_native_thread_id: 31,
    tstate_status: 33,
    frame_size: 39,
    frame_previous: 40,
    frame_executable: 41,
    frame_instr_ptr: 42,
    frame_owner: 44,
    code_size: 47,
    code_filename: 48,
    code_qualname: 50,
    code_linetable: 51,
    code_firstlineno: 52,
    code_adaptive: 56,
    object_size: 58,
    object_type: 59,
    type_size: 60,
    type_name: 61,
    bytes_size: 86,
    bytes_ob_size: 87,
    bytes_data: 88,
    unicode_size: 89,
    unicode_state: 90,
    unicode_length: 91,
    unicode_ascii_size: 92,
    unicode_compact_size: Some(93),
    entry_owner_min: 3,
    executable_tag_mask: 3,
    code_version: 92,
    objects: Some(ObjectLayout {
        frame_stackpointer: 45,
        type_flags: 63,
        set_size: 74,
        set_used: 75,
        set_table: 76,
        set_mask: 77,
        long_size: 83,
        long_tag: 84,
        long_digits: 85,
        gen_size: 99,
        gen_iframe: 101,
        gen_frame_state: 102,
        llist_next: 103,
        states: FrameStates { created: 0, suspended: &[1, 2, 3], yield_from: &[2, 3], executing: 4 },
        awaited_below_top: 16,
    }),
};

/// A CPython version as `PY_VERSION_HEX` encodes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyVersion(pub u64);

impl PyVersion {
    /// A version known only by its interpreter's file name (`3.10`): versions before 3.11 have no
    /// `Py_Version`. Its release level is 0, which no release has, and it shows as `3.10`.
    pub fn from_name(name: &str) -> Option<PyVersion> {
        let (major, minor) = name.split_once('.')?;
        let (major, minor): (u64, u64) = (major.parse().ok()?, minor.parse().ok()?);
        (major < 256 && minor < 256).then_some(PyVersion(major << 24 | minor << 16))
    }

    fn minor_only(self) -> bool {
        self.0 & 0xffff == 0
    }

    pub fn major(self) -> u64 {
        (self.0 >> 24) & 0xff
    }
    pub fn minor(self) -> u64 {
        (self.0 >> 16) & 0xff
    }
    pub fn micro(self) -> u64 {
        (self.0 >> 8) & 0xff
    }
    fn level(self) -> u64 {
        (self.0 >> 4) & 0xf
    }
    fn serial(self) -> u64 {
        self.0 & 0xf
    }
}

impl std::fmt::Display for PyVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.minor_only() {
            return write!(f, "{}.{}", self.major(), self.minor());
        }
        write!(f, "{}.{}.{}", self.major(), self.minor(), self.micro())?;
        match (self.level(), self.serial()) {
            (0xf, _) => Ok(()),
            (0xa, s) => write!(f, "a{s}"),
            (0xb, s) => write!(f, "b{s}"),
            (0xc, s) => write!(f, "rc{s}"),
            (l, s) => write!(f, "-{l:x}{s}"),
        }
    }
}

/// The layout of a version, for releases and release candidates whose layout is known.
/// Whether this version has debug offsets pyebpf reads.
pub(super) fn is_supported(version: PyVersion) -> bool {
    layout_for(version).is_some()
}

fn layout_for(version: PyVersion) -> Option<&'static Layout> {
    let release_candidate_or_later = version.level() >= 0xc;
    match (version.major(), version.minor()) {
        (3, 13) if release_candidate_or_later => Some(&LAYOUT_3_13),
        (3, 14) if release_candidate_or_later => Some(&LAYOUT_3_14),
        (3, 15) if version.micro() > 0 || release_candidate_or_later || (version.level() == 0xb && version.serial() >= 4) => Some(&LAYOUT_3_15),
        _ => None,
    }
}

/// The offsets pyebpf uses, decoded and checked.
#[derive(Clone, Debug)]
pub struct DebugOffsets {
    pub version: PyVersion,
    pub interpreters_head: u64,
    pub interp_size: u64,
    pub interp_id: u64,
    pub interp_next: u64,
    pub interp_threads_head: u64,
    /// Pointer to the GIL the interpreter uses (3.12+).
    pub interp_ceval_gil: u64,
    /// 3.11: the GIL is the runtime's, and `_PyRuntime.gilstate.tstate_current` (here) points at
    /// the thread state holding it (0 when none does); the three fields above are then unused.
    pub runtime_gil_holder: Option<u64>,
    /// Offsets of `locked` and `last_holder` in the GIL structure.
    pub gil_locked: u64,
    pub gil_holder: u64,
    pub code_object_generation: Option<u64>,
    pub tstate_size: u64,
    pub tstate_next: u64,
    /// 3.11 and 3.12: the thread's innermost frame is `tstate->cframe->current_frame`: `tstate_cframe` is
    /// where the `_PyCFrame` pointer sits in the thread state, and `tstate_current_frame` is then
    /// the frame's offset in the `_PyCFrame`. `None` from 3.13 on (`tstate->current_frame`).
    pub tstate_cframe: Option<u64>,
    pub tstate_current_frame: u64,
    pub tstate_last_profiled_frame: Option<u64>,
    pub tstate_last_profiled_seq: Option<u64>,
    /// The thread's id (`native_thread_id`, 3.11+); before 3.11 its `pthread_t` (`thread_id`), see
    /// `pthread_tid`.
    pub tstate_native_thread_id: u64,
    /// Before 3.11: where the C library's thread descriptor, which `pthread_t` points at, keeps the
    /// thread's id (glibc and musl differ; [`PTHREAD_TID_OFFSETS`] are tried against the process).
    pub pthread_tid: Option<u64>,
    /// `_status` (3.12+), whose `active` bit says the thread state is attached to its thread.
    pub tstate_status: Option<u64>,
    pub frame_size: u64,
    pub frame_previous: u64,
    pub frame_executable: u64,
    pub frame_instr_ptr: u64,
    /// What `frame_instr_ptr` holds.
    pub instr_field: InstrField,
    /// `owner` (3.11+).
    pub frame_owner: Option<u64>,
    /// Before 3.11 frames are `PyFrameObject`s and every Python call is an interpreter activation
    /// of its own (the evaluation loop recurses in C), so every frame ends its segment.
    pub frame_objects: bool,
    /// 3.11's `is_entry` byte: the frame is the first of an interpreter activation (later versions
    /// push a frame of their own for that, whose owner is `entry_owner_min` or more).
    pub frame_is_entry: Option<u64>,
    pub code_size: u64,
    pub code_filename: u64,
    pub code_qualname: u64,
    pub code_linetable: u64,
    pub code_firstlineno: u64,
    pub code_adaptive: u64,
    /// Before 3.11: `co_code`, the `bytes` holding the instructions (outside the code object).
    pub code_bytes: Option<u64>,
    pub line_table: LineTable,
    pub object_type: u64,
    pub type_name: u64,
    pub bytes_ob_size: u64,
    pub bytes_data: u64,
    pub unicode_state: u64,
    pub unicode_length: u64,
    pub unicode_ascii_size: u64,
    pub unicode_compact_size: u64,
    pub entry_owner_min: u8,
    pub executable_tag_mask: u64,
    /// Size of `_PyRuntime`: thread states inside it (the main interpreter's initial thread) are
    /// static memory, never freed.
    pub runtime_size: u64,
    pub code_identity: CodeIdentity,
    /// Coroutines, sets, ints and list links, for asyncio tasks (3.14+).
    pub objects: Option<ObjectOffsets>,
}

/// Offsets of the object fields asyncio task reading uses.
#[derive(Clone, Debug)]
pub struct ObjectOffsets {
    /// `stackpointer` of an interpreter frame: the top of its value stack.
    pub frame_stackpointer: u64,
    pub type_flags: u64,
    pub set_used: u64,
    pub set_table: u64,
    pub set_mask: u64,
    pub long_tag: u64,
    pub long_digits: u64,
    /// The coroutine's own interpreter frame, inside the coroutine object.
    pub gen_iframe: u64,
    pub gen_frame_state: u64,
    pub llist_next: u64,
    pub states: FrameStates,
    pub awaited_below_top: u64,
}

/// The values of a coroutine's `gi_frame_state` pyebpf tells apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameStates {
    pub created: i8,
    pub suspended: &'static [i8],
    /// Suspended in `await` (`yield from`): the awaited object is on top of the frame's stack.
    pub yield_from: &'static [i8],
    pub executing: i8,
}

impl DebugOffsets {
    /// A frame's instruction field as read (8 bytes from `frame_instr_ptr`) made an address in the
    /// code's instructions (3.11+) or a byte offset into them (before; `u64::MAX` before the first
    /// instruction): in both, `CodeInfo` finds the instruction from its own base.
    pub fn instr_of(&self, raw: u64) -> u64 {
        // `f_lasti` is an `int`; the next field shares the 8 bytes read.
        let lasti = raw as u32 as i32;
        match self.instr_field {
            InstrField::Pointer => raw,
            _ if lasti < 0 => u64::MAX,
            InstrField::LastiBytes => lasti as u64,
            InstrField::LastiUnits => lasti as u64 * 2,
        }
    }

    /// What a frame is, from its owner bits (with [`pyebpf_common::ENTRY_FLAG`] for 3.11's `is_entry`).
    pub fn link_kind(&self, owner: u8) -> crate::chain::LinkKind {
        use crate::chain::LinkKind;
        if self.frame_objects {
            LinkKind::EntryCode
        } else if owner >= self.entry_owner_min {
            LinkKind::Entry
        } else if self.frame_is_entry.is_some() && owner & pyebpf_common::ENTRY_FLAG != 0 {
            LinkKind::EntryCode
        } else {
            LinkKind::Code
        }
    }
}

/// Where glibc (2.2x to 2.3x) and musl keep a thread's id in the descriptor `pthread_self()` points
/// at, on x86_64.
pub const PTHREAD_TID_OFFSETS: [u64; 2] = [720, 48];

/// What a frame's instruction field holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstrField {
    /// The address of the instruction running, in the code object (3.11+).
    Pointer,
    /// `f_lasti`, an `int`: the byte offset of the instruction running (3.8, 3.9), or -1 before the
    /// first.
    LastiBytes,
    /// `f_lasti` in 2-byte code units (3.10).
    LastiUnits,
}

/// The format of a code object's line table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineTable {
    /// `co_linetable`, lines and columns (3.11+).
    Locations,
    /// `co_lnotab` (3.8, 3.9).
    Lnotab,
    /// `co_linetable` of 3.10: line ranges, no columns.
    Lines310,
}

/// How a code object is told from another that took its address after it was freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodeIdentity {
    /// `co_version` (a `u32`) at this offset: never reused (3.12+).
    Version(u64),
    /// [`pyebpf_common::code_fingerprint`] of the words at `words` and the hash a `str` caches
    /// at `str_hash` (3.11).
    Fingerprint { words: u64, str_hash: u64 },
}

/// The offsets of a version without `_Py_DebugOffsets`, from pyebpf's own table: CPython 3.8 to
/// 3.12 releases (x86_64, default builds; taken from the headers with `offsetof` and checked on
/// pyenv's 3.8.18, 3.9.18, 3.10.13, 3.11.7 and 3.12.1 and Debian 12's 3.11.2). A table is only a
/// claim about the build: `PyProcess` checks it against the live process before using it.
pub fn builtin_offsets(version: PyVersion) -> Option<DebugOffsets> {
    match (version.major(), version.minor(), version.level()) {
        // Known by their file name only (no `Py_Version`).
        (3, minor @ 8..=10, 0) => Some(offsets_frame_objects(version, minor)),
        // Releases only: pre-release layouts moved.
        (3, 11, 0xf) => Some(offsets_3_11(version)),
        (3, 12, 0xf) => Some(offsets_3_12(version)),
        _ => None,
    }
}

/// 3.8, 3.9 and 3.10, whose frames are `PyFrameObject`s: one table with what moved between them.
fn offsets_frame_objects(version: PyVersion, minor: u64) -> DebugOffsets {
    let v3_8 = minor == 8;
    let v3_10 = minor == 10;
    DebugOffsets {
        version,
        interpreters_head: 32,
        interp_size: [2720, 5656, 113_528][minor as usize - 8],
        interp_id: if v3_8 { 16 } else { 24 },
        interp_next: 0,
        // `tstate_head`.
        interp_threads_head: 8,
        interp_ceval_gil: 0,
        gil_locked: 0,
        gil_holder: 0,
        // `gilstate.tstate_current`, after 3.8's larger `ceval` state.
        runtime_gil_holder: Some(if v3_8 { 1368 } else { 568 }),
        code_object_generation: None,
        tstate_size: if v3_10 { 280 } else { 264 },
        tstate_next: 8,
        tstate_cframe: None,
        // `frame`.
        tstate_current_frame: 24,
        tstate_last_profiled_frame: None,
        tstate_last_profiled_seq: None,
        // `thread_id`, the `pthread_t`.
        tstate_native_thread_id: 176,
        pthread_tid: Some(PTHREAD_TID_OFFSETS[0]),
        tstate_status: None,
        frame_size: if v3_10 { 360 } else { 368 },
        // `f_back`, `f_code`, `f_lasti`.
        frame_previous: 24,
        frame_executable: 32,
        frame_instr_ptr: if v3_10 { 96 } else { 104 },
        instr_field: if v3_10 { InstrField::LastiUnits } else { InstrField::LastiBytes },
        frame_owner: None,
        frame_objects: true,
        frame_is_entry: None,
        code_size: 176,
        code_filename: 104,
        // No qualified names before 3.11: `co_name`.
        code_qualname: 112,
        // `co_lnotab`, or 3.10's `co_linetable`.
        code_linetable: 120,
        code_firstlineno: 40,
        code_adaptive: 0,
        code_bytes: Some(48),
        line_table: if v3_10 { LineTable::Lines310 } else { LineTable::Lnotab },
        object_type: 8,
        type_name: 24,
        bytes_ob_size: 16,
        bytes_data: 32,
        unicode_state: 32,
        unicode_length: 16,
        unicode_ascii_size: 48,
        unicode_compact_size: 72,
        entry_owner_min: 8,
        executable_tag_mask: 0,
        runtime_size: [1464, 656, 672][minor as usize - 8],
        // `co_filename`, `co_name`, the line table; `PyASCIIObject.hash`.
        code_identity: CodeIdentity::Fingerprint { words: 104, str_hash: 24 },
        objects: None,
    }
}

fn offsets_3_11(version: PyVersion) -> DebugOffsets {
    DebugOffsets {
        version,
        interpreters_head: 40,
        interp_size: 107_752,
        interp_id: 48,
        interp_next: 0,
        interp_threads_head: 16,
        interp_ceval_gil: 0,
        gil_locked: 0,
        gil_holder: 0,
        runtime_gil_holder: Some(576),
        code_object_generation: None,
        tstate_size: 360,
        tstate_next: 8,
        tstate_cframe: Some(56),
        tstate_current_frame: 8,
        tstate_last_profiled_frame: None,
        tstate_last_profiled_seq: None,
        tstate_native_thread_id: 160,
        pthread_tid: None,
        tstate_status: None,
        frame_size: 80,
        frame_previous: 48,
        frame_executable: 32,
        // `prev_instr`, read as in 3.12.
        frame_instr_ptr: 56,
        instr_field: InstrField::Pointer,
        frame_owner: Some(69),
        frame_objects: false,
        frame_is_entry: Some(68),
        code_size: 192,
        code_filename: 112,
        code_qualname: 128,
        code_linetable: 136,
        code_firstlineno: 72,
        code_adaptive: 184,
        code_bytes: None,
        line_table: LineTable::Locations,
        object_type: 8,
        type_name: 24,
        bytes_ob_size: 16,
        bytes_data: 32,
        unicode_state: 32,
        unicode_length: 16,
        unicode_ascii_size: 48,
        // 3.11's compact strings still carry `wstr_length` after `utf8_length` and `utf8`.
        unicode_compact_size: 72,
        // 3.11's owners are 0 to 2: no frame is an entry frame by its owner.
        entry_owner_min: 8,
        executable_tag_mask: 0,
        runtime_size: 166_688,
        // `co_name`, `co_qualname`, `co_linetable`; `PyASCIIObject.hash`.
        code_identity: CodeIdentity::Fingerprint { words: 120, str_hash: 24 },
        objects: None,
    }
}

fn offsets_3_12(version: PyVersion) -> DebugOffsets {
    DebugOffsets {
        version,
        interpreters_head: 40,
        interp_size: 383_552,
        interp_id: 8,
        interp_next: 0,
        interp_threads_head: 72,
        // `ceval.gil` points at the `_gil_runtime_state`: `last_holder` at 8, `locked` at 16.
        interp_ceval_gil: 384,
        gil_locked: 16,
        gil_holder: 8,
        runtime_gil_holder: None,
        code_object_generation: None,
        tstate_size: 288,
        tstate_next: 8,
        tstate_cframe: Some(56),
        tstate_current_frame: 0,
        tstate_last_profiled_frame: None,
        tstate_last_profiled_seq: None,
        tstate_native_thread_id: 144,
        pthread_tid: None,
        // `_status`, with `active` its fifth bit, as in 3.13.
        tstate_status: Some(24),
        frame_size: 80,
        frame_previous: 8,
        // `f_code`, never tagged.
        frame_executable: 0,
        // `prev_instr`: like 3.13's `instr_ptr`, set to the instruction running at its start (for
        // a caller, its call), so both are decoded alike.
        frame_instr_ptr: 56,
        instr_field: InstrField::Pointer,
        frame_owner: Some(70),
        frame_objects: false,
        frame_is_entry: None,
        code_size: 200,
        code_filename: 112,
        code_qualname: 128,
        code_linetable: 136,
        code_firstlineno: 68,
        code_adaptive: 192,
        code_bytes: None,
        line_table: LineTable::Locations,
        object_type: 8,
        type_name: 24,
        bytes_ob_size: 16,
        bytes_data: 32,
        unicode_state: 32,
        unicode_length: 16,
        unicode_ascii_size: 40,
        unicode_compact_size: 40 + COMPACT_UTF8_FIELDS,
        entry_owner_min: 3,
        executable_tag_mask: 0,
        runtime_size: 459_944,
        code_identity: CodeIdentity::Version(92),
        objects: None,
    }
}

/// Reads and validates the table at `runtime` (the address of `_PyRuntime`).
pub fn read_debug_offsets(mem: &impl ReadMemory, runtime: u64) -> Result<DebugOffsets, PyError> {
    let raw = mem.read_vec(runtime, MAX_FIELDS * 8)?;
    if &raw[..8] != b"xdebugpy" {
        return Err(PyError::NoDebugOffsets);
    }
    let version = PyVersion(field_u64(&raw, 8));
    let layout = layout_for(version).ok_or(PyError::UnsupportedVersion(version))?;
    let at = |index: usize| field_u64(&raw, index as u64 * 8);
    if at(layout.free_threaded) != 0 {
        return Err(PyError::FreeThreaded(version));
    }
    let sized = |size_index: usize, limit: u64, fields: &[usize]| -> Result<Vec<u64>, PyError> {
        let size = at(size_index);
        if size == 0 || size > limit {
            return Err(PyError::BadOffsets(format!("structure size {size} at field {size_index}")));
        }
        fields
            .iter()
            .map(|&index| {
                let offset = at(index);
                if offset >= size {
                    Err(PyError::BadOffsets(format!("offset {offset} at field {index} beyond size {size}")))
                } else {
                    Ok(offset)
                }
            })
            .collect()
    };
    let l = layout;
    let runtime_fields = sized(l.runtime_size, MAX_STATE_SIZE, &[l.interpreters_head])?;
    let interp = sized(
        l.interp_size,
        MAX_STATE_SIZE,
        &[l.interp_next, l.interp_threads_head, l.interp_ceval_gil, l.interp_gil, l.gil_locked, l.gil_holder, l.interp_id],
    )?;
    // The GIL may be another interpreter's (shared with the main one): its fields are read through
    // the `ceval.gil` pointer, relative to the start of the GIL structure.
    let within_gil = |field: u64| field.checked_sub(interp[3]).ok_or_else(|| PyError::BadOffsets(format!("GIL field {field} before the GIL at {}", interp[3])));
    let tstate = sized(l.tstate_size, MAX_OBJECT_SIZE, &[l.tstate_next, l.tstate_current_frame, l.tstate_native_thread_id, l.tstate_status])?;
    let marker = match (l.tstate_last_profiled_frame, l.tstate_last_profiled_seq) {
        (Some(frame), Some(seq)) => Some(sized(l.tstate_size, MAX_OBJECT_SIZE, &[frame, seq])?),
        _ => None,
    };
    let frame = sized(l.frame_size, MAX_OBJECT_SIZE, &[l.frame_previous, l.frame_executable, l.frame_instr_ptr, l.frame_owner])?;
    let code = sized(l.code_size, MAX_OBJECT_SIZE, &[l.code_filename, l.code_qualname, l.code_linetable, l.code_firstlineno, l.code_adaptive])?;
    if l.code_version + 4 > at(l.code_size) {
        return Err(PyError::BadOffsets(format!("co_version at {} beyond code size {}", l.code_version, at(l.code_size))));
    }
    let bytes = sized(l.bytes_size, MAX_OBJECT_SIZE, &[l.bytes_ob_size, l.bytes_data])?;
    let unicode = sized(l.unicode_size, MAX_OBJECT_SIZE, &[l.unicode_state, l.unicode_length, l.unicode_ascii_size])?;
    let unicode_compact_size = match l.unicode_compact_size {
        Some(index) => sized(l.unicode_size, MAX_OBJECT_SIZE, &[index])?[0],
        None => unicode[2] + COMPACT_UTF8_FIELDS,
    };
    let object_type = sized(l.object_size, MAX_OBJECT_SIZE, &[l.object_type])?[0];
    let type_name = sized(l.type_size, MAX_OBJECT_SIZE, &[l.type_name])?[0];
    let objects = l.objects.as_ref().map(|o| object_offsets(o, l, &at, &sized)).transpose()?;
    Ok(DebugOffsets {
        version,
        interpreters_head: runtime_fields[0],
        interp_size: at(l.interp_size),
        interp_id: interp[6],
        interp_next: interp[0],
        interp_threads_head: interp[1],
        interp_ceval_gil: interp[2],
        runtime_gil_holder: None,
        gil_locked: within_gil(interp[4])?,
        gil_holder: within_gil(interp[5])?,
        code_object_generation: l.code_object_generation.map(at).filter(|&o| o < at(l.interp_size)),
        tstate_size: at(l.tstate_size),
        tstate_next: tstate[0],
        tstate_cframe: None,
        tstate_current_frame: tstate[1],
        tstate_last_profiled_frame: marker.as_ref().map(|m| m[0]),
        tstate_last_profiled_seq: marker.as_ref().map(|m| m[1]),
        tstate_native_thread_id: tstate[2],
        pthread_tid: None,
        tstate_status: Some(tstate[3]),
        frame_size: at(l.frame_size),
        frame_previous: frame[0],
        frame_executable: frame[1],
        frame_instr_ptr: frame[2],
        instr_field: InstrField::Pointer,
        frame_owner: Some(frame[3]),
        frame_objects: false,
        frame_is_entry: None,
        code_size: at(l.code_size),
        code_filename: code[0],
        code_qualname: code[1],
        code_linetable: code[2],
        code_firstlineno: code[3],
        code_adaptive: code[4],
        code_bytes: None,
        line_table: LineTable::Locations,
        object_type,
        type_name,
        bytes_ob_size: bytes[0],
        bytes_data: bytes[1],
        unicode_state: unicode[0],
        unicode_length: unicode[1],
        unicode_ascii_size: unicode[2],
        unicode_compact_size,
        entry_owner_min: l.entry_owner_min,
        executable_tag_mask: l.executable_tag_mask,
        runtime_size: at(l.runtime_size),
        code_identity: CodeIdentity::Version(l.code_version),
        objects,
    })
}

fn object_offsets(
    o: &ObjectLayout,
    l: &Layout,
    at: &impl Fn(usize) -> u64,
    sized: &impl Fn(usize, u64, &[usize]) -> Result<Vec<u64>, PyError>,
) -> Result<ObjectOffsets, PyError> {
    let set = sized(o.set_size, MAX_OBJECT_SIZE, &[o.set_used, o.set_table, o.set_mask])?;
    let long = sized(o.long_size, MAX_OBJECT_SIZE, &[o.long_tag, o.long_digits])?;
    let gen = sized(o.gen_size, MAX_OBJECT_SIZE, &[o.gen_iframe, o.gen_frame_state])?;
    // A list node is two pointers.
    let llist_next = at(o.llist_next);
    if llist_next > 8 || !llist_next.is_multiple_of(8) {
        return Err(PyError::BadOffsets(format!("list node link at {llist_next}")));
    }
    Ok(ObjectOffsets {
        frame_stackpointer: sized(l.frame_size, MAX_OBJECT_SIZE, &[o.frame_stackpointer])?[0],
        type_flags: sized(l.type_size, MAX_OBJECT_SIZE, &[o.type_flags])?[0],
        set_used: set[0],
        set_table: set[1],
        set_mask: set[2],
        long_tag: long[0],
        long_digits: long[1],
        gen_iframe: gen[0],
        gen_frame_state: gen[1],
        llist_next,
        states: o.states,
        awaited_below_top: o.awaited_below_top,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpython::memory::MemoryImage;

    const RUNTIME: u64 = 0x10000;

    /// A table in `layout`'s shape: every offset 8, except the GIL's fields, which lie after the GIL.
    fn table(layout: &Layout, version: u64) -> Vec<u64> {
        let mut fields = vec![8u64; MAX_FIELDS];
        fields[0] = u64::from_le_bytes(*b"xdebugpy");
        fields[1] = version;
        fields[layout.free_threaded] = 0;
        for size in [
            layout.runtime_size,
            layout.interp_size,
            layout.tstate_size,
            layout.frame_size,
            layout.code_size,
            layout.bytes_size,
            layout.unicode_size,
            layout.object_size,
            layout.type_size,
        ] {
            fields[size] = 256;
        }
        if let Some(o) = &layout.objects {
            for size in [o.set_size, o.long_size, o.gen_size] {
                fields[size] = 256;
            }
        }
        fields[layout.interp_gil] = 64;
        fields[layout.gil_locked] = 72;
        fields[layout.gil_holder] = 80;
        fields
    }

    fn read(fields: &[u64]) -> Result<DebugOffsets, PyError> {
        let mut image = MemoryImage::default();
        image.insert(RUNTIME, fields.iter().flat_map(|f| f.to_le_bytes()).collect());
        read_debug_offsets(&image, RUNTIME)
    }

    #[test]
    fn accepts_known_layouts() {
        for (layout, version) in [(&LAYOUT_3_13, 0x030d00f0), (&LAYOUT_3_14, 0x030e0af0), (&LAYOUT_3_15, 0x030f00b4), (&LAYOUT_3_15, 0x030f02f0)] {
            let offsets = read(&table(layout, version)).unwrap();
            assert_eq!((offsets.gil_locked, offsets.gil_holder), (8, 16), "GIL fields relative to the GIL");
            assert_eq!(offsets.objects.is_some(), layout.objects.is_some(), "asyncio's object offsets from 3.14 on");
        }
    }

    /// 3.11 flags the first frame of an activation; later versions push an entry frame of their own.
    #[test]
    fn frames_are_told_apart_by_owner_and_entry_flag() {
        use crate::chain::LinkKind;
        use pyebpf_common::ENTRY_FLAG;
        let v3_11 = builtin_offsets(PyVersion(0x030b07f0)).unwrap();
        let v3_12 = builtin_offsets(PyVersion(0x030c01f0)).unwrap();
        assert_eq!(
            [0, 1, 2, ENTRY_FLAG, 2 | ENTRY_FLAG].map(|owner| v3_11.link_kind(owner)),
            [LinkKind::Code, LinkKind::Code, LinkKind::Code, LinkKind::EntryCode, LinkKind::EntryCode]
        );
        assert_eq!([0, 2, 3, 4].map(|owner| v3_12.link_kind(owner)), [LinkKind::Code, LinkKind::Code, LinkKind::Entry, LinkKind::Entry]);
        assert!(builtin_offsets(PyVersion(0x030b00c1)).is_none(), "a 3.11 release candidate's layout is not known");
        assert!(builtin_offsets(PyVersion(0x030a0df0)).is_none(), "3.10 has no table");
    }

    #[test]
    fn refuses_unknown_versions_and_free_threading() {
        assert!(matches!(read(&table(&LAYOUT_3_13, 0x030c00f0)), Err(PyError::UnsupportedVersion(_))));
        assert!(matches!(read(&table(&LAYOUT_3_15, 0x030f00b3)), Err(PyError::UnsupportedVersion(_))));
        assert!(matches!(read(&table(&LAYOUT_3_15, 0x031000f0)), Err(PyError::UnsupportedVersion(_))));
        let mut free_threaded = table(&LAYOUT_3_14, 0x030e00f0);
        free_threaded[LAYOUT_3_14.free_threaded] = 1;
        assert!(matches!(read(&free_threaded), Err(PyError::FreeThreaded(_))));
        let mut bad_link = table(&LAYOUT_3_14, 0x030e00f0);
        bad_link[LAYOUT_3_14.objects.as_ref().unwrap().llist_next] = 12;
        assert!(matches!(read(&bad_link), Err(PyError::BadOffsets(_))), "a list link inside no two-pointer node");
        let mut no_cookie = table(&LAYOUT_3_14, 0x030e00f0);
        no_cookie[0] = 0;
        assert!(matches!(read(&no_cookie), Err(PyError::NoDebugOffsets)));
    }

    #[test]
    fn refuses_implausible_offsets_and_sizes() {
        let l = &LAYOUT_3_14;
        for (field, value) in
            [(l.frame_previous, 256), (l.code_qualname, u64::MAX), (l.frame_size, 0), (l.code_size, 1 << 20), (l.type_name, 4096), (l.gil_locked, 8)]
        {
            let mut fields = table(l, 0x030e00f0);
            fields[field] = value;
            assert!(matches!(read(&fields), Err(PyError::BadOffsets(_))), "field {field} = {value} accepted");
        }
    }
}
