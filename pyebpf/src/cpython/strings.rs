//! Reading `str` objects: compact ASCII, Latin-1, UCS-2 and UCS-4 forms.

use super::memory::{field_u32, field_u64, ReadExt, ReadMemory};
use super::offsets::DebugOffsets;
use super::PyError;

/// Longest name or file name read, in characters.
const MAX_CHARS: u64 = 4096;

/// Reads the `str` at `addr`.
pub fn read_str(mem: &impl ReadMemory, offsets: &DebugOffsets, addr: u64) -> Result<String, PyError> {
    if addr == 0 {
        return Err(PyError::Malformed("null string".into()));
    }
    let header = mem.read_vec(addr, (offsets.unicode_state.max(offsets.unicode_length) + 8) as usize)?;
    let length = field_u64(&header, offsets.unicode_length);
    if length > MAX_CHARS {
        return Err(PyError::Malformed(format!("string of {length} characters")));
    }
    let state = field_u32(&header, offsets.unicode_state);
    // state: interned (2 bits), kind (3 bits), compact (1), ascii (1).
    let kind = (state >> 2) & 7;
    let compact = state & (1 << 5) != 0;
    let ascii = state & (1 << 6) != 0;
    if !compact {
        return Err(PyError::Malformed("non-compact string".into()));
    }
    // ASCII text follows the ASCII header; other compact forms follow the longer compact header.
    let data = addr.wrapping_add(if ascii { offsets.unicode_ascii_size } else { offsets.unicode_compact_size });
    let width = match kind {
        1 | 2 | 4 => kind as usize,
        other => return Err(PyError::Malformed(format!("string kind {other}"))),
    };
    let raw = mem.read_vec(data, length as usize * width)?;
    let chars: Option<String> = match width {
        1 => Some(raw.iter().map(|&b| char::from(b)).collect()),
        2 => raw.chunks_exact(2).map(|c| char::from_u32(u16::from_le_bytes([c[0], c[1]]) as u32)).collect(),
        _ => raw.chunks_exact(4).map(|c| char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect(),
    };
    chars.ok_or_else(|| PyError::Malformed("string with an invalid code point".into()))
}
