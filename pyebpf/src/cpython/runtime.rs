//! Finding `_PyRuntime` in a process: the Python executable or `libpython3.X.so` mapped in it,
//! opened inside `/proc/PID/root` (so containers work; see [`crate::target_file`]), its `.PyRuntime` section or `_PyRuntime`
//! symbol, plus the load bias of where the file is mapped.

use std::collections::HashMap;
use std::fs::{File, Metadata};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};

use object::read::ReadCache;
use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol, ReadRef, SectionIndex};
use procfs::process::MMapPath;

use super::offsets::PyVersion;
use super::PyError;
use crate::maps::{Maps, MapsError};

/// Largest ELF file read to look for the runtime.
const MAX_ELF_SIZE: u64 = 512 << 20;

/// Interpreter files read, kept at most (all dropped at once beyond).
const MAX_KNOWN_FILES: usize = 256;

/// What each interpreter file read holds ([`ElfFacts`]), by the file's identity and version: a host
/// that starts the same interpreter again and again (cron jobs, command-line tools) has each new
/// process cost a `stat` here, not a parse of the file's symbol tables.
static KNOWN_FILES: LazyLock<Mutex<HashMap<FileKey, Option<ElfFacts>>>> = LazyLock::new(Mutex::default);

/// A file's identity and version: a file written since (in place or replaced) has another
/// size, modification or status-change time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FileKey {
    dev: u64,
    inode: u64,
    size: u64,
    modified_ns: i128,
    changed_ns: i128,
}

impl FileKey {
    fn of(metadata: &Metadata) -> FileKey {
        let ns = |secs: i64, nanos: i64| i128::from(secs) * 1_000_000_000 + i128::from(nanos);
        FileKey {
            dev: metadata.dev(),
            inode: metadata.ino(),
            size: metadata.len(),
            modified_ns: ns(metadata.mtime(), metadata.mtime_nsec()),
            changed_ns: ns(metadata.ctime(), metadata.ctime_nsec()),
        }
    }
}

/// Whether a mapped file looks like a CPython interpreter or its shared library (Python 2 and 3,
/// so that versions pyebpf does not read are named as such).
pub(super) fn is_python_file(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|name| {
        let name = name.strip_prefix("lib").unwrap_or(name);
        (name.starts_with("python3") || name.starts_with("python2")) && !name.ends_with(".py")
    })
}

/// Whether `maps` map a file named as an interpreter or `libpython`.
pub fn maps_python_file(maps: &Maps) -> bool {
    !mapped_files(maps, is_python_file).is_empty()
}

/// Whether `addr` lies in the code of a file `maps` map that is named as an interpreter or
/// `libpython`.
pub fn is_python_code(maps: &Maps, addr: u64) -> bool {
    maps.find(addr).filter(|mapping| mapping.is_executable()).and_then(|mapping| mapping.file()).is_some_and(is_python_file)
}

/// The `MAJOR.MINOR` in an interpreter's file name (`python3.8`, `libpython2.7.so.1.0`,
/// `python3.12d`), for versions without `Py_Version` (before 3.11).
fn version_in_name(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    let rest = name.strip_prefix("lib").unwrap_or(name).strip_prefix("python")?;
    let (major, rest) = rest.split_once('.')?;
    let minor: String = rest.chars().take_while(char::is_ascii_digit).collect();
    (matches!(major, "2" | "3") && !minor.is_empty()).then(|| format!("{major}.{minor}"))
}

/// Whether `pid` is gone: no /proc entry, or exiting or exited and not yet reaped (its /proc entry
/// stays but its memory is gone).
pub fn has_exited(pid: u32) -> bool {
    // PF_EXITING: set when the process starts to exit, before its memory goes (its maps read
    // empty from then on) and well before it shows as a zombie.
    const PF_EXITING: u32 = 0x4;
    crate::process::stat(pid).map_or(true, |stat| matches!(stat.state, 'Z' | 'X') || stat.flags & PF_EXITING != 0)
}

