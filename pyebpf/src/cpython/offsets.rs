//! `_Py_DebugOffsets`: the table of structure offsets CPython 3.13+ keeps at the start of
//! `_PyRuntime` for out-of-process readers. Its own layout grew between minor versions (and within
//! 3.15's pre-releases), so each known layout is one table of field positions (`layouts`), and
//! each offset is read from the field of its own name. For 3.8 to 3.12, which have no such table,
//! pyebpf brings the offsets itself ([`builtin_offsets`]).

mod builtin;
mod layouts;
#[cfg(test)]
mod tests;

use super::memory::{field_u64, ReadExt, ReadMemory};
use super::PyError;
pub use builtin::builtin_offsets;
use layouts::{layout_for, Layout, ObjectLayout};

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
/// Where `co_version` sits in `PyCodeObject` (`cpython/code.h`, 3.12 to 3.15): after
/// `co_firstlineno` and five more `int`s, and right before the `co_localsplusnames` pointer.
const CO_VERSION_AFTER_FIRSTLINENO: u64 = 24;
const CO_VERSION_BEFORE_NAMES: u64 = 4;

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

/// Whether this version has debug offsets pyebpf reads.
pub(super) fn is_supported(version: PyVersion) -> bool {
    layout_for(version).is_some()
}

/// The offsets pyebpf uses, decoded and checked.
#[derive(Clone, Debug)]
pub struct DebugOffsets {
    pub version: PyVersion,
    /// A free-threaded build (PEP 703): no GIL, and a larger object header, which the table's
    /// offsets already include.
    pub free_threaded: bool,
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
    /// `prev`, `next` and `interp` of a thread state: its interpreter's thread list links it.
    pub tstate_prev: u64,
    pub tstate_next: u64,
    pub tstate_interp: u64,
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
    /// `co_tlbc` of a free-threaded 3.14+: where a code object points at the copies of its
    /// instructions its threads run (see `code::CodeInfo`).
    pub code_tlbc: Option<u64>,
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

/// Reads and validates the table at `runtime` (the address of `_PyRuntime`).
pub fn read_debug_offsets(mem: &impl ReadMemory, runtime: u64) -> Result<DebugOffsets, PyError> {
    let raw = mem.read_vec(runtime, MAX_FIELDS * 8)?;
    if &raw[..8] != b"xdebugpy" {
        return Err(PyError::NoDebugOffsets);
    }
    let table = Table(&raw);
    let version = PyVersion(table.at(1));
    let layout = layout_for(version).ok_or(PyError::UnsupportedVersion(version))?;
    let free_threaded = table.at(layout.free_threaded) != 0;
    if free_threaded && layout.code_tlbc.is_some() {
        // From 3.14 a free-threaded thread may run its own copy of a code object's bytecode: the
        // reading is built (`co_tlbc` below, `code::CodeInfo`) but no 3.14t could be tested
        // here, so such a process is profiled natively, with this error named, until one is.
        return Err(PyError::FreeThreaded(version));
    }
    let structures = Structures::check(table, layout)?;
    let mut offsets = decode(&structures, layout, version)?;
    offsets.free_threaded = free_threaded;
    if free_threaded {
        offsets.code_tlbc = structures.code.optional_field(layout.code_tlbc)?;
    }
    Ok(offsets)
}

/// The table as read: 64-bit fields, the cookie the first.
#[derive(Clone, Copy)]
struct Table<'r>(&'r [u8]);

impl<'r> Table<'r> {
    fn at(self, index: usize) -> u64 {
        field_u64(self.0, index as u64 * 8)
    }

    /// The structure whose size is the field at `size_index`, checked to be at most `limit`.
    fn structure(self, size_index: usize, limit: u64) -> Result<Structure<'r>, PyError> {
        let size = self.at(size_index);
        if size == 0 || size > limit {
            return Err(PyError::BadOffsets(format!("structure size {size} at field {size_index}")));
        }
        Ok(Structure { table: self, size })
    }
}

/// A structure the table gives the size of.
#[derive(Clone, Copy)]
struct Structure<'r> {
    table: Table<'r>,
    size: u64,
}

