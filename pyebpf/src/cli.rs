//! Command-line interface definitions.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::bpf::{ring_buffer_kb_fits, UnwindMode, MAX_RING_BUFFER_KB};
use crate::mode::Mode;
use crate::otlp::ServiceName;
use crate::output::OutputFormat;

#[derive(Parser, Debug)]
#[command(
    name = "pyebpf",
    version = env!("PYEBPF_LONG_VERSION"),
    about = "System-wide sampling profiler for Python on Linux, built on eBPF",
    long_about = "System-wide sampling profiler for Python on Linux, built on eBPF.\n\n\
        Samples every CPU with a perf-event eBPF program and shows, for every process, where CPU time \
        goes: Python functions and lines (CPython 3.8+) merged with the native and kernel frames \
        around them. Needs root (or CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Sample stacks (CPU, wall-clock, off-CPU or GIL time) and write a profile
    #[command(long_about = RECORD_ABOUT)]
    Record(RecordArgs),
    /// Print the Python stack of every thread of a running CPython 3.8+ process
    Dump(DumpArgs),
    /// Live view of the hottest functions on the host, refreshed every second
    #[command(long_about = TOP_ABOUT)]
    Top(TopArgs),
    /// Write the manual pages (pyebpf.1 and one per subcommand) into DIR, for packages
    #[command(hide = true)]
    Man {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
}

/// The manual pages, generated from these definitions so they cannot drift from `--help`.
pub fn write_man_pages(dir: &std::path::Path) -> std::io::Result<()> {
    clap_mangen::generate_to(<Cli as clap::CommandFactory>::command(), dir)
}

const TOP_ABOUT: &str = "Live view of the hottest functions on the host, refreshed every second.\n\n\
    Samples every process (or those of -p/--comm/--python-only) with the same sampler as `record` and \
    shows one row per function and process: OWN% (time whose innermost frame is the function) and \
    TOTAL% (time with the function anywhere on the stack), both shares of the last second's time; \
    OWN s and TOTAL s, the seconds accumulated since top started. The time is what --mode measures: \
    CPU time (the default), wall-clock or off-CPU time, or time holding the GIL; the function; for \
    Python frames file:line (the line where the function starts), for native frames the module; and \
    the process (COMM PID).\n\n\
    Keys: o sort by own time, t sort by total time, m switch to the next mode (cpu, wall, off-cpu, \
    gil; the sampler starts again), p switch between Python frames only and merged \
    native + Python frames, space pause the display (sampling goes on), q, Esc or Ctrl-C quit.\n\n\
    Needs a terminal of at least 60x10 on standard output.\n\n\
    SIGINT, SIGTERM and SIGHUP quit, as for `record`.";

const RECORD_ABOUT: &str = "Sample stacks and write a profile (pprof, collapsed, SVG or speedscope).\n\n\
    --mode says what is measured: CPU time (the default), wall-clock time (on and off CPU), off-CPU \
    time or time holding the GIL. Off-CPU intervals come from the scheduler: when a thread of a \
    profiled process leaves the CPU and when it comes back, with the stacks it waited in.\n\n\
    Stop signals, from pyebpf's start to its exit: SIGINT (Ctrl-C) and SIGTERM stop the recording and \
    write the profile, also when the parent left them ignored (a script's background job can be \
    stopped with `kill -INT`). SIGHUP does the same, unless the parent left it ignored: under \
    `nohup` the recording outlives the terminal. With COMMAND, the first stop signal is passed to \
    COMMAND and pyebpf writes once it exits; a second one stops pyebpf at once (it still writes).";

/// Which processes' samples are kept, for `record` and `top`.
#[derive(Args, Debug)]
pub struct FilterArgs {
    /// Only processes whose name (comm) matches this regular expression
    #[arg(long = "comm", value_name = "REGEX", value_parser = parse_comm_regex)]
    pub comm: Option<regex::Regex>,

    /// Only samples of Python (CPython 3.8+) processes
    #[arg(long = "python-only")]
    pub python_only: bool,
}

impl FilterArgs {
    pub fn sample_filter(&self) -> crate::filter::SampleFilter {
        crate::filter::SampleFilter { comm: self.comm.clone(), python_only: self.python_only }
    }
}

/// What is measured, for `record` and `top`.
#[derive(Args, Debug, Clone, Copy)]
pub struct ModeArgs {
    /// What to measure: `cpu` (time on CPU), `wall` (on CPU plus every wait off CPU, so each
    /// thread adds up to its wall-clock time), `off-cpu` (waits only), `gil` (Python threads
    /// holding the GIL). Off-CPU stacks are labelled with why the thread waited (sleep, lock, io,
    /// gil, runqueue: preempted, waiting for a CPU; other) and weighted in nanoseconds
    #[arg(long = "mode", value_enum, default_value = "cpu")]
    pub mode: Mode,

