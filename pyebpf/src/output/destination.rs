//! Where `-o PATH` sends the profile, and writing it there without harming what is at PATH.
//!
//! - `-` is standard output. Binary pprof is refused on a terminal, be it standard output or a device.
//! - A character or block device or a FIFO (`/dev/null`, a pipe with a reader) is opened and written
//!   in place: it is never replaced.
//! - A regular file, or nothing, is replaced atomically. Symlinks are followed first, so a link stays a
//!   link and its target gets the profile. The profile goes into an unnamed `O_TMPFILE` in the
//!   target's directory. Only once it is complete does `linkat` give it a name, `.pyebpf-XXXXXX.tmp`,
//!   and `rename` moves it over the target. Where the file system has no `O_TMPFILE`, the temporary is
//!   named from the start. Either way a SIGKILL can leave a named temporary behind (for the whole
//!   write, or for the instant between link and rename). So each write first removes temporaries of
//!   exactly that name in its directory that are over a minute old and unlocked: every writer holds
//!   an exclusive `flock` on its temporary until the rename.
//! - A directory or a socket is refused.
//!
//! [`Destination::check`] runs before sampling and opens nothing: opening a FIFO for writing blocks
//! until it has a reader, and opening a device can have effects of its own. [`Destination::resolve`]
//! runs again when the profile is written, so the write acts on the node that is there then.

use std::ffi::{CString, OsStr};
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, BufWriter, IsTerminal, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::OutputFormat;

use super::OutputError;

/// The name of standard output in `-o`.
pub const STDOUT: &str = "-";

/// Temporaries are `.pyebpf-` + this many ASCII letters or digits + `.tmp`.
const TEMP_PREFIX: &str = ".pyebpf-";
const TEMP_SUFFIX: &str = ".tmp";
const TEMP_RANDOM_LEN: usize = 6;

/// A temporary untouched for this long whose writer holds no lock was left by a killed pyebpf.
const STALE_AFTER: Duration = Duration::from_secs(60);

/// As many links as the kernel follows in one path lookup before giving up with ELOOP.
const MAX_LINKS: usize = 40;

/// Profiles are readable by all, like other files the user creates (the umask still applies).
const FILE_MODE: u32 = 0o644;

#[derive(Debug, PartialEq, Eq)]
pub enum Destination {
    /// `-`.
    Stdout,
    /// A device or FIFO, written where it is.
    InPlace(PathBuf),
    /// The regular file (existing or not) to replace, symlinks already followed.
    Replace(PathBuf),
}

impl Destination {
    /// What `path` names now.
    pub fn resolve(path: &Path) -> Result<Destination, OutputError> {
        if super::is_stdout(path) {
            return Ok(Destination::Stdout);
        }
        // `metadata` follows links in the kernel, including /proc's fd links (`/dev/stdout`) whose
        // text is no path (`pipe:[1234]`).
        match fs::metadata(path) {
            Ok(meta) => {
                let kind = meta.file_type();
                if kind.is_dir() {
                    Err(OutputError::IsDirectory(path.to_path_buf()))
                } else if kind.is_file() {
                    fs::canonicalize(path).map(Destination::Replace).map_err(OutputError::io(path))
                } else if kind.is_char_device() || kind.is_block_device() || kind.is_fifo() {
                    Ok(Destination::InPlace(path.to_path_buf()))
                } else {
                    Err(OutputError::Socket(path.to_path_buf()))
                }
            }
            Err(err) if err.kind() == io::ErrorKind::NotFound => new_file_at(path).map(Destination::Replace),
            Err(err) => Err(OutputError::io(path)(err)),
        }
    }

