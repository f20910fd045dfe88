//! Unwinding copied user stacks from call frame information (`--unwind dwarf|auto`).
//!
//! The eBPF program copies up to [`STACK_SNAPSHOT_MAX`] bytes of a thread's stack from its stack
//! pointer up, with its instruction, stack and frame pointers, at the sample; here `framehop` unwinds
//! that copy with the `.eh_frame`/`.eh_frame_hdr`/`.debug_frame` of every file the process maps
//! (and falls back to frame pointers where a file has none). The copy was taken at the sample, so
//! the unwind cannot race the thread.
//!
//! Each frame keeps its canonical frame address (CFA): its frame base is reported as CFA - 16, where
//! a frame-pointer prologue puts `rbp`, so the merge places Python segments by the same rule for
//! both unwinders.
//!
//! Each function's rows are tabulated once per file and shared by all processes (see [`rows`]).
//!
//! Caches are bounded: a file's unwind sections (only those: the file is read piecemeal) are read
//! once per (device, inode) and kept for at most [`MAX_FILES`] files and [`MAX_CACHED_BYTES`]; a
//! process's module list is rebuilt only when [`MapsCache`] has a new snapshot of its maps (it
//! re-reads them when the instruction pointer falls outside them), kept for at most
//! [`MAX_PROCESSES`] processes, and dropped when the process exits or execs.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder};
use object::{Object, ObjectSection, ObjectSegment};
use procfs::process::MMapPath;
use pyebpf_common::{MAX_USER_FRAMES, STACK_SNAPSHOT_MAX};

use crate::maps::{Maps, MapsCache};
use crate::target_file;

mod kernel_pages;
mod rows;

use kernel_pages::KernelPages;
pub use kernel_pages::{PageUpdate, UnwindPagesMap};
use rows::{Rule, RuleTables};

/// Files whose unwind sections are kept at most (all dropped at once when exceeded).
const MAX_FILES: usize = 256;
/// Processes whose module lists are kept at most.
const MAX_PROCESSES: usize = 4096;
/// Unwind sections kept at most, over all files (all dropped at once when exceeded).
const MAX_CACHED_BYTES: usize = 256 << 20;
/// Unwind sections larger than this are not read (their frames fall back to frame pointers): a
/// bound on what one hostile mapping can make pyebpf hold.
const MAX_SECTION_BYTES: u64 = 64 << 20;

/// Where a frame-pointer prologue puts the frame pointer, below the CFA: the saved `rbp` and the
/// return address lie between them.
const FRAME_BASE_BELOW_CFA: u64 = 16;

const PAGE_MASK: u64 = 4095;

type Data = Arc<[u8]>;

/// The user registers and stack copy of one sample.
#[derive(Clone, Copy, Debug)]
pub struct Snapshot<'a> {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// The stack from `sp` up.
    pub stack: &'a [u8],
}

/// A stack unwound from a snapshot, innermost first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Unwound {
    /// The instruction pointer, then return addresses.
    pub addrs: Vec<u64>,
    /// The frame base (CFA - 16) of each entry of `addrs` whose caller was found.
    pub frame_bases: Vec<u64>,
    /// The unwind reached the stack's root; otherwise it stopped early (the copy ended, the CFI or
    /// the stack was bad, or it grew too deep) and the outer frames are missing.
    pub complete: bool,
}

/// A file's identity, independent of the path a process reaches it by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FileId {
    dev: (i32, i32),
    inode: u64,
}

/// The identity given to the vDSO, which every process maps from pyebpf's own copy.
const VDSO: FileId = FileId { dev: (-1, -1), inode: 0 };

/// Where a process maps a file with unwind sections.
struct MappedFile {
    avma: Range<u64>,
    /// Where the file's stated address 0 lies in the process.
    base_avma: u64,
    id: FileId,
    cfi: Arc<FileCfi>,
}

/// The tabulated rules and the files one process maps, sorted by address.
struct Tabulated<'a> {
    tables: &'a mut RuleTables,
    files: &'a [MappedFile],
}

impl Tabulated<'_> {
    /// The tabulated rule at `avma`, if a file with unwind sections is mapped there.
    fn rule(&mut self, avma: u64) -> Option<Rule> {
        let file = mapped_at(self.files, avma)?;
        self.tables.rule(file.id, &file.cfi, avma.wrapping_sub(file.base_avma))
    }
}

/// The file of `files` (sorted by address) mapped at `avma`.
fn mapped_at(files: &[MappedFile], avma: u64) -> Option<&MappedFile> {
    let at = files.partition_point(|file| file.avma.start <= avma).checked_sub(1)?;
    files.get(at).filter(|file| avma < file.avma.end)
}

