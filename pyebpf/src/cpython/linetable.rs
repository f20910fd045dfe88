//! The line tables of code objects: the location table (`co_linetable` of CPython 3.11+), which
//! maps an instruction's offset to its line and columns, and the line-only tables before it
//! (`co_lnotab` of 3.8 and 3.9, `co_linetable` of 3.10).
//!
//! In the location table, each entry starts with a byte `1CCCCLLL`: code `C`, and `L + 1` code units covered. Codes 0–9
//! are the short form (same line, one byte of columns), 10–12 one-line forms (line moves by
//! `C - 10`, two bytes of columns), 13 gives a line delta only, 14 the long form (line delta, end
//! line delta, start and end columns), 15 no location.

/// Where an instruction is in the source: what Python's `co_positions()` gives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Location {
    pub line: Option<u32>,
    pub end_line: Option<u32>,
    /// 0-based UTF-8 byte columns.
    pub column: Option<u32>,
    pub end_column: Option<u32>,
}

/// The location of the instruction `index` code units into the code; `None` if the table does not
/// reach that far or is malformed.
pub fn location_for_index(table: &[u8], first_line: u32, index: u64) -> Option<Location> {
    let mut reader = Reader { table, pos: 0 };
    let mut line = i64::from(first_line);
    let mut units_seen = 0u64;
    while let Some(first) = reader.byte() {
        if first & 0x80 == 0 {
            return None;
        }
        let code = (first >> 3) & 0xf;
        let units = u64::from(first & 7) + 1;
        let location = match code {
            15 => Location::default(),
            14 => {
                line = line.checked_add(reader.signed()?)?;
                let end_line = line.checked_add(i64::try_from(reader.unsigned()?).ok()?)?;
                let column = reader.unsigned()?.checked_sub(1);
                let end_column = reader.unsigned()?.checked_sub(1);
                Location { line: number(line), end_line: number(end_line), column: column.and_then(number), end_column: end_column.and_then(number) }
            }
            13 => {
                line = line.checked_add(reader.signed()?)?;
                Location { line: number(line), end_line: number(line), column: None, end_column: None }
            }
            10..=12 => {
                line = line.checked_add(i64::from(code - 10))?;
                let column = reader.byte()?;
                let end_column = reader.byte()?;
                Location { line: number(line), end_line: number(line), column: Some(column.into()), end_column: Some(end_column.into()) }
            }
            _ => {
                // Short form: the column's high bits are the code, its low bits and the span's
                // length are in the second byte.
                let second = reader.byte()?;
                let column = u32::from(code) << 3 | u32::from(second >> 4 & 7);
                Location { line: number(line), end_line: number(line), column: Some(column), end_column: Some(column + u32::from(second & 15)) }
            }
        };
        units_seen += units;
        if index < units_seen {
            return Some(location);
        }
    }
    None
}

/// The line of the instruction at byte `offset`, from a `co_lnotab` (3.8, 3.9): pairs of (bytes
/// advanced, line delta as a signed byte); the walk stops at the pair that advances past the offset.
pub fn line_for_lnotab(table: &[u8], first_line: u32, offset: u64) -> Option<u32> {
    let mut line = i64::from(first_line);
    let mut addr = 0u64;
    for pair in table.chunks_exact(2) {
        addr += u64::from(pair[0]);
        if addr > offset {
            break;
        }
        line += i64::from(pair[1] as i8);
    }
    number(line)
}

/// The line of the instruction at byte `offset`, from a 3.10 `co_linetable`: pairs of (bytes
/// covered, line delta as a signed byte, or -128: no line), each a range of the code. `None` if the
/// table ends before the offset, `Some(None)` in a range without a line.
pub fn line_for_lines_310(table: &[u8], first_line: u32, offset: u64) -> Option<Option<u32>> {
    let mut line = i64::from(first_line);
    let mut end = 0u64;
    for pair in table.chunks_exact(2) {
        let start = end;
        end += u64::from(pair[0]);
        let range_line = match pair[1] as i8 {
            -128 => None,
            delta => {
                line += i64::from(delta);
                number(line)
            }
        };
        if (start..end).contains(&offset) {
            return Some(range_line);
        }
    }
    None
}

/// A line or column as Python shows it: negative values mean "unknown".
fn number<T: TryInto<u32>>(value: T) -> Option<u32> {
    value.try_into().ok()
}

