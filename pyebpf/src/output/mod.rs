//! Profile writers: collapsed stacks (flamegraph input), gzip-compressed pprof, an interactive SVG
//! flame graph and speedscope's JSON format, all from the one aggregated [`Profile`].
//!
//! Every writer names frames the same way (see [`frame_name`]), so a stack reads alike in every
//! format. Where the profile goes, and how it gets there without harming what is at the path
//! (`-`, devices, FIFOs, symlinks, atomic replacement of regular files), is [`destination`]'s concern.

mod collapsed;
mod destination;
mod pprof;
mod rotate;
mod speedscope;
mod svg;

use std::borrow::Cow;
use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::stack::{Frame, KernelFrame, NativeFrame, Profile, PythonFrame, Stack, ThreadState, Weight};

use destination::{Destination, STDOUT};

/// The file formats a profile is written in (`--format`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// gzip-compressed profile.proto, for `go tool pprof`, Grafana/Pyroscope, speedscope
    Pprof,
    /// One line per stack, `frame;frame;... count`, for flamegraph.pl and inferno
    Collapsed,
    /// An interactive flame graph (SVG) to open in a browser
    Svg,
    /// speedscope's JSON file format, for `https://www.speedscope.app` or `npx speedscope`
    Speedscope,
}

#[derive(Debug, Error)]
pub enum OutputError {
    #[error("directory {} does not exist", .0.display())]
    MissingDirectory(PathBuf),
    #[error("{} is a directory", .0.display())]
    IsDirectory(PathBuf),
    #[error("{} is a socket; write to a file, a device, a FIFO or `-` (standard output)", .0.display())]
    Socket(PathBuf),
    #[error("{} is a terminal and pprof is binary: write to a file, pipe it, or use --format collapsed", display_name(.0))]
    BinaryOnTerminal(PathBuf),
    #[error("--rotate writes a new file every period: {} is not a regular file, give -o a file name", display_name(.0))]
    CannotRotate(PathBuf),
    #[error("{}: {cause}", path.display())]
    Io { path: PathBuf, cause: io::Error },
    #[error("{} is on a {kind} file system, where no file can be created", .path.display())]
    PseudoFileSystem { path: PathBuf, kind: &'static str },
    #[error("cannot tell the format of {} from its extension: use .pb.gz or .pprof (pprof), .folded, .txt or .collapsed (collapsed), .svg (flame graph), .speedscope.json (speedscope), or --format", .0.display())]
    UnknownExtension(PathBuf),
}

/// What the writers need besides the profile.
#[derive(Debug, Clone, Default)]
pub struct Rendering {
    /// Keep threads apart (collapsed and SVG: a `thread TID` frame; speedscope: a profile each).
    pub threads: bool,
    /// What was recorded, as the SVG's title and speedscope's name: pyebpf's command line.
    pub title: String,
}

/// Stands right under the process (and thread) in stacks whose Python chain was cut, so they stay apart.
pub(crate) const TRUNCATED_FRAME: &str = "[truncated]";

/// The leaf of an off-CPU stack: why the thread waited (`[off-cpu lock]`), so waits stand apart
/// from the time on CPU in flame graphs.
pub(crate) fn state_frame(state: ThreadState) -> Option<String> {
    match state {
        ThreadState::TaskWait => Some("[awaiting]".into()),
        _ => state.off_cpu().then(|| format!("[off-cpu {}]", state.name())),
    }
}

/// A stack's value in the text formats (collapsed, SVG): samples where the profile measures CPU
/// time, microseconds where it measures waits too (they are not samples of one period).
pub(crate) fn text_value(profile: &Profile, weight: Weight) -> u64 {
    if profile.mode.counts_waits() {
        (weight.ns + 500) / 1000
    } else {
        weight.samples
    }
}

/// The unit of [`text_value`].
pub(crate) fn text_unit(profile: &Profile) -> &'static str {
    if profile.mode.counts_waits() {
        "microseconds"
    } else {
        "samples"
    }
}

/// The root frame of a process's stacks.
pub(crate) fn process_frame(key: &Stack<'_>) -> String {
    format!("{} ({})", key.comm, key.pid)
}

/// The frame under the process root that keeps a thread's stacks apart.
pub(crate) fn thread_frame(tid: u32) -> String {
    format!("thread {tid}")
}

impl OutputError {
    fn io(path: &Path) -> impl FnOnce(io::Error) -> OutputError + '_ {
        move |cause| OutputError::Io { path: path.to_path_buf(), cause }
    }
}

/// Whether `-o PATH` is standard output.
pub fn is_stdout(path: &Path) -> bool {
    path.as_os_str() == STDOUT
}