impl Structure<'_> {
    /// The offset at field `index` of the table, checked to lie within the structure.
    fn field(self, index: usize) -> Result<u64, PyError> {
        let offset = self.table.at(index);
        if offset >= self.size {
            return Err(PyError::BadOffsets(format!("offset {offset} at field {index} beyond size {}", self.size)));
        }
        Ok(offset)
    }

    /// [`Structure::field`] of a field only some layouts have.
    fn optional_field(self, index: Option<usize>) -> Result<Option<u64>, PyError> {
        index.map(|index| self.field(index)).transpose()
    }
}

/// The structures pyebpf reads, each with its size checked.
struct Structures<'r> {
    table: Table<'r>,
    runtime: Structure<'r>,
    interp: Structure<'r>,
    tstate: Structure<'r>,
    frame: Structure<'r>,
    code: Structure<'r>,
    object: Structure<'r>,
    type_object: Structure<'r>,
    bytes: Structure<'r>,
    unicode: Structure<'r>,
}

impl<'r> Structures<'r> {
    fn check(table: Table<'r>, l: &Layout) -> Result<Self, PyError> {
        Ok(Structures {
            table,
            runtime: table.structure(l.runtime_size, MAX_STATE_SIZE)?,
            interp: table.structure(l.interp_size, MAX_STATE_SIZE)?,
            tstate: table.structure(l.tstate_size, MAX_OBJECT_SIZE)?,
            frame: table.structure(l.frame_size, MAX_OBJECT_SIZE)?,
            code: table.structure(l.code_size, MAX_OBJECT_SIZE)?,
            object: table.structure(l.object_size, MAX_OBJECT_SIZE)?,
            type_object: table.structure(l.type_size, MAX_OBJECT_SIZE)?,
            bytes: table.structure(l.bytes_size, MAX_OBJECT_SIZE)?,
            unicode: table.structure(l.unicode_size, MAX_OBJECT_SIZE)?,
        })
    }

    /// A field of the GIL, relative to the start of the GIL structure: the GIL may be another
    /// interpreter's (shared with the main one), so its fields are read through the `ceval.gil`
    /// pointer.
    fn gil_field(&self, l: &Layout, index: usize) -> Result<u64, PyError> {
        let (gil, field) = (self.interp.field(l.interp_gil)?, self.interp.field(index)?);
        field.checked_sub(gil).ok_or_else(|| PyError::BadOffsets(format!("GIL field {field} before the GIL at {gil}")))
    }

    /// `co_version`, which is not in the table: the `u32` just before `co_localsplusnames`, and
    /// the sixth `int` after `co_firstlineno`. Both must agree, so a build whose code object is
    /// laid out otherwise is refused rather than read at a guessed place.
    fn code_identity(&self, l: &Layout) -> Result<CodeIdentity, PyError> {
        let (names, first_line) = (self.code.field(l.code_localsplusnames)?, self.code.field(l.code_firstlineno)?);
        let version = names.checked_sub(CO_VERSION_BEFORE_NAMES).unwrap_or(u64::MAX);
        if version != first_line + CO_VERSION_AFTER_FIRSTLINENO {
            return Err(PyError::BadOffsets(format!("co_version: co_localsplusnames at {names} and co_firstlineno at {first_line} disagree")));
        }
        Ok(CodeIdentity::Version(version))
    }

    fn unicode_compact_size(&self, l: &Layout) -> Result<u64, PyError> {
        match l.unicode_compact_size {
            Some(index) => self.unicode.field(index),
            None => Ok(self.unicode.field(l.unicode_ascii_size)? + COMPACT_UTF8_FIELDS),
        }
    }
}