/// One loadable segment: where its file bytes sit in the file and in the stated address space.
#[derive(Clone, Copy, Debug)]
struct Segment {
    file_offset: u64,
    file_size: u64,
    svma: u64,
}

/// What unwinding needs of one ELF file. (framehop reads instructions only for Mach-O and PE
/// files, so `.text` is not kept.)
#[derive(Debug, Default)]
struct FileCfi {
    segments: Vec<Segment>,
    eh_frame: Option<(Range<u64>, Data)>,
    eh_frame_hdr: Option<(Range<u64>, Data)>,
    debug_frame: Option<Data>,
    got: Option<Range<u64>>,
}

impl FileCfi {
    fn parse<'data, R: object::ReadRef<'data>>(data: R) -> Result<FileCfi, object::Error> {
        let file = object::File::parse(data)?;
        let section = |name: &str| {
            let section = file.section_by_name(name).filter(|section| section.size() <= MAX_SECTION_BYTES)?;
            let bytes: Data = section.data().ok()?.into();
            Some((section.address()..section.address() + section.size(), bytes))
        };
        Ok(FileCfi {
            segments: file
                .segments()
                .map(|segment| {
                    let (file_offset, file_size) = segment.file_range();
                    Segment { file_offset, file_size, svma: segment.address() }
                })
                .collect(),
            eh_frame: section(".eh_frame"),
            eh_frame_hdr: section(".eh_frame_hdr"),
            debug_frame: section(".debug_frame").map(|(_, data)| data),
            got: file.section_by_name(".got").map(|s| s.address()..s.address() + s.size()),
        })
    }

    /// The bytes it holds.
    fn size(&self) -> usize {
        let len = |section: &Option<(Range<u64>, Data)>| section.as_ref().map_or(0, |(_, data)| data.len());
        len(&self.eh_frame) + len(&self.eh_frame_hdr) + self.debug_frame.as_ref().map_or(0, |data| data.len())
    }

    /// Where stated address 0 lies in a process that maps `file_offset` of this file at `start`.
    /// The loader maps each segment from its offset rounded down to a page, so the mapping belongs
    /// to the last segment whose rounded-down start is at or before `file_offset` (segments that
    /// share a page both contain it).
    fn base_avma(&self, start: u64, file_offset: u64) -> Option<u64> {
        let segment = self
            .segments
            .iter()
            .filter(|s| s.file_offset & !PAGE_MASK <= file_offset && file_offset < s.file_offset.saturating_add(s.file_size.max(1)))
            .max_by_key(|s| s.file_offset)?;
        // The stated address of the mapping's first byte.
        let svma = if file_offset <= segment.file_offset {
            segment.svma.checked_sub(segment.file_offset - file_offset)?
        } else {
            segment.svma.checked_add(file_offset - segment.file_offset)?
        };
        Some(start.wrapping_sub(svma))
    }

    fn module(&self, name: String, avma: Range<u64>, base_avma: u64) -> Module<Data> {
        let (eh_frame_svma, eh_frame) = self.eh_frame.clone().unzip();
        let (eh_frame_hdr_svma, eh_frame_hdr) = self.eh_frame_hdr.clone().unzip();
        let info = ExplicitModuleSectionInfo {
            base_svma: 0,
            got_svma: self.got.clone(),
            eh_frame_svma,
            eh_frame,
            eh_frame_hdr_svma,
            eh_frame_hdr,
            debug_frame: self.debug_frame.clone(),
            ..Default::default()
        };
        Module::new(name, avma, base_avma, info)
    }
}

/// One process's modules, as framehop needs them, built from one snapshot of its maps.
struct ProcessModules {
    snapshot: Arc<Maps>,
    unwinder: UnwinderX86_64<Data>,
    cache: CacheX86_64,
    files: Vec<MappedFile>,
}

/// Unwinds snapshots of many processes, caching what it reads of their files.
#[derive(Default)]
pub struct StackUnwinder {
    files: HashMap<FileId, Option<Arc<FileCfi>>>,
    /// The bytes `files` holds.
    cached_bytes: usize,
    /// The kernel's vDSO, read once from pyebpf's own mapping.
    vdso: Option<Option<Arc<FileCfi>>>,
    processes: HashMap<u32, ProcessModules>,
    /// Rules of the functions unwound so far, by file (dropped with `files`).
    rules: RuleTables,
    /// The rules handed to the eBPF program.
    pages: KernelPages,
}