/// Where a process keeps its runtime state.
#[derive(Clone, Debug)]
pub struct Runtime {
    /// Address of `_PyRuntime` in the process.
    pub address: u64,
    /// The ELF file defining it, as the process maps it.
    pub file: PathBuf,
    /// The file's `Py_Version` (CPython 3.11+), which names versions too old to have debug offsets.
    pub version: Option<PyVersion>,
    /// `MAJOR.MINOR` from the file's name, for older versions.
    pub named_version: Option<String>,
}

/// Finds `_PyRuntime` in `pid`, whose maps are read now.
pub fn find_runtime(pid: u32) -> Result<Runtime, PyError> {
    find_runtime_in(pid, &Maps::read(pid)?)
}

/// Finds `_PyRuntime` in `pid`, in the files its `maps` name.
pub fn find_runtime_in(pid: u32, maps: &Maps) -> Result<Runtime, PyError> {
    let mut candidates = mapped_files(maps, is_python_file);
    // Maps read while the process exited may name nothing: asked once, either way.
    if has_exited(pid) {
        return Err(PyError::NoProcess(pid));
    }
    if candidates.is_empty() {
        return Err(PyError::NotPython(pid));
    }
    // libpython first: where both are mapped, the executable only links it.
    candidates.sort_by_key(|(path, _)| !path.to_string_lossy().contains("libpython"));
    // An interpreter pyebpf may not open (a directory its user cannot enter) is named as such,
    // not taken for a process without Python.
    let mut unreadable = None;
    // An interpreter without `_PyRuntime` (2.7, 3.6) is named by its version.
    let mut older = None;
    for (path, base) in &candidates {
        match runtime_in_file(pid, path, *base) {
            Ok(Some(PythonElf { runtime: Some(address), version, .. })) => {
                return Ok(Runtime { address, file: path.clone(), version, named_version: version_in_name(path) })
            }
            Ok(Some(PythonElf { runtime: None, embeds_python: true, .. })) => {
                older = older.or_else(|| version_in_name(path));
            }
            Err(cause) if cause.kind() == std::io::ErrorKind::PermissionDenied => {
                unreadable.get_or_insert_with(|| PyError::InterpreterUnreadable { pid, path: path.clone(), cause });
            }
            Ok(_) | Err(_) => {}
        }
    }
    Err(unreadable.or(older.map(PyError::UnsupportedRelease)).unwrap_or(PyError::NotPython(pid)))
}

/// The files in `maps` that `keep` accepts, each once, with where its first page is mapped.
pub(super) fn mapped_files(maps: &Maps, keep: impl Fn(&Path) -> bool) -> Vec<(PathBuf, u64)> {
    let mut files: Vec<(PathBuf, u64)> = Vec::new();
    for map in maps.mappings() {
        if let MMapPath::Path(path) = &map.path {
            if map.offset == 0 && keep(path) && !files.iter().any(|(p, _)| p == path) {
                files.push((path.clone(), map.start));
            }
        }
    }
    files
}

/// Why `/proc/PID/maps` could not be read: the process is gone, or it is not ours to read.
impl From<MapsError> for PyError {
    fn from(err: MapsError) -> PyError {
        match err {
            MapsError::PermissionDenied(pid) => PyError::PermissionDenied(pid),
            MapsError::Unreadable { pid, .. } => PyError::NoProcess(pid),
        }
    }
}

/// What an ELF file holds of CPython.
#[derive(Clone, Copy, Debug)]
pub struct PythonElf {
    /// `_PyRuntime`'s address where the file is mapped (CPython 3.7+).
    pub runtime: Option<u64>,
    /// The file's `Py_Version` (CPython 3.11+).
    pub version: Option<PyVersion>,
    /// Whether it defines `Py_Initialize`: an interpreter of any version, not only a file named like one.
    pub embeds_python: bool,
}