/// `-o PATH` as messages name it: `-` is standard output.
pub fn display_name(path: &Path) -> Cow<'_, str> {
    if is_stdout(path) {
        Cow::Borrowed("standard output")
    } else {
        path.to_string_lossy()
    }
}

/// File name endings and the format each means.
const EXTENSIONS: [(&str, OutputFormat); 8] = [
    (".pb.gz", OutputFormat::Pprof),
    (".pprof", OutputFormat::Pprof),
    (".pb", OutputFormat::Pprof),
    (".folded", OutputFormat::Collapsed),
    (".txt", OutputFormat::Collapsed),
    (".collapsed", OutputFormat::Collapsed),
    (".svg", OutputFormat::Svg),
    (".speedscope.json", OutputFormat::Speedscope),
];

/// The format to write: the explicit choice, else inferred from the file name. A name without an
/// extension (`-`, `/dev/null`, `profile`) is pprof; an extension pyebpf does not know is an error,
/// so `-o out.html` does not silently get a binary profile.
pub fn resolve_format(path: &Path, explicit: Option<OutputFormat>) -> Result<OutputFormat, OutputError> {
    if let Some(format) = explicit {
        return Ok(format);
    }
    let name = path.file_name().map(|name| name.to_string_lossy()).unwrap_or_default();
    if let Some((_, format)) = EXTENSIONS.iter().find(|(ext, _)| name.ends_with(ext)) {
        return Ok(*format);
    }
    match path.extension() {
        None => Ok(OutputFormat::Pprof),
        Some(_) => Err(OutputError::UnknownExtension(path.to_path_buf())),
    }
}

/// Writes `profile` to `path` in `format`: regular files atomically, devices, FIFOs and `-` in place.
pub fn write_profile(profile: &Profile, path: &Path, format: OutputFormat, rendering: &Rendering) -> Result<(), OutputError> {
    Destination::resolve(path)?.write(path, format, |mut out| match format {
        OutputFormat::Collapsed => collapsed::write(profile, rendering.threads, &mut out),
        OutputFormat::Pprof => pprof::write(profile, &mut out),
        OutputFormat::Svg => svg::write(profile, rendering, &mut out),
        OutputFormat::Speedscope => speedscope::write(profile, rendering, &mut out),
    })
}

/// The command that opens a profile written to `path` in `format`, for the summary; none for
/// standard output, devices and FIFOs.
pub fn open_command(path: &Path, format: OutputFormat) -> Option<String> {
    if !matches!(Destination::resolve(path), Ok(Destination::Replace(_))) {
        return None;
    }
    let name = path.to_string_lossy();
    Some(match format {
        OutputFormat::Pprof => format!("go tool pprof -http=: {name}"),
        OutputFormat::Collapsed => format!("inferno-flamegraph {name} > flamegraph.svg"),
        OutputFormat::Svg => format!("xdg-open {name}"),
        OutputFormat::Speedscope => format!("npx speedscope {name}"),
    })
}

/// One profile at `-o`, or with `--rotate` a file per period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Files {
    Single,
    /// `--rotate`, keeping at most `keep` files (`--keep`).
    Rotated {
        keep: Option<usize>,
    },
}

/// Where a recording's profiles go: `-o PATH`, or with `--rotate` a new file per period, named
/// after PATH and the period's start (see [`rotate`]).
pub struct ProfileSink {
    path: PathBuf,
    format: OutputFormat,
    files: Files,
    rendering: Rendering,
    /// `--function`: Python frames without their lines.
    by_function: bool,
}

impl ProfileSink {
    /// Checks, before any sampling, that profiles can be written as asked: a directory, a socket, a
    /// missing directory, a read-only place or binary output on a terminal are refused. Opens and
    /// changes nothing.
    pub fn new(path: &Path, format: Option<OutputFormat>, files: Files, rendering: Rendering, by_function: bool) -> Result<ProfileSink, OutputError> {
        let format = resolve_format(path, format)?;
        let destination = Destination::resolve(path)?;
        if files != Files::Single && !matches!(destination, Destination::Replace(_)) {
            return Err(OutputError::CannotRotate(path.to_path_buf()));
        }
        destination.check(format)?;
        Ok(ProfileSink { path: path.to_path_buf(), format, files, rendering, by_function })
    }

    /// Writes one complete profile; returns the name it went to, as messages show it.
    pub fn write(&self, profile: &Profile) -> Result<String, OutputError> {
        let by_function;
        let profile = if self.by_function {
            by_function = profile.by_function();
            &by_function
        } else {
            profile
        };
        if self.files == Files::Single {
            write_profile(profile, &self.path, self.format, &self.rendering)?;
            return Ok(display_name(&self.path).into_owned());
        }
        let path = rotate::free_name(&self.path, profile.start_unix_ns)?;
        write_profile(profile, &path, self.format, &self.rendering)?;
        Ok(path.to_string_lossy().into_owned())
    }