impl StackUnwinder {
    pub fn new() -> StackUnwinder {
        StackUnwinder::default()
    }

    /// Unwinds one sample's stack copy: as far as the copy and the unwind information allow.
    pub fn unwind(&mut self, maps: &mut MapsCache, pid: u32, snapshot: &Snapshot<'_>) -> Unwound {
        if snapshot.ip == 0 {
            return Unwound::default();
        }
        self.follow_maps(pid, maps.covering(pid, &[snapshot.ip]));
        let Some(process) = self.processes.get_mut(&pid) else {
            return Unwound { addrs: vec![snapshot.ip], ..Default::default() };
        };
        let mut tabulated = Tabulated { tables: &mut self.rules, files: &process.files };
        let unwound = unwind_with(&process.unwinder, &mut process.cache, &mut tabulated, snapshot);
        if unwound.complete {
            let processes = &self.processes;
            // Only modules built from a process's latest maps place its pages: by an older
            // snapshot a page could lie where another file is mapped now.
            let files_of = |pid| {
                let process = processes.get(&pid)?;
                maps.latest(pid).is_some_and(|latest| Arc::ptr_eq(latest, &process.snapshot)).then_some(&process.files[..])
            };
            self.pages.publish(pid, &unwound, files_of, &self.rules);
        }
        unwound
    }

    /// Drops what is known of `pid`'s address space (it exited or replaced its program).
    pub fn forget_process(&mut self, pid: u32) {
        self.processes.remove(&pid);
        self.pages.forget(pid);
    }

    /// Follows `pid`'s maps as last read (new mappings re-read them): where they changed, the
    /// rules published for it that no longer hold are withdrawn.
    pub fn follow_process(&mut self, maps: &mut MapsCache, pid: u32) {
        self.follow_maps(pid, maps.covering(pid, &[]));
    }

    /// The changes to the eBPF program's unwind rules since the last call.
    pub fn take_page_updates(&mut self) -> Vec<PageUpdate> {
        self.pages.take_updates()
    }

    /// Rebuilds `pid`'s modules from `snapshot` unless they were built from it.
    fn follow_maps(&mut self, pid: u32, snapshot: &Arc<Maps>) {
        if self.processes.get(&pid).is_some_and(|known| Arc::ptr_eq(&known.snapshot, snapshot)) {
            return;
        }
        if self.processes.len() >= MAX_PROCESSES {
            self.processes.clear();
        }
        if self.files.len() >= MAX_FILES || self.cached_bytes >= MAX_CACHED_BYTES {
            self.files.clear();
            self.cached_bytes = 0;
            self.rules.start_afresh();
        }
        let mut unwinder = UnwinderX86_64::new();
        let files = self.mapped_files(pid, snapshot);
        self.pages.remapped(pid, &files);
        for file in &files {
            unwinder.add_module(file.cfi.module(format!("{:?}", file.id), file.avma.clone(), file.base_avma));
        }
        self.processes.insert(pid, ProcessModules { snapshot: snapshot.clone(), unwinder, cache: CacheX86_64::new(), files });
    }

    /// The files with unwind sections `maps` holds, by address.
    fn mapped_files(&mut self, pid: u32, maps: &Maps) -> Vec<MappedFile> {
        let mut files = Vec::new();
        for entry in maps.executable() {
            let (start, limit) = (entry.start, entry.limit);
            let (cfi, id) = match &entry.path {
                MMapPath::Path(path) => {
                    let id = FileId { dev: (entry.dev.0, entry.dev.1), inode: entry.inode };
                    let cached_bytes = &mut self.cached_bytes;
                    let cfi = self.files.entry(id).or_insert_with(|| {
                        let cfi = read_file_cfi(pid, start, limit, path, entry.inode);
                        *cached_bytes += cfi.as_ref().map_or(0, |cfi| cfi.size());
                        cfi
                    });
                    (cfi.clone(), id)
                }
                MMapPath::Vdso => (self.vdso.get_or_insert_with(own_vdso_cfi).clone(), VDSO),
                _ => continue,
            };
            let Some(cfi) = cfi else { continue };
            let Some(base_avma) = cfi.base_avma(start, entry.offset) else { continue };
            files.push(MappedFile { avma: start..limit, base_avma, id, cfi });
        }
        files.sort_by_key(|file| file.avma.start);
        files
    }
}

