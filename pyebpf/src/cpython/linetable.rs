//! The location table of code objects (`co_linetable`, the format of CPython 3.11+): maps an
//! instruction's offset to its line.
//!
//! Each entry starts with a byte `1CCCCLLL`: code `C`, and `L + 1` code units covered. Codes 0–9
//! are the short form (same line, one byte of columns), 10–12 one-line forms (line moves by
//! `C - 10`, two bytes of columns), 13 gives a line delta only, 14 the long form (line delta, end
//! line delta, start and end columns), 15 no location.

/// The line of the instruction `index` code units into the code, if the table says.
pub fn line_for_index(table: &[u8], first_line: u32, index: u64) -> Option<u32> {
    let mut reader = Reader { table, pos: 0 };
    let mut line = first_line as i64;
    let mut units_seen = 0u64;
    while let Some(first) = reader.byte() {
        if first & 0x80 == 0 {
            return None;
        }
        let code = (first >> 3) & 0xf;
        let units = (first & 7) as u64 + 1;
        let mut has_line = true;
        match code {
            15 => has_line = false,
            14 => {
                line += reader.signed()?;
                reader.unsigned()?;
                reader.unsigned()?;
                reader.unsigned()?;
            }
            13 => line += reader.signed()?,
            10..=12 => {
                line += (code - 10) as i64;
                reader.byte()?;
                reader.byte()?;
            }
            _ => {
                reader.byte()?;
            }
        }
        units_seen += units;
        if index < units_seen {
            return has_line.then(|| u32::try_from(line).ok()).flatten();
        }
    }
    None
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
    use super::line_for_index;

    #[test]
    fn walks_short_one_line_and_long_forms() {
        // 2 units, line delta via code 13 (+1); 1 unit one-line form +2 (code 12); 3 units long form -1.
        let table = [0x80 | (13 << 3) | 1, 2, 0x80 | (12 << 3), 0, 0, 0x80 | (14 << 3) | 2, 3, 0, 1, 1];
        assert_eq!(line_for_index(&table, 10, 0), Some(11));
        assert_eq!(line_for_index(&table, 10, 1), Some(11));
        assert_eq!(line_for_index(&table, 10, 2), Some(13));
        assert_eq!(line_for_index(&table, 10, 5), Some(12));
        assert_eq!(line_for_index(&table, 10, 6), None);
    }

    #[test]
    fn truncated_or_garbage_tables_give_none() {
        assert_eq!(line_for_index(&[0x80 | (14 << 3), 0x40, 0x40], 1, 0), None);
        assert_eq!(line_for_index(&[0x12], 1, 0), None);
        assert_eq!(line_for_index(&[0xff; 64], 1, 1000), None);
    }
}