/// What the ELF file `pid` maps at `path` holds of CPython, given where its first page is mapped;
/// `None` if it is not ELF, an error only when the file cannot be opened. Read once per file
/// ([`KNOWN_FILES`]).
fn runtime_in_file(pid: u32, path: &Path, mapped_at: u64) -> std::io::Result<Option<PythonElf>> {
    let Some((file, metadata)) = open_bounded(pid, path)? else { return Ok(None) };
    let key = FileKey::of(&metadata);
    let known = KNOWN_FILES.lock().ok().and_then(|files| files.get(&key).copied());
    let facts = known.unwrap_or_else(|| {
        let facts = elf_facts(&ReadCache::new(file));
        if let Ok(mut files) = KNOWN_FILES.lock() {
            if files.len() >= MAX_KNOWN_FILES {
                files.clear();
            }
            files.insert(key, facts);
        }
        facts
    });
    Ok(facts.map(|facts| facts.mapped_at(mapped_at)))
}

/// The file `pid` maps at `path`, opened in its root to be read on demand (headers and the tables
/// looked at only, not the whole, often 8 MB, interpreter); `None` past `MAX_ELF_SIZE`.
pub(super) fn open_elf(pid: u32, path: &Path) -> std::io::Result<Option<ReadCache<File>>> {
    Ok(open_bounded(pid, path)?.map(|(file, _)| ReadCache::new(file)))
}

/// The file `pid` maps at `path`, opened in its root, with its metadata; `None` past
/// `MAX_ELF_SIZE`.
fn open_bounded(pid: u32, path: &Path) -> std::io::Result<Option<(File, Metadata)>> {
    let file = crate::target_file::open_in_root(pid, path)?;
    let metadata = file.metadata()?;
    Ok((metadata.len() <= MAX_ELF_SIZE).then_some((file, metadata)))
}

/// [`runtime_in_file`] on the file's bytes, however they are read (public for fuzzing).
pub fn runtime_in_elf<'data, R: ReadRef<'data>>(data: R, mapped_at: u64) -> Option<PythonElf> {
    elf_facts(data).map(|facts| facts.mapped_at(mapped_at))
}

/// What an ELF file holds of CPython, at the file's own addresses: the same in every process.
#[derive(Clone, Copy, Debug)]
struct ElfFacts {
    runtime: Option<u64>,
    version: Option<PyVersion>,
    embeds_python: bool,
    /// The page of the first loadable segment, which is mapped where the file's first page is.
    first_page: u64,
}

impl ElfFacts {
    fn mapped_at(&self, mapped_at: u64) -> PythonElf {
        let bias = mapped_at.wrapping_sub(self.first_page);
        PythonElf { runtime: self.runtime.map(|address| address.wrapping_add(bias)), version: self.version, embeds_python: self.embeds_python }
    }
}

fn elf_facts<'data, R: ReadRef<'data>>(data: R) -> Option<ElfFacts> {
    let elf = object::File::parse(data).ok()?;
    let symbols = CPythonSymbols::of(&elf);
    let runtime = elf.section_by_name(".PyRuntime").map(|section| section.address()).or(symbols.runtime);
    Some(ElfFacts {
        runtime,
        version: symbols.py_version.and_then(|(section, address)| py_version(&elf, data, section, address)),
        embeds_python: symbols.initialize,
        first_page: first_page(&elf),
    })
}

/// The symbols of CPython's looked for, each the first definition of its name among the dynamic
/// symbols and then the others, found in one pass that ends once all are.
#[derive(Default)]
struct CPythonSymbols {
    runtime: Option<u64>,
    py_version: Option<(SectionIndex, u64)>,
    initialize: bool,
}

