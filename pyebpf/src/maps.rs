//! Processes' memory maps: the one reader of `/proc/PID/maps`, and the one cache of what it read.
//!
//! A [`Maps`] is an immutable snapshot of one process's mappings, sorted by address. The symbolizer,
//! the unwinder and the CPython reader all take their mappings from it; the symbolizer and the
//! unwinder derive their own per-process structures from a snapshot and rebuild them only when
//! [`MapsCache`] hands out a new one (`Arc::ptr_eq` tells): a re-read that finds the same mappings
//! keeps the snapshot there was.
//!
//! [`MapsCache`] keeps each process's latest snapshot, and re-reads it:
//! - for samples ([`MapsCache::covering`]): when the process was never read, or an address to be
//!   resolved falls outside every executable mapping and the stacks and heap (a new `dlopen`), at
//!   most once per [`REFRESH_INTERVAL`], and less often while re-reads find nothing new (up to
//!   [`MAX_REFRESH_INTERVAL`]): a stack unwound through code without frame pointers ends in junk
//!   that no re-read explains;
//! - for a reader that waits for a file to be mapped ([`MapsCache::newer_than`]): when the snapshot
//!   is older than the age it asks for.
//!
//! A read that fails (most likely the process exited) keeps the snapshot there was, so the late
//! samples of a process that has exited still resolve. The cache holds at most [`MAX_PROCESSES`]
//! processes (all dropped at once beyond); [`MapsCache::forget`] drops one that exited or exec'd.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use procfs::process::{MMPermissions, MMapPath, Process};

/// The shortest time between two reads of one process's maps for samples: junk addresses from a
/// broken frame-pointer chain fall outside every mapping and must not cause a re-read per sample.
pub const REFRESH_INTERVAL: Duration = Duration::from_millis(100);
/// The longest: each re-read for samples that finds the same mappings doubles the time to the
/// next, up to this; one that finds new ones starts over.
pub const MAX_REFRESH_INTERVAL: Duration = Duration::from_millis(3200);

/// Processes whose maps are kept at most (all dropped at once when exceeded; they are read again
/// on demand).
pub const MAX_PROCESSES: usize = 4096;

/// Why a process's maps cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum MapsError {
    #[error("no permission to read the maps of process {0}")]
    PermissionDenied(u32),
    #[error("cannot read the maps of process {pid}: {source}")]
    Unreadable { pid: u32, source: procfs::ProcError },
}

impl MapsError {
    fn new(pid: u32, source: procfs::ProcError) -> MapsError {
        match source {
            procfs::ProcError::PermissionDenied(_) => MapsError::PermissionDenied(pid),
            source => MapsError::Unreadable { pid, source },
        }
    }
}

/// One mapping of a process, as `/proc/PID/maps` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub limit: u64,
    pub perms: MMPermissions,
    /// The file offset mapped at `start`.
    pub offset: u64,
    pub dev: (i32, i32),
    /// 0 for anonymous memory and pseudo-files.
    pub inode: u64,
    pub path: MMapPath,
}

impl Mapping {
    pub fn contains(&self, addr: u64) -> bool {
        (self.start..self.limit).contains(&addr)
    }

    pub fn is_executable(&self) -> bool {
        self.perms.contains(MMPermissions::EXECUTE)
    }

    /// Whether it is the stack, the heap or a kernel page, which never hold code: a frame-pointer
    /// chain broken in code built without frame pointers often ends at a stack address, which no
    /// re-read will explain (anonymous memory may turn executable, a JIT's code; files' data pages
    /// are left to a re-read too, as `dlopen` maps a file's code over a part of it).
    fn never_code(&self) -> bool {
        matches!(self.path, MMapPath::Stack | MMapPath::TStack(_) | MMapPath::Heap | MMapPath::Vvar)
    }

    /// The file it maps, where it maps one (not anonymous memory, a pseudo-file or the vDSO).
    pub fn file(&self) -> Option<&Path> {
        match &self.path {
            MMapPath::Path(path) if self.inode != 0 => Some(path),
            _ => None,
        }
    }
}

