//! Native symbolization of sampled stacks: user frames per process from its maps ([`crate::maps`])
//! and the ELF files they map (`.symtab`, `.dynsym`; a stripped file's installed debug file for
//! its symbol table, [`debug_file`]), kernel frames from kallsyms. A file's own DWARF gives lines
//! and inlined calls only when asked for (`--native-lines`): blazesym keeps what it parsed of it
//! and the pages it touched for the whole run, tens of MB for an interpreter built with `-g`, and
//! each new address in it costs a look-up there.
//!
//! Symbolization runs for every sample, so everything is cached for the whole recording:
//! - each process's executable mappings, rebuilt only when [`MapsCache`] has a new snapshot of its
//!   maps (it re-reads them when an address falls outside them, a new `dlopen`);
//! - each file's build ID and symbols, keyed by the file's identity (device and inode), so a library
//!   that many processes map is parsed once; blazesym keeps the parsed file open, so late samples of
//!   a process that has exited still resolve;
//! - each result, per (file, file offset) and per kernel address; and a file's CPython eval loop,
//!   whose addresses need no look-up once one resolved there ([`EVAL_LOOP`]); without lines, every
//!   function's range likewise (a sample's leaf lands at a new address of a known function often).
//!
//! A long host-wide run sees an endless stream of processes and files, so every cache is bounded:
//! what belongs to a process goes when the process has exited ([`Symbolizer::forget_process`]);
//! open files beyond [`MAX_OPEN_FILES`] (or [`MAX_OPEN_BYTES`] in all) are closed, and results beyond [`MAX_RESOLVED`] dropped,
//! all at once (they are found again on demand; a bound hit is rare enough for that to be cheap).
//!
//! Files are opened through `/proc/PID/map_files/` (falling back to `/proc/PID/root/PATH`), which
//! reaches the process's own file even inside a container or after it was deleted or replaced;
//! pyebpf opens each itself and blazesym reads it through the open descriptor ([`open_files`]).
//!
//! blazesym's symbolizer is single-threaded (`!Send`), and so is [`Symbolizer`]: create it on the
//! thread that symbolizes (e.g. inside `tokio::task::spawn_blocking` or a dedicated thread).

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use blazesym::symbolize::evict::{self, Evict};
use blazesym::symbolize::source::{Elf, Kernel, Process, Source};
use blazesym::symbolize::{CodeInfo, Input, Sym, Symbolized};
use blazesym::{MaybeDefault, Pid};
use procfs::process::MMapPath;

use crate::maps::{self, Maps, MapsCache};
use crate::stack::{KernelFrame, Module, NativeFrame};
use open_files::{Location, OpenFiles};

mod debug_file;
mod open_files;
mod symbol_gaps;

/// Files blazesym keeps open (and mapped) at most.
const MAX_OPEN_FILES: usize = 256;

/// The open files' sizes added up, at most: what blazesym parses of a file grows with its size.
const MAX_OPEN_BYTES: u64 = 2 << 30;

/// Build IDs kept at most (of files seen, whether symbolized or not).
const MAX_BUILD_IDS: usize = 4096;

/// Resolved addresses kept at most, per kind (file offsets, in-process, kernel addresses).
const MAX_RESOLVED: usize = 100_000;

/// The function CPython up to 3.14 runs Python code in: samples land at thousands of addresses in
/// it, and the merge replaces its levels with the Python frames they ran. Once one address of a
/// file resolved there, the others in its range are known to be it without a look-up (the
/// function alone: no inlined calls, no line).
const EVAL_LOOP: &str = "_PyEval_EvalFrameDefault";

/// A file's identity, independent of the path a process reaches it by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FileId {
    dev: (i32, i32),
    inode: u64,
}

/// What a function at one address resolved to.
#[derive(Debug)]
struct Function {
    name: Arc<str>,
    file: Option<Arc<str>>,
    line: Option<u32>,
}

/// The functions at one address, innermost (inlined callee) first; empty where unknown.
type Resolved = Arc<[Function]>;

/// An address looked up in a file: what it resolved to, and where the function it lies in
/// lies (file offsets), where its size is known.
type Looked = (Resolved, Option<Range<u64>>);

