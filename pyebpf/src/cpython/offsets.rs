//! `_Py_DebugOffsets`: the table of structure offsets CPython 3.13+ keeps at the start of
//! `_PyRuntime` for out-of-process readers. Its own layout grew between minor versions (and within
//! 3.15's pre-releases), so each known layout is one table of field positions below.

use super::memory::{field_u64, ReadExt, ReadMemory};
use super::PyError;

/// The table is a cookie followed by 64-bit fields; none of the known layouts has more.
const MAX_FIELDS: usize = 128;
/// Largest structure size accepted from a table (a sanity bound: `_PyRuntime` and interpreter
/// states are a few hundred KiB).
const MAX_STRUCT_SIZE: u64 = 16 << 20;

/// Position (in 64-bit fields, the cookie counting as one) of each field pyebpf reads.
struct Layout {
    free_threaded: usize,
    runtime_size: usize,
    interpreters_head: usize,
    interp_size: usize,
    interp_next: usize,
    interp_threads_head: usize,
    interp_ceval_gil: usize,
    gil_runtime_state: usize,
    gil_locked: usize,
    gil_holder: usize,
    code_object_generation: Option<usize>,
    tstate_size: usize,
    tstate_next: usize,
    tstate_current_frame: usize,
    tstate_last_profiled_frame: Option<usize>,
    tstate_last_profiled_seq: Option<usize>,
    tstate_native_thread_id: usize,
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
    object_type: usize,
    type_name: usize,
    bytes_size: usize,
    bytes_ob_size: usize,
    bytes_data: usize,
    unicode_size: usize,
    unicode_state: usize,
    unicode_length: usize,
    unicode_ascii_size: usize,
    /// Owner values of frames that belong to the interpreter itself (entry frames).
    entry_owner_min: u8,
    /// Tag bits of `f_executable` (a `_PyStackRef` since 3.14).
    executable_tag_mask: u64,
}

const LAYOUT_3_13: Layout = Layout {
    free_threaded: 2, runtime_size: 3, interpreters_head: 5,
    interp_size: 6, interp_next: 8, interp_threads_head: 9, interp_ceval_gil: 14, gil_runtime_state: 15, gil_locked: 17, gil_holder: 18,
    code_object_generation: None,
    tstate_size: 19, tstate_next: 21, tstate_current_frame: 23, tstate_last_profiled_frame: None,
    tstate_last_profiled_seq: None, tstate_native_thread_id: 25,
    frame_size: 28, frame_previous: 29, frame_executable: 30, frame_instr_ptr: 31, frame_owner: 33,
    code_size: 34, code_filename: 35, code_qualname: 37, code_linetable: 38, code_firstlineno: 39, code_adaptive: 43,
    object_type: 45, type_name: 47, bytes_size: 64, bytes_ob_size: 65, bytes_data: 66,
    unicode_size: 67, unicode_state: 68, unicode_length: 69, unicode_ascii_size: 70,
    entry_owner_min: 3, executable_tag_mask: 0,
};

const LAYOUT_3_14: Layout = Layout {
    free_threaded: 2, runtime_size: 3, interpreters_head: 5,
    interp_size: 6, interp_next: 8, interp_threads_head: 9, interp_ceval_gil: 15, gil_runtime_state: 16, gil_locked: 18, gil_holder: 19,
    code_object_generation: Some(20),
    tstate_size: 22, tstate_next: 24, tstate_current_frame: 26, tstate_last_profiled_frame: None,
    tstate_last_profiled_seq: None, tstate_native_thread_id: 28,
    frame_size: 31, frame_previous: 32, frame_executable: 33, frame_instr_ptr: 34, frame_owner: 36,
    code_size: 39, code_filename: 40, code_qualname: 42, code_linetable: 43, code_firstlineno: 44, code_adaptive: 48,
    object_type: 51, type_name: 53, bytes_size: 74, bytes_ob_size: 75, bytes_data: 76,
    unicode_size: 77, unicode_state: 78, unicode_length: 79, unicode_ascii_size: 80,
    entry_owner_min: 3, executable_tag_mask: 3,
};

/// 3.15.0b4 and later (b4 inserted `last_profiled_frame_seq`).
const LAYOUT_3_15: Layout = Layout {
    free_threaded: 2, runtime_size: 3, interpreters_head: 5,
    interp_size: 6, interp_next: 8, interp_threads_head: 9, interp_ceval_gil: 15, gil_runtime_state: 16, gil_locked: 18, gil_holder: 19,
    code_object_generation: Some(20),
    tstate_size: 22, tstate_next: 24, tstate_current_frame: 26, tstate_last_profiled_frame: Some(28),
    tstate_last_profiled_seq: Some(29), tstate_native_thread_id: 31,
    frame_size: 39, frame_previous: 40, frame_executable: 41, frame_instr_ptr: 42, frame_owner: 44,
    code_size: 47, code_filename: 48, code_qualname: 50, code_linetable: 51, code_firstlineno: 52, code_adaptive: 56,
    object_type: 59, type_name: 61, bytes_size: 86, bytes_ob_size: 87, bytes_data: 88,
    unicode_size: 89, unicode_state: 90, unicode_length: 91, unicode_ascii_size: 92,
    entry_owner_min: 3, executable_tag_mask: 3,
};

