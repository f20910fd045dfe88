//! Opening a file a target process names (a path in its `/proc/PID/maps`), without letting the
//! target choose what pyebpf opens. The target controls that path and everything along it: it can
//! unlink its mapped interpreter and put a FIFO at `NAME (deleted)` (a plain open blocks pyebpf
//! forever), or a symlink to a device (opening some has effects: a watchdog arms) or to a file
//! of the host (an absolute link is resolved from pyebpf's root, not the target's).
//!
//! So the path is resolved by `openat2` inside `/proc/PID/root` (`RESOLVE_IN_ROOT`: absolute links
//! and `..` stay in the target's root; no magic links), as an `O_PATH` handle, which opens nothing;
//! only a regular file is then opened for reading, through that handle, so no second lookup races.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// Opens `path`, as process `pid` names it, for reading, if it is a regular file.
pub fn open_in_root(pid: u32, path: &Path) -> io::Result<File> {
    let root = File::open(format!("/proc/{pid}/root"))?;
    let handle = openat2(&root, path.strip_prefix("/").unwrap_or(path), libc::O_PATH | libc::O_CLOEXEC)?;
    reopen_if_regular(handle, path)
}

/// Opens the file process `pid` maps at `start..limit` (inode `inode`, `path` in its maps), for
/// reading: through `map_files`, which reaches exactly the file mapped (also in containers and
/// after deletion) but needs CAP_SYS_ADMIN; otherwise by `path` inside the process's root, if that
/// is still the inode mapped (the target may have renamed another file over it since).
pub fn open_mapped(pid: u32, start: u64, limit: u64, path: &Path, inode: u64) -> io::Result<File> {
    use std::os::unix::fs::MetadataExt;
    if let Ok(file) = open_regular(Path::new(&format!("/proc/{pid}/map_files/{start:x}-{limit:x}"))) {
        return Ok(file);
    }
    let file = open_in_root(pid, path)?;
    if file.metadata()?.ino() != inode {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} is no longer the file process {pid} maps", path.display())));
    }
    Ok(file)
}

/// Opens `path` for reading if it is a regular file; anything else (a FIFO, a device) is refused
/// without being opened. For `/proc/PID/map_files/...` links, which lead to exactly the file a
/// process mapped, but which could be a device it mapped.
pub fn open_regular(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let handle = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(path)?;
    reopen_if_regular(handle.into(), path)
}

fn reopen_if_regular(handle: OwnedFd, path: &Path) -> io::Result<File> {
    let kind = File::from(handle.try_clone()?).metadata()?.file_type();
    if !kind.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} is not a regular file", path.display())));
    }
    // Reopening the O_PATH handle's own magic link opens exactly the inode checked above.
    File::open(format!("/proc/self/fd/{}", handle.as_raw_fd()))
}

fn openat2(dir: &File, path: &Path, flags: i32) -> io::Result<OwnedFd> {
    let path = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()))
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))?;
    // SAFETY: open_how is plain data; all-zero is valid, and the fields used are set below.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = flags as u64;
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: openat2 reads the path and `how` (of the size given) and returns a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_openat2, dir.as_raw_fd(), path.as_ptr(), &how as *const libc::open_how, size_of::<libc::open_how>()) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor openat2 just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_regular_files_and_refuses_fifos_devices_and_escapes() {
        let dir = tempfile::tempdir().unwrap();
        let pid = std::process::id();
        let file = dir.path().join("lib.so");
        std::fs::write(&file, b"ELF").unwrap();
        assert_eq!(std::io::read_to_string(open_in_root(pid, &file).unwrap()).unwrap(), "ELF");
        // A FIFO: refused at once rather than blocking.
        let fifo = dir.path().join("python3.99 (deleted)");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo reads a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(open_in_root(pid, &fifo).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        let device = dir.path().join("dev-link");
        std::os::unix::fs::symlink("/dev/null", &device).unwrap();
        assert_eq!(open_in_root(pid, &device).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        // A link through a magic link (/proc/self/...) is refused.
        let magic = dir.path().join("magic");
        std::os::unix::fs::symlink("/proc/self/exe", &magic).unwrap();
        assert!(open_in_root(pid, &magic).is_err());
    }

    #[test]
    fn open_mapped_refuses_another_file_renamed_over_the_mapped_path() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let (mapped, other) = (dir.path().join("lib.so"), dir.path().join("other.so"));
        std::fs::write(&mapped, b"mapped").unwrap();
        std::fs::write(&other, b"other").unwrap();
        let inode = std::fs::metadata(&mapped).unwrap().ino();
        let pid = std::process::id();
        // No mapping at 0-0, so the path inside the root is what is opened.
        assert_eq!(std::io::read_to_string(open_mapped(pid, 0, 0, &mapped, inode).unwrap()).unwrap(), "mapped");
        std::fs::rename(&other, &mapped).unwrap();
        assert_eq!(open_mapped(pid, 0, 0, &mapped, inode).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn open_regular_refuses_fifos_and_devices_without_opening_them() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("lib.so");
        std::fs::write(&file, b"ELF").unwrap();
        assert_eq!(std::io::read_to_string(open_regular(&file).unwrap()).unwrap(), "ELF");
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo reads a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(open_regular(&fifo).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(open_regular(Path::new("/dev/null")).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        // A map_files link of this process's own executable mapping.
        let maps = procfs::process::Process::myself().unwrap().maps().unwrap();
        let exe = maps.iter().find(|m| matches!(m.pathname, procfs::process::MMapPath::Path(_))).unwrap();
        let link = format!("/proc/self/map_files/{:x}-{:x}", exe.address.0, exe.address.1);
        assert!(open_regular(Path::new(&link)).unwrap().metadata().unwrap().is_file());
    }

    #[test]
    fn a_map_files_link_to_a_mapped_device_is_refused() {
        // Any user may map a device executable; its map_files link leads to the device itself.
        let zero = File::open("/dev/zero").unwrap();
        // SAFETY: a new shared read/exec mapping of /dev/zero, which this test never touches.
        let address = unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_EXEC, libc::MAP_SHARED, zero.as_raw_fd(), 0) };
        assert_ne!(address, libc::MAP_FAILED);
        let link = format!("/proc/self/map_files/{:x}-{:x}", address as u64, address as u64 + 4096);
        let error = open_regular(Path::new(&link)).unwrap_err();
        // SAFETY: unmaps exactly the mapping made above.
        unsafe { libc::munmap(address, 4096) };
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput, "{error}");
    }
}