/// The sized functions of each file found so far, by start offset: their end and what they
/// resolve to.
#[derive(Default)]
struct KnownFunctions {
    by_file: HashMap<FileId, BTreeMap<u64, (u64, Resolved)>>,
    /// Functions kept, over all files.
    count: usize,
}

impl KnownFunctions {
    fn found(&mut self, id: FileId, range: Range<u64>, resolved: &Resolved) {
        if self.by_file.entry(id).or_default().insert(range.start, (range.end, resolved.clone())).is_none() {
            self.count += 1;
        }
    }

    /// What `offset` of file `id` resolves to if a function found before holds it.
    fn at(&self, id: FileId, offset: u64) -> Option<Resolved> {
        let (_, (end, resolved)) = self.by_file.get(&id)?.range(..=offset).next_back()?;
        (offset < *end).then(|| resolved.clone())
    }
}

/// How the code of a mapping is symbolized.
#[derive(Debug)]
enum Backing {
    /// A file: by file offset, in the file's own symbol tables.
    File { id: FileId, path_in_process: PathBuf },
    /// The vDSO or anonymous code (JIT, perf trampolines): through the process, which reads its
    /// perf map (`/tmp/perf-PID.map`) and vDSO image.
    Process,
}

#[derive(Debug)]
struct Mapping {
    module: Arc<Module>,
    backing: Backing,
}

impl Mapping {
    fn contains(&self, addr: u64) -> bool {
        (self.module.start..self.module.limit).contains(&addr)
    }

    fn file_offset(&self, addr: u64) -> u64 {
        addr - self.module.start + self.module.file_offset
    }
}

/// File offsets to look up in one file, and where the mapping that needs them lies.
struct FileBatch<'a> {
    location: Location<'a>,
    offsets: Vec<u64>,
}

impl<'a> FileBatch<'a> {
    fn new(pid: u32, mapping: &Mapping, path_in_process: &'a Path) -> FileBatch<'a> {
        let location = Location { pid, start: mapping.module.start, limit: mapping.module.limit, path: path_in_process };
        FileBatch { location, offsets: Vec::new() }
    }
}

/// A process's executable mappings, sorted by start address, as of one snapshot of its maps.
#[derive(Debug)]
struct ProcessMaps {
    snapshot: Arc<Maps>,
    mappings: Vec<Mapping>,
}

impl ProcessMaps {
    fn find(&self, addr: u64) -> Option<&Mapping> {
        let index = self.mappings.partition_point(|mapping| mapping.module.start <= addr);
        index.checked_sub(1).map(|index| &self.mappings[index]).filter(|mapping| mapping.contains(addr))
    }
}

pub struct Symbolizer {
    blazesym: blazesym::symbolize::Symbolizer,
    processes: HashMap<u32, ProcessMaps>,
    build_ids: HashMap<FileId, Option<Arc<str>>>,
    open_files: OpenFiles,
    by_file_offset: HashMap<(FileId, u64), Resolved>,
    by_process_addr: HashMap<(u32, u64), Resolved>,
    kernel: HashMap<u64, Option<Arc<str>>>,
    /// Each file's [`EVAL_LOOP`], as file offsets, once an address resolved there.
    eval_loops: HashMap<FileId, Range<u64>>,
    /// Without lines, every address of a function resolves alike: each file's functions found so
    /// far, so a new address in one (a new leaf, mostly) needs no look-up.
    functions: KnownFunctions,
    /// What every address in an eval loop resolves to.
    eval_loop: Resolved,
    /// Whether files' own DWARF is read, for lines and inlined calls.
    lines: bool,
}

impl Default for Symbolizer {
    fn default() -> Self {
        Self::new(false)
    }
}

impl Symbolizer {
    /// A symbolizer naming functions from symbol tables, and with `lines` also their lines and
    /// inlined calls from the files' own DWARF.
    pub fn new(lines: bool) -> Symbolizer {
        let blazesym = blazesym::symbolize::Symbolizer::builder()
            // Files are identified by device and inode already; skipping blazesym's re-check saves a
            // stat per lookup and keeps files of exited processes usable.
            .enable_auto_reload(false)
            .enable_code_info(lines)
            .enable_inlined_fns(lines)
            .enable_demangling(true)
            .build();
        Symbolizer {
            blazesym,
            processes: HashMap::new(),
            build_ids: HashMap::new(),
            open_files: OpenFiles::default(),
            by_file_offset: HashMap::new(),
            by_process_addr: HashMap::new(),
            kernel: HashMap::new(),
            eval_loops: HashMap::new(),
            functions: KnownFunctions::default(),
            eval_loop: Arc::new([Function { name: EVAL_LOOP.into(), file: None, line: None }]),
            lines,
        }
    }

