//! Command-line interface definitions.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "pyebpf",
    version,
    about = "System-wide sampling profiler for Python on Linux, built on eBPF",
    long_about = "System-wide sampling profiler for Python on Linux, built on eBPF.\n\n\
        Samples every CPU with a perf-event eBPF program and shows, for every process, where CPU time \
        goes: Python functions and lines (CPython 3.13+) merged with the native and kernel frames \
        around them. Needs root (or CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Sample CPU stacks and write a profile (pprof or collapsed)
    Record(RecordArgs),
    /// Print the Python stack of every thread of a running CPython 3.13+ process
    Dump(DumpArgs),
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// gzip-compressed profile.proto, for `go tool pprof`, Grafana/Pyroscope, speedscope
    Pprof,
    /// One line per stack, `frame;frame;... count`, for flamegraph.pl and inferno
    Collapsed,
    /// An interactive flame graph (SVG) to open in a browser
    Svg,
    /// speedscope's JSON file format, for https://www.speedscope.app or `npx speedscope`
    Speedscope,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["all", "pid", "command"])))]
pub struct RecordArgs {
    /// Profile every process on the host
    #[arg(short = 'a', long = "all")]
    pub all: bool,

    /// Profile this process (repeat for several)
    #[arg(short = 'p', long = "pid", value_name = "PID")]
    pub pid: Vec<u32>,

    /// Sampling frequency per CPU, in Hz
    #[arg(short = 'F', long = "frequency", value_name = "HZ", default_value_t = 99,
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub frequency: u64,

    /// Stop after this many seconds (default: until Ctrl-C, or until COMMAND exits)
    #[arg(short = 'd', long = "duration", value_name = "SECONDS")]
    pub duration: Option<f64>,

    /// Where to write the profile: a file, `-` (standard output), a device or a FIFO
    #[arg(short = 'o', long = "output", value_name = "PATH", default_value = "profile.pb.gz")]
    pub output: PathBuf,

    /// Output format [default: from the output's extension: .pb.gz/.pprof -> pprof,
    /// .folded/.txt/.collapsed -> collapsed, .svg -> svg, .speedscope.json -> speedscope; a name
    /// without an extension (`-`, a device) -> pprof; any other extension is an error]
    #[arg(long = "format", value_enum)]
    pub format: Option<OutputFormat>,

    /// Aggregate Python frames by function, without line numbers
    #[arg(long = "function")]
    pub function: bool,

    /// Keep threads apart: a `thread TID` frame under each process (collapsed, svg), one
    /// speedscope profile per thread
    #[arg(long = "threads")]
    pub threads: bool,

    /// Only processes whose name (comm) matches this regular expression
    #[arg(long = "comm", value_name = "REGEX", value_parser = parse_comm_regex)]
    pub comm: Option<regex::Regex>,

    /// Only samples of Python (CPython 3.13+) processes
    #[arg(long = "python-only")]
    pub python_only: bool,

    /// Capture kernel stacks too (frames end in `_[k]` in collapsed output)
    #[arg(long = "kernel")]
    pub kernel: bool,

    /// Show Python frames only, without the native frames around them
    #[arg(long = "no-native")]
    pub no_native: bool,

    /// Don't use CPython 3.15's last_profiled_frame marker: the eBPF program walks every Python
    /// frame chain in full at each sample (for comparison; costs more per sample)
    #[arg(long = "no-cache")]
    pub no_cache: bool,

    /// Never write into a profiled process. Without it, pyebpf writes one field on CPython 3.15:
    /// the main thread's last_profiled_frame marker, which lets the eBPF program stop its walk
    /// at frames it already knows (see README, "The 3.15 marker")
    #[arg(long = "read-only")]
    pub read_only: bool,

    /// Python frames walked at most per sample; deeper stacks keep their innermost frames and
    /// are marked truncated
    #[arg(long = "max-python-frames", value_name = "N", default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(1..=512))]
    pub max_python_frames: u32,

    /// Print statistics at the end: samples, lost samples, Python frames read and cached, remote reads
    #[arg(long = "stats")]
    pub stats: bool,

    /// Size of the kernel-to-user sample ring buffer, in KiB (a power of two, at least 4)
    #[arg(long = "ring-buffer-kb", value_name = "KIB", default_value_t = 4096)]
    pub ring_buffer_kb: u32,

    /// Launch COMMAND and profile it and its children until it exits
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

#[derive(Args, Debug)]
pub struct DumpArgs {
    /// The process to read
    #[arg(short = 'p', long = "pid", value_name = "PID")]
    pub pid: u32,

    /// Print JSON instead of tracebacks
    #[arg(long = "json")]
    pub json: bool,
}

/// A `--comm` pattern; regex's own errors span several lines (the pattern with a caret under it),
/// so only their last line, the reason, is kept.
fn parse_comm_regex(pattern: &str) -> Result<regex::Regex, String> {
    regex::Regex::new(pattern).map_err(|err| {
        let text = err.to_string();
        let reason = text.lines().map(str::trim).rfind(|line| !line.is_empty()).unwrap_or("invalid").to_string();
        format!("not a regular expression ({reason})")
    })
}
