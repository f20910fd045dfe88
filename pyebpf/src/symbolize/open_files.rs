//! The mapped files blazesym reads, each opened by pyebpf itself and handed to blazesym only as
//! `/proc/self/fd/N`.
//!
//! blazesym opens files by path. A path a target names can be swapped (for a FIFO that blocks the
//! open forever, a device, another file) between any check pyebpf makes and blazesym's open, and
//! `map_files` names an address range, which can be remapped. So pyebpf opens the file itself, as a
//! regular file ([`crate::target_file`]), and keeps the descriptor: its own magic link leads to that
//! open file and nothing else for as long as the descriptor lives. blazesym keeps what it opened
//! under the path and never looks again (auto-reload is off), so the path must never name another
//! file while blazesym remembers it: blazesym forgets the path before the descriptor is closed.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use blazesym::symbolize::evict::{self, Evict};

use super::debug_file::{DebugSymbols, DEBUG_ROOT};
use super::symbol_gaps::SymbolBounds;
use super::FileId;
use crate::target_file;

/// Where a process maps a file, which is how pyebpf opens it.
pub(super) struct Location<'a> {
    pub pid: u32,
    pub start: u64,
    pub limit: u64,
    pub path: &'a Path,
}

/// A file pyebpf holds open, and the one path that reaches it.
struct OpenFile {
    file: File,
    path: PathBuf,
    size: u64,
    /// Whether blazesym may follow its debug link, once decided.
    debug_syms: Option<bool>,
    /// Its functions from its separate debug file, once looked for.
    debug_symbols: Option<Option<DebugSymbols>>,
    /// Where its own symbols lie, once an address was found in none.
    symbol_bounds: Option<Option<SymbolBounds>>,
}

impl OpenFile {
    fn new(file: File) -> OpenFile {
        let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        let size = file.metadata().map_or(0, |metadata| metadata.len());
        OpenFile { file, path, size, debug_syms: None, debug_symbols: None, symbol_bounds: None }
    }

    fn open(location: &Location, id: FileId) -> io::Result<OpenFile> {
        let Location { pid, start, limit, path } = *location;
        Ok(OpenFile::new(target_file::open_mapped(pid, start, limit, path, id.inode)?))
    }
}

/// The files open for blazesym, by identity.
pub(super) struct OpenFiles {
    files: HashMap<FileId, OpenFile>,
    /// The open files' sizes, added up.
    bytes: u64,
    /// Where separate debug files are looked for.
    debug_root: PathBuf,
}

impl Default for OpenFiles {
    fn default() -> Self {
        OpenFiles::with_debug_root(DEBUG_ROOT.into())
    }
}

impl OpenFiles {
    pub fn with_debug_root(debug_root: PathBuf) -> OpenFiles {
        OpenFiles { files: HashMap::new(), bytes: 0, debug_root }
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The path blazesym reaches file `id` by, opening the file where `location` says first.
    pub fn path(&mut self, id: FileId, location: &Location) -> io::Result<&Path> {
        let file = match self.files.entry(id) {
            Entry::Occupied(entry) => entry.into_mut(),
            Entry::Vacant(entry) => {
                let file = OpenFile::open(location, id)?;
                self.bytes += file.size;
                entry.insert(file)
            }
        };
        Ok(&file.path)
    }

    /// Whether blazesym may follow file `id`'s debug link ([`super::may_follow_debug_link`]):
    /// decided when blazesym first reads the file, as it never reads it again (and the check
    /// walks the file's path, a dozen system calls, too many for every new address).
    pub fn debug_syms(&mut self, id: FileId) -> bool {
        let Some(file) = self.files.get_mut(&id) else { return false };
        *file.debug_syms.get_or_insert_with(|| super::may_follow_debug_link(&file.path, id))
    }

    /// File `id`'s functions from its separate debug file ([`super::debug_file`]), looked for
    /// when the file is first symbolized.
    pub fn debug_symbols(&mut self, id: FileId) -> Option<&DebugSymbols> {
        let root = &self.debug_root;
        let file = self.files.get_mut(&id)?;
        file.debug_symbols.get_or_insert_with(|| DebugSymbols::find(root, &file.file)).as_ref()
    }

    /// Where file `id`'s own symbols lie ([`super::symbol_gaps`]), read the first time it is asked.
    pub fn symbol_bounds(&mut self, id: FileId) -> Option<&SymbolBounds> {
        let file = self.files.get_mut(&id)?;
        file.symbol_bounds.get_or_insert_with(|| SymbolBounds::read(&file.file)).as_ref()
    }

    /// The file's GNU build ID, read from the open file, or from one opened for this alone.
    pub fn build_id(&self, id: FileId, location: &Location) -> Option<Vec<u8>> {
        let opened;
        let file = match self.files.get(&id) {
            Some(file) => file,
            None => {
                opened = OpenFile::open(location, id).ok()?;
                &opened
            }
        };
        blazesym::helper::read_elf_build_id(&file.path).ok().flatten().map(|build_id| build_id.into_owned())
    }

    /// Closes file `id`, once blazesym has forgotten its path.
    pub fn close(&mut self, blazesym: &mut blazesym::symbolize::Symbolizer, id: FileId) {
        if let Some(file) = self.files.remove(&id) {
            self.bytes = self.bytes.saturating_sub(file.size);
            forget(blazesym, &file);
        }
    }

    /// Closes every file, once blazesym has forgotten its path.
    pub fn close_all(&mut self, blazesym: &mut blazesym::symbolize::Symbolizer) {
        for (_, file) in self.files.drain() {
            forget(blazesym, &file);
        }
        self.bytes = 0;
    }
}

fn forget(blazesym: &mut blazesym::symbolize::Symbolizer, file: &OpenFile) {
    // blazesym 0.2 returns no error for an ELF path; one it does not know is a no-op.
    let _ = blazesym.evict(&Evict::Elf(evict::Elf::new(file.path.clone())));
}

#[cfg(test)]
mod tests {
    use std::os::fd::FromRawFd;
    use std::os::unix::fs::MetadataExt;
    use std::process::Command;