    /// With --mode wall or off-cpu: a thread's stacks are captured as it leaves the CPU, after a
    /// burst of 16, at most once per this many microseconds; the waits that begin without a
    /// capture (a thread switching tens of thousands of times a second has many) are summed and
    /// counted with the thread's next capture of the same kind (a wait, or a preemption), whose
    /// stacks stand for them as a sample's do
    #[arg(long = "off-cpu-min", value_name = "MICROSECONDS", default_value_t = DEFAULT_OFF_CPU_MIN_US, allow_negative_numbers = true,
          value_parser = clap::value_parser!(u64).range(0..=MAX_SECONDS * 1_000_000))]
    pub off_cpu_min_us: u64,

    /// Show asyncio tasks (CPython 3.14+): where a thread runs a task, its stack shows the task
    /// and the tasks awaiting it, outermost first, as `[task NAME]` frames, each awaiting task
    /// with its suspended coroutine frames, above the running coroutine's frames. With --mode wall
    /// or off-cpu, every waiting task counts too, for as long as it waits: its task chain down to
    /// what it awaits, ending in `[awaiting]`. Read in the kernel at each capture, like the frames;
    /// at most 8 tasks per chain and 16 waiting tasks per capture
    #[arg(long = "async-aware")]
    pub async_aware: bool,
}

/// `--off-cpu-min` unless given: a thread is captured at most this often after its burst. A
/// thread that blocks and wakes tens of thousands of times a second (a pipe ping-pong) then costs
/// two map updates per switch, not a capture.
pub const DEFAULT_OFF_CPU_MIN_US: u64 = 1000;

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupBy {
    Process,
    Container,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["all", "pid", "command"])))]
pub struct RecordArgs {
    /// Profile every process on the host
    #[arg(short = 'a', long = "all")]
    pub all: bool,

    /// Profile this process (repeat for several), until it exits
    #[arg(short = 'p', long = "pid", value_name = "PID", allow_negative_numbers = true)]
    pub pid: Vec<u32>,

    /// Sampling frequency per CPU, in Hz
    #[arg(short = 'F', long = "frequency", value_name = "HZ", default_value_t = 99, allow_negative_numbers = true,
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub frequency: u64,

    #[command(flatten)]
    pub mode: ModeArgs,

    /// Stop after this many seconds (default: until Ctrl-C, or until COMMAND or every -p process exits)
    #[arg(short = 'd', long = "duration", value_name = "SECONDS", value_parser = parse_duration, allow_negative_numbers = true)]
    pub duration: Option<Duration>,

    /// Where to write the profile: a file, `-` (standard output), a device or a FIFO (default:
    /// profile.pb.gz; with --otlp, no file unless -o is given)
    #[arg(short = 'o', long = "output", value_name = "PATH")]
    pub output: Option<PathBuf>,

    /// Output format (default: from the output's extension: .pb.gz/.pprof -> pprof,
    /// .folded/.txt/.collapsed -> collapsed, .svg -> svg, .speedscope.json -> speedscope; a name
    /// without an extension (`-`, a device) -> pprof; any other extension is an error)
    #[arg(long = "format", value_enum)]
    pub format: Option<OutputFormat>,