/// The offsets of a table, each read from the field of its own name in the layout.
fn decode(s: &Structures, l: &Layout, version: PyVersion) -> Result<DebugOffsets, PyError> {
    Ok(DebugOffsets {
        version,
        free_threaded: false,
        interpreters_head: s.runtime.field(l.interpreters_head)?,
        interp_size: s.interp.size,
        interp_id: s.interp.field(l.interp_id)?,
        interp_next: s.interp.field(l.interp_next)?,
        interp_threads_head: s.interp.field(l.interp_threads_head)?,
        interp_ceval_gil: s.interp.field(l.interp_ceval_gil)?,
        runtime_gil_holder: None,
        gil_locked: s.gil_field(l, l.gil_locked)?,
        gil_holder: s.gil_field(l, l.gil_holder)?,
        // Outside the interpreter state, the counter is taken as absent.
        code_object_generation: l.code_object_generation.and_then(|index| s.interp.field(index).ok()),
        tstate_size: s.tstate.size,
        tstate_prev: s.tstate.field(l.tstate_prev)?,
        tstate_next: s.tstate.field(l.tstate_next)?,
        tstate_interp: s.tstate.field(l.tstate_interp)?,
        tstate_cframe: None,
        tstate_current_frame: s.tstate.field(l.tstate_current_frame)?,
        tstate_last_profiled_frame: s.tstate.optional_field(l.tstate_last_profiled_frame)?,
        tstate_last_profiled_seq: s.tstate.optional_field(l.tstate_last_profiled_seq)?,
        tstate_native_thread_id: s.tstate.field(l.tstate_native_thread_id)?,
        pthread_tid: None,
        tstate_status: Some(s.tstate.field(l.tstate_status)?),
        frame_size: s.frame.size,
        frame_previous: s.frame.field(l.frame_previous)?,
        frame_executable: s.frame.field(l.frame_executable)?,
        frame_instr_ptr: s.frame.field(l.frame_instr_ptr)?,
        instr_field: InstrField::Pointer,
        frame_owner: Some(s.frame.field(l.frame_owner)?),
        frame_objects: false,
        frame_is_entry: None,
        code_size: s.code.size,
        code_filename: s.code.field(l.code_filename)?,
        code_qualname: s.code.field(l.code_qualname)?,
        code_linetable: s.code.field(l.code_linetable)?,
        code_firstlineno: s.code.field(l.code_firstlineno)?,
        code_adaptive: s.code.field(l.code_adaptive)?,
        code_tlbc: None,
        code_bytes: None,
        line_table: LineTable::Locations,
        object_type: s.object.field(l.object_type)?,
        type_name: s.type_object.field(l.type_name)?,
        bytes_ob_size: s.bytes.field(l.bytes_ob_size)?,
        bytes_data: s.bytes.field(l.bytes_data)?,
        unicode_state: s.unicode.field(l.unicode_state)?,
        unicode_length: s.unicode.field(l.unicode_length)?,
        unicode_ascii_size: s.unicode.field(l.unicode_ascii_size)?,
        unicode_compact_size: s.unicode_compact_size(l)?,
        entry_owner_min: l.entry_owner_min,
        executable_tag_mask: l.executable_tag_mask,
        runtime_size: s.runtime.size,
        code_identity: s.code_identity(l)?,
        objects: l.objects.as_ref().map(|o| object_offsets(o, s)).transpose()?,
    })
}

fn object_offsets(o: &ObjectLayout, s: &Structures) -> Result<ObjectOffsets, PyError> {
    let set = s.table.structure(o.set_size, MAX_OBJECT_SIZE)?;
    let long = s.table.structure(o.long_size, MAX_OBJECT_SIZE)?;
    let coroutine = s.table.structure(o.gen_size, MAX_OBJECT_SIZE)?;
    // A list node is two pointers.
    let llist_next = s.table.at(o.llist_next);
    if llist_next > 8 || !llist_next.is_multiple_of(8) {
        return Err(PyError::BadOffsets(format!("list node link at {llist_next}")));
    }
    Ok(ObjectOffsets {
        frame_stackpointer: s.frame.field(o.frame_stackpointer)?,
        type_flags: s.type_object.field(o.type_flags)?,
        set_used: set.field(o.set_used)?,
        set_table: set.field(o.set_table)?,
        set_mask: set.field(o.set_mask)?,
        long_tag: long.field(o.long_tag)?,
        long_digits: long.field(o.long_digits)?,
        gen_iframe: coroutine.field(o.gen_iframe)?,
        gen_frame_state: coroutine.field(o.gen_frame_state)?,
        llist_next,
        states: o.states,
        awaited_below_top: o.awaited_below_top,
    })
}