/// A snapshot of one process's mappings, sorted by start address (they never overlap).
#[derive(Debug)]
pub struct Maps {
    mappings: Vec<Mapping>,
}

impl Maps {
    /// Reads `pid`'s maps now.
    pub fn read(pid: u32) -> Result<Maps, MapsError> {
        Maps::read_process(pid, Process::new(pid as i32))
    }

    /// Reads pyebpf's own maps (through `/proc/self`, whichever PID namespace `/proc` shows).
    pub fn read_own() -> Result<Maps, MapsError> {
        Maps::read_process(std::process::id(), Process::myself())
    }

    fn read_process(pid: u32, process: procfs::ProcResult<Process>) -> Result<Maps, MapsError> {
        let entries = process.and_then(|process| process.maps()).map_err(|err| MapsError::new(pid, err))?;
        let mut mappings: Vec<Mapping> = entries
            .into_iter()
            .map(|entry| Mapping {
                start: entry.address.0,
                limit: entry.address.1,
                perms: entry.perms,
                offset: entry.offset,
                dev: entry.dev,
                inode: entry.inode,
                path: entry.pathname,
            })
            .collect();
        mappings.sort_by_key(|mapping| mapping.start);
        Ok(Maps { mappings })
    }

    /// No mappings: what is known of a process whose maps could never be read.
    fn unknown() -> Maps {
        Maps { mappings: Vec::new() }
    }

    /// Every mapping, by address.
    pub fn mappings(&self) -> &[Mapping] {
        &self.mappings
    }

    /// The executable mappings, by address.
    pub fn executable(&self) -> impl Iterator<Item = &Mapping> {
        self.mappings.iter().filter(|mapping| mapping.is_executable())
    }

    /// The mapping holding `addr`.
    pub fn find(&self, addr: u64) -> Option<&Mapping> {
        let index = self.mappings.partition_point(|mapping| mapping.start <= addr);
        index.checked_sub(1).map(|index| &self.mappings[index]).filter(|mapping| mapping.contains(addr))
    }

    /// Whether `addr` could not be code while this snapshot holds: no user address, or one in the
    /// stack, the heap or a kernel page (where frame-pointer walks through code built without
    /// them end).
    pub fn never_code_at(&self, addr: u64) -> bool {
        !could_be_code(addr) || self.find(addr).is_some_and(Mapping::never_code)
    }

    /// Whether `addr` is either in an executable mapping or could not be code at all: either way a
    /// re-read would not tell more.
    fn explains(&self, addr: u64) -> bool {
        self.never_code_at(addr) || self.find(addr).is_some_and(Mapping::is_executable)
    }
}

/// Whether an address can be in a user-space mapping at all; frame-pointer chains through code
/// built without frame pointers end in small numbers or data that no maps re-read will explain.
fn could_be_code(addr: u64) -> bool {
    const FIRST_PAGE_END: u64 = 0x1000;
    const USER_SPACE_END: u64 = 1 << 47;
    (FIRST_PAGE_END..USER_SPACE_END).contains(&addr)
}

/// A process's latest snapshot, and when its maps were last read (or tried).
struct Entry {
    maps: Arc<Maps>,
    tried_at: Instant,
    /// None while they could never be read.
    read_at: Option<Instant>,
    /// The time from `tried_at` before samples may have them read again.
    refresh_after: Duration,
}

/// The latest maps of each process sampled; see the module documentation for when they are read.
#[derive(Default)]
pub struct MapsCache {
    processes: HashMap<u32, Entry>,
}