    use blazesym::symbolize::source::{Elf, Source};
    use blazesym::symbolize::Input;
    use object::{Object, ObjectSymbol};

    use super::*;

    /// A shared library defining `function`, built into `dir`.
    fn library(dir: &Path, function: &str) -> PathBuf {
        let source = dir.join(format!("{function}.c"));
        std::fs::write(&source, format!("int {function}(int x) {{ return x * 3; }}\n")).unwrap();
        let library = dir.join(format!("lib{function}.so"));
        let status = Command::new("gcc").args(["-shared", "-fPIC", "-O1", "-o"]).arg(&library).arg(&source).status().expect("gcc runs");
        assert!(status.success());
        library
    }

    /// `path` opened at the lowest free descriptor from 900 up, which nothing else in the tests
    /// uses, so a number freed there is the next one given.
    fn open_high(path: &Path) -> (FileId, File) {
        let file = File::open(path).unwrap();
        // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor this function owns.
        let high = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 900) };
        assert!(high >= 900, "F_DUPFD_CLOEXEC: {}", io::Error::last_os_error());
        // SAFETY: a descriptor fcntl just made, owned by nobody else.
        let file = unsafe { File::from_raw_fd(high) };
        let metadata = file.metadata().unwrap();
        let id = FileId { dev: (libc::major(metadata.dev()) as i32, libc::minor(metadata.dev()) as i32), inode: metadata.ino() };
        (id, file)
    }

    /// The function blazesym finds at `function`'s address in `library`, reading it as `path`.
    fn name_at(blazesym: &blazesym::symbolize::Symbolizer, path: &Path, library: &Path, function: &str) -> Option<String> {
        let data = std::fs::read(library).unwrap();
        let address = object::File::parse(&*data).unwrap().symbols().find(|symbol| symbol.name() == Ok(function)).unwrap().address();
        let results = blazesym.symbolize(&Source::Elf(Elf::new(path)), Input::VirtOffset(&[address])).unwrap();
        results[0].as_sym().map(|sym| sym.name.to_string())
    }

    #[test]
    fn a_closed_file_is_forgotten_before_its_number_can_name_another() {
        let dir = tempfile::tempdir().unwrap();
        let (first, second) = (library(dir.path(), "first_fn"), library(dir.path(), "second_fn"));
        let mut blazesym = blazesym::symbolize::Symbolizer::builder().enable_auto_reload(false).build();
        let mut files = OpenFiles::default();

        let (id, file) = open_high(&first);
        files.files.insert(id, OpenFile::new(file));
        let path = files.files[&id].path.clone();
        assert_eq!(name_at(&blazesym, &path, &first, "first_fn").as_deref(), Some("first_fn"));
        files.close(&mut blazesym, id);

        let (id, file) = open_high(&second);
        files.files.insert(id, OpenFile::new(file));
        assert_eq!(files.files[&id].path, path, "the number was not given again: the test shows nothing");
        assert_eq!(name_at(&blazesym, &path, &second, "second_fn").as_deref(), Some("second_fn"));
    }
}
