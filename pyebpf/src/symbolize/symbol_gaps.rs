//! Where a file's symbol tables name nothing: the stretches between its symbols.
//!
//! A stripped interpreter's dynamic symbols name its API, not its static functions (`long_mul`,
//! the allocator), where its samples land at thousands of addresses. Each such address found in no
//! symbol cost a look-up in blazesym (tens of µs) and taught nothing about the next. Once one address
//! is found in no symbol, the stretch around it up to the next symbol is known to be unnamed too.

use std::fs::File;
use std::ops::Range;

use object::{Object, ObjectSymbol};

use super::debug_file::{loaded_segments, segment_at, Segment};

/// Symbols read from one file at most (16 bytes each kept): a file with more has no gaps found,
/// as a table read in part would show gaps where the rest names code.
const MAX_SYMBOLS: usize = 1 << 17;

/// Every symbol of a file's symbol tables (`.symtab`, `.dynsym`), of any kind, by address.
pub(super) struct SymbolBounds {
    segments: Vec<Segment>,
    /// Start addresses, sorted.
    starts: Vec<u64>,
    /// For each of `starts`, the furthest end of the symbols starting there or before.
    ends_so_far: Vec<u64>,
}

impl SymbolBounds {
    /// The symbols of the open file `file`, if it parses as an object file and holds no more
    /// than [`MAX_SYMBOLS`], nor a compressed symbol table (`.gnu_debugdata`, which blazesym can be
    /// built to read).
    pub fn read(file: &File) -> Option<SymbolBounds> {
        let cache = object::ReadCache::new(file);
        let elf = object::File::parse(&cache).ok()?;
        if elf.section_by_name(".gnu_debugdata").is_some() {
            return None;
        }
        let symbols: Vec<(u64, u64)> = elf
            .symbols()
            .chain(elf.dynamic_symbols())
            // Any kind counts: more bounds only make gaps smaller.
            .filter(|symbol| symbol.address() != 0)
            .take(MAX_SYMBOLS + 1)
            .map(|symbol| (symbol.address(), symbol.address().saturating_add(symbol.size())))
            .collect();
        (symbols.len() <= MAX_SYMBOLS).then(|| SymbolBounds::new(loaded_segments(&elf), symbols))
    }

    /// The bounds of `symbols` (start and end addresses, in any order) in a file of `segments`.
    fn new(segments: Vec<Segment>, mut symbols: Vec<(u64, u64)>) -> SymbolBounds {
        symbols.sort_unstable();
        let mut furthest = 0;
        let ends_so_far = symbols
            .iter()
            .map(|&(_, end)| {
                furthest = furthest.max(end);
                furthest
            })
            .collect();
        SymbolBounds { segments, starts: symbols.into_iter().map(|(start, _)| start).collect(), ends_so_far }
    }

    /// The file offsets around `offset` that no symbol holds, if none holds `offset` (a symbol of
    /// no size holds its own address), within the segment that holds it.
    pub fn gap(&self, offset: u64) -> Option<Range<u64>> {
        let (segment, address) = segment_at(&self.segments, offset)?;
        let before = self.starts.partition_point(|&start| start <= address);
        let unnamed_from = match before.checked_sub(1) {
            Some(last) if self.starts[last] == address || self.ends_so_far[last] > address => return None,
            // Past every symbol's start before it, and past its own address for one of no size.
            Some(last) => self.ends_so_far[last].max(self.starts[last] + 1),
            None => 0,
        };
        let unnamed_to = self.starts.get(before).copied().unwrap_or(u64::MAX);
        // Back to file offsets, within the segment (whose numbers the file chose: checked).
        let segment_end = segment.address.checked_add(segment.file_size)?;
        let from = unnamed_from.max(segment.address);
        let to = unnamed_to.min(segment_end);
        Some(segment.file_offset.checked_add(from - segment.address)?..segment.file_offset.checked_add(to - segment.address)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(symbols: &[(u64, u64)]) -> SymbolBounds {
        SymbolBounds::new(vec![Segment { file_offset: 0x1000, file_size: 0x1000, address: 0x40_1000 }], symbols.to_vec())
    }

    #[test]
    fn a_gap_runs_from_the_furthest_end_before_to_the_next_start() {
        // A long symbol at 0x401100 and a short one inside it: the gap starts where the long ends.
        let symbols = bounds(&[(0x40_1100, 0x40_1400), (0x40_1200, 0x40_1210), (0x40_1800, 0x40_1900)]);
        assert_eq!(symbols.gap(0x1500), Some(0x1400..0x1800));
        assert_eq!(symbols.gap(0x1300), None, "inside the long symbol");
        assert_eq!(symbols.gap(0x1800), None, "at a symbol's start");
        // Before the first symbol and after the last, the gap stops at the segment.
        assert_eq!(symbols.gap(0x1050), Some(0x1000..0x1100));
        assert_eq!(symbols.gap(0x1a00), Some(0x1900..0x2000));
        assert_eq!(symbols.gap(0x2000), None, "outside every segment");
    }

    #[test]
    fn a_symbol_of_no_size_bounds_a_gap() {
        let symbols = bounds(&[(0x40_1100, 0x40_1100), (0x40_1800, 0x40_1900)]);
        assert_eq!(symbols.gap(0x1100), None);
        assert_eq!(symbols.gap(0x1101), Some(0x1101..0x1800));
        assert_eq!(symbols.gap(0x10ff), Some(0x1000..0x1100));
    }
}
