//! Decoding code objects: names, file, first line and the location table.
//!
//! A target chooses the sizes of all of these, so each is read within a budget: the location
//! table up to `MAX_LINETABLE` bytes (and never past what the code's own instructions can use),
//! names and file names up to `strings::MAX_STRING_BYTES`. A decoded code object thus holds at most
//! 64 KiB + 2 × 8 KiB of data; what a budget cuts is counted (`CodeCacheCounters`).

use std::collections::HashSet;
use std::sync::Arc;

pub use super::linetable::Location;
use super::linetable::{line_for_lines_310, line_for_lnotab, location_for_index};
use super::memory::{field_u32, field_u64, ReadExt, ReadMemory};
use super::offsets::{DebugOffsets, LineTable};
use super::strings::{read_str, ReadString};
use super::{CodeCacheCounters, PyError};

/// Most bytes of a location table read: instructions past what they cover get line 0 ("unknown").
/// CPython's own tables are about 1 to 3 bytes per instruction, so this covers functions of 20,000+
/// instructions in full.
pub const MAX_LINETABLE: usize = 64 << 10;
/// The longest location-table entry CPython writes: a first byte and four varints of at most 33
/// bits (6 bits a byte). Each entry covers at least one code unit, so a table needs at most this
/// many bytes per code unit of the code it describes.
const MAX_ENTRY_BYTES: u64 = 1 + 4 * 6;
/// The instructions of a code object are 2-byte code units.
const CODE_UNIT: u64 = 2;
/// Type objects remembered as `code` at most: CPython has one, but a target can make any number
/// of objects whose type is named "code" (they are checked again once forgotten).
const MAX_CODE_TYPES: usize = 16;

/// What a profile needs of a code object.
#[derive(Debug)]
pub struct CodeInfo {
    pub qualname: Arc<str>,
    pub filename: Arc<str>,
    pub first_line: u32,
    linetable: Vec<u8>,
    format: LineTable,
    /// Address of the first instruction (`co_code_adaptive`); 0 before 3.11, whose frames give
    /// their instruction as an offset (see `DebugOffsets::instr_of`).
    instructions: u64,
    /// Free-threaded 3.14+: where the thread-local copies of the instructions were when the code
    /// was read (`co_tlbc`, the first of them `co_code_adaptive`), each `code_bytes` long.
    copies: Vec<u64>,
    code_bytes: u64,
}

impl CodeInfo {
    /// The source location of the instruction at `instr_ptr` (an address inside this code object's
    /// instructions, or before 3.11 its byte offset, as `DebugOffsets::instr_of` gives it).
    pub fn location_for(&self, instr_ptr: u64) -> Option<Location> {
        let base = self.base_of(instr_ptr);
        if self.format == LineTable::Locations && instr_ptr.wrapping_add(CODE_UNIT) == base {
            // 3.11 and 3.12 point a frame that has not started yet one code unit before its first
            // instruction: it is on its first line, as CPython says (none for interpreter shims).
            // (Builds with copies, 3.14t on, point such a frame at the first instruction.)
            return Some(Location { line: Some(self.first_line).filter(|&line| line > 0), end_line: None, column: None, end_column: None });
        }
        let offset = instr_ptr.checked_sub(base)?;
        let line = match self.format {
            LineTable::Locations => return location_for_index(&self.linetable, self.first_line, offset / CODE_UNIT),
            // A frame that has not started yet is on its first line, as CPython says.
            _ if offset > i32::MAX as u64 => Some(self.first_line),
            LineTable::Lnotab => line_for_lnotab(&self.linetable, self.first_line, offset),
            LineTable::Lines310 => line_for_lines_310(&self.linetable, self.first_line, offset)?,
        };
        Some(Location { line, end_line: None, column: None, end_column: None })
    }