    /// Checks, before sampling, that the profile can be written here; changes and opens nothing.
    pub fn check(&self, format: OutputFormat) -> Result<(), OutputError> {
        match self {
            Destination::Stdout => refuse_binary_on_terminal(&io::stdout(), format, Path::new(STDOUT)),
            Destination::InPlace(path) => {
                if format == OutputFormat::Pprof && is_terminal_device(path) {
                    return Err(OutputError::BinaryOnTerminal(path.to_path_buf()));
                }
                may_write(path, libc::W_OK)
            }
            Destination::Replace(path) => {
                // A new file is renamed into the directory; an existing file must also be writable,
                // or the user did not mean to have it replaced.
                refuse_pseudo_file_system(parent_dir(path))?;
                may_write(parent_dir(path), libc::W_OK | libc::X_OK)?;
                if fs::symlink_metadata(path).is_ok() {
                    may_write(path, libc::W_OK)?;
                }
                Ok(())
            }
        }
    }

    /// Writes what `encode` produces here; `path` is the name the user gave, for messages.
    pub fn write(&self, path: &Path, format: OutputFormat, encode: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<(), OutputError> {
        match self {
            Destination::Stdout => {
                let stdout = io::stdout();
                refuse_binary_on_terminal(&stdout, format, path)?;
                fill(stdout.lock(), encode).map_err(OutputError::io(path))
            }
            Destination::InPlace(target) => {
                // No O_CREAT, no O_TRUNC: the node exists and stays as it is; O_NOCTTY so a terminal
                // named here does not become pyebpf's controlling terminal.
                let file = OpenOptions::new().write(true).custom_flags(libc::O_NOCTTY).open(target).map_err(OutputError::io(target))?;
                refuse_binary_on_terminal(&file, format, path)?;
                fill(&file, encode).map_err(OutputError::io(target))
            }
            Destination::Replace(target) => replace(target, encode),
        }
    }
}

/// `-o PATH` where nothing is: a missing file, or the missing target of a symlink (chain), whose
/// directory must exist.
fn new_file_at(path: &Path) -> Result<PathBuf, OutputError> {
    let mut target = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        match fs::symlink_metadata(&target) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let link = fs::read_link(&target).map_err(OutputError::io(&target))?;
                target = parent_dir(&target).join(link);
            }
            // Something appeared since `metadata` found nothing: never replace what we did not look at.
            Ok(_) => return Err(OutputError::io(path)(io::ErrorKind::NotFound.into())),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                let dir = parent_dir(&target);
                if !dir.is_dir() {
                    return Err(OutputError::MissingDirectory(dir.to_path_buf()));
                }
                return Ok(target);
            }
            Err(err) => return Err(OutputError::io(&target)(err)),
        }
    }
    Err(OutputError::io(path)(io::Error::from_raw_os_error(libc::ELOOP)))
}

/// Writes the profile to a temporary in `target`'s directory and renames it over `target`.
fn replace(target: &Path, encode: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<(), OutputError> {
    let dir = parent_dir(target);
    remove_stale_temporaries(dir);
    match create_unnamed(dir).map_err(OutputError::io(dir))? {
        Some(file) => {
            // Locked before it has a name, so no cleanup ever takes it for abandoned.
            file.lock().map_err(OutputError::io(dir))?;
            fill(&file, encode).and_then(|()| give_to_invoking_user(&file)).and_then(|()| file.sync_all()).map_err(OutputError::io(target))?;
            let named = temp_names().make_in(dir, |name| link_unnamed(&file, name)).map_err(OutputError::io(dir))?;
            named.persist(target).map_err(|err| OutputError::io(target)(err.error))
        }
        None => {
            let named = temp_names().permissions(Permissions::from_mode(FILE_MODE)).tempfile_in(dir).map_err(OutputError::io(dir))?;
            named.as_file().lock().map_err(OutputError::io(dir))?;
            fill(named.as_file(), encode)
                .and_then(|()| give_to_invoking_user(named.as_file()))
                .and_then(|()| named.as_file().sync_all())
                .map_err(OutputError::io(target))?;
            named.persist(target).map(drop).map_err(|err| OutputError::io(target)(err.error))
        }
    }
}

/// Under sudo, the profile belongs to the user who ran sudo (`SUDO_UID`, `SUDO_GID`), not to root,
/// so they can move or delete it. Only files pyebpf creates: devices, FIFOs and `-` keep their owner.
fn give_to_invoking_user(file: &File) -> io::Result<()> {
    match invoking_user() {
        Some((uid, gid)) => std::os::unix::fs::fchown(file, Some(uid), Some(gid)),
        None => Ok(()),
    }
}

/// `SUDO_UID` and `SUDO_GID` when pyebpf runs as root and both are numbers.
fn invoking_user() -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let id = |name| std::env::var(name).ok()?.parse::<u32>().ok();
    Some((id("SUDO_UID")?, id("SUDO_GID")?))
}

