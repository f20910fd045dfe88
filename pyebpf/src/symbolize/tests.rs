use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

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

const EVAL_LOOP_PROGRAM: &str = r#"
#include <stdio.h>
#include <unistd.h>
volatile unsigned long sink;
static inline __attribute__((always_inline)) void step(int i) { sink += i * 3; }
__attribute__((noinline)) void _PyEval_EvalFrameDefault(void) { for (int i = 0; i < 1000; i++) { step(i); sink ^= i; } }
__attribute__((noinline)) void other_fn(void) { for (int i = 0; i < 1000; i++) { step(i); sink ^= i; } }
int main(void) {
printf("%lx %lx\n", (unsigned long)&_PyEval_EvalFrameDefault, (unsigned long)&other_fn);
fflush(stdout);
for (;;) pause();
}
"#;

/// A symbolizer with its own maps, as a sample resolver pairs them: symbol tables only, as by
/// default.
#[derive(Default)]
struct Resolving {
    symbolizer: Symbolizer,
    maps: MapsCache,
}

impl Resolving {
    /// One that reads lines and inlined calls from DWARF too (`--native-lines`).
    fn with_lines() -> Resolving {
        Resolving { symbolizer: Symbolizer::new(true), maps: MapsCache::default() }
    }

    fn user_frames(&mut self, pid: u32, stack: &[u64]) -> Vec<NativeFrame> {
        self.symbolizer.user_frames(&mut self.maps, pid, stack)
    }
}

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

    // As bpf_get_stack gives them: the sampled IP, then return addresses just past each call.
    let stack = [leaf + 1, middle + 5, outer + 5];
    let frames = Resolving::with_lines().user_frames(program.pid(), &stack);
    assert_eq!(names(&frames), ["leaf_fn", "middle_fn", "outer_fn"], "{frames:#?}");
    let module = frames[0].module.as_ref().expect("module of a mapped address");
    assert_eq!(Path::new(&*module.path), exe);
    assert!(module.build_id.as_ref().is_some_and(|id| id.len() == 40), "GNU build ID: {module:?}");
    assert!(frames[0].file.as_deref().is_some_and(|file| file.ends_with("spin.c")), "{:?}", frames[0]);
    assert_eq!(frames[0].line, Some(5));
    // Return addresses are reported at the call instruction, one byte back.
    assert_eq!(frames[1].addr, middle + 4);

    // By default the same frames come from the symbol table alone: names, no files or lines.
    let named = Resolving::default().user_frames(program.pid(), &stack);
    assert_eq!(names(&named), ["leaf_fn", "middle_fn", "outer_fn"], "{named:#?}");
    assert!(named.iter().all(|frame| frame.file.is_none() && frame.line.is_none()), "{named:#?}");
    assert_eq!(named.iter().map(|frame| frame.addr).collect::<Vec<_>>(), frames.iter().map(|frame| frame.addr).collect::<Vec<_>>());
}

/// [`PROGRAM`] built into `dir` with its functions exported, and a stripped copy of it.
fn program_and_stripped_copy(dir: &Path) -> (PathBuf, PathBuf) {
    let exe = compile("gcc", PROGRAM, "spin", &["-O1", "-fno-omit-frame-pointer", "-rdynamic"], dir);
    let stripped = dir.join("spin-stripped");
    let status = Command::new("strip").arg("-o").arg(&stripped).arg(&exe).status().expect("strip (binutils) runs");
    assert!(status.success());
    (exe, stripped)
}

#[test]
fn stripped_code_shows_its_module_and_file_offset() {
    let dir = tempfile::tempdir().unwrap();
    let (exe, stripped) = program_and_stripped_copy(dir.path());
    let mut program = Running::start(&stripped);
    let [leaf, middle, _] = program.addresses()[..] else { panic!("three addresses") };

    let frames = Resolving::default().user_frames(program.pid(), &[leaf, middle + 5]);
    // leaf_fn is exported (.dynsym survives strip); the static middle_fn is only in .symtab.
    assert_eq!(frames[0].symbol.as_deref(), Some("leaf_fn"), "{frames:#?}");
    assert_eq!(frames[1].symbol, None);
    let expected = format!("spin-stripped+{:#x}", file_offset_of(&exe, "middle_fn") + 4);
    assert_eq!(crate::output::native_name(&frames[1]), expected);
}