    /// Keeps the caches that grow with the files and code seen within their bounds.
    fn enforce_bounds(&mut self) {
        if self.open_files.len() > MAX_OPEN_FILES || self.open_files.bytes() > MAX_OPEN_BYTES {
            self.open_files.close_all(&mut self.blazesym);
            self.build_ids.clear();
        }
        clear_if_over(&mut self.build_ids, MAX_BUILD_IDS);
        clear_if_over(&mut self.eval_loops, MAX_BUILD_IDS);
        clear_if_over(&mut self.by_file_offset, MAX_RESOLVED);
        clear_if_over(&mut self.by_process_addr, MAX_RESOLVED);
        if self.functions.count > MAX_RESOLVED {
            self.functions = KnownFunctions::default();
        }
    }

    /// Symbolizes a user stack as `bpf_get_stack` returns it: innermost first, entry 0 the sampled
    /// instruction, later entries return addresses. Frames keep their place even when unknown; an
    /// address inlined into its caller gives several frames, innermost first.
    pub fn user_frames(&mut self, maps: &mut MapsCache, pid: u32, stack: &[u64]) -> Vec<NativeFrame> {
        let sites: Vec<u64> = call_sites(stack).collect();
        self.site_levels(maps, pid, &sites).into_iter().flatten().collect()
    }

    /// The frames of each call site (an address to look up, as [`call_sites`] gives for a stack's
    /// entries), kept apart.
    pub fn site_levels(&mut self, maps: &mut MapsCache, pid: u32, addrs: &[u64]) -> Vec<Vec<NativeFrame>> {
        self.enforce_bounds();
        self.follow_maps(pid, maps.covering(pid, addrs));
        self.resolve_missing(pid, addrs);

        let maps = self.processes.get(&pid);
        addrs
            .iter()
            .map(|&addr| {
                let Some(mapping) = maps.and_then(|maps| maps.find(addr)) else {
                    return vec![NativeFrame { addr, module: None, symbol: None, file: None, line: None }];
                };
                let resolved = match &mapping.backing {
                    Backing::File { id, .. } => self.by_file_offset.get(&(*id, mapping.file_offset(addr))),
                    Backing::Process => self.by_process_addr.get(&(pid, addr)),
                };
                level_frames(addr, &mapping.module, resolved.map_or(&[][..], |r| &r[..]))
            })
            .collect()
    }

    /// The frames of call site `addr` of `pid` where [`Self::site_levels`] would give them without
    /// reading anything: `pid`'s latest maps (as `maps` holds them) are those followed, and the
    /// address lies in a file mapping at an offset resolved before, or in a function found before
    /// (in this or another process): a hot C function's new addresses in each process, mostly.
    pub fn known_site(&self, maps: &MapsCache, pid: u32, addr: u64) -> Option<Vec<NativeFrame>> {
        let known = self.processes.get(&pid)?;
        if !maps.latest(pid).is_some_and(|latest| Arc::ptr_eq(latest, &known.snapshot)) {
            return None;
        }
        let mapping = known.find(addr)?;
        let Backing::File { id, .. } = &mapping.backing else { return None };
        let offset = mapping.file_offset(addr);
        let resolved = self.by_file_offset.get(&(*id, offset)).cloned().or_else(|| self.known_without_look_up(*id, offset))?;
        Some(level_frames(addr, &mapping.module, &resolved))
    }

    /// What `offset` of file `id` resolves to without a look-up, though not resolved itself: it
    /// lies in the file's eval loop or in a function found before.
    fn known_without_look_up(&self, id: FileId, offset: u64) -> Option<Resolved> {
        if self.eval_loops.get(&id).is_some_and(|range| range.contains(&offset)) {
            return Some(self.eval_loop.clone());
        }
        self.functions.at(id, offset)
    }

