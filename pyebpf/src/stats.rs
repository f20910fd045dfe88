//! Counters of one recording, printed by `record --stats`.

use std::fmt;

use crate::cpython::CodeCacheCounters;

#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub samples: u64,
    /// Samples lost, in the kernel (ring buffer full) or by the reader thread (below).
    pub lost_samples: u64,
    /// Batches (and their samples) the ring-buffer reader dropped because the consumer was behind.
    pub reader_dropped_batches: u64,
    pub reader_dropped_samples: u64,
    /// Samples counted with the stack resolved for an identical one before (no resolution of their own).
    pub repeats: u64,
    /// Samples that carried Python frames.
    pub python_samples: u64,
    /// Python samples cut at the first frame that could not be proven (depth limit, unreadable
    /// frame, a code object freed since the sample, no proven chain behind a marker).
    pub truncated_samples: u64,
    /// Frames the eBPF program walked at the samples.
    pub kernel_frames: u64,
    /// Frames appended from established marker chains (3.15).
    pub frames_joined: u64,
    pub marker_joins: u64,
    pub markers_established: u64,
    /// Establishments abandoned: the thread moved while it was read, or a read or check failed.
    pub marker_races: u64,
    /// Remote reads (`process_vm_readv` calls) and bytes spent on Python samples.
    pub remote_reads: u64,
    pub remote_bytes: u64,
    /// Code-object caches summed over the processes still attached at the end.
    pub code_cache: CodeCacheCounters,
    /// Python processes attached to.
    pub python_processes: u64,
    /// Processes running a CPython pyebpf does not read (`CPython 3.11.2 (pid 6309)`).
    pub unsupported_pythons: NamedProcesses,
    /// Free-threaded CPython processes read (no GIL: `--mode gil` counts their time on CPU).
    pub free_threaded: NamedProcesses,
    /// CPU time pyebpf itself used (user + system), in nanoseconds.
    pub own_cpu_ns: u64,
    /// Which clock sampled: `timer`, or `perf-event` and why (see `bpf::Sampler::clock`).
    pub sampling_clock: String,
    /// Time the eBPF sampler ran in the kernel, on the sampled CPUs, and how many times it ran
    /// (every tick of every CPU, also those it drops at once).
    pub program_run_time_ns: u64,
    pub program_runs: u64,
    /// The same for the switch hook (`--mode wall`, `off-cpu`): every context switch on the host.
    pub switch_run_time_ns: u64,
    pub switch_runs: u64,
    /// Samples unwound from a stack copy (`--unwind dwarf|auto`), and those whose unwind stopped
    /// before the stack's root (of them, those whose copy had reached its size limit).
    pub unwound_samples: u64,
    /// Samples the eBPF program unwound itself, by the rules published to it (none copied).
    pub rules_unwound_samples: u64,
    pub unwind_truncated: u64,
    pub unwind_truncated_copy_full: u64,
    /// Stack bytes copied, and CPU time spent unwinding them in userspace (reading files included).
    pub stack_bytes: u64,
    pub unwind_ns: u64,
    /// `--mode wall` and `off-cpu`.
    pub off_cpu: OffCpuTotals,
    /// `--async-aware`.
    pub tasks: TaskTotals,
    /// `--otlp`.
    pub otlp: Option<crate::otlp::OtlpTotals>,
}

/// asyncio tasks read at the captures (`--async-aware`).
#[derive(Debug, Default, Clone)]
pub struct TaskTotals {
    /// `--async-aware` was given.
    pub enabled: bool,
    /// Python samples of a thread running a task, with the task chain placed in the stack.
    pub placed: u64,
    /// Of a thread running a task whose coroutine frame is not in the stack the sample kept (the
    /// stack was cut before it, or the task had not entered its coroutine yet): no task frames.
    pub unplaced: u64,
    /// Chains cut: past 8 tasks, an awaiter that could not be read, or awaiting tasks' frames
    /// past 32 or unproven.
    pub chains_cut: u64,
    /// Waiting tasks' stacks counted (`--mode wall|off-cpu`), and captures that read their thread's
    /// task list in part (past 16 waiting tasks, or out of steps).
    pub waiting: u64,
    pub waiting_cut: u64,
    /// Processes whose tasks cannot be read (`CPython 3.13.9 (pid 6309)`: before 3.14, no asyncio
    /// debug offsets).
    pub unsupported: NamedProcesses,
}

