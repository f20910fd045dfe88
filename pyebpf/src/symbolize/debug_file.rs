//! The separate debug file of a stripped system library (Debian's `libc6-dbg`, `*-dbgsym`
//! packages), found by build ID, read for its symbol table alone.
//!
//! Given the file's DWARF, blazesym follows the debug link itself and reads the debug file's DWARF,
//! which packages ship compressed: the first frame in glibc cost 0.6 s of CPU and 16 MB that stayed
//! (11 MB of sections decompressed onto the heap, 5 MB of the file's pages) for line numbers and
//! inlined calls in the C library. Its symbol table names what the stripped file's dynamic symbols
//! do not (static functions, `__memmove_avx_unaligned_erms`), as perf does by default, in a table of
//! a few hundred KB read once. Files that carry their own DWARF (a Python built with `-g`, an
//! extension) are read by blazesym as before, with lines and inlined calls.
//!
//! A debug file lives under a directory only root may change, and is named by the build ID of
//! the file it describes, which pyebpf reads from the file it opened itself; it is opened only if
//! it is a regular file, so a target has no say in what is read.

use std::fs::File;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};

use super::{hex, only_root_may_change, Function, Looked};
use crate::target_file;

/// Where packaged debug files are installed, under `.build-id/NN/REST.debug`.
pub(super) const DEBUG_ROOT: &str = "/usr/lib/debug";

/// Function symbols read from one debug file at most: glibc's has about 6,000.
const MAX_SYMBOLS: usize = 1 << 20;

/// A loaded segment of a file: where its bytes lie in the file and in its address space.
#[derive(Debug, Clone, Copy)]
pub(super) struct Segment {
    pub file_offset: u64,
    pub file_size: u64,
    pub address: u64,
}

impl Segment {
    /// The address (as the file's symbol tables count) of the file's byte at `offset`, if this
    /// segment holds it.
    pub fn address_of(&self, offset: u64) -> Option<u64> {
        let within = offset.checked_sub(self.file_offset).filter(|&within| within < self.file_size)?;
        self.address.checked_add(within)
    }
}

/// The segment of `segments` holding the file's byte at `offset`, and that byte's address.
pub(super) fn segment_at(segments: &[Segment], offset: u64) -> Option<(&Segment, u64)> {
    segments.iter().find_map(|segment| Some((segment, segment.address_of(offset)?)))
}

/// The segments of `elf` that hold bytes of the file.
pub(super) fn loaded_segments<'data, R: object::ReadRef<'data>>(elf: &object::File<'data, R>) -> Vec<Segment> {
    elf.segments()
        .map(|segment| {
            let (file_offset, file_size) = segment.file_range();
            Segment { file_offset, file_size, address: segment.address() }
        })
        .filter(|segment| segment.file_size > 0)
        .collect()
}

/// One function of the debug file's symbol table; its name is `names[name]`.
#[derive(Debug, Clone)]
struct Symbol {
    address: u64,
    size: u64,
    name: Range<usize>,
}

/// A stripped file's functions, from its debug file, by the addresses its symbol table uses
/// (reached from the stripped file's offsets through its program headers: a debug file's own
/// describe no file contents).
pub(super) struct DebugSymbols {
    segments: Vec<Segment>,
    /// Sorted by address; one per address range (the best named of its aliases).
    symbols: Vec<Symbol>,
    names: String,
}

impl DebugSymbols {
    /// The functions of the debug file under `root` for the open file `stripped`, if that file has
    /// no DWARF of its own, its build ID names a debug file installed there, and only root may
    /// change the directory it is in.
    pub fn find(root: &Path, stripped: &File) -> Option<DebugSymbols> {
        let (segments, build_id) = stripped_segments(stripped)?;
        let (head, rest) = build_id.split_first()?;
        let candidate = root.join(".build-id").join(hex(&[*head])).join(format!("{}.debug", hex(rest)));
        let canonical = std::fs::canonicalize(&candidate).ok()?;
        if !only_root_may_change(canonical.parent()?) {
            return None;
        }
        let (symbols, names) = functions(&target_file::open_regular(&canonical).ok()?)?;
        Some(DebugSymbols { segments, symbols, names })
    }