    /// The frame at `addr` of `pid` where it lies in an eval loop found before: known without a
    /// look-up, as [`Self::site_levels`] would give it.
    pub fn eval_loop_frame(&self, pid: u32, addr: u64) -> Option<NativeFrame> {
        let mapping = self.eval_loop_mapping(pid, addr)?;
        let name = self.eval_loop.first().map(|function| function.name.clone());
        Some(NativeFrame { addr, module: Some(mapping.module.clone()), symbol: name, file: None, line: None })
    }

    fn eval_loop_mapping(&self, pid: u32, addr: u64) -> Option<&Mapping> {
        let mapping = self.processes.get(&pid)?.find(addr)?;
        let Backing::File { id, .. } = &mapping.backing else { return None };
        self.eval_loops.get(id)?.contains(&mapping.file_offset(addr)).then_some(mapping)
    }

    /// Drops what is known of `pid`'s address space (it exited or replaced its program); what was
    /// learnt of the files it mapped stays, shared with other processes.
    pub fn forget_process(&mut self, pid: u32) {
        self.processes.remove(&pid);
        let _ = self.blazesym.evict(&Evict::Process(evict::Process::new(Pid::from(pid))));
        self.by_process_addr.retain(|(owner, _), _| *owner != pid);
    }

    /// Symbolizes a kernel stack (innermost first) with kallsyms.
    pub fn kernel_frames(&mut self, stack: &[u64]) -> Vec<KernelFrame> {
        clear_if_over(&mut self.kernel, MAX_RESOLVED);
        let addrs: Vec<u64> = call_sites(stack).collect();
        let mut missing: Vec<u64> = addrs.iter().copied().filter(|addr| !self.kernel.contains_key(addr)).collect();
        missing.sort_unstable();
        missing.dedup();
        if !missing.is_empty() {
            let names = self.kernel_symbols(&missing);
            self.kernel.extend(missing.into_iter().zip(names));
        }
        addrs.into_iter().map(|addr| KernelFrame { addr, symbol: self.kernel.get(&addr).cloned().flatten() }).collect()
    }

    fn kernel_symbols(&self, addrs: &[u64]) -> Vec<Option<Arc<str>>> {
        let source = Source::Kernel(Kernel {
            // kallsyms is always there; looking for a vmlinux costs time and rarely finds one.
            vmlinux: MaybeDefault::None,
            debug_syms: false,
            ..Kernel::default()
        });
        match self.blazesym.symbolize(&source, Input::AbsAddr(addrs)) {
            Ok(results) => results.into_iter().map(|result| result.as_sym().map(|sym| Arc::from(&*sym.name))).collect(),
            Err(err) => {
                log::debug!("kernel symbolization failed: {err}");
                vec![None; addrs.len()]
            }
        }
    }

    /// Rebuilds `pid`'s executable mappings from `snapshot` unless they were built from it.
    fn follow_maps(&mut self, pid: u32, snapshot: &Arc<Maps>) {
        if self.processes.get(&pid).is_some_and(|known| Arc::ptr_eq(&known.snapshot, snapshot)) {
            return;
        }
        let mappings = snapshot.executable().map(|entry| self.mapping(pid, entry)).collect();
        self.processes.insert(pid, ProcessMaps { snapshot: snapshot.clone(), mappings });
    }

    fn mapping(&mut self, pid: u32, entry: &maps::Mapping) -> Mapping {
        let (start, limit) = (entry.start, entry.limit);
        let (path, backing, build_id) = match entry.file() {
            Some(path) => {
                let id = FileId { dev: entry.dev, inode: entry.inode };
                let build_id = self.build_id(id, &Location { pid, start, limit, path });
                let name = path.to_string_lossy().into();
                (name, Backing::File { id, path_in_process: path.to_path_buf() }, build_id)
            }
            None => (pseudo_path(&entry.path), Backing::Process, None),
        };
        let module = Module { path, start, limit, file_offset: entry.offset, build_id };
        Mapping { module: Arc::new(module), backing }
    }

    fn build_id(&mut self, id: FileId, location: &Location) -> Option<Arc<str>> {
        self.build_ids.entry(id).or_insert_with(|| self.open_files.build_id(id, location).map(|bytes| hex(&bytes).into())).clone()
    }