/// A CPython version as `PY_VERSION_HEX` encodes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyVersion(pub u64);

impl PyVersion {
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
fn layout_for(version: PyVersion) -> Option<&'static Layout> {
    let release_candidate_or_later = version.level() >= 0xc;
    match (version.major(), version.minor()) {
        (3, 13) if release_candidate_or_later => Some(&LAYOUT_3_13),
        (3, 14) if release_candidate_or_later => Some(&LAYOUT_3_14),
        (3, 15) if version.micro() > 0 || release_candidate_or_later || (version.level() == 0xb && version.serial() >= 4) => {
            Some(&LAYOUT_3_15)
        }
        _ => None,
    }
}

/// The offsets pyebpf uses, decoded and checked.
#[derive(Clone, Debug)]
pub struct DebugOffsets {
    pub version: PyVersion,
    pub interpreters_head: u64,
    pub interp_size: u64,
    pub interp_next: u64,
    pub interp_threads_head: u64,
    pub interp_ceval_gil: u64,
    pub gil_locked: u64,
    pub gil_holder: u64,
    pub code_object_generation: Option<u64>,
    pub tstate_size: u64,
    pub tstate_next: u64,
    pub tstate_current_frame: u64,
    pub tstate_last_profiled_frame: Option<u64>,
    pub tstate_last_profiled_seq: Option<u64>,
    pub tstate_native_thread_id: u64,
    pub frame_size: u64,
    pub frame_previous: u64,
    pub frame_executable: u64,
    pub frame_instr_ptr: u64,
    pub frame_owner: u64,
    pub code_size: u64,
    pub code_filename: u64,
    pub code_qualname: u64,
    pub code_linetable: u64,
    pub code_firstlineno: u64,
    pub code_adaptive: u64,
    pub object_type: u64,
    pub type_name: u64,
    pub bytes_ob_size: u64,
    pub bytes_data: u64,
    pub unicode_state: u64,
    pub unicode_length: u64,
    pub unicode_ascii_size: u64,
    pub entry_owner_min: u8,
    pub executable_tag_mask: u64,
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
    let sized = |size_index: usize, fields: &[usize]| -> Result<Vec<u64>, PyError> {
        let size = at(size_index);
        if size == 0 || size > MAX_STRUCT_SIZE {
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
    let runtime_fields = sized(l.runtime_size, &[l.interpreters_head])?;
    let interp = sized(l.interp_size, &[l.interp_next, l.interp_threads_head, l.interp_ceval_gil])?;
    let tstate = sized(l.tstate_size, &[l.tstate_next, l.tstate_current_frame, l.tstate_native_thread_id])?;
    let marker = match (l.tstate_last_profiled_frame, l.tstate_last_profiled_seq) {
        (Some(frame), Some(seq)) => Some(sized(l.tstate_size, &[frame, seq])?),
        _ => None,
    };
    let frame = sized(l.frame_size, &[l.frame_previous, l.frame_executable, l.frame_instr_ptr, l.frame_owner])?;
    let code = sized(l.code_size, &[l.code_filename, l.code_qualname, l.code_linetable, l.code_firstlineno, l.code_adaptive])?;
    let bytes = sized(l.bytes_size, &[l.bytes_ob_size, l.bytes_data])?;
    let unicode = sized(l.unicode_size, &[l.unicode_state, l.unicode_length, l.unicode_ascii_size])?;
    Ok(DebugOffsets {
        version,
        interpreters_head: runtime_fields[0],
        interp_size: at(l.interp_size),
        interp_next: interp[0],
        interp_threads_head: interp[1],
        interp_ceval_gil: interp[2],
        // The table gives the GIL's fields as offsets in the interpreter state (of its own GIL);
        // `ceval.gil` may point at another interpreter's, so keep them relative to the GIL.
        gil_locked: at(l.gil_locked).wrapping_sub(at(l.gil_runtime_state)),
        gil_holder: at(l.gil_holder).wrapping_sub(at(l.gil_runtime_state)),
        code_object_generation: l.code_object_generation.map(at).filter(|&o| o < at(l.interp_size)),
        tstate_size: at(l.tstate_size),
        tstate_next: tstate[0],
        tstate_current_frame: tstate[1],
        tstate_last_profiled_frame: marker.as_ref().map(|m| m[0]),
        tstate_last_profiled_seq: marker.as_ref().map(|m| m[1]),
        tstate_native_thread_id: tstate[2],
        frame_size: at(l.frame_size),
        frame_previous: frame[0],
        frame_executable: frame[1],
        frame_instr_ptr: frame[2],
        frame_owner: frame[3],
        code_size: at(l.code_size),
        code_filename: code[0],
        code_qualname: code[1],
        code_linetable: code[2],
        code_firstlineno: code[3],
        code_adaptive: code[4],
        object_type: at(l.object_type),
        type_name: at(l.type_name),
        bytes_ob_size: bytes[0],
        bytes_data: bytes[1],
        unicode_state: unicode[0],
        unicode_length: unicode[1],
        unicode_ascii_size: unicode[2],
        entry_owner_min: l.entry_owner_min,
        executable_tag_mask: l.executable_tag_mask,
    })
}
