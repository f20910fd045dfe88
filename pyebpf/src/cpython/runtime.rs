//! Finding `_PyRuntime` in a process: the Python executable or `libpython3.X.so` mapped in it,
//! opened inside `/proc/PID/root` (so containers work; see [`crate::target_file`]), its `.PyRuntime` section or `_PyRuntime`
//! symbol, plus the load bias of where the file is mapped.

use std::path::{Path, PathBuf};

use object::read::ReadCache;
use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol, ReadRef};
use procfs::process::{MMapPath, Process};

use super::offsets::PyVersion;
use super::PyError;

/// Largest ELF file read to look for the runtime.
const MAX_ELF_SIZE: u64 = 512 << 20;

/// Whether a mapped file looks like a CPython interpreter or its shared library.
fn is_python_file(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|name| name.starts_with("libpython3") || (name.starts_with("python3") && !name.ends_with(".py")))
}

/// Whether `pid` is gone: no /proc entry, or exiting or exited and not yet reaped (its /proc entry
/// stays but its memory is gone).
pub fn has_exited(pid: u32) -> bool {
    // PF_EXITING: set when the process starts to exit, before its memory goes (its maps read
    // empty from then on) and well before it shows as a zombie.
    const PF_EXITING: u32 = 0x4;
    let Ok(process) = Process::new(pid as i32) else { return true };
    process.stat().map_or(true, |stat| matches!(stat.state, 'Z' | 'X') || stat.flags & PF_EXITING != 0)
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
}

/// Finds `_PyRuntime` in `pid`.
pub fn find_runtime(pid: u32) -> Result<Runtime, PyError> {
    if has_exited(pid) {
        return Err(PyError::NoProcess(pid));
    }
    let process = Process::new(pid as i32).map_err(|err| process_error(pid, err))?;
    let maps = process.maps().map_err(|err| process_error(pid, err))?;
    let mut candidates: Vec<(PathBuf, u64)> = Vec::new();
    for map in maps.iter() {
        if let MMapPath::Path(path) = &map.pathname {
            if map.offset == 0 && is_python_file(path) && !candidates.iter().any(|(p, _)| p == path) {
                candidates.push((path.clone(), map.address.0));
            }
        }
    }
    // libpython first: where both are mapped, the executable only links it.
    candidates.sort_by_key(|(path, _)| !path.to_string_lossy().contains("libpython"));
    // An interpreter pyebpf may not open (a directory its user cannot enter) is named as such,
    // not taken for a process without Python.
    let mut unreadable = None;
    for (path, base) in &candidates {
        match runtime_in_file(pid, path, *base) {
            Ok(Some((address, version))) => return Ok(Runtime { address, file: path.clone(), version }),
            Err(cause) if cause.kind() == std::io::ErrorKind::PermissionDenied => {
                unreadable.get_or_insert_with(|| PyError::InterpreterUnreadable { pid, path: path.clone(), cause });
            }
            Ok(None) | Err(_) => {}
        }
    }
    if candidates.is_empty() && has_exited(pid) {
        // Its maps were read while it exited.
        return Err(PyError::NoProcess(pid));
    }
    Err(unreadable.unwrap_or(PyError::NotPython(pid)))
}

/// Why `/proc/PID` could not be read: the process is gone, or it is not ours to read.
fn process_error(pid: u32, err: procfs::ProcError) -> PyError {
    match err {
        procfs::ProcError::PermissionDenied(_) => PyError::PermissionDenied(pid),
        _ => PyError::NoProcess(pid),
    }
}

/// `_PyRuntime`'s address if the ELF file `pid` maps at `path` defines it, given where its first
/// page is mapped, and the file's `Py_Version`; an error only when the file cannot be opened.
fn runtime_in_file(pid: u32, path: &Path, mapped_at: u64) -> std::io::Result<Option<(u64, Option<PyVersion>)>> {
    let file = crate::target_file::open_in_root(pid, path)?;
    if file.metadata()?.len() > MAX_ELF_SIZE {
        return Ok(None);
    }
    // Read on demand: headers and symbol tables only, not the whole (often 8 MB) interpreter, for
    // every process attached.
    let data = ReadCache::new(file);
    Ok(runtime_in_elf(&data, mapped_at))
}

/// [`runtime_in_file`] on the file's bytes, however they are read (public for fuzzing).
pub fn runtime_in_elf<'data, R: ReadRef<'data>>(data: R, mapped_at: u64) -> Option<(u64, Option<PyVersion>)> {
    let elf = object::File::parse(data).ok()?;
    let runtime = elf.section_by_name(".PyRuntime").map(|section| section.address()).or_else(|| {
        elf.dynamic_symbols().chain(elf.symbols()).find(|symbol| symbol.name() == Ok("_PyRuntime") && symbol.is_definition()).map(|symbol| symbol.address())
    });
    // The first loadable segment (file offset 0) is mapped at `mapped_at`.
    let first_vaddr = elf.segments().map(|segment| segment.address()).min().unwrap_or(0) & !0xfff;
    let bias = mapped_at.wrapping_sub(first_vaddr);
    Some((runtime?.wrapping_add(bias), py_version(&elf)))
}

/// The constant `Py_Version` (`PY_VERSION_HEX`) as the file stores it.
fn py_version<'data, R: ReadRef<'data>>(elf: &object::File<'data, R>) -> Option<PyVersion> {
    let symbol = elf.dynamic_symbols().chain(elf.symbols()).find(|symbol| symbol.name() == Ok("Py_Version") && symbol.is_definition())?;
    let section = elf.section_by_index(symbol.section_index()?).ok()?;
    let bytes = section.data_range(symbol.address(), 4).ok()??;
    Some(PyVersion(u64::from(u32::from_le_bytes(bytes.try_into().ok()?))))
}