    /// Write a complete profile every SECONDS and start a new one, so a long run never risks more
    /// than one period: each goes to the output's name with the period's UTC start inserted before
    /// the extension (`profile.20261123T120000.pb.gz`); the last, partial period is written at exit
    #[arg(long = "rotate", value_name = "SECONDS", allow_negative_numbers = true,
          value_parser = clap::value_parser!(u64).range(1..=MAX_SECONDS))]
    pub rotate: Option<u64>,

    /// With --rotate: keep only the newest N period files, removing the oldest after each write.
    /// Only regular files named as --rotate names them after -o are removed, those of earlier
    /// runs too, so a service restarted with the same -o stays within N
    #[arg(long = "keep", value_name = "N", requires = "rotate", allow_negative_numbers = true,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub keep: Option<u64>,

    /// Aggregate Python frames by function, without line numbers
    #[arg(long = "function")]
    pub function: bool,

    /// Keep threads apart: a `thread TID` frame under each process (collapsed, svg), one
    /// speedscope profile per thread
    #[arg(long = "threads")]
    pub threads: bool,

    #[command(flatten)]
    pub filter: FilterArgs,

    /// Capture kernel stacks too (frames end in `_[k]` in collapsed output)
    #[arg(long = "kernel")]
    pub kernel: bool,

    /// How native stacks are unwound: `fp` (frame pointers, in the kernel), `dwarf` (a copy of
    /// up to 16 KiB of every user stack, unwound in userspace from .eh_frame/.debug_frame), `auto`
    /// (frame pointers until a process shows a stack they cannot unwind, then dwarf for it)
    #[arg(long = "unwind", value_enum, default_value = "auto")]
    pub unwind: UnwindMode,

    /// Show Python frames only, without the native frames around them
    #[arg(long = "no-native")]
    pub no_native: bool,

    /// Give native frames their source lines and inlined calls, from the DWARF of files that
    /// carry their own (built with `-g`). Without it they are named from symbol tables, function
    /// names only: parsed DWARF stays in memory for the run (tens of MB for an interpreter built
    /// with `-g`) and every new address in it costs a look-up
    #[arg(long = "native-lines")]
    pub native_lines: bool,

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
    #[arg(long = "max-python-frames", value_name = "N", default_value_t = DEFAULT_MAX_PYTHON_FRAMES, allow_negative_numbers = true,
          value_parser = clap::value_parser!(u32).range(1..=pyebpf_common::MAX_PY_FRAMES as i64))]
    pub max_python_frames: u32,

    /// Print statistics at the end: samples, lost samples, Python frames read and cached, remote reads
    #[arg(long = "stats")]
    pub stats: bool,

    /// Size of the kernel-to-user sample ring buffer, in KiB (a power of two, at least 4).
    /// Default: about half a wake-up bound (100 sampling periods, 0.25 to 2 s) of the largest samples at the rate on every CPU, 1024 to 4096.
    /// The reader is woken once half of it is pending, or a wake-up bound after its last wake-up
    #[arg(long = "ring-buffer-kb", value_name = "KIB", value_parser = parse_ring_buffer_kb, allow_negative_numbers = true)]
    pub ring_buffer_kb: Option<u32>,

    /// With -p: also profile the children the given processes start after pyebpf attached
    #[arg(long = "subprocesses", requires = "pid")]
    pub subprocesses: bool,

    /// Collapsed output: `container` puts a root frame naming the process's cgroup (its
    /// container) above the `COMM (PID)` frame; `process` (the default) starts at the process
    #[arg(long = "group-by", value_enum, default_value = "process")]
    pub group_by: GroupBy,

    #[command(flatten)]
    pub otlp: Box<OtlpArgs>,

    /// Launch COMMAND and profile it and its children until it exits; the first stop signal
    /// (SIGINT, SIGTERM, SIGHUP) is passed to it (a second one stops pyebpf while it runs).
    /// COMMAND starts with the signal dispositions pyebpf's parent left
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// `record --otlp`: pushing the profiles to an OpenTelemetry Collector or Pyroscope.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Sending profiles over OTLP")]
pub struct OtlpArgs {
    /// Send the profiles as OTLP profiles (v1development) to an OpenTelemetry Collector (receiver
    /// `otlp`, run with --feature-gates=+service.profilesSupport) or Pyroscope: every
    /// --otlp-period, one request holding every process profiled in that period.
    /// `grpc://HOST:PORT` or `grpcs://HOST:PORT` (gRPC, plain or TLS), `http://HOST:PORT[/PATH]` or
    /// `https://HOST:PORT[/PATH]` (HTTP/protobuf POST; PATH defaults to /v1development/profiles);
    /// gzip-compressed. Works with every target and --mode; -o files are written as without it.
    /// Default (also for an empty ENDPOINT): the environment variable PYEBPF_OTLP_ENDPOINT, when
    /// set and not empty
    #[arg(long = "otlp", value_name = "ENDPOINT")]
    pub endpoint: Option<String>,

    /// With --otlp: send a request every SECONDS (the end of the recording sends the last,
    /// partial period)
    #[arg(long = "otlp-period", value_name = "SECONDS", default_value_t = 60, allow_negative_numbers = true,
          value_parser = clap::value_parser!(u64).range(1..=MAX_SECONDS))]
    pub period: u64,

    /// With --otlp over TLS: trust the certificate authorities of this PEM file instead of the
    /// system's
    #[arg(long = "otlp-ca", value_name = "FILE")]
    pub ca: Option<PathBuf>,

    /// With --otlp over TLS: present this client certificate (PEM; with --otlp-key)
    #[arg(long = "otlp-cert", value_name = "FILE", requires = "key")]
    pub cert: Option<PathBuf>,

    /// The private key of --otlp-cert (PEM)
    #[arg(long = "otlp-key", value_name = "FILE", requires = "cert")]
    pub key: Option<PathBuf>,

    /// With --otlp: headers to send with every request (an API key, a tenant), one `name: value`
    /// per line, `#` starting a comment. Headers are also read from the environment variable
    /// PYEBPF_OTLP_HEADERS (else OTEL_EXPORTER_OTLP_HEADERS): `name=value,name=value`, values
    /// percent-encoded. Never on the command line, where other users can read them
    #[arg(long = "otlp-headers-file", value_name = "FILE")]
    pub headers_file: Option<PathBuf>,

    /// With --otlp: the memory the periods waiting to be sent may take, in MiB (encoded); past
    /// it, the oldest waiting period is dropped. Failed sends are retried with backoff while
    /// the periods wait
    #[arg(long = "otlp-queue-mb", value_name = "MIB", default_value_t = 64, allow_negative_numbers = true,
          value_parser = clap::value_parser!(u64).range(1..=16_384))]
    pub queue_mb: u64,

    /// With --otlp: at the end of the recording (its duration, COMMAND's exit, a stop signal), how
    /// long to wait for the waiting periods to be delivered before dropping them
    #[arg(long = "otlp-flush-timeout", value_name = "SECONDS", default_value_t = 10, allow_negative_numbers = true,
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub flush_timeout: u64,

    /// With --otlp: the `service.name` of each process: `exe` (its executable's name), `env:VAR`
    /// (the value of VAR in the environment the process started with, else its executable's
    /// name), `cgroup` (the last component of its cgroup path: its container or systemd unit),
    /// `=NAME` (NAME for every process)
    #[arg(long = "service-name", value_name = "RULE", default_value = "exe", value_parser = ServiceName::parse)]
    pub service_name: ServiceName,
}