/// Processes named by a description each, the first [`MAX_NAMED_UNSUPPORTED`] of them, and how
/// many more there were.
#[derive(Debug, Default, Clone)]
pub struct NamedProcesses {
    pub names: Vec<String>,
    pub more: u64,
}

impl NamedProcesses {
    pub fn add(&mut self, description: String) {
        if self.names.len() < MAX_NAMED_UNSUPPORTED {
            self.names.push(description);
        } else {
            self.more += 1;
        }
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

/// `A, B and 2 more`.
impl fmt::Display for NamedProcesses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.names.join(", "))?;
        if self.more > 0 {
            write!(f, " and {} more", self.more)?;
        }
        Ok(())
    }
}

/// Off-CPU intervals of a recording.
#[derive(Debug, Default, Clone, Copy)]
pub struct OffCpuTotals {
    /// Captured with their stacks (those still open at the end included).
    pub intervals: u64,
    /// Threads still off CPU when the recording ended, counted up to its end.
    pub open_at_end: u64,
    /// Begun without a capture (the thread's last one was more recent than `--off-cpu-min`):
    /// summed in the kernel, without stacks.
    pub short_intervals: u64,
    pub short_ns: u64,
    /// The part of `short_ns` counted with the thread's next captured stacks (the rest had no
    /// capture after it before the end).
    pub carried_ns: u64,
}

/// Processes of unsupported CPythons named in the summary at most.
pub const MAX_NAMED_UNSUPPORTED: usize = 8;

/// The counters resolving one sample adds to (those a sample resolved once and counted again for
/// its repeats adds to each time): what a repeat adds is what its first resolution did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SampleCounts {
    python_samples: u64,
    truncated_samples: u64,
    kernel_frames: u64,
    frames_joined: u64,
    marker_joins: u64,
    tasks_unplaced: u64,
}

impl SampleCounts {
    pub fn of(stats: &Stats) -> SampleCounts {
        SampleCounts {
            python_samples: stats.python_samples,
            truncated_samples: stats.truncated_samples,
            kernel_frames: stats.kernel_frames,
            frames_joined: stats.frames_joined,
            marker_joins: stats.marker_joins,
            tasks_unplaced: stats.tasks.unplaced,
        }
    }

    /// What `stats` gained since `self` was taken of them.
    pub fn since(self, stats: &Stats) -> SampleCounts {
        let now = SampleCounts::of(stats);
        SampleCounts {
            python_samples: now.python_samples - self.python_samples,
            truncated_samples: now.truncated_samples - self.truncated_samples,
            kernel_frames: now.kernel_frames - self.kernel_frames,
            frames_joined: now.frames_joined - self.frames_joined,
            marker_joins: now.marker_joins - self.marker_joins,
            tasks_unplaced: now.tasks_unplaced - self.tasks_unplaced,
        }
    }

    pub fn add_to(self, stats: &mut Stats) {
        stats.python_samples += self.python_samples;
        stats.truncated_samples += self.truncated_samples;
        stats.kernel_frames += self.kernel_frames;
        stats.frames_joined += self.frames_joined;
        stats.marker_joins += self.marker_joins;
        stats.tasks.unplaced += self.tasks_unplaced;
    }
}

impl Stats {
    pub fn count_unwind(&mut self, unwound: &crate::unwind::Unwound, stack_bytes: usize, copy_full: bool, cpu_ns: u64) {
        self.unwound_samples += 1;
        self.stack_bytes += stack_bytes as u64;
        self.unwind_ns += cpu_ns;
        if !unwound.complete {
            self.unwind_truncated += 1;
            if copy_full {
                self.unwind_truncated_copy_full += 1;
            }
        }
    }
}

fn per(value: u64, count: u64) -> f64 {
    if count == 0 {
        0.0
    } else {
        value as f64 / count as f64
    }
}