    /// With `--keep`, removes the oldest period files past it; returns those it removed.
    pub fn remove_oldest(&self) -> Result<Vec<PathBuf>, OutputError> {
        match self.files {
            Files::Rotated { keep: Some(keep) } => rotate::remove_oldest(&self.path, keep),
            _ => Ok(Vec::new()),
        }
    }

    /// The command that opens what [`Self::write`] writes, for the summary.
    pub fn open_command(&self) -> Option<String> {
        if self.files != Files::Single {
            return None;
        }
        open_command(&self.path, self.format)
    }
}

/// How a frame is named in every output format.
pub(crate) fn frame_name(frame: &Frame) -> Cow<'_, str> {
    match frame {
        Frame::Native(native) => native_name(native),
        Frame::Kernel(kernel) => Cow::Owned(kernel_name(kernel)),
        Frame::Python(python) => Cow::Owned(python_name(python)),
        Frame::Task(name) => Cow::Owned(task_name(name)),
    }
}

/// `[task NAME]`, as CPython's own sampler marks tasks.
pub(crate) fn task_name(name: &str) -> String {
    format!("[task {name}]")
}

/// The symbol, else where the frame was: `MODULE+0xOFFSET` (file offset), else `0xADDR`.
pub(crate) fn native_name(frame: &NativeFrame) -> Cow<'_, str> {
    if let Some(symbol) = &frame.symbol {
        return Cow::Borrowed(symbol);
    }
    match &frame.module {
        Some(module) => {
            let file_name = Path::new(&*module.path).file_name().map_or_else(|| module.path.to_string(), |name| name.to_string_lossy().into_owned());
            let offset = frame.addr.wrapping_sub(module.start).wrapping_add(module.file_offset);
            Cow::Owned(format!("{file_name}+{offset:#x}"))
        }
        None => Cow::Owned(format!("{:#x}", frame.addr)),
    }
}

/// `SYMBOL_[k]`, the suffix perf and flame graphs use to mark kernel code.
pub(crate) fn kernel_name(frame: &KernelFrame) -> String {
    match &frame.symbol {
        Some(symbol) => format!("{symbol}_[k]"),
        None => format!("{:#x}_[k]", frame.addr),
    }
}

/// `QUALNAME (FILE:LINE)`; without the line where it could not be computed.
pub(crate) fn python_name(frame: &PythonFrame) -> String {
    if frame.line == 0 {
        format!("{} ({})", frame.qualname, frame.filename)
    } else {
        format!("{} ({}:{})", frame.qualname, frame.filename, frame.line)
    }
}

#[cfg(test)]
pub(crate) mod test_profile {
    //! A hand-made profile with every kind of frame, shared by the writers' tests.
    use std::sync::Arc;

    use crate::stack::{Frame, KernelFrame, Module, NativeFrame, Profile, PythonFrame, StackKey};

    pub fn module(path: &str, start: u64) -> Arc<Module> {
        Arc::new(Module {
            path: path.into(),
            start,
            limit: start + 0x10_0000,
            file_offset: 0x1000,
            build_id: Some(format!("build-id-of-{}", path.rsplit('/').next().unwrap_or(path)).into()),
        })
    }

    pub fn native(module: &Arc<Module>, addr: u64, symbol: Option<&str>) -> Frame {
        Frame::Native(NativeFrame {
            addr,
            module: Some(module.clone()),
            symbol: symbol.map(Into::into),
            file: symbol.map(|_| "/src/app.c".into()),
            line: symbol.map(|_| 42),
        })
    }

    pub fn python(qualname: &str, filename: &str, first_line: u32, line: u32) -> Frame {
        Frame::Python(PythonFrame { qualname: qualname.into(), filename: filename.into(), first_line, line })
    }

    pub fn kernel(symbol: &str) -> Frame {
        Frame::Kernel(KernelFrame { addr: 0xffff_ffff_8100_0000, symbol: Some(symbol.into()) })
    }

    pub fn key(pid: u32, tid: u32, comm: &str, frames: Vec<Frame>) -> StackKey {
        StackKey { pid, tid, comm: comm.into(), frames, truncated: false, labels: None, state: crate::stack::ThreadState::OnCpu }
    }

