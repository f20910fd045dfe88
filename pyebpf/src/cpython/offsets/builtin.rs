//! pyebpf's own offsets of the CPython versions without `_Py_DebugOffsets` (3.8 to 3.12).

use super::{CodeIdentity, DebugOffsets, InstrField, LineTable, PyVersion, COMPACT_UTF8_FIELDS, PTHREAD_TID_OFFSETS};

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
        free_threaded: false,
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
        tstate_prev: 0,
        tstate_next: 8,
        tstate_interp: 16,
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
        code_tlbc: None,
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
        free_threaded: false,
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
        tstate_prev: 0,
        tstate_next: 8,
        tstate_interp: 16,
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
        code_tlbc: None,
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
        free_threaded: false,
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
        tstate_prev: 0,
        tstate_next: 8,
        tstate_interp: 16,
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
        code_tlbc: None,
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