/// Without lines, an address no symbol names teaches the stretch around it up to the symbols on
/// either side: later addresses there are unnamed as a look-up would say, without one.
#[test]
fn addresses_between_the_symbols_of_a_stripped_file_need_no_look_up() {
    let dir = tempfile::tempdir().unwrap();
    let (_, stripped) = program_and_stripped_copy(dir.path());
    let mut program = Running::start(&stripped);
    let [leaf, middle, outer] = program.addresses()[..] else { panic!("three addresses") };
    let pid = program.pid();
    let known = |resolving: &Resolving, addr: u64| known_function(resolving, pid, addr).map(|resolved| resolved.len());

    let mut resolving = Resolving::default();
    // The static middle_fn lies between the exported leaf_fn and outer_fn (gcc keeps their order).
    assert!(leaf < middle && middle < outer, "{leaf:#x} {middle:#x} {outer:#x}");
    assert_eq!(resolving.user_frames(pid, &[middle + 4])[0].symbol, None);
    assert_eq!(known(&resolving, middle + 8), Some(0), "unnamed, known without a look-up");
    assert_eq!(known(&resolving, leaf + 1), None, "leaf_fn bounds the stretch");
    assert_eq!(known(&resolving, outer + 1), None, "outer_fn bounds the stretch");
    let later = resolving.user_frames(pid, &[middle + 8]);
    assert_eq!(later, Resolving::default().user_frames(pid, &[middle + 8]));
    assert_eq!(names(&resolving.user_frames(pid, &[leaf + 1, outer + 1])), ["leaf_fn", "outer_fn"]);

    let mut with_lines = Resolving::with_lines();
    with_lines.user_frames(pid, &[middle + 4]);
    assert_eq!(with_lines.symbolizer.functions.count, 0);
}

/// The function names `symbolize_file` gives `file`'s offsets, with debug files under `debug_root`
/// (and the file's own DWARF, as with `--native-lines`).
fn names_in_file(file: &Path, debug_root: &Path, offsets: &[u64]) -> Vec<Vec<(String, Option<u32>)>> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata(file).unwrap();
    let id = FileId { dev: (libc::major(metadata.dev()) as i32, libc::minor(metadata.dev()) as i32), inode: metadata.ino() };
    let mut files = OpenFiles::with_debug_root(debug_root.to_path_buf());
    let mut blazesym = blazesym::symbolize::Symbolizer::new();
    let batch = FileBatch { location: Location { pid: std::process::id(), start: 0, limit: 0, path: file }, offsets: offsets.to_vec() };
    let looked = symbolize_file(&mut blazesym, &mut files, id, &batch, true);
    looked.iter().map(|(functions, _)| functions.iter().map(|f| (f.name.to_string(), f.line)).collect()).collect()
}

#[test]
fn a_stripped_file_is_named_from_its_installed_debug_files_symbol_table() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // leaf_fn gets glibc's kinds of aliases: a weak one (shorter), a hidden (local) `__GI_` one; and
    // outer_fn a shorter versioned one, `outer@@V1` in the symbol table.
    let aliases = "extern void leaf(void) __attribute__((weak, alias(\"leaf_fn\")));\n\
                   extern void __GI_leaf_fn(void) __attribute__((alias(\"leaf_fn\"), visibility(\"hidden\")));\n\
                   __asm__(\".symver outer_fn, outer@@V1\");\n";
    let versions = dir.path().join("versions.map");
    std::fs::write(&versions, "V1 { global: *; };\n").unwrap();
    let version_script = format!("-Wl,--version-script={}", versions.display());
    let flags = ["-g", "-O1", "-rdynamic", "-Wl,--build-id", &version_script];
    let exe = compile("gcc", &format!("{PROGRAM}{aliases}"), "spin", &flags, dir.path());
    let (stripped, debug) = (dir.path().join("spin-stripped"), dir.path().join("spin.debug"));
    let tool = |program: &str, args: &[&Path]| assert!(Command::new(program).args(args).status().expect("binutils run").success(), "{program}");
    tool("objcopy", &[Path::new("--only-keep-debug"), Path::new("--compress-debug-sections=zlib"), &exe, &debug]);
    tool("strip", &[Path::new("-o"), &stripped, &exe]);
    let build_id = object::File::parse(&*std::fs::read(&exe).unwrap()).unwrap().build_id().unwrap().expect("a build ID").to_vec();
    let root = tempfile::tempdir().unwrap();
    let hex = |bytes: &[u8]| bytes.iter().map(|byte| format!("{byte:02x}")).collect::<String>();
    let installed = root.path().join(".build-id").join(hex(&build_id[..1]));
    std::fs::create_dir_all(&installed).unwrap();
    std::fs::copy(&debug, installed.join(format!("{}.debug", hex(&build_id[1..])))).unwrap();
    let offsets = [file_offset_of(&exe, "leaf_fn"), file_offset_of(&exe, "middle_fn") + 4, file_offset_of(&exe, "outer_fn")];

    // The static middle_fn is only in the debug file's .symtab; names come without lines (its DWARF
    // is not read), leaf_fn by its global name, outer_fn by its shorter one without the version.
    let named = [vec![("leaf_fn".to_string(), None)], vec![("middle_fn".to_string(), None)], vec![("outer".to_string(), None)]];
    assert_eq!(names_in_file(&stripped, root.path(), &offsets), named);
    // The unstripped file still gives its own lines.
    assert!(names_in_file(&exe, root.path(), &offsets)[1].iter().any(|(name, line)| name == "middle_fn" && line.is_some()));

    let nothing_installed = tempfile::tempdir().unwrap();
    assert_eq!(names_in_file(&stripped, nothing_installed.path(), &offsets)[1], [], "named without the debug file");
    // A directory others may change could hold anything under that name.
    std::fs::set_permissions(&installed, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert_eq!(names_in_file(&stripped, root.path(), &offsets)[1], [], "read from a directory anyone may change");
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

    let frames = Resolving::default().user_frames(std::process::id(), &[stub]);
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
    let mut symbolizer = Resolving::default();
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
    let mut symbolizer = Resolving::default();
    assert_eq!(names(&symbolizer.user_frames(pid, &[leaf])), ["leaf_fn"]);
    program.stop();

    // Samples still in flight when the process exits: its maps and opened files stay known.
    let late = symbolizer.user_frames(pid, &[middle, outer + 5]);
    assert_eq!(names(&late), ["middle_fn", "outer_fn"], "{late:#?}");

    let mut never_seen = Command::new("true").spawn().unwrap();
    let gone = never_seen.id();
    never_seen.wait().unwrap();
    let frames = Resolving::default().user_frames(gone, &[0x40_1000, 0x40_2000]);
    assert_eq!(frames.len(), 2);
    assert!(frames.iter().all(|frame| frame.module.is_none() && frame.symbol.is_none()));
    assert_eq!(frames[0].addr, 0x40_1000);
}