/// An unnamed file in `dir`, or `None` where `O_TMPFILE` or the `/proc/self/fd` link to name it later
/// is missing.
fn create_unnamed(dir: &Path) -> io::Result<Option<File>> {
    if !Path::new("/proc/self/fd").is_dir() {
        return Ok(None);
    }
    match OpenOptions::new().write(true).mode(FILE_MODE).custom_flags(libc::O_TMPFILE).open(dir) {
        Ok(file) => Ok(Some(file)),
        // EOPNOTSUPP: the file system lacks it; EISDIR: the kernel predates it (3.11).
        Err(err) if matches!(err.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR)) => Ok(None),
        Err(err) => Err(err),
    }
}

/// Gives the unnamed `file` the name `name` (which must not exist).
fn link_unnamed(file: &File, name: &Path) -> io::Result<()> {
    let source = CString::new(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
    let name = CString::new(name.as_os_str().as_bytes())?;
    // SAFETY: both are valid NUL-terminated strings that outlive the call.
    let linked = unsafe { libc::linkat(libc::AT_FDCWD, source.as_ptr(), libc::AT_FDCWD, name.as_ptr(), libc::AT_SYMLINK_FOLLOW) };
    if linked == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn temp_names() -> tempfile::Builder<'static, 'static> {
    let mut builder = tempfile::Builder::new();
    builder.prefix(TEMP_PREFIX).suffix(TEMP_SUFFIX).rand_bytes(TEMP_RANDOM_LEN);
    builder
}

/// Removes the temporaries killed pyebpf runs left in `dir`. Best effort: a temporary that cannot be
/// removed is no reason to lose the profile.
fn remove_stale_temporaries(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if is_temporary_name(&entry.file_name()) {
            let _ = remove_if_abandoned(&entry.path());
        }
    }
}

fn is_temporary_name(name: &OsStr) -> bool {
    let Some(random) = name.to_str().and_then(|name| name.strip_prefix(TEMP_PREFIX)).and_then(|rest| rest.strip_suffix(TEMP_SUFFIX)) else {
        return false;
    };
    random.len() == TEMP_RANDOM_LEN && random.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// Removes `path` if it is a regular file, stale and not locked by a live writer.
fn remove_if_abandoned(path: &Path) -> io::Result<()> {
    // O_NOFOLLOW: never act through a link; O_NONBLOCK: never wait on a FIFO of that name.
    let file = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path)?;
    let meta = file.metadata()?;
    let age = meta.modified()?.elapsed().unwrap_or_default();
    if meta.is_file() && age > STALE_AFTER && file.try_lock().is_ok() {
        fs::remove_file(path)?;
    }
    Ok(())
}

fn fill(out: impl Write, encode: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> io::Result<()> {
    let mut out = BufWriter::new(out);
    encode(&mut out)?;
    out.flush()
}

fn refuse_binary_on_terminal(out: &impl IsTerminal, format: OutputFormat, path: &Path) -> Result<(), OutputError> {
    if format == OutputFormat::Pprof && out.is_terminal() {
        return Err(OutputError::BinaryOnTerminal(path.to_path_buf()));
    }
    Ok(())
}

/// Whether `path` is a terminal, told from its device number without opening it (the write checks
/// again on the open file): majors 4 and 5 are the virtual consoles, serial lines and `/dev/tty`,
/// 136 to 143 the pseudo-terminals (Linux's `devices.txt`).
fn is_terminal_device(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|meta| meta.file_type().is_char_device() && matches!(libc::major(meta.rdev()), 4 | 5 | 136..=143))
}

/// Whether this process may `mode` (`W_OK`, ...) `path`, as `open` would decide (effective ids), without opening it.
fn may_write(path: &Path, mode: libc::c_int) -> Result<(), OutputError> {
    let name = CString::new(path.as_os_str().as_bytes()).map_err(|err| OutputError::io(path)(err.into()))?;
    // SAFETY: `name` is a valid NUL-terminated string that outlives the call.
    if unsafe { libc::faccessat(libc::AT_FDCWD, name.as_ptr(), mode, libc::AT_EACCESS) } == 0 {
        Ok(())
    } else {
        Err(OutputError::io(path)(io::Error::last_os_error()))
    }
}

/// Kernel file systems (`statfs` magic numbers) whose directories take no new files: access()
/// says a root user may write there, and the temporary fails only once the recording is over.
const PSEUDO_FILE_SYSTEMS: [(u64, &str); 10] = [
    (0x9fa0, "proc"),
    (0x6265_6572, "sysfs"),
    (0x0027_e0eb, "cgroup"),
    (0x6367_7270, "cgroup2"),
    (0x6462_6720, "debugfs"),
    (0x7472_6163, "tracefs"),
    (0x7363_6673, "securityfs"),
    (0xcafe_4a11, "bpf"),
    (0x6165_676c, "pstore"),
    (0xde5e_81e4, "efivarfs"),
];

/// Refuses, before sampling, a directory on a kernel file system (`-o /proc/version`).
fn refuse_pseudo_file_system(dir: &Path) -> Result<(), OutputError> {
    let name = CString::new(dir.as_os_str().as_bytes()).map_err(|err| OutputError::io(dir)(err.into()))?;
    let mut stats = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `name` is a valid NUL-terminated string and `stats` a statfs to fill.
    if unsafe { libc::statfs(name.as_ptr(), stats.as_mut_ptr()) } != 0 {
        return Ok(()); // may_write names what is wrong with the directory
    }
    #[allow(clippy::unnecessary_cast)] // u64 to u64 on musl
    // SAFETY: filled by the successful call above.
    // `f_type` is signed in glibc and unsigned in musl; the magic numbers are positive in both.
    let magic = unsafe { stats.assume_init() }.f_type as u64;
    match PSEUDO_FILE_SYSTEMS.iter().find(|(kind, _)| *kind == magic) {
        Some(&(_, kind)) => Err(OutputError::PseudoFileSystem { path: dir.to_path_buf(), kind }),
        None => Ok(()),
    }
}

/// The directory a relative file name like `profile.pb.gz` lives in.
pub(super) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::os::unix::fs::symlink;
    use std::time::SystemTime;

    use super::*;

    fn names_in(dir: &Path) -> Vec<OsString> {
        let mut names: Vec<_> = fs::read_dir(dir).unwrap().map(|entry| entry.unwrap().file_name()).collect();
        names.sort();
        names
    }

    fn write_text(destination: &Destination, text: &str) -> Result<(), OutputError> {
        destination.write(Path::new("test"), OutputFormat::Collapsed, |out| out.write_all(text.as_bytes()))
    }

    fn mkfifo(path: &Path) {
        let name = CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0, "{}", io::Error::last_os_error());
    }

    #[test]
    fn dash_is_stdout_and_devices_and_fifos_are_written_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        assert_eq!(Destination::resolve(Path::new("-")).unwrap(), Destination::Stdout);
        assert_eq!(Destination::resolve(Path::new("/dev/null")).unwrap(), Destination::InPlace("/dev/null".into()));
        assert_eq!(Destination::resolve(&fifo).unwrap(), Destination::InPlace(fifo.clone()));
        // Checking a FIFO without a reader must not block.
        Destination::resolve(&fifo).unwrap().check(OutputFormat::Pprof).unwrap();
    }

    #[test]
    fn links_are_followed_to_their_target_even_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.folded");
        fs::write(&real, "old 1\n").unwrap();
        symlink("real.folded", dir.path().join("link")).unwrap();
        symlink("link", dir.path().join("link2")).unwrap();
        let canonical = fs::canonicalize(&real).unwrap();
        assert_eq!(Destination::resolve(&dir.path().join("link2")).unwrap(), Destination::Replace(canonical));
        symlink("missing.folded", dir.path().join("dangling")).unwrap();
        assert_eq!(Destination::resolve(&dir.path().join("dangling")).unwrap(), Destination::Replace(dir.path().join("missing.folded")));
        symlink("loop", dir.path().join("loop")).unwrap();
        assert!(matches!(Destination::resolve(&dir.path().join("loop")), Err(OutputError::Io { .. })));
    }

    #[test]
    fn directories_sockets_and_missing_directories_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(Destination::resolve(dir.path()), Err(OutputError::IsDirectory(_))));
        let socket = dir.path().join("sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        assert!(matches!(Destination::resolve(&socket), Err(OutputError::Socket(_))));
        let missing = dir.path().join("no/such/dir/profile.pb.gz");
        assert!(matches!(Destination::resolve(&missing), Err(OutputError::MissingDirectory(_))));
    }

    #[test]
    fn writing_through_a_link_keeps_the_link_and_leaves_no_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.folded");
        let link = dir.path().join("link.folded");
        fs::write(&real, "old 1\n").unwrap();
        symlink("real.folded", &link).unwrap();
        write_text(&Destination::resolve(&link).unwrap(), "new 2\n").unwrap();
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(fs::read_to_string(&real).unwrap(), "new 2\n");
        assert_eq!(names_in(dir.path()), ["link.folded", "real.folded"]);
    }

    #[test]
    fn a_fifo_is_written_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || fs::read_to_string(fifo).unwrap())
        };
        write_text(&Destination::resolve(&fifo).unwrap(), "a;b 3\n").unwrap();
        assert_eq!(reader.join().unwrap(), "a;b 3\n");
        assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    }

    #[test]
    fn stale_unlocked_temporaries_of_our_name_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let old = SystemTime::now() - 2 * STALE_AFTER;
        let make = |name: &str, modified: SystemTime| {
            let file = File::create(dir.path().join(name)).unwrap();
            file.set_modified(modified).unwrap();
            file
        };
        make(".pyebpf-abc123.tmp", old);
        make(".pyebpf-fresh1.tmp", SystemTime::now());
        let held = make(".pyebpf-held12.tmp", old);
        held.lock().unwrap();
        make(".pyebpf-toolong1.tmp", old);
        make("pyebpf-abc123.tmp", old);
        make(".pyebpf-abc12!.tmp", old);
        let target = dir.path().join("profile.folded");
        write_text(&Destination::resolve(&target).unwrap(), "x 1\n").unwrap();
        assert_eq!(
            names_in(dir.path()),
            [".pyebpf-abc12!.tmp", ".pyebpf-fresh1.tmp", ".pyebpf-held12.tmp", ".pyebpf-toolong1.tmp", "profile.folded", "pyebpf-abc123.tmp"]
        );
    }

    #[test]
    fn temporary_names_match_what_the_builder_makes() {
        let dir = tempfile::tempdir().unwrap();
        let named = temp_names().tempfile_in(dir.path()).unwrap();
        assert!(is_temporary_name(named.path().file_name().unwrap()), "{}", named.path().display());
    }
}
