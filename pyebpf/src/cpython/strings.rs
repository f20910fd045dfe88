//! Reading `str` objects: compact ASCII, Latin-1, UCS-2 and UCS-4 forms.

use super::memory::{field_u32, field_u64, ReadExt, ReadMemory};
use super::offsets::DebugOffsets;
use super::PyError;

/// Most bytes of character data read per string (4,096 ASCII or Latin-1 characters, 2,048 UCS-2,
/// 1,024 UCS-4): a target chooses its names' lengths, so a longer name is cut there. The decoded
/// text is then at most 8 KiB of UTF-8.
pub const MAX_STRING_BYTES: usize = 4096;
/// Ends a name cut at `MAX_STRING_BYTES`.
pub const TRUNCATION_MARK: char = '…';

/// A string as read: cut at the budget when `truncated` (the text then ends with `TRUNCATION_MARK`).
#[derive(Debug, PartialEq, Eq)]
pub struct ReadString {
    pub text: String,
    pub truncated: bool,
}

/// Reads the `str` at `addr`, at most `MAX_STRING_BYTES` of its characters.
pub fn read_str(mem: &impl ReadMemory, offsets: &DebugOffsets, addr: u64) -> Result<ReadString, PyError> {
    if addr == 0 {
        return Err(PyError::Malformed("null string".into()));
    }
    let header = mem.read_vec(addr, (offsets.unicode_state.max(offsets.unicode_length) + 8) as usize)?;
    let length = field_u64(&header, offsets.unicode_length);
    if i64::try_from(length).is_err() {
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
    check_end_mapped(mem, data, length, width)?;
    let chars = usize::try_from(length).unwrap_or(usize::MAX).min(MAX_STRING_BYTES / width);
    let raw = mem.read_vec(data, chars * width)?;
    let mut text = decode(&raw, width).ok_or_else(|| PyError::Malformed("string with an invalid code point".into()))?;
    let truncated = chars as u64 != length;
    if truncated {
        text.push(TRUNCATION_MARK);
    }
    Ok(ReadString { text, truncated })
}

/// A string's claimed characters must all lie in the process's memory: a length that runs past
/// it (a corrupted or hostile object) is refused, not read as the bytes that happen to follow.
fn check_end_mapped(mem: &impl ReadMemory, data: u64, length: u64, width: usize) -> Result<(), PyError> {
    if length == 0 {
        return Ok(());
    }
    let beyond = || PyError::Malformed(format!("string of {length} characters beyond the process's memory"));
    let last = length.checked_mul(width as u64).and_then(|bytes| data.checked_add(bytes - 1)).ok_or_else(beyond)?;
    match mem.read(last, &mut [0; 1]) {
        Ok(_) => Ok(()),
        Err(err) if err.process_gone() => Err(err.into()),
        Err(_) => Err(beyond()),
    }
}

/// Characters stored `width` bytes each (PEP 393's kinds: UCS-2 never holds surrogate pairs, so
/// cutting between any two units cuts between characters).
pub(super) fn decode(raw: &[u8], width: usize) -> Option<String> {
    match width {
        1 => Some(raw.iter().map(|&b| char::from(b)).collect()),
        2 => raw.chunks_exact(2).map(|c| char::from_u32(u16::from_le_bytes([c[0], c[1]]) as u32)).collect(),
        _ => raw.chunks_exact(4).map(|c| char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect(),
    }
}