/// `--max-python-frames` unless given (and what `top` walks).
pub const DEFAULT_MAX_PYTHON_FRAMES: u32 = pyebpf_common::MAX_PY_FRAMES as u32;

/// The longest `--duration` and `--rotate`: a year.
const MAX_SECONDS: u64 = 365 * 24 * 3600;

/// The shortest `--duration`: a millisecond (`1e-12` would be a recording of no time at all).
const MIN_DURATION: f64 = 0.001;

/// `--duration`: a finite number of seconds from [`MIN_DURATION`] to [`MAX_SECONDS`].
fn parse_duration(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text.trim().parse().map_err(|_| "not a number of seconds".to_string())?;
    if !(MIN_DURATION..=MAX_SECONDS as f64).contains(&seconds) {
        return Err(format!("must be a number of seconds from {MIN_DURATION} to {MAX_SECONDS} (a year)"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// `--ring-buffer-kb`: a power of two from 4 to [`MAX_RING_BUFFER_KB`].
fn parse_ring_buffer_kb(text: &str) -> Result<u32, String> {
    let bad = || format!("must be a power of two from 4 to {MAX_RING_BUFFER_KB} (256 MiB)");
    let kb: u32 = text.trim().parse().map_err(|_| bad())?;
    ring_buffer_kb_fits(kb).then_some(kb).ok_or_else(bad)
}

#[derive(Args, Debug)]
pub struct TopArgs {
    /// Only this process (repeat for several; default: every process on the host)
    #[arg(short = 'p', long = "pid", value_name = "PID", allow_negative_numbers = true)]
    pub pid: Vec<u32>,

    /// Sampling frequency per CPU, in Hz
    #[arg(short = 'F', long = "frequency", value_name = "HZ", default_value_t = 99, allow_negative_numbers = true,
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub frequency: u64,

    #[command(flatten)]
    pub filter: FilterArgs,

    #[command(flatten)]
    pub mode: ModeArgs,

    /// Never write into a profiled process (see `record --read-only`)
    #[arg(long = "read-only")]
    pub read_only: bool,
}

#[derive(Args, Debug)]
pub struct DumpArgs {
    /// The process to read
    #[arg(short = 'p', long = "pid", value_name = "PID", allow_negative_numbers = true)]
    pub pid: u32,

    /// Print JSON instead of tracebacks
    #[arg(long = "json")]
    pub json: bool,

    /// List the asyncio tasks of every thread's event loop instead of the threads' stacks: each
    /// task's name, state and coroutine stack, as a tree of who awaits whom (CPython 3.14+)
    #[arg(long = "async")]
    pub async_tasks: bool,

    /// With --async: read at most this many tasks (the rest are counted and the cut is shown)
    #[arg(long = "max-tasks", value_name = "N", default_value_t = 1000, requires = "async_tasks",
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_tasks: u64,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_finite_positive_and_bounded() {
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("31536000"), Ok(Duration::from_secs(MAX_SECONDS)));
        assert_eq!(parse_duration("0.001"), Ok(Duration::from_millis(1)));
        for bad in ["inf", "-inf", "NaN", "1e20", "-1", "-0", "0", "0.0", "1e-12", "0.0009", "", "x", "31536001"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn ring_buffer_sizes_are_bounded_powers_of_two() {
        assert_eq!(parse_ring_buffer_kb("4"), Ok(4));
        assert_eq!(parse_ring_buffer_kb("262144"), Ok(262_144));
        for bad in ["0", "2", "3", "4095", "524288", "4194304", "4294967296", "-4", "x"] {
            assert!(parse_ring_buffer_kb(bad).is_err(), "{bad:?} accepted");
        }
    }
}