    /// Looks up, in one batch per file, every address not resolved yet.
    fn resolve_missing(&mut self, pid: u32, addrs: &[u64]) {
        let Some(maps) = self.processes.get(&pid) else { return };
        let mut by_file: HashMap<FileId, FileBatch> = HashMap::new();
        let mut by_process = Vec::new();
        for &addr in addrs {
            let Some(mapping) = maps.find(addr) else { continue };
            match &mapping.backing {
                Backing::File { id, path_in_process } => {
                    let offset = mapping.file_offset(addr);
                    if self.by_file_offset.contains_key(&(*id, offset)) {
                        continue;
                    }
                    if let Some(resolved) = self.known_without_look_up(*id, offset) {
                        self.by_file_offset.insert((*id, offset), resolved);
                    } else {
                        by_file.entry(*id).or_insert_with(|| FileBatch::new(pid, mapping, path_in_process)).offsets.push(offset);
                    }
                }
                Backing::Process => {
                    if !self.by_process_addr.contains_key(&(pid, addr)) {
                        by_process.push(addr);
                    }
                }
            }
        }

        for (id, mut batch) in by_file {
            batch.offsets.sort_unstable();
            batch.offsets.dedup();
            let looked = symbolize_file(&mut self.blazesym, &mut self.open_files, id, &batch, self.lines);
            for (offset, (resolved, function)) in batch.offsets.into_iter().zip(looked) {
                if let Some(range) = function {
                    // Innermost first: the function itself is the last, after calls inlined there.
                    if resolved.last().is_some_and(|function| &*function.name == EVAL_LOOP) {
                        self.eval_loops.insert(id, range.clone());
                    }
                    if !self.lines {
                        self.functions.found(id, range, &resolved);
                    }
                } else if resolved.is_empty() && !self.lines && self.open_files.debug_symbols(id).is_none() {
                    // Without lines only the file's symbol tables name its code: the stretch around
                    // an address none names is unnamed to its ends.
                    if let Some(gap) = self.open_files.symbol_bounds(id).and_then(|bounds| bounds.gap(offset)) {
                        self.functions.found(id, gap, &resolved);
                    }
                }
                self.by_file_offset.insert((id, offset), resolved);
            }
        }

        if !by_process.is_empty() {
            by_process.sort_unstable();
            by_process.dedup();
            let resolved = self.symbolize_in_process(pid, &by_process);
            self.by_process_addr.extend(by_process.into_iter().map(|addr| (pid, addr)).zip(resolved));
        }
    }

    fn symbolize_in_process(&self, pid: u32, addrs: &[u64]) -> Vec<Resolved> {
        let mut process = Process::new(Pid::from(pid));
        process.debug_syms = false;
        match self.blazesym.symbolize(&Source::Process(process), Input::AbsAddr(addrs)) {
            Ok(results) => results.iter().map(resolved).collect(),
            Err(err) => {
                log::debug!("cannot symbolize anonymous code of process {pid}: {err}");
                vec![Arc::from([]); addrs.len()]
            }
        }
    }
}

/// Symbolizes file offsets in one file (with `lines`, from its DWARF too), each with where its
/// function lies. A file opened before stays open, so late samples of a process that has exited
/// still resolve. A file that cannot be opened or read gives unknown results, remembered like any
/// other so it is not retried every sample.
fn symbolize_file(blazesym: &mut blazesym::symbolize::Symbolizer, files: &mut OpenFiles, id: FileId, batch: &FileBatch, lines: bool) -> Vec<Looked> {
    let name = batch.location.path.display();
    let path = match files.path(id, &batch.location) {
        Ok(path) => path.to_path_buf(),
        Err(err) => {
            log::debug!("cannot open {name} of process {}: {err}", batch.location.pid);
            return unknown(batch.offsets.len());
        }
    };
    if let Some(symbols) = files.debug_symbols(id) {
        return symbols.resolve(&batch.offsets);
    }
    let mut elf = Elf::new(path);
    elf.debug_syms = lines && files.debug_syms(id);
    match blazesym.symbolize(&Source::Elf(elf), Input::FileOffset(&batch.offsets)) {
        Ok(results) => batch.offsets.iter().zip(&results).map(|(&offset, result)| (resolved(result), function_range(offset, result))).collect(),
        Err(err) => {
            log::debug!("cannot symbolize {name}: {err}");
            files.close(blazesym, id);
            unknown(batch.offsets.len())
        }
    }
}

/// The file offsets of the sized function `offset` resolved into, if it did.
fn function_range(offset: u64, result: &Symbolized<'_>) -> Option<Range<u64>> {
    let sym = result.as_sym()?;
    let start = offset.checked_sub(sym.offset as u64)?;
    Some(start..start.checked_add(sym.size? as u64)?)
}

fn clear_if_over<K, V>(map: &mut HashMap<K, V>, max: usize) {
    if map.len() > max {
        map.clear();
    }
}

/// The addresses to look up for a stack's entries (innermost first): return addresses (every entry
/// but the first) point after the call, possibly into the next function or line, so look at the
/// call instruction.
pub(crate) fn call_sites(stack: &[u64]) -> impl Iterator<Item = u64> + '_ {
    stack.iter().enumerate().map(|(depth, &addr)| if depth == 0 { addr } else { addr.saturating_sub(1) })
}

