//! One interpreter frame read into a record: the frame walk's and the awaiting coroutines' step.

use core::ffi::c_void;

use aya_ebpf::helpers::{bpf_probe_read_user, generated};
use pyebpf_common::{code_fingerprint, PyFrameRecord, PyProcConfig, CODE_FINGERPRINT_WORDS, ENTRY_FLAG, FINGERPRINT_NAME_WORD, NO_OFFSET, PY_FRAME_WINDOW};

use crate::read::{read_u32, read_u64};

/// The frame at `addr` as a record, read into `window` (whose other fields the caller may then
/// take); `None` if it cannot be read.
pub fn frame_record(config: &PyProcConfig, addr: u64, window: &mut [u8; PY_FRAME_WINDOW]) -> Option<PyFrameRecord> {
    // A form the verifier can bound: in 1..=PY_FRAME_WINDOW (an out-of-range value reads the
    // whole window).
    let read_len = (config.frame_window.wrapping_sub(1) & (PY_FRAME_WINDOW as u32 - 1)) + 1;
    // SAFETY: a checked user read of at most the buffer's size into it.
    if unsafe { generated::bpf_probe_read_user(window.as_mut_ptr() as *mut c_void, read_len, addr as *const c_void) } < 0 {
        return None;
    }
    let code = window_u64(window, config.frame_executable) & !config.executable_tag_mask;
    let mut owner = if config.frame_owner == NO_OFFSET { 0 } else { window[config.frame_owner as usize & (PY_FRAME_WINDOW - 1)] & 7 };
    if config.frame_is_entry != NO_OFFSET && window[config.frame_is_entry as usize & (PY_FRAME_WINDOW - 1)] != 0 {
        owner |= ENTRY_FLAG;
    }
    Some(PyFrameRecord {
        addr_owner: addr | owner as u64,
        code,
        instr_ptr: window_u64(window, config.frame_instr_ptr),
        code_version: code_identity(config, code),
        _pad: 0,
    })
}

/// What identifies the code object at `code` with its address: its `co_version`, or where there
/// is none (3.11) its fingerprint; 0 if it cannot be read.
fn code_identity(config: &PyProcConfig, code: u64) -> u32 {
    if code == 0 {
        return 0;
    }
    if config.code_version != NO_OFFSET {
        return read_u32(code + config.code_version as u64).unwrap_or(0);
    }
    if config.code_fingerprint == NO_OFFSET {
        return 0;
    }
    // SAFETY: checked user reads.
    let Ok(words) = (unsafe { bpf_probe_read_user((code + config.code_fingerprint as u64) as *const [u64; CODE_FINGERPRINT_WORDS]) }) else {
        return 0;
    };
    let Some(name_hash) = read_u64(words[FINGERPRINT_NAME_WORD] + config.str_hash as u64) else { return 0 };
    code_fingerprint(&words, name_hash)
}

/// The u64 at `offset` in a frame window; userspace checked every offset fits in the window.
pub fn window_u64(window: &[u8; PY_FRAME_WINDOW], offset: u32) -> u64 {
    let at = offset as usize & (PY_FRAME_WINDOW - 8);
    // SAFETY: `at + 8 <= PY_FRAME_WINDOW`; the window need not be aligned, hence read_unaligned.
    unsafe { core::ptr::read_unaligned(window.as_ptr().add(at) as *const u64) }
}
