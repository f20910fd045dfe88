//! Native symbolization of sampled stacks: user frames per process from `/proc/PID/maps` and the ELF
//! files they map (`.symtab`, `.dynsym`, DWARF where present), kernel frames from kallsyms.
//!
//! Symbolization runs for every sample, so everything is cached for the whole recording:
//! - each process's executable mappings, re-read only when an address falls outside them (a new
//!   `dlopen`), at most once per [`MAPS_REFRESH_INTERVAL`];
//! - each file's build ID and symbols, keyed by the file's identity (device and inode), so a library
//!   that many processes map is parsed once; blazesym keeps the parsed file open, so late samples of
//!   a process that has exited still resolve;
//! - each result, per (file, file offset) and per kernel address.
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

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesym::symbolize::evict::{self, Evict};
use blazesym::symbolize::source::{Elf, Kernel, Process, Source};
use blazesym::symbolize::{CodeInfo, Input, Sym, Symbolized};
use blazesym::{MaybeDefault, Pid};
use procfs::process::{MMPermissions, MMapPath, MemoryMap};

use crate::stack::{KernelFrame, Module, NativeFrame};
use open_files::{Location, OpenFiles};

mod open_files;

/// The shortest time between two reads of one process's maps: junk addresses from a broken
/// frame-pointer chain fall outside every mapping and must not cause a re-read per sample.
const MAPS_REFRESH_INTERVAL: Duration = Duration::from_millis(100);

/// Files blazesym keeps open (and mapped) at most.
const MAX_OPEN_FILES: usize = 256;

/// The open files' sizes added up, at most: what blazesym parses of a file grows with its size.
const MAX_OPEN_BYTES: u64 = 2 << 30;

/// Build IDs kept at most (of files seen, whether symbolized or not).
const MAX_BUILD_IDS: usize = 4096;

/// Resolved addresses kept at most, per kind (file offsets, in-process, kernel addresses).
const MAX_RESOLVED: usize = 100_000;

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

/// A process's executable mappings, sorted by start address.
#[derive(Debug, Default)]
struct ProcessMaps {
    mappings: Vec<Mapping>,
    read_at: Option<Instant>,
}

impl ProcessMaps {
    fn find(&self, addr: u64) -> Option<&Mapping> {
        let index = self.mappings.partition_point(|mapping| mapping.module.start <= addr);
        index.checked_sub(1).map(|index| &self.mappings[index]).filter(|mapping| mapping.contains(addr))
    }

    fn may_refresh(&self, now: Instant) -> bool {
        self.read_at.is_none_or(|read_at| now.duration_since(read_at) >= MAPS_REFRESH_INTERVAL)
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
}

impl Default for Symbolizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Symbolizer {
    pub fn new() -> Symbolizer {
        let blazesym = blazesym::symbolize::Symbolizer::builder()
            // Files are identified by device and inode already; skipping blazesym's re-check saves a
            // stat per lookup and keeps files of exited processes usable.
            .enable_auto_reload(false)
            .enable_code_info(true)
            .enable_inlined_fns(true)
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
        }
    }

    /// Keeps the caches that grow with the files and code seen within their bounds.
    fn enforce_bounds(&mut self) {
        if self.open_files.len() > MAX_OPEN_FILES || self.open_files.bytes() > MAX_OPEN_BYTES {
            self.open_files.close_all(&mut self.blazesym);
            self.build_ids.clear();
        }
        clear_if_over(&mut self.build_ids, MAX_BUILD_IDS);
        clear_if_over(&mut self.by_file_offset, MAX_RESOLVED);
        clear_if_over(&mut self.by_process_addr, MAX_RESOLVED);
    }

    /// Symbolizes a user stack as `bpf_get_stack` returns it: innermost first, entry 0 the sampled
    /// instruction, later entries return addresses. Frames keep their place even when unknown; an
    /// address inlined into its caller gives several frames, innermost first.
    pub fn user_frames(&mut self, pid: u32, stack: &[u64]) -> Vec<NativeFrame> {
        self.user_levels(pid, stack).into_iter().flatten().collect()
    }