#[test]
fn libraries_loaded_later_are_found() {
    let dir = tempfile::tempdir().unwrap();
    let library = compile("gcc", "int plugin_fn(int x) { return x * 3; }\n", "libplugin.so", &["-shared", "-fPIC", "-g"], dir.path());
    let mut symbolizer = Resolving::default();
    let pid = std::process::id();
    assert_eq!(names(&symbolizer.user_frames(pid, &[marker as fn() -> u64 as usize as u64])).last(), Some(&"pyebpf::symbolize::tests::marker"));

    let address = load_library(&library, c"plugin_fn").0;
    assert_ne!(address, 0);
    std::thread::sleep(maps::REFRESH_INTERVAL);
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
    let maps = Maps::read(pid).unwrap();
    let entry = maps.find(leaf).unwrap();
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

    let offsets = [leaf, middle, outer].iter().map(|addr| addr - entry.start + entry.offset).collect();
    let (sender, receiver) = std::sync::mpsc::channel();
    // On its own thread: a read that blocks on a FIFO fails the test instead of hanging it.
    std::thread::spawn(move || {
        let mut blazesym = blazesym::symbolize::Symbolizer::new();
        let batch = FileBatch { location: Location { pid, start: 0, limit: 0, path: &exe }, offsets };
        let looked = symbolize_file(&mut blazesym, &mut files, id, &batch, true);
        let names: Vec<String> = looked.iter().map(|(functions, _)| functions.iter().map(|f| f.name.to_string()).collect()).collect();
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

    let frames = Symbolizer::default().kernel_frames(&[address + 4, address + 9]);
    let names: Vec<_> = frames.iter().map(|frame| frame.symbol.as_deref()).collect();
    assert_eq!(names, [Some("schedule"), Some("schedule")]);
    assert_eq!(frames[1].addr, address + 8);
}

#[test]
fn the_eval_loop_is_looked_up_once_per_file() {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile("gcc", EVAL_LOOP_PROGRAM, "eval", &["-g", "-O1"], dir.path());
    let mut program = Running::start(&exe);
    let [eval_loop, other] = program.addresses()[..] else { panic!("two addresses") };
    let lines = |frames: &[NativeFrame]| frames.iter().map(|frame| frame.line).collect::<Vec<_>>();

    // Looked up, an address in the eval loop has its line (and those of any call inlined there).
    let looked_up = Resolving::with_lines().user_frames(program.pid(), &[eval_loop + 8]);
    assert!(names(&looked_up).ends_with(&["_PyEval_EvalFrameDefault"]) && looked_up.iter().all(|frame| frame.line.is_some()), "{looked_up:?}");

    // Once an address there resolved, the others are the function alone, without a look-up.
    let mut resolving = Resolving::with_lines();
    let first = resolving.user_frames(program.pid(), &[eval_loop]);
    assert_eq!(names(&first), ["_PyEval_EvalFrameDefault"]);
    let later = resolving.user_frames(program.pid(), &[eval_loop + 8]);
    assert_eq!((names(&later), lines(&later)), (vec!["_PyEval_EvalFrameDefault"], vec![None]));
    // Other functions are looked up as before.
    let beside = resolving.user_frames(program.pid(), &[other + 8]);
    assert!(names(&beside).ends_with(&["other_fn"]) && beside.iter().all(|frame| frame.line.is_some()), "{beside:?}");
}

/// What `pid`'s `addr` resolves to from the functions (and unnamed stretches) found before,
/// without a look-up.
fn known_function(resolving: &Resolving, pid: u32, addr: u64) -> Option<Resolved> {
    let mapping = resolving.symbolizer.processes.get(&pid).and_then(|maps| maps.find(addr)).expect("mapped");
    let Backing::File { id, .. } = &mapping.backing else { panic!("a file") };
    resolving.symbolizer.functions.at(*id, mapping.file_offset(addr))
}

/// Without lines, a new address in a function found before is that function, as a look-up would
/// say, without one; with lines each address is looked up (its line is its own).
#[test]
fn addresses_in_a_function_found_before_need_no_look_up() {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile("gcc", PROGRAM, "spin", &["-g", "-O1", "-fno-omit-frame-pointer"], dir.path());
    let mut program = Running::start(&exe);
    let [leaf, middle, _] = program.addresses()[..] else { panic!("three addresses") };
    let pid = program.pid();
    let known = |resolving: &Resolving, addr: u64| known_function(resolving, pid, addr).map(|resolved| resolved[0].name.to_string());

    let mut resolving = Resolving::default();
    assert_eq!(names(&resolving.user_frames(pid, &[leaf + 1])), ["leaf_fn"]);
    assert_eq!(known(&resolving, leaf + 9).as_deref(), Some("leaf_fn"));
    assert_eq!(known(&resolving, middle + 1), None, "middle_fn was not looked up");
    let later = resolving.user_frames(pid, &[leaf + 9]);
    assert_eq!(later, Resolving::default().user_frames(pid, &[leaf + 9]));
    assert_eq!((names(&later), later[0].addr), (vec!["leaf_fn"], leaf + 9));

    let mut with_lines = Resolving::with_lines();
    with_lines.user_frames(pid, &[leaf + 1]);
    assert_eq!(with_lines.symbolizer.functions.count, 0);
}

/// A site found before, in this process or another mapping the same file, is known without a
/// look-up and as one would give it; one never looked up, or of a process whose maps were not
/// followed, is not.
#[test]
fn sites_resolved_before_are_known_in_every_process_mapping_their_file() {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile("gcc", PROGRAM, "spin", &["-g", "-O1", "-fno-omit-frame-pointer"], dir.path());
    let (mut first, mut second) = (Running::start(&exe), Running::start(&exe));
    let [leaf, middle, _] = first.addresses()[..] else { panic!("three addresses") };
    let [other_leaf, _, other_outer] = second.addresses()[..] else { panic!("three addresses") };
    let mut resolving = Resolving::default();
    let known = |resolving: &Resolving, pid: u32, addr: u64| resolving.symbolizer.known_site(&resolving.maps, pid, addr);

    assert_eq!(known(&resolving, first.pid(), leaf + 1), None, "nothing followed yet");
    resolving.symbolizer.site_levels(&mut resolving.maps, first.pid(), &[leaf + 1]);
    assert_eq!(known(&resolving, first.pid(), leaf + 9), Some(Resolving::default().user_frames(first.pid(), &[leaf + 9])));
    assert_eq!(known(&resolving, first.pid(), middle + 1), None, "middle_fn was not looked up");
    assert_eq!(known(&resolving, second.pid(), other_leaf + 9), None, "the second process's maps were not followed");

    // Once the second process's maps are followed (for another site), the first's finds serve it.
    resolving.symbolizer.site_levels(&mut resolving.maps, second.pid(), &[other_outer + 1]);
    let shared = known(&resolving, second.pid(), other_leaf + 9).expect("leaf_fn found in the first process");
    assert_eq!(shared, Resolving::default().user_frames(second.pid(), &[other_leaf + 9]));
    assert_eq!((names(&shared), shared[0].addr), (vec!["leaf_fn"], other_leaf + 9));
    assert_eq!(known(&resolving, second.pid(), 0x10), None, "outside every mapping");
}