    /// The start of the copy of the instructions holding `instr_ptr`: a thread may run a copy of
    /// its own, with the same instructions at the same offsets. A pointer in no copy known is
    /// taken against `co_code_adaptive`, as every build without copies does.
    fn base_of(&self, instr_ptr: u64) -> u64 {
        let holds = |&base: &u64| instr_ptr.checked_sub(base).is_some_and(|offset| offset < self.code_bytes);
        self.copies.iter().copied().find(holds).unwrap_or(self.instructions)
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

impl CodeInfo {
    /// Bytes this decoded code object holds, for the cache's budget.
    pub fn heap_bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.linetable.len() + self.qualname.len() + self.filename.len() + self.copies.len() * 8
    }
}

/// Bytes of a code object that cover every field read from it (offsets are bounded by the checks
/// on the table, so this stays small even when the table claims a huge structure). A code object
/// is a `PyVarObject`, whose `ob_size` (the number of code units) sits where `bytes`' does.
fn header_len(o: &DebugOffsets) -> usize {
    let last = [o.object_type, o.bytes_ob_size, o.code_filename, o.code_qualname, o.code_linetable, o.code_firstlineno, o.code_bytes.unwrap_or(0)]
        .into_iter()
        .max()
        .unwrap_or(0);
    (last + 8) as usize
}

/// How much of a location table of `table_size` bytes to read for code of `code_units` units, and
/// whether `MAX_LINETABLE` cut off part that the code could use.
fn linetable_read_len(table_size: u64, code_units: u64) -> (usize, bool) {
    let usable = table_size.min(code_units.saturating_mul(MAX_ENTRY_BYTES));
    let len = usable.min(MAX_LINETABLE as u64);
    (len as usize, len < usable)
}

/// Reads the code object at `addr`, checking first that it is one. `code_types` remembers type
/// objects already confirmed to be `code`; what the budgets cut is counted in `counters`.
pub fn read_code(
    mem: &impl ReadMemory,
    offsets: &DebugOffsets,
    code_types: &mut HashSet<u64>,
    addr: u64,
    counters: &mut CodeCacheCounters,
) -> Result<CodeInfo, PyError> {
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
        remember_code_type(code_types, ob_type);
    }
    let linetable = field_u64(&header, offsets.code_linetable);
    let size = mem.read_u64(linetable.wrapping_add(offsets.bytes_ob_size))?;
    let code_units = match offsets.code_bytes {
        // Before 3.11 the instructions are a `bytes` object of their own.
        Some(field) => mem.read_u64(field_u64(&header, field).wrapping_add(offsets.bytes_ob_size))? / CODE_UNIT,
        None => field_u64(&header, offsets.bytes_ob_size),
    };
    // CPython's sizes are C ints: a larger table is corrupt (a shared or overlong but real table is
    // read only as far as the code can use).
    if size > i32::MAX as u64 {
        return Err(PyError::Malformed(format!("a location table of {size} bytes for {code_units} code units")));
    }
    let (len, truncated) = linetable_read_len(size, code_units);
    counters.truncated_linetables += u64::from(truncated);
    let mut name = |field: u64| -> Result<std::sync::Arc<str>, PyError> {
        let ReadString { text, truncated } = read_str(mem, offsets, field_u64(&header, field))?;
        counters.truncated_strings += u64::from(truncated);
        Ok(text.into())
    };
    Ok(CodeInfo {
        qualname: name(offsets.code_qualname)?,
        filename: name(offsets.code_filename)?,
        first_line: field_u32(&header, offsets.code_firstlineno),
        linetable: mem.read_vec(linetable.wrapping_add(offsets.bytes_data), len)?,
        format: offsets.line_table,
        instructions: if offsets.code_bytes.is_some() { 0 } else { addr.wrapping_add(offsets.code_adaptive) },
        copies: match offsets.code_tlbc {
            Some(field) => read_copies(mem, mem.read_u64(addr.wrapping_add(field))?)?,
            None => Vec::new(),
        },
        code_bytes: code_units.saturating_mul(CODE_UNIT),
    })
}

/// Most thread-local copies of one code object read: CPython makes one per thread index that ran
/// the code, and indexes are reused as threads exit.
const MAX_COPIES: u64 = 4096;

/// The copies a `_PyCodeArray` (`Py_ssize_t size; char *entries[size]`) at `array` lists; an
/// entry of a thread index that has not run the code is 0.
fn read_copies(mem: &impl ReadMemory, array: u64) -> Result<Vec<u64>, PyError> {
    let size = mem.read_u64(array)?;
    if size == 0 || size > MAX_COPIES {
        return Err(PyError::Malformed(format!("{size} thread-local copies of a code object's instructions")));
    }
    let entries = mem.read_vec(array.wrapping_add(8), size as usize * 8)?;
    Ok(entries.chunks_exact(8).map(|entry| field_u64(entry, 0)).filter(|&base| base != 0).collect())
}