fn level_frames(addr: u64, module: &Arc<Module>, functions: &[Function]) -> Vec<NativeFrame> {
    if functions.is_empty() {
        return vec![NativeFrame { addr, module: Some(module.clone()), symbol: None, file: None, line: None }];
    }
    functions
        .iter()
        .map(|function| NativeFrame {
            addr,
            module: Some(module.clone()),
            symbol: Some(function.name.clone()),
            file: function.file.clone(),
            line: function.line,
        })
        .collect()
}

fn unknown(count: usize) -> Vec<Looked> {
    vec![(Arc::from([]), None); count]
}

/// The functions at one address, innermost first: blazesym lists inlined calls outermost first,
/// each with its line inside that function.
fn resolved(result: &Symbolized<'_>) -> Resolved {
    let Some(sym) = result.as_sym().filter(|sym| !is_unsized_neighbour(sym)) else { return Arc::from([]) };
    let inlined = sym.inlined.iter().rev().map(|inlined| function(&inlined.name, inlined.code_info.as_ref()));
    inlined.chain(std::iter::once(outer_function(sym))).collect()
}

/// A symbol-table entry without a size only vouches for its own address: blazesym otherwise names
/// everything up to the next symbol after it, e.g. the whole PLT after `_init`.
fn is_unsized_neighbour(sym: &Sym<'_>) -> bool {
    sym.size.is_none() && sym.code_info.is_none() && sym.offset > 0
}

fn outer_function(sym: &Sym<'_>) -> Function {
    function(&sym.name, sym.code_info.as_deref())
}

fn function(name: &str, code_info: Option<&CodeInfo<'_>>) -> Function {
    Function { name: name.into(), file: code_info.map(|info| info.to_path().to_string_lossy().into()), line: code_info.and_then(|info| info.line) }
}

/// Whether blazesym may read this file's DWARF. With it, blazesym follows the file's debug link:
/// it canonicalizes the path it opened, which for the descriptor's `/proc/self/fd/N` link is the
/// path the file had when opened, as pyebpf's root sees it (`NAME (deleted)`, say), and opens that
/// and what it finds beside it (a FIFO there blocks it forever). Only a file that canonical path
/// still reaches, in a directory only root can change, is safe; others are symbolized from their
/// ELF symbols alone.
fn may_follow_debug_link(path: &Path, id: FileId) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(canonical) = std::fs::canonicalize(path) else { return false };
    let Ok(file) = std::fs::symlink_metadata(&canonical) else { return false };
    let same_file = file.is_file() && file.ino() == id.inode && (libc::major(file.dev()) as i32, libc::minor(file.dev()) as i32) == id.dev;
    same_file && canonical.parent().is_some_and(only_root_may_change)
}

/// Whether `dir` is a directory only root may change (owned by root, not group or world writable).
fn only_root_may_change(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(dir).is_ok_and(|meta| meta.is_dir() && meta.uid() == 0 && meta.mode() & 0o022 == 0)
}

fn pseudo_path(path: &MMapPath) -> Arc<str> {
    match path {
        MMapPath::Vdso => "[vdso]".into(),
        MMapPath::Vsyscall => "[vsyscall]".into(),
        MMapPath::Other(name) => name.as_str().into(),
        MMapPath::Path(path) => path.to_string_lossy().into(),
        _ => "[anon]".into(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests;