impl MapsCache {
    /// `pid`'s maps, re-read first if one of `addrs` falls outside every executable mapping (or the
    /// process was never read) and they were not read too recently (see the module documentation).
    /// Never fails: a process whose maps cannot be read has none (or keeps those read before).
    pub fn covering(&mut self, pid: u32, addrs: &[u64]) -> &Arc<Maps> {
        let stale = self
            .processes
            .get(&pid)
            .is_none_or(|entry| !addrs.iter().all(|&addr| entry.maps.explains(addr)) && entry.tried_at.elapsed() >= entry.refresh_after);
        if stale {
            let before = self.processes.get(&pid).map(|entry| entry.maps.clone());
            if let Err(err) = self.reread(pid) {
                log::debug!("{err}");
            }
            let entry = self.entry(pid);
            if before.is_some_and(|before| Arc::ptr_eq(&before, &entry.maps)) {
                entry.refresh_after = (entry.refresh_after * 2).min(MAX_REFRESH_INTERVAL);
            }
        }
        &self.entry(pid).maps
    }

    /// `pid`'s latest snapshot, if its maps were ever read (never reads them).
    pub fn latest(&self, pid: u32) -> Option<&Arc<Maps>> {
        self.processes.get(&pid).map(|entry| &entry.maps)
    }

    /// `pid`'s latest snapshot, re-read first when `pc`, the instruction a sample ran, falls
    /// outside every executable mapping and they were not read in the last [`REFRESH_INTERVAL`].
    /// A sampled instruction is never junk, so code mapped since (a `dlopen`) shows within that
    /// interval, however far junk return addresses have had the samples' re-reads back off.
    /// None while its maps were never read (this does not read them first).
    pub fn explaining(&mut self, pid: u32, pc: u64) -> Option<&Arc<Maps>> {
        let entry = self.processes.get(&pid)?;
        if !entry.maps.explains(pc) && entry.tried_at.elapsed() >= REFRESH_INTERVAL {
            if let Err(err) = self.reread(pid) {
                log::debug!("{err}");
            }
        }
        self.latest(pid)
    }

    /// `pid`'s maps as read at most `age` ago, read now if older: for a reader that waits for a
    /// file to be mapped. Fails if they have to be read and cannot be.
    pub fn newer_than(&mut self, pid: u32, age: Duration) -> Result<&Arc<Maps>, MapsError> {
        if self.processes.get(&pid).is_none_or(|entry| entry.read_at.is_none_or(|read_at| read_at.elapsed() > age)) {
            self.reread(pid)?;
        }
        Ok(&self.entry(pid).maps)
    }

    /// Drops what is known of `pid`'s address space (it exited or replaced its program).
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    /// Reads `pid`'s maps into the cache; a failed read keeps the snapshot there was, and so
    /// does a read that finds the same mappings, so that what the readers built from it stands.
    fn reread(&mut self, pid: u32) -> Result<(), MapsError> {
        let read = Maps::read(pid);
        let entry = self.entry(pid);
        entry.tried_at = Instant::now();
        let read = read?;
        entry.read_at = Some(entry.tried_at);
        if read.mappings != entry.maps.mappings {
            entry.maps = Arc::new(read);
            entry.refresh_after = REFRESH_INTERVAL;
        }
        Ok(())
    }