/// Unwinds `snapshot` through one ELF image (a file's bytes) mapped whole at `start`: how the
/// fuzzers reach the unwind-section parsing and unwinding with bytes of their own. None if the
/// image does not parse.
pub fn unwind_in_image(image: &[u8], start: u64, snapshot: &Snapshot<'_>) -> Option<Unwound> {
    let cfi = Arc::new(FileCfi::parse(image).ok()?);
    let limit = start.checked_add(image.len() as u64)?;
    let base_avma = cfi.base_avma(start, 0)?;
    let mut unwinder = UnwinderX86_64::new();
    unwinder.add_module(cfi.module("image".to_owned(), start..limit, base_avma));
    let files = [MappedFile { avma: start..limit, base_avma, id: VDSO, cfi }];
    let mut tabulated = Tabulated { tables: &mut RuleTables::default(), files: &files };
    Some(unwind_with(&unwinder, &mut CacheX86_64::new(), &mut tabulated, snapshot))
}

/// Unwinds `snapshot` frame by frame, keeping each frame's CFA, until the root, an unreadable or
/// inconsistent frame, or [`MAX_USER_FRAMES`].
fn unwind_with(unwinder: &UnwinderX86_64<Data>, cache: &mut CacheX86_64, tabulated: &mut Tabulated<'_>, snapshot: &Snapshot<'_>) -> Unwound {
    let stack = &snapshot.stack[..snapshot.stack.len().min(STACK_SNAPSHOT_MAX)];
    let mut read_stack = |addr: u64| -> Result<u64, ()> {
        let offset = usize::try_from(addr.checked_sub(snapshot.sp).ok_or(())?).map_err(|_| ())?;
        let bytes = stack.get(offset..offset.checked_add(8).ok_or(())?).ok_or(())?;
        Ok(u64::from_ne_bytes(bytes.try_into().map_err(|_| ())?))
    };
    let mut regs = UnwindRegsX86_64::new(snapshot.ip, snapshot.sp, snapshot.bp);
    let mut unwound = Unwound { addrs: vec![snapshot.ip], ..Default::default() };
    let mut address = FrameAddress::from_instruction_pointer(snapshot.ip);
    let mut previous_sp = snapshot.sp;
    while unwound.addrs.len() < MAX_USER_FRAMES {
        let step = match tabulated.rule(address.address_for_lookup()) {
            Some(rule) if rule != Rule::Other => rows::step(rule, !address.is_return_address(), &mut regs, &mut read_stack).map_err(|rows::Stuck| None),
            _ => unwinder.unwind_frame(address, &mut regs, cache, &mut read_stack).map_err(Some),
        };
        match step {
            Ok(Some(return_address)) => {
                let cfa = regs.sp();
                // A stack only grows towards its root: anything else is a loop or garbage.
                if cfa <= previous_sp {
                    break;
                }
                previous_sp = cfa;
                unwound.frame_bases.push(cfa - FRAME_BASE_BELOW_CFA);
                unwound.addrs.push(return_address);
                match FrameAddress::from_return_address(return_address) {
                    Some(next) => address = next,
                    None => break,
                }
            }
            Ok(None) => {
                unwound.complete = true;
                break;
            }
            Err(err) => {
                log::trace!("unwind stopped after {} frames: {err:?}", unwound.addrs.len());
                break;
            }
        }
    }
    unwound
}

/// Reads a mapped file's unwind sections (and headers; nothing else of it); None if it cannot be
/// read or parsed (its frames fall back to frame pointers).
fn read_file_cfi(pid: u32, start: u64, limit: u64, path: &Path, inode: u64) -> Option<Arc<FileCfi>> {
    let file = target_file::open_mapped(pid, start, limit, path, inode).ok()?;
    match FileCfi::parse(&object::ReadCache::new(file)) {
        Ok(cfi) => Some(Arc::new(cfi)),
        Err(err) => {
            log::debug!("cannot read the unwind information of {}: {err}", path.display());
            None
        }
    }
}

/// The unwind sections of the kernel's vDSO as pyebpf itself maps it: every 64-bit process maps
/// the same image, so this serves them all, and nothing of it is read from a target.
fn own_vdso_cfi() -> Option<Arc<FileCfi>> {
    let maps = Maps::read_own().ok()?;
    let vdso = maps.mappings().iter().find(|entry| entry.path == MMapPath::Vdso)?;
    let (start, limit) = (vdso.start, vdso.limit);
    // SAFETY: the kernel maps the vDSO readable for the process's whole life, and never moves it.
    let image = unsafe { std::slice::from_raw_parts(start as *const u8, (limit - start) as usize) };
    FileCfi::parse(image).map(Arc::new).inspect_err(|err| log::debug!("cannot read the vDSO's unwind information: {err}")).ok()
}

#[cfg(test)]
mod tests;