fn remember_code_type(code_types: &mut HashSet<u64>, ob_type: u64) {
    if code_types.len() >= MAX_CODE_TYPES {
        code_types.clear();
    }
    code_types.insert(ob_type);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_types_remembered_stay_bounded() {
        let mut code_types = HashSet::new();
        for ob_type in (0..100_000u64).map(|n| n * 8) {
            remember_code_type(&mut code_types, ob_type);
            assert!(code_types.len() <= MAX_CODE_TYPES);
        }
        assert!(code_types.contains(&(99_999 * 8)), "the latest type is remembered");
    }

    /// Free-threaded 3.14+: an instruction in a thread's own copy has the line of the same
    /// offset in `co_code_adaptive`; the copies come from the code's `_PyCodeArray`.
    #[test]
    fn an_instruction_in_a_thread_local_copy_has_the_line_of_its_offset() {
        use super::super::memory::MemoryImage;
        let (main, copy) = (0x10_0000u64, 0x20_0000u64);
        let mut image = MemoryImage::default();
        let array: Vec<u8> = [3u64, main, 0, copy].iter().flat_map(|word| word.to_le_bytes()).collect();
        image.insert(0x9000, array);
        let copies = read_copies(&image, 0x9000).unwrap();
        assert_eq!(copies, [main, copy], "the unused index is skipped");
        // Ten code units, each a line further than the one before.
        let code = CodeInfo {
            qualname: "f".into(),
            filename: "f.py".into(),
            first_line: 10,
            linetable: [0x80 | (13 << 3), 2].repeat(10),
            format: LineTable::Locations,
            instructions: main,
            copies,
            code_bytes: 20,
        };
        for unit in 0..10 {
            assert_eq!(code.line_for(copy + unit * CODE_UNIT), code.line_for(main + unit * CODE_UNIT), "code unit {unit}");
        }
        assert_eq!(code.line_for(copy + 8), Some(15));
        // 3.11 and 3.12: a frame not started yet points one unit before the first instruction.
        assert_eq!(code.line_for(main - CODE_UNIT), Some(10));
        assert_eq!(code.line_for(main - 2 * CODE_UNIT), None);
        assert!(!code.is_interpreter_shim(main - CODE_UNIT));
        // A size the target made absurd does not overflow the bounds.
        let code = CodeInfo { code_bytes: u64::MAX, ..code };
        assert_eq!(code.line_for(main + 8), Some(15));
        assert_eq!(code.line_for(main - CODE_UNIT), Some(10));
        assert!(CodeInfo { first_line: 0, linetable: Vec::new(), ..code }.is_interpreter_shim(main - CODE_UNIT));
        image.insert(0x9000, u64::MAX.to_le_bytes().to_vec());
        assert!(matches!(read_copies(&image, 0x9000), Err(PyError::Malformed(_))), "an absurd size is refused");
    }

    #[test]
    fn location_tables_are_read_up_to_what_the_code_can_use_and_the_cap() {
        // A 1 MiB table on a 10-unit function: only what 10 entries could take is read, uncut.
        assert_eq!(linetable_read_len(1 << 20, 10), (250, false));
        // A table shorter than the bound is read whole.
        assert_eq!(linetable_read_len(40, 10), (40, false));
        // A large function's table stops at the cap, and that is a cut.
        assert_eq!(linetable_read_len(1 << 20, 1 << 20), (MAX_LINETABLE, true));
        assert_eq!(linetable_read_len(u64::MAX, u64::MAX), (MAX_LINETABLE, true));
        assert_eq!(linetable_read_len(MAX_LINETABLE as u64, 1 << 20), (MAX_LINETABLE, false));
    }

    #[test]
    fn a_table_cut_at_the_cap_gives_lines_up_to_the_cut_and_unknown_after() {
        // One 2-byte entry per code unit, each a line further (code 13, delta +1): 80,000 bytes.
        let table: Vec<u8> = [0x80 | (13 << 3), 2].repeat(40_000);
        let (len, cut) = linetable_read_len(table.len() as u64, 40_000);
        assert!(cut);
        let read = &table[..len];
        let last = (MAX_LINETABLE / 2 - 1) as u64;
        assert_eq!(location_for_index(read, 10, last).and_then(|l| l.line), Some(10 + 1 + last as u32));
        assert_eq!(location_for_index(read, 10, last + 1), None);
        assert_eq!(location_for_index(&table, 10, last + 1).and_then(|l| l.line), Some(10 + 2 + last as u32));
    }
}