fn percent(part: u64, whole: u64) -> f64 {
    100.0 * per(part, whole)
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let py = self.python_samples;
        writeln!(f, "samples:                    {}", self.samples)?;
        writeln!(f, "lost samples:               {}", self.lost_samples)?;
        writeln!(f, "  by the reader:            {} ({} batches: the consumer was behind)", self.reader_dropped_samples, self.reader_dropped_batches)?;
        writeln!(f, "pyebpf CPU time:            {:.1} ms ({:.1} us per sample)", self.own_cpu_ns as f64 / 1e6, per(self.own_cpu_ns, self.samples) / 1e3)?;
        writeln!(f, "sampling clock:             {}", self.sampling_clock)?;
        writeln!(
            f,
            "eBPF program time:          {:.1} ms ({:.2} us per recorded sample, {:.2} us per run)",
            self.program_run_time_ns as f64 / 1e6,
            per(self.program_run_time_ns, self.samples) / 1e3,
            per(self.program_run_time_ns, self.program_runs) / 1e3
        )?;
        if self.switch_runs > 0 {
            writeln!(
                f,
                "switch hook time:           {:.1} ms ({:.0} ns per context switch, {} switches)",
                self.switch_run_time_ns as f64 / 1e6,
                per(self.switch_run_time_ns, self.switch_runs),
                self.switch_runs
            )?;
        }
        let unwound = self.unwound_samples;
        writeln!(
            f,
            "CFI-unwound samples:        {unwound} ({:.0} stack bytes, {:.2} us CPU unwinding per sample)",
            per(self.stack_bytes, unwound),
            per(self.unwind_ns, unwound) / 1e3
        )?;
        writeln!(f, "  in the kernel, by rules:  {} (sent without a stack copy)", self.rules_unwound_samples)?;
        writeln!(
            f,
            "  stopped before the root:  {} ({:.1}%; {} with the 16 KiB copy full)",
            self.unwind_truncated,
            percent(self.unwind_truncated, unwound),
            self.unwind_truncated_copy_full
        )?;
        writeln!(
            f,
            "repeated samples:           {} ({:.1}%: counted with the stack resolved for an identical sample)",
            self.repeats,
            percent(self.repeats, self.samples)
        )?;
        writeln!(f, "python processes:           {}", self.python_processes)?;
        writeln!(f, "python samples:             {py}")?;
        writeln!(f, "  truncated:                {} ({:.1}%)", self.truncated_samples, percent(self.truncated_samples, py))?;
        writeln!(f, "frames walked in the kernel: {} ({:.1} per python sample)", self.kernel_frames, per(self.kernel_frames, py))?;
        writeln!(f, "frames from marker chains:  {} ({:.1} per python sample)", self.frames_joined, per(self.frames_joined, py))?;
        writeln!(f, "marker joins:               {} ({:.1}% of python samples)", self.marker_joins, percent(self.marker_joins, py))?;
        writeln!(f, "markers established:        {} ({} abandoned: the thread moved or a read failed)", self.markers_established, self.marker_races)?;
        writeln!(f, "remote reads:               {} ({:.2} per python sample)", self.remote_reads, per(self.remote_reads, py))?;
        writeln!(f, "remote bytes:               {} ({:.0} per python sample)", self.remote_bytes, per(self.remote_bytes, py))?;
        code_cache_lines(&self.code_cache, f)?;
        if let Some(otlp) = &self.otlp {
            write!(f, "\n{otlp}")?;
        }
        Ok(())
    }
}

/// `--stats`' lines on the code-object caches.
fn code_cache_lines(code: &CodeCacheCounters, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let code_lookups = code.hits + code.misses;
    writeln!(f, "code object cache hit rate: {:.1}% of {code_lookups}", percent(code.hits, code_lookups))?;
    writeln!(f, "code objects cached:        {} ({:.1} MiB)", code.cached_entries, code.cached_bytes as f64 / (1 << 20) as f64)?;
    writeln!(f, "  evicted (cache budget):   {}", code.evictions)?;
    writeln!(f, "  line tables cut at 64 KiB: {}", code.truncated_linetables)?;
    write!(f, "  names cut at 4 KiB:       {}", code.truncated_strings)
}
