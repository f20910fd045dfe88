//! Decoding code objects: names, file, first line and the location table.

use std::collections::HashSet;
use std::sync::Arc;

pub use super::linetable::Location;
use super::linetable::location_for_index;
use super::memory::{field_u32, field_u64, ReadExt, ReadMemory};
use super::offsets::DebugOffsets;
use super::strings::read_str;
use super::PyError;

/// Largest location table read.
const MAX_LINETABLE: u64 = 1 << 20;
/// The instructions of a code object are 2-byte code units.
const CODE_UNIT: u64 = 2;

/// What a profile needs of a code object.
#[derive(Debug)]
pub struct CodeInfo {
    pub qualname: Arc<str>,
    pub filename: Arc<str>,
    pub first_line: u32,
    linetable: Vec<u8>,
    /// Address of the first instruction (`co_code_adaptive`).
    instructions: u64,
}

impl CodeInfo {
    /// The source location of the instruction at `instr_ptr` (an address inside this code object's
    /// instructions, as a frame's `instr_ptr` holds it).
    pub fn location_for(&self, instr_ptr: u64) -> Option<Location> {
        let index = instr_ptr.checked_sub(self.instructions)? / CODE_UNIT;
        location_for_index(&self.linetable, self.first_line, index)
    }

    /// The line of the instruction at `instr_ptr`.
    pub fn line_for(&self, instr_ptr: u64) -> Option<u32> {
        self.location_for(instr_ptr)?.line
    }

    /// Whether a frame running this code at `instr_ptr` is one the interpreter pushed for itself
    /// (the `__init__` clean-up trampoline of 3.13+): such code has no first line and no location,
    /// and Python's own frame list (`f_back`, `sys._current_frames`) leaves it out. User code always
    /// has a first line, and a caller's call instruction always has a location.
    pub fn is_interpreter_shim(&self, instr_ptr: u64) -> bool {
        self.first_line == 0 && self.location_for(instr_ptr).is_none_or(|location| location.line.is_none())
    }
}

/// Bytes of a code object that cover every field read from it (offsets are bounded by the checks
/// on the table, so this stays small even when the table claims a huge structure).
fn header_len(o: &DebugOffsets) -> usize {
    let last = [o.object_type, o.code_filename, o.code_qualname, o.code_linetable, o.code_firstlineno].into_iter().max().unwrap_or(0);
    (last + 8) as usize
}

/// Reads the code object at `addr`, checking first that it is one. `code_types` remembers type
/// objects already confirmed to be `code`.
pub fn read_code(mem: &impl ReadMemory, offsets: &DebugOffsets, code_types: &mut HashSet<u64>, addr: u64) -> Result<CodeInfo, PyError> {
    if addr == 0 || !addr.is_multiple_of(8) {
        return Err(PyError::Malformed(format!("code object address {addr:#x}")));
    }
    let header = mem.read_vec(addr, header_len(offsets))?;
    let ob_type = field_u64(&header, offsets.object_type);
    if !code_types.contains(&ob_type) {
        let name = mem.read_u64(ob_type.wrapping_add(offsets.type_name))?;
        let mut text = [0u8; 5];
        mem.read(name, &mut text)?;
        if &text != b"code\0" {
            return Err(PyError::Malformed(format!("object at {addr:#x} is not a code object")));
        }
        code_types.insert(ob_type);
    }
    let linetable = field_u64(&header, offsets.code_linetable);
    let size = mem.read_u64(linetable.wrapping_add(offsets.bytes_ob_size))?;
    if size > MAX_LINETABLE {
        return Err(PyError::Malformed(format!("location table of {size} bytes")));
    }
    Ok(CodeInfo {
        qualname: read_str(mem, offsets, field_u64(&header, offsets.code_qualname))?.into(),
        filename: read_str(mem, offsets, field_u64(&header, offsets.code_filename))?.into(),
        first_line: field_u32(&header, offsets.code_firstlineno),
        linetable: mem.read_vec(linetable.wrapping_add(offsets.bytes_data), size as usize)?,
        instructions: addr.wrapping_add(offsets.code_adaptive),
    })
}