    /// `pid`'s entry, made (without maps) if there is none.
    fn entry(&mut self, pid: u32) -> &mut Entry {
        if self.processes.len() >= MAX_PROCESSES && !self.processes.contains_key(&pid) {
            self.processes.clear();
        }
        self.processes.entry(pid).or_insert_with(|| Entry {
            maps: Arc::new(Maps::unknown()),
            tried_at: Instant::now(),
            read_at: None,
            refresh_after: REFRESH_INTERVAL,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PID no process has (above the kernel's `pid_max` limit).
    const NO_PROCESS: u32 = u32::MAX - 1;

    /// Code of its own: a body the same as another test's `marker` may be folded into one
    /// function, named after either.
    #[inline(never)]
    fn marker() -> u64 {
        std::hint::black_box(0x6d61_7073)
    }

    fn own_code() -> u64 {
        marker as fn() -> u64 as usize as u64
    }

    #[test]
    fn reads_this_process_sorted_with_its_own_code_and_vdso() {
        let maps = Maps::read(std::process::id()).unwrap();
        assert!(maps.mappings().windows(2).all(|pair| pair[0].limit <= pair[1].start), "sorted, apart");
        let code = maps.find(own_code()).expect("a mapping holds this function");
        assert!(code.is_executable());
        assert_eq!(code.file(), Some(std::env::current_exe().unwrap().as_path()));
        assert!(maps.executable().any(|mapping| mapping.contains(own_code())));
        assert!(maps.find(0).is_none());
        assert!(Maps::read_own().unwrap().mappings().iter().any(|mapping| mapping.path == MMapPath::Vdso && mapping.file().is_none()));
        assert!(matches!(Maps::read(NO_PROCESS), Err(MapsError::Unreadable { pid: NO_PROCESS, .. })));
    }

    #[test]
    fn an_unmapped_address_rereads_at_most_once_per_interval() {
        let pid = std::process::id();
        let mut cache = MapsCache::default();
        let first = cache.covering(pid, &[own_code()]).clone();
        assert!(Arc::ptr_eq(cache.covering(pid, &[own_code()]), &first), "mapped: not read again");
        // Neither in user space's first page nor in user space at all: no re-read would explain them.
        std::thread::sleep(REFRESH_INTERVAL);
        assert!(Arc::ptr_eq(cache.covering(pid, &[0x10, 1 << 60]), &first));

        // Executable memory mapped since: found once the interval has passed since the last read.
        let page = map_code_page();
        let before = cache.covering(pid, &[page]).clone();
        assert!(!Arc::ptr_eq(&before, &first) && before.find(page).is_some_and(Mapping::is_executable));
        assert!(Arc::ptr_eq(cache.covering(pid, &[page + 4096 * 1024]), &before), "read too recently");
    }

    #[test]
    fn rereads_that_find_nothing_new_come_less_often() {
        let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let pid = child.id();
        let mut cache = MapsCache::default();
        // Once asleep, `sleep` maps nothing more.
        let started = Instant::now();
        let first = loop {
            let read = cache.newer_than(pid, Duration::ZERO).unwrap().clone();
            std::thread::sleep(Duration::from_millis(20));
            if Arc::ptr_eq(cache.newer_than(pid, Duration::ZERO).unwrap(), &read) {
                break read;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "sleep kept mapping");
        };
        let tried = |cache: &MapsCache| cache.processes[&pid].tried_at;
        // Its stack, where a broken frame-pointer chain often ends: never code, so not read again.
        let stack = first.mappings().iter().find(|mapping| mapping.path == MMapPath::Stack).expect("sleep has a [stack] mapping");
        std::thread::sleep(REFRESH_INTERVAL);
        let read = tried(&cache);
        cache.covering(pid, &[stack.start + 8]);
        assert_eq!(tried(&cache), read, "read again for an address on the stack");
        // Junk (the page above the first, which nothing maps): read again, found the same, so the
        // next re-read waits twice as long.
        std::thread::sleep(REFRESH_INTERVAL);
        let read = tried(&cache);
        cache.covering(pid, &[0x2000]);
        let reread = tried(&cache);
        assert!(reread > read && Arc::ptr_eq(&cache.processes[&pid].maps, &first));
        std::thread::sleep(REFRESH_INTERVAL);
        cache.covering(pid, &[0x2000]);
        assert_eq!(tried(&cache), reread, "read again after one interval though the last re-read found nothing");
        std::thread::sleep(REFRESH_INTERVAL);
        cache.covering(pid, &[0x2000]);
        assert!(tried(&cache) > reread);
        assert_eq!(cache.processes[&pid].refresh_after, 4 * REFRESH_INTERVAL);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Junk return addresses had the samples' re-reads back off as far as they go; a sampled
    /// instruction in code mapped since has the maps re-read once the shortest interval has passed.
    #[test]
    fn a_sampled_instruction_in_new_code_rereads_whatever_the_back_off() {
        let pid = std::process::id();
        let mut cache = MapsCache::default();
        let first = cache.covering(pid, &[own_code()]).clone();
        let entry = cache.processes.get_mut(&pid).unwrap();
        entry.refresh_after = MAX_REFRESH_INTERVAL;
        entry.tried_at = Instant::now();
        assert!(Arc::ptr_eq(cache.explaining(pid, own_code()).unwrap(), &first), "a mapped instruction had the maps re-read");
        let page = map_code_page();
        assert!(cache.explaining(pid, page).is_some_and(|maps| maps.find(page).is_none()), "re-read within the shortest interval");
        std::thread::sleep(REFRESH_INTERVAL);
        assert!(Arc::ptr_eq(cache.covering(pid, &[page]), &first), "the samples' re-reads did not wait out their back-off");
        assert!(cache.explaining(pid, page).is_some_and(|maps| maps.find(page).is_some_and(Mapping::is_executable)), "new code not found");
        assert!(cache.explaining(NO_PROCESS, page).is_none(), "read maps never read before");
    }

    /// Maps a page of executable memory that stays for the rest of the test process.
    fn map_code_page() -> u64 {
        // SAFETY: a new anonymous mapping, placed by the kernel; nothing else refers to it.
        let page = unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_EXEC, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        assert_ne!(page, libc::MAP_FAILED);
        page as u64
    }

    #[test]
    fn a_reader_waiting_for_a_file_asks_for_recent_maps() {
        let pid = std::process::id();
        let mut cache = MapsCache::default();
        let first = cache.newer_than(pid, Duration::from_secs(3600)).unwrap().clone();
        assert!(Arc::ptr_eq(cache.newer_than(pid, Duration::from_secs(3600)).unwrap(), &first));
        let page = map_code_page();
        std::thread::sleep(Duration::from_millis(2));
        let recent = cache.newer_than(pid, Duration::from_millis(1)).unwrap().clone();
        assert!(!Arc::ptr_eq(&recent, &first) && recent.find(page).is_some(), "what was mapped since is not shown");
        assert!(Arc::ptr_eq(cache.covering(pid, &[own_code()]), &recent), "samples see the same snapshot");
        assert!(cache.newer_than(NO_PROCESS, Duration::ZERO).is_err());
    }

    #[test]
    fn maps_read_again_unchanged_keep_their_snapshot() {
        let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let pid = child.id();
        // The loader maps libraries after the exec; once asleep, `sleep` maps nothing more.
        let asleep =
            || std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('S')));
        let started = std::time::Instant::now();
        while !asleep() {
            assert!(started.elapsed() < Duration::from_secs(10), "sleep never went to sleep");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut cache = MapsCache::default();
        let first = cache.newer_than(pid, Duration::ZERO).unwrap().clone();
        // Read again (nothing asks for older ones), found the same: what readers built stands.
        assert!(Arc::ptr_eq(cache.newer_than(pid, Duration::ZERO).unwrap(), &first));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_process_that_exited_keeps_its_last_maps_until_forgotten() {
        let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let pid = child.id();
        let mut cache = MapsCache::default();
        let read = cache.covering(pid, &[]).clone();
        assert!(!read.mappings().is_empty());
        child.kill().unwrap();
        child.wait().unwrap();

        assert!(cache.newer_than(pid, Duration::ZERO).is_err());
        std::thread::sleep(REFRESH_INTERVAL);
        assert!(Arc::ptr_eq(cache.covering(pid, &[0x40_1000]), &read), "a failed read keeps the snapshot");
        cache.forget(pid);
        assert!(cache.covering(pid, &[]).mappings().is_empty());
    }

    #[test]
    fn the_cache_holds_a_bounded_number_of_processes() {
        let mut cache = MapsCache::default();
        for pid in (0..2 * MAX_PROCESSES as u32).map(|n| NO_PROCESS - n) {
            assert!(cache.covering(pid, &[0x40_1000]).mappings().is_empty());
            assert!(cache.processes.len() <= MAX_PROCESSES);
        }
    }
}
