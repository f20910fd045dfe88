//! Finding `_PyRuntime` in a process: the Python executable or `libpython3.X.so` mapped in it,
//! opened through `/proc/PID/root` (so containers work), its `.PyRuntime` section or `_PyRuntime`
//! symbol, plus the load bias of where the file is mapped.

use std::path::{Path, PathBuf};

use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol};
use procfs::process::{MMapPath, Process};

use super::PyError;

/// Largest ELF file read to look for the runtime.
const MAX_ELF_SIZE: u64 = 512 << 20;

/// Whether a mapped file looks like a CPython interpreter or its shared library.
fn is_python_file(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|name| {
        name.starts_with("libpython3") || (name.starts_with("python3") && !name.ends_with(".py"))
    })
}

/// The address of `_PyRuntime` in `pid`.
pub fn find_runtime(pid: u32) -> Result<u64, PyError> {
    let process = Process::new(pid as i32).map_err(|_| PyError::NoProcess(pid))?;
    let maps = process.maps().map_err(|_| PyError::NoProcess(pid))?;
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
    for (path, base) in &candidates {
        let file = PathBuf::from(format!("/proc/{pid}/root")).join(path.strip_prefix("/").unwrap_or(path));
        if let Some(addr) = runtime_in_file(&file, *base)? {
            return Ok(addr);
        }
    }
    Err(PyError::NotPython(pid))
}

/// `_PyRuntime`'s address if this ELF file defines it, given where its first page is mapped.
fn runtime_in_file(file: &Path, mapped_at: u64) -> Result<Option<u64>, PyError> {
    let Ok(meta) = std::fs::metadata(file) else { return Ok(None) };
    if meta.len() > MAX_ELF_SIZE {
        return Ok(None);
    }
    let Ok(data) = std::fs::read(file) else { return Ok(None) };
    let Ok(elf) = object::File::parse(&*data) else { return Ok(None) };
    let runtime = elf
        .section_by_name(".PyRuntime")
        .map(|section| section.address())
        .or_else(|| {
            elf.dynamic_symbols()
                .chain(elf.symbols())
                .find(|symbol| symbol.name() == Ok("_PyRuntime") && symbol.is_definition())
                .map(|symbol| symbol.address())
        });
    let Some(runtime) = runtime else { return Ok(None) };
    // The first loadable segment (file offset 0) is mapped at `mapped_at`.
    let first_vaddr = elf.segments().map(|segment| segment.address()).min().unwrap_or(0) & !0xfff;
    let bias = mapped_at.wrapping_sub(first_vaddr);
    Ok(Some(runtime.wrapping_add(bias)))
}