    /// The function at each of the stripped file's `offsets` (unknown where none), with where it
    /// lies, as file offsets.
    pub fn resolve(&self, offsets: &[u64]) -> Vec<Looked> {
        offsets
            .iter()
            .map(|&offset| {
                let Some((symbol, within)) = self.address(offset).and_then(|address| self.symbol_at(address)) else { return (Arc::from([]), None) };
                let name = &self.names[symbol.name.clone()];
                // Checked: the target's program headers need not place the function in one segment.
                let range = offset.checked_sub(within).and_then(|start| Some(start..start.checked_add(symbol.size)?));
                (Arc::from([Function { name: name.into(), file: None, line: None }]), range)
            })
            .collect()
    }

    /// The address (as the symbol table counts) of the stripped file's byte at `offset`, if a
    /// loaded segment holds it.
    fn address(&self, offset: u64) -> Option<u64> {
        segment_at(&self.segments, offset).map(|(_, address)| address)
    }

    /// The function whose range holds `address`, and how far into it the address is.
    fn symbol_at(&self, address: u64) -> Option<(&Symbol, u64)> {
        let index = self.symbols.partition_point(|symbol| symbol.address <= address).checked_sub(1)?;
        let symbol = &self.symbols[index];
        let within = address - symbol.address;
        (within < symbol.size).then_some((symbol, within))
    }
}

/// A stripped file's loaded segments, from its program headers (read on demand, not whole), and
/// its build ID; none for a file with DWARF of its own.
fn stripped_segments(file: &File) -> Option<(Vec<Segment>, Vec<u8>)> {
    let cache = object::ReadCache::new(file);
    let elf = object::File::parse(&cache).ok()?;
    if elf.section_by_name(".debug_info").is_some() {
        return None;
    }
    let build_id = elf.build_id().ok()??.to_vec();
    let segments = loaded_segments(&elf);
    (!segments.is_empty()).then_some((segments, build_id))
}

/// An alias's rank: see [`alias_rank`].
type AliasRank = (u8, usize, usize);

/// How perf ranks aliases of one function, best first: a global name before a weak one before a
/// local one (glibc's `__GI_*`), then the fewest leading underscores, then the shortest.
fn alias_rank<'data>(symbol: &impl ObjectSymbol<'data>, name: &str) -> AliasRank {
    let binding = if symbol.is_weak() {
        1
    } else if symbol.is_global() {
        0
    } else {
        2
    };
    (binding, name.len() - name.trim_start_matches('_').len(), name.len())
}

/// The debug file's sized functions, sorted by address, each range named once by its best alias
/// ([`alias_rank`]), and their names back to back.
fn functions(file: &File) -> Option<(Vec<Symbol>, String)> {
    let cache = object::ReadCache::new(file);
    let elf = object::File::parse(&cache).ok()?;
    // Address, size, rank and name of every sized function symbol.
    let mut candidates: Vec<(u64, u64, AliasRank, &str)> = Vec::new();
    for symbol in elf.symbols().filter(|symbol| symbol.kind() == SymbolKind::Text && symbol.size() > 0).take(MAX_SYMBOLS) {
        let Ok(name) = symbol.name() else { continue };
        // Versioned definitions are named `clock_gettime@@GLIBC_2.17` there; the version is no
        // part of the function's name.
        let name = name.split_once('@').map_or(name, |(name, _version)| name);
        candidates.push((symbol.address(), symbol.size(), alias_rank(&symbol, name), name));
    }
    candidates.sort_unstable();
    candidates.dedup_by(|later, kept| (later.0, later.1) == (kept.0, kept.1));
    let mut names = String::new();
    let symbols = candidates
        .into_iter()
        .map(|(address, size, _, name)| {
            names.push_str(name);
            Symbol { address, size, name: names.len() - name.len()..names.len() }
        })
        .collect();
    Some((symbols, names))
}