    /// Like [`Symbolizer::user_frames`], with the frames of each stack entry kept apart.
    pub fn user_levels(&mut self, pid: u32, stack: &[u64]) -> Vec<Vec<NativeFrame>> {
        self.enforce_bounds();
        let addrs: Vec<u64> = stack.iter().enumerate().map(|(depth, &addr)| call_site(depth, addr)).collect();
        self.refresh_maps_if_unmapped(pid, &addrs);
        self.resolve_missing(pid, &addrs);

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
        let addrs: Vec<u64> = stack.iter().enumerate().map(|(depth, &addr)| call_site(depth, addr)).collect();
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

    /// Re-reads the process's maps when an address is outside all known mappings (or the process
    /// was never seen), unless they were read very recently.
    fn refresh_maps_if_unmapped(&mut self, pid: u32, addrs: &[u64]) {
        let maps = self.processes.entry(pid).or_default();
        let all_mapped = maps.read_at.is_some() && addrs.iter().all(|&addr| !could_be_code(addr) || maps.find(addr).is_some());
        let now = Instant::now();
        if all_mapped || !maps.may_refresh(now) {
            return;
        }
        maps.read_at = Some(now);
        match read_executable_maps(pid) {
            Ok(entries) => {
                let mappings = entries.into_iter().map(|entry| self.mapping(pid, entry)).collect();
                if let Some(maps) = self.processes.get_mut(&pid) {
                    maps.mappings = mappings;
                }
            }
            // Most likely the process exited: keep what was known, so its late samples still resolve.
            Err(err) => log::debug!("cannot read the maps of process {pid}: {err}"),
        }
    }

    fn mapping(&mut self, pid: u32, entry: MemoryMap) -> Mapping {
        let (start, limit) = entry.address;
        let file = match &entry.pathname {
            MMapPath::Path(path) if entry.inode != 0 => Some(path.clone()),
            _ => None,
        };
        let (path, backing, build_id) = match file {
            Some(path) => {
                let id = FileId { dev: entry.dev, inode: entry.inode };
                let build_id = self.build_id(id, &Location { pid, start, limit, path: &path });
                let name = path.to_string_lossy().into();
                (name, Backing::File { id, path_in_process: path }, build_id)
            }
            None => (pseudo_path(&entry.pathname), Backing::Process, None),
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
                    if !self.by_file_offset.contains_key(&(*id, offset)) {
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
            let resolved = symbolize_file(&mut self.blazesym, &mut self.open_files, id, &batch);
            self.by_file_offset.extend(batch.offsets.into_iter().map(|offset| (id, offset)).zip(resolved));
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
                unknown(addrs.len())
            }
        }
    }
}

/// Symbolizes file offsets in one file. A file opened before stays open, so late samples of a
/// process that has exited still resolve. A file that cannot be opened or read gives unknown
/// results, remembered like any other so it is not retried every sample.
fn symbolize_file(blazesym: &mut blazesym::symbolize::Symbolizer, files: &mut OpenFiles, id: FileId, batch: &FileBatch) -> Vec<Resolved> {
    let name = batch.location.path.display();
    let path = match files.path(id, &batch.location) {
        Ok(path) => path.to_path_buf(),
        Err(err) => {
            log::debug!("cannot open {name} of process {}: {err}", batch.location.pid);
            return unknown(batch.offsets.len());
        }
    };
    let mut elf = Elf::new(path.clone());
    elf.debug_syms = may_follow_debug_link(&path, id);
    match blazesym.symbolize(&Source::Elf(elf), Input::FileOffset(&batch.offsets)) {
        Ok(results) => results.iter().map(resolved).collect(),
        Err(err) => {
            log::debug!("cannot symbolize {name}: {err}");
            files.close(blazesym, id);
            unknown(batch.offsets.len())
        }
    }
}

fn clear_if_over<K, V>(map: &mut HashMap<K, V>, max: usize) {
    if map.len() > max {
        map.clear();
    }
}

/// Whether an address can be in a user-space mapping at all; frame-pointer chains through code
/// built without frame pointers end in small numbers or data that no maps re-read will explain.
fn could_be_code(addr: u64) -> bool {
    const FIRST_PAGE_END: u64 = 0x1000;
    const USER_SPACE_END: u64 = 1 << 47;
    (FIRST_PAGE_END..USER_SPACE_END).contains(&addr)
}

/// The address to look up for a stack entry: return addresses (every entry but the first) point
/// after the call, possibly into the next function or line, so look at the call instruction.
pub(crate) fn call_site(depth: usize, addr: u64) -> u64 {
    if depth == 0 {
        addr
    } else {
        addr.saturating_sub(1)
    }
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

fn unknown(count: usize) -> Vec<Resolved> {
    vec![Arc::from([]); count]
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

/// The executable mappings of a process.
fn read_executable_maps(pid: u32) -> procfs::ProcResult<Vec<MemoryMap>> {
    let process = procfs::process::Process::new(pid as i32)?;
    let maps = process.maps()?;
    let mut entries: Vec<_> = maps.into_iter().filter(|entry| entry.perms.contains(MMPermissions::EXECUTE)).collect();
    entries.sort_by_key(|entry| entry.address.0);
    Ok(entries)
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
    let (Ok(file), Some(Ok(dir))) = (std::fs::symlink_metadata(&canonical), canonical.parent().map(std::fs::symlink_metadata)) else {
        return false;
    };
    let same_file = file.is_file() && file.ino() == id.inode && (libc::major(file.dev()) as i32, libc::minor(file.dev()) as i32) == id.dev;
    same_file && dir.uid() == 0 && dir.mode() & 0o022 == 0
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
mod tests {
    use std::io::{BufRead, BufReader};
    use std::path::Path;
    use std::process::{Child, ChildStdout, Command, Stdio};

    use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol};

    use super::*;

    const PROGRAM: &str = r#"
#include <stdio.h>
#include <unistd.h>
volatile unsigned long sink;
__attribute__((noinline)) void leaf_fn(void) { for (int i = 0; i < 1000; i++) sink += i; }
__attribute__((noinline)) static void middle_fn(void) { leaf_fn(); sink++; }
__attribute__((noinline)) void outer_fn(void) { middle_fn(); sink++; }
int main(void) {
    printf("%lx %lx %lx\n", (unsigned long)&leaf_fn, (unsigned long)&middle_fn, (unsigned long)&outer_fn);
    fflush(stdout);
    for (;;) pause();
}
"#;

    const CPP_PROGRAM: &str = r#"
#include <cstdio>
#include <unistd.h>
namespace shapes { __attribute__((noinline)) double area(int side) { return side * 1.5; } }
int main() {
    std::printf("%lx\n", (unsigned long)&shapes::area);
    std::fflush(stdout);
    for (;;) pause();
}
"#;

    /// A compiled test program, running until dropped.
    struct Running {
        child: Child,
        stdout: BufReader<ChildStdout>,
    }

    impl Running {
        fn start(exe: &Path) -> Running {
            let mut child = Command::new(exe).stdout(Stdio::piped()).spawn().expect("start the test program");
            let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
            Running { child, stdout }
        }

        fn pid(&self) -> u32 {
            self.child.id()
        }

        /// The function addresses the program prints once it is ready.
        fn addresses(&mut self) -> Vec<u64> {
            let mut line = String::new();
            self.stdout.read_line(&mut line).expect("read the program's addresses");
            line.split_whitespace().map(|word| u64::from_str_radix(word, 16).expect("hex address")).collect()
        }

        fn stop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    impl Drop for Running {
        fn drop(&mut self) {
            self.stop();
        }
    }

    fn compile(compiler: &str, source: &str, name: &str, flags: &[&str], dir: &Path) -> PathBuf {
        let ext = if compiler == "g++" { "cpp" } else { "c" };
        let source_path = dir.join(format!("{name}.{ext}"));
        std::fs::write(&source_path, source).unwrap();
        let exe = dir.join(name);
        let status = Command::new(compiler)
            .args(flags)
            .arg("-o")
            .arg(&exe)
            .arg(&source_path)
            .status()
            .unwrap_or_else(|err| panic!("this test compiles a program with {compiler}, which failed to run: {err}"));
        assert!(status.success(), "{compiler} failed on {}", source_path.display());
        exe
    }

    fn names(frames: &[NativeFrame]) -> Vec<&str> {
        frames.iter().map(|frame| frame.symbol.as_deref().unwrap_or("?")).collect()
    }

    /// The file offset of a function, from the ELF's own symbol table and program headers.
    fn file_offset_of(exe: &Path, function: &str) -> u64 {
        let data = std::fs::read(exe).unwrap();
        let file = object::File::parse(&*data).unwrap();
        let symbol = file.symbols().find(|symbol| symbol.name() == Ok(function)).expect("symbol in the ELF");
        let segment =
            file.segments().find(|segment| (segment.address()..segment.address() + segment.size()).contains(&symbol.address())).expect("segment of the symbol");
        symbol.address() - segment.address() + segment.file_range().0
    }

    #[test]
    fn finds_functions_files_and_lines_in_a_running_program() {
        let dir = tempfile::tempdir().unwrap();
        let exe = compile("gcc", PROGRAM, "spin", &["-g", "-O1", "-fno-omit-frame-pointer"], dir.path());
        let mut program = Running::start(&exe);
        let [leaf, middle, outer] = program.addresses()[..] else { panic!("three addresses") };

        let mut symbolizer = Symbolizer::new();
        // As bpf_get_stack gives them: the sampled IP, then return addresses just past each call.
        let frames = symbolizer.user_frames(program.pid(), &[leaf + 1, middle + 5, outer + 5]);
        assert_eq!(names(&frames), ["leaf_fn", "middle_fn", "outer_fn"], "{frames:#?}");
        let module = frames[0].module.as_ref().expect("module of a mapped address");
        assert_eq!(Path::new(&*module.path), exe);
        assert!(module.build_id.as_ref().is_some_and(|id| id.len() == 40), "GNU build ID: {module:?}");
        assert!(frames[0].file.as_deref().is_some_and(|file| file.ends_with("spin.c")), "{:?}", frames[0]);
        assert_eq!(frames[0].line, Some(5));
        // Return addresses are reported at the call instruction, one byte back.
        assert_eq!(frames[1].addr, middle + 4);
    }

    #[test]
    fn stripped_code_shows_its_module_and_file_offset() {
        let dir = tempfile::tempdir().unwrap();
        let exe = compile("gcc", PROGRAM, "spin", &["-O1", "-fno-omit-frame-pointer", "-rdynamic"], dir.path());
        let stripped = dir.path().join("spin-stripped");
        let status = Command::new("strip").arg("-o").arg(&stripped).arg(&exe).status().expect("strip (binutils) runs");
        assert!(status.success());
        let mut program = Running::start(&stripped);
        let [leaf, middle, _] = program.addresses()[..] else { panic!("three addresses") };

        let frames = Symbolizer::new().user_frames(program.pid(), &[leaf, middle + 5]);
        // leaf_fn is exported (.dynsym survives strip); the static middle_fn is only in .symtab.
        assert_eq!(frames[0].symbol.as_deref(), Some("leaf_fn"), "{frames:#?}");
        assert_eq!(frames[1].symbol, None);
        let expected = format!("spin-stripped+{:#x}", file_offset_of(&exe, "middle_fn") + 4);
        assert_eq!(crate::output::native_name(&frames[1]), expected);
    }

    #[test]
    fn plt_stubs_are_unknown_rather_than_named_after_init() {
        let dir = tempfile::tempdir().unwrap();
        let source = "#include <stdio.h>\nvoid say(void) { puts(\"hi\"); }\n";
        let library = compile("gcc", source, "libsay.so", &["-shared", "-fPIC", "-g", "-O1"], dir.path());
        let base = load_library(&library, c"say").1;
        let data = std::fs::read(&library).unwrap();
        let elf = object::File::parse(&*data).unwrap();
        let plt = elf.section_by_name(".plt").expect("a .plt section");
        // The first stub after the PLT header, which only `_init`, without a size, precedes.
        let stub = base + plt.address() + 16;

        let frames = Symbolizer::new().user_frames(std::process::id(), &[stub]);
        assert_eq!(frames[0].symbol, None, "{frames:#?}");
        assert!(crate::output::native_name(&frames[0]).starts_with("libsay.so+0x"), "{frames:#?}");
    }

    /// Loads a library into this test process; returns a function's address and the load base.
    fn load_library(library: &Path, function: &std::ffi::CStr) -> (u64, u64) {
        let path = std::ffi::CString::new(library.to_str().unwrap()).unwrap();
        // SAFETY: dlopen/dlsym/dladdr on a library this test just built; it stays loaded.
        unsafe {
            let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW);
            assert!(!handle.is_null(), "dlopen {}", library.display());
            let address = libc::dlsym(handle, function.as_ptr());
            assert!(!address.is_null(), "dlsym {function:?}");
            let mut info: libc::Dl_info = std::mem::zeroed();
            assert_ne!(libc::dladdr(address, &mut info), 0, "dladdr");
            (address as u64, info.dli_fbase as u64)
        }
    }

    #[test]
    fn demangles_cpp_and_rust_names() {
        let dir = tempfile::tempdir().unwrap();
        let exe = compile("g++", CPP_PROGRAM, "shapes", &["-O1"], dir.path());
        let mut program = Running::start(&exe);
        let [area] = program.addresses()[..] else { panic!("one address") };
        let mut symbolizer = Symbolizer::new();
        let frames = symbolizer.user_frames(program.pid(), &[area]);
        assert_eq!(names(&frames), ["shapes::area(int)"]);

        // Optimised builds inline black_box into marker: the chain ends in marker itself.
        let own = symbolizer.user_frames(std::process::id(), &[marker as fn() -> u64 as usize as u64]);
        assert_eq!(names(&own).last(), Some(&"pyebpf::symbolize::tests::marker"), "{own:#?}");
    }

    #[inline(never)]
    fn marker() -> u64 {
        std::hint::black_box(7)
    }

    #[test]
    fn a_process_that_exited_keeps_what_was_learned_and_unknown_ones_keep_the_address() {
        let dir = tempfile::tempdir().unwrap();
        let exe = compile("gcc", PROGRAM, "spin", &["-O1"], dir.path());
        let mut program = Running::start(&exe);
        let pid = program.pid();
        let [leaf, middle, outer] = program.addresses()[..] else { panic!("three addresses") };
        let mut symbolizer = Symbolizer::new();
        assert_eq!(names(&symbolizer.user_frames(pid, &[leaf])), ["leaf_fn"]);
        program.stop();

        // Samples still in flight when the process exits: its maps and opened files stay known.
        let late = symbolizer.user_frames(pid, &[middle, outer + 5]);
        assert_eq!(names(&late), ["middle_fn", "outer_fn"], "{late:#?}");

        let mut never_seen = Command::new("true").spawn().unwrap();
        let gone = never_seen.id();
        never_seen.wait().unwrap();
        let frames = Symbolizer::new().user_frames(gone, &[0x40_1000, 0x40_2000]);
        assert_eq!(frames.len(), 2);
        assert!(frames.iter().all(|frame| frame.module.is_none() && frame.symbol.is_none()));
        assert_eq!(frames[0].addr, 0x40_1000);
    }

    #[test]
    fn libraries_loaded_later_are_found() {
        let dir = tempfile::tempdir().unwrap();
        let library = compile("gcc", "int plugin_fn(int x) { return x * 3; }\n", "libplugin.so", &["-shared", "-fPIC", "-g"], dir.path());
        let mut symbolizer = Symbolizer::new();
        let pid = std::process::id();
        assert_eq!(names(&symbolizer.user_frames(pid, &[marker as fn() -> u64 as usize as u64])).last(), Some(&"pyebpf::symbolize::tests::marker"));

        let address = load_library(&library, c"plugin_fn").0;
        assert_ne!(address, 0);
        std::thread::sleep(MAPS_REFRESH_INTERVAL);
        let frames = symbolizer.user_frames(pid, &[address]);
        assert_eq!(names(&frames), ["plugin_fn"], "{frames:#?}");
    }

    fn mkfifo(path: &Path) {
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo reads a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
    }

    #[test]
    fn a_file_once_opened_is_read_even_after_the_target_puts_a_fifo_at_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let exe = compile("gcc", PROGRAM, "spin", &["-g", "-O1", "-fno-omit-frame-pointer"], dir.path());
        let mut program = Running::start(&exe);
        let pid = program.pid();
        let [leaf, middle, outer] = program.addresses()[..] else { panic!("three addresses") };
        let entry = read_executable_maps(pid).unwrap().into_iter().find(|entry| (entry.address.0..entry.address.1).contains(&leaf)).unwrap();
        let id = FileId { dev: entry.dev, inode: entry.inode };
        // No mapping lies at 0..0, so map_files has nothing and the path the process names is
        // opened, as it is without CAP_SYS_ADMIN.
        let mut files = OpenFiles::default();
        let path = files.path(id, &Location { pid, start: 0, limit: 0, path: &exe }).unwrap().to_path_buf();
        assert!(path.starts_with("/proc/self/fd"), "{}", path.display());
        let build_id = files.build_id(id, &Location { pid, start: 0, limit: 0, path: &exe }).expect("a build ID");
        assert!(may_follow_debug_link(&path, id), "{} in a directory only root may change", exe.display());

        // The target swaps its file for FIFOs, under both names its mapping can be found by.
        std::fs::remove_file(&exe).unwrap();
        mkfifo(&exe);
        mkfifo(&dir.path().join("spin (deleted)"));

        let offsets = [leaf, middle, outer].iter().map(|addr| addr - entry.address.0 + entry.offset).collect();
        let (sender, receiver) = std::sync::mpsc::channel();
        // On its own thread: a read that blocks on a FIFO fails the test instead of hanging it.
        std::thread::spawn(move || {
            let mut blazesym = blazesym::symbolize::Symbolizer::new();
            let batch = FileBatch { location: Location { pid, start: 0, limit: 0, path: &exe }, offsets };
            let resolved = symbolize_file(&mut blazesym, &mut files, id, &batch);
            let names: Vec<String> = resolved.iter().map(|functions| functions.iter().map(|f| f.name.to_string()).collect()).collect();
            let _ = sender.send((names, files.build_id(id, &batch.location), may_follow_debug_link(&path, id)));
        });
        let (names, after, follows) = receiver.recv_timeout(Duration::from_secs(30)).expect("symbolizing blocked on the FIFO");
        assert_eq!(names, ["leaf_fn", "middle_fn", "outer_fn"]);
        assert_eq!(after.as_deref(), Some(&build_id[..]));
        // The descriptor's canonical path is now `spin (deleted)`, a FIFO: no debug link from there.
        assert!(!follows);
    }

    #[test]
    fn the_debug_link_is_followed_from_an_open_file_only_where_root_alone_may_change_it() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let exe = compile("gcc", PROGRAM, "spin", &["-g", "-O1"], dir.path());
        let metadata = std::fs::metadata(&exe).unwrap();
        let id = FileId { dev: (libc::major(metadata.dev()) as i32, libc::minor(metadata.dev()) as i32), inode: metadata.ino() };
        let location = Location { pid: std::process::id(), start: 0, limit: 0, path: &exe };
        let mut files = OpenFiles::default();
        let path = files.path(id, &location).unwrap().to_path_buf();
        assert!(may_follow_debug_link(&path, id), "a root-owned directory of mode 0700");

        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(!may_follow_debug_link(&path, id), "a directory anyone may change");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(may_follow_debug_link(&path, id));

        // Another file renamed over the opened one: the canonical path reaches a different file.
        let other = dir.path().join("other");
        std::fs::copy(&exe, &other).unwrap();
        std::fs::rename(&other, &exe).unwrap();
        assert!(!may_follow_debug_link(&path, id), "the canonical path no longer reaches the open file");
    }

    #[test]
    fn kernel_addresses_resolve_through_kallsyms() {
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").expect("/proc/kallsyms is readable");
        let address = kallsyms
            .lines()
            .find_map(|line| match line.split_whitespace().collect::<Vec<_>>()[..] {
                [address, "T" | "t", "schedule"] => u64::from_str_radix(address, 16).ok(),
                _ => None,
            })
            .expect("`schedule` in /proc/kallsyms");
        assert_ne!(address, 0, "/proc/kallsyms hides addresses: run as root (kptr_restrict)");

        let frames = Symbolizer::new().kernel_frames(&[address + 4, address + 9]);
        let names: Vec<_> = frames.iter().map(|frame| frame.symbol.as_deref()).collect();
        assert_eq!(names, [Some("schedule"), Some("schedule")]);
        assert_eq!(frames[1].addr, address + 8);
    }
}