impl CPythonSymbols {
    fn of<'data, R: ReadRef<'data>>(elf: &object::File<'data, R>) -> CPythonSymbols {
        let mut found = CPythonSymbols::default();
        for symbol in elf.dynamic_symbols().chain(elf.symbols()) {
            if !symbol.is_definition() {
                continue;
            }
            match symbol.name() {
                Ok("_PyRuntime") => {
                    found.runtime.get_or_insert(symbol.address());
                }
                Ok("Py_Version") => {
                    if found.py_version.is_none() {
                        found.py_version = symbol.section_index().map(|section| (section, symbol.address()));
                    }
                }
                Ok("Py_Initialize") => found.initialize = true,
                _ => continue,
            }
            if found.runtime.is_some() && found.py_version.is_some() && found.initialize {
                break;
            }
        }
        found
    }
}

/// What to add to the file's addresses to get where they are mapped, given where its first page
/// is: the first loadable segment (file offset 0) is mapped at `mapped_at`.
pub(super) fn load_bias<'data, R: ReadRef<'data>>(elf: &object::File<'data, R>, mapped_at: u64) -> u64 {
    mapped_at.wrapping_sub(first_page(elf))
}

fn first_page<'data, R: ReadRef<'data>>(elf: &object::File<'data, R>) -> u64 {
    elf.segments().map(|segment| segment.address()).min().unwrap_or(0) & !0xfff
}

/// The constant `Py_Version` (`PY_VERSION_HEX`) as the file stores it at `address` of `section`,
/// read alone: its section (`.rodata`, megabytes in a static interpreter) is not read whole.
fn py_version<'data, R: ReadRef<'data>>(elf: &object::File<'data, R>, data: R, section: SectionIndex, address: u64) -> Option<PyVersion> {
    let section = elf.section_by_index(section).ok()?;
    let (offset, size) = section.file_range()?;
    let within = address.checked_sub(section.address())?;
    if within.checked_add(4)? > size {
        return None;
    }
    let bytes = data.read_bytes_at(offset.checked_add(within)?, 4).ok()?;
    Some(PyVersion(u64::from(u32::from_le_bytes(bytes.try_into().ok()?))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_interpreter_names() {
        for (name, version) in [
            ("python3.8", Some("3.8")),
            ("libpython3.10.so.1.0", Some("3.10")),
            ("python2.7", Some("2.7")),
            ("libpython2.7.so.1.0", Some("2.7")),
            ("python3.12d", Some("3.12")),
            ("python3", None),
            ("python3.x", None),
            ("python4.1", None),
            ("pythonista", None),
        ] {
            assert_eq!(version_in_name(Path::new("/usr/bin").join(name).as_path()).as_deref(), version, "{name}");
        }
        assert!(is_python_file(Path::new("/usr/lib/libpython2.7.so.1.0")));
        assert!(!is_python_file(Path::new("/srv/python3_app.py")));
        assert!(!is_python_file(Path::new("/usr/bin/perl")));
    }

    #[test]
    fn an_interpreter_file_is_read_once_until_it_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("python3.11");
        std::fs::copy("/usr/bin/python3.11", &copy).unwrap();
        let pid = std::process::id();
        let first = runtime_in_file(pid, &copy, 0x5555_0000_0000).unwrap().expect("Debian's python3.11 is ELF");
        assert!(first.runtime.is_some() && first.version.is_some() && first.embeds_python, "{first:?}");
        assert!(KNOWN_FILES.lock().unwrap().contains_key(&FileKey::of(&std::fs::metadata(&copy).unwrap())));
        // Known, mapped elsewhere: moved with it.
        let moved = runtime_in_file(pid, &copy, 0x5555_0010_0000).unwrap().unwrap();
        assert_eq!(moved.runtime.unwrap().wrapping_sub(first.runtime.unwrap()), 0x10_0000);
        // Written in place: what is known of it no longer holds.
        std::fs::write(&copy, b"not an ELF file").unwrap();
        assert!(runtime_in_file(pid, &copy, 0x5555_0000_0000).unwrap().is_none());
    }
}