    /// Process `app` (pid 100, two threads) runs Python over native code and the kernel; the
    /// unknown frame sits in `libfoo.so` at file offset 0x1234.
    pub fn sample_profile() -> Profile {
        let exe = module("/usr/bin/app", 0x40_0000);
        let lib = module("/usr/lib/libfoo.so", 0x7f00_0000_0000);
        let mut profile = Profile::new(100);
        profile.start_unix_ns = 1_700_000_000_000_000_000;
        profile.duration_ns = 2_000_000_000;
        let python_stack = vec![
            kernel("do_syscall_64"),
            native(&lib, 0x7f00_0000_0234, None),
            python("Worker.compute", "/srv/work.py", 10, 14),
            python("main", "/srv/work.py", 30, 33),
            native(&exe, 0x40_1000, Some("_start")),
        ];
        profile.add(key(100, 100, "app", python_stack.clone()), 7);
        profile.add(key(100, 101, "app", python_stack), 3);
        profile.add(key(200, 200, "busy;loop", vec![native(&exe, 0x40_2000, Some("leaf_fn")), native(&exe, 0x40_1000, Some("main"))]), 5);
        profile
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    #[test]
    fn format_follows_the_extension_unless_given() {
        let cases = [
            ("profile.pb.gz", OutputFormat::Pprof),
            ("out/x.pprof", OutputFormat::Pprof),
            ("x.pb", OutputFormat::Pprof),
            ("stacks.folded", OutputFormat::Collapsed),
            ("stacks.txt", OutputFormat::Collapsed),
            ("stacks.collapsed", OutputFormat::Collapsed),
            ("profile", OutputFormat::Pprof),
            ("-", OutputFormat::Pprof),
            ("/dev/null", OutputFormat::Pprof),
            ("flame.svg", OutputFormat::Svg),
            ("run.speedscope.json", OutputFormat::Speedscope),
        ];
        for (name, expected) in cases {
            assert_eq!(resolve_format(Path::new(name), None).unwrap(), expected, "{name}");
        }
        assert_eq!(resolve_format(Path::new("x.txt"), Some(OutputFormat::Pprof)).unwrap(), OutputFormat::Pprof);
        assert_eq!(resolve_format(Path::new("x.html"), Some(OutputFormat::Svg)).unwrap(), OutputFormat::Svg);
    }

    #[test]
    fn an_unknown_extension_is_an_error_naming_the_known_ones() {
        for name in ["out.html", "profile.json", "x.gz", "flame.svgz"] {
            let err = resolve_format(Path::new(name), None).unwrap_err();
            assert!(matches!(err, OutputError::UnknownExtension(_)), "{name}");
            let text = err.to_string();
            assert!(text.contains(name) && text.contains(".speedscope.json") && !text.contains('\n'), "{text}");
        }
    }

    #[test]
    fn check_writable_leaves_no_file_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("profile.pb.gz");
        ProfileSink::new(&path, Some(OutputFormat::Pprof), Files::Single, Rendering::default(), false).unwrap();
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0, "the check left a file");
    }

    #[test]
    fn check_writable_keeps_an_existing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.folded");
        fs::write(&path, "a;b 1\n").unwrap();
        ProfileSink::new(&path, Some(OutputFormat::Collapsed), Files::Single, Rendering::default(), false).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "a;b 1\n");
    }

    #[test]
    fn check_writable_rejects_missing_directories_and_directories() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no/such/dir/profile.pb.gz");
        assert!(matches!(
            ProfileSink::new(&missing, Some(OutputFormat::Pprof), Files::Single, Rendering::default(), false),
            Err(OutputError::MissingDirectory(_))
        ));
        assert!(matches!(
            ProfileSink::new(dir.path(), Some(OutputFormat::Pprof), Files::Single, Rendering::default(), false),
            Err(OutputError::IsDirectory(_))
        ));
    }

    #[test]
    fn write_profile_replaces_the_file_and_leaves_no_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("profile.folded");
        fs::write(&path, "stale 1\n").unwrap();
        write_profile(&test_profile::sample_profile(), &path, OutputFormat::Collapsed, &Rendering::default()).unwrap();
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("profile.folded")]);
        assert!(!fs::read_to_string(&path).unwrap().contains("stale"));
    }

    #[test]
    fn unknown_native_frames_show_module_and_file_offset() {
        let lib = test_profile::module("/usr/lib/libfoo.so", 0x7f00_0000_0000);
        let frame = NativeFrame { addr: 0x7f00_0000_0234, module: Some(lib), symbol: None, file: None, line: None };
        assert_eq!(native_name(&frame), "libfoo.so+0x1234");
        let bare = NativeFrame { addr: 0xdead, module: None, symbol: None, file: None, line: None };
        assert_eq!(native_name(&bare), "0xdead");
    }
}