struct Reader<'a> {
    table: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> Option<u8> {
        let b = *self.table.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    /// Six bits per byte, least significant first; bit 6 says another byte follows.
    fn unsigned(&mut self) -> Option<u64> {
        let mut value = 0u64;
        let mut shift = 0;
        loop {
            let b = self.byte()?;
            value |= ((b & 0x3f) as u64).checked_shl(shift)?;
            if b & 0x40 == 0 {
                return Some(value);
            }
            shift += 6;
            if shift > 60 {
                return None;
            }
        }
    }

    /// Sign in the lowest bit.
    fn signed(&mut self) -> Option<i64> {
        let v = self.unsigned()?;
        let magnitude = (v >> 1) as i64;
        Some(if v & 1 != 0 { -magnitude } else { magnitude })
    }
}

#[cfg(test)]
mod tests {
    use super::{line_for_lines_310, line_for_lnotab, location_for_index, Location};

    #[test]
    fn lnotab_lines_advance_until_the_pair_past_the_offset() {
        // Bytes 0-5 line 10, 6-9 line 11, 10-29 line 9 (a negative delta), then line 200 (two pairs,
        // the first advancing no bytes).
        let table = [6, 1, 4, (-2i8) as u8, 20, 127, 0, 64];
        let lines: Vec<_> = [0, 5, 6, 9, 10, 29, 30, 1000].iter().map(|&at| line_for_lnotab(&table, 10, at)).collect();
        assert_eq!(lines, [10, 10, 11, 11, 9, 9, 200, 200].map(Some));
        assert_eq!(line_for_lnotab(&[], 7, 40), Some(7));
        assert_eq!(line_for_lnotab(&[0, (-10i8) as u8], 3, 0), None, "a line below zero is unknown");
    }

    #[test]
    fn lines_310_are_ranges_with_lines_or_none() {
        // Bytes 0-1 no line (-128), 2-7 line 5 (+4 from 1), an empty range (+2), 8-11 line 3 (-4).
        let table = [2, 0x80, 6, 4, 0, 2, 4, (-4i8) as u8];
        let lines: Vec<_> = [0, 1, 2, 7, 8, 11].iter().map(|&at| line_for_lines_310(&table, 1, at)).collect();
        assert_eq!(lines, [Some(None), Some(None), Some(Some(5)), Some(Some(5)), Some(Some(3)), Some(Some(3))]);
        assert_eq!(line_for_lines_310(&table, 1, 12), None, "past the table");
    }

    fn line(table: &[u8], first_line: u32, index: u64) -> Option<u32> {
        location_for_index(table, first_line, index).and_then(|l| l.line)
    }

    #[test]
    fn walks_short_one_line_and_long_forms() {
        // 2 units, line delta via code 13 (+1); 1 unit one-line form +2 (code 12); 3 units long form -1.
        let table = [0x80 | (13 << 3) | 1, 2, 0x80 | (12 << 3), 4, 9, 0x80 | (14 << 3) | 2, 3, 1, 5, 8, 0x80 | (15 << 3)];
        assert_eq!(line(&table, 10, 0), Some(11));
        assert_eq!(line(&table, 10, 1), Some(11));
        assert_eq!(location_for_index(&table, 10, 2), Some(Location { line: Some(13), end_line: Some(13), column: Some(4), end_column: Some(9) }));
        assert_eq!(location_for_index(&table, 10, 5), Some(Location { line: Some(12), end_line: Some(13), column: Some(4), end_column: Some(7) }));
        assert_eq!(location_for_index(&table, 10, 6), Some(Location::default()));
        assert_eq!(location_for_index(&table, 10, 7), None);
    }

    #[test]
    fn short_form_columns() {
        // Code 2: column 2*8 + 3 = 19, span 5.
        let table = [0x80 | (2 << 3), 3 << 4 | 5];
        assert_eq!(location_for_index(&table, 7, 0), Some(Location { line: Some(7), end_line: Some(7), column: Some(19), end_column: Some(24) }));
    }

    #[test]
    fn truncated_or_garbage_tables_give_none() {
        assert_eq!(location_for_index(&[0x80 | (14 << 3), 0x40, 0x40], 1, 0), None);
        assert_eq!(location_for_index(&[0x12], 1, 0), None);
        assert_eq!(line(&[0xff; 64], 1, 1000), None);
        // A line driven below zero is unknown, not a wrapped number.
        assert_eq!(line(&[0x80 | (13 << 3), 5], 1, 0), None);
    }
}
