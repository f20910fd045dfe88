//! Counters of one recording, printed by `record --stats`.

use std::fmt;

use crate::chain::{CacheOutcome, Walk};
use crate::cpython::CodeCacheCounters;

#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub samples: u64,
    pub lost_samples: u64,
    /// Samples that carried Python frames.
    pub python_samples: u64,
    /// Python samples whose chain no longer matched the kernel's capture.
    pub chain_moved: u64,
    /// Python samples whose chain could not be read (the sample kept its native frames).
    pub chain_errors: u64,
    pub frames_read: u64,
    pub frames_reused: u64,
    /// Remote reads (`process_vm_readv` calls) and bytes spent on Python samples.
    pub remote_reads: u64,
    pub remote_bytes: u64,
    /// Code-object caches summed over the processes still attached at the end.
    pub code_cache: CodeCacheCounters,
    pub marker_hits: u64,
    pub marker_partial_hits: u64,
    pub marker_misses: u64,
    /// The address-batch cache (3.13/3.14, and 3.15 where the marker missed).
    pub batch_hits: u64,
    pub batch_partial_hits: u64,
    pub batch_misses: u64,
    /// Python processes attached to.
    pub python_processes: u64,
    /// CPU time pyebpf itself used (user + system), in nanoseconds.
    pub own_cpu_ns: u64,
}

impl Stats {
    pub fn count_walk(&mut self, walk: &Walk) {
        self.frames_read += walk.frames_read;
        self.frames_reused += walk.frames_reused;
        self.chain_moved += u64::from(walk.moved);
        count_outcome(walk.marker, [&mut self.marker_hits, &mut self.marker_partial_hits, &mut self.marker_misses]);
        count_outcome(walk.batch, [&mut self.batch_hits, &mut self.batch_partial_hits, &mut self.batch_misses]);
    }
}

fn count_outcome(outcome: Option<CacheOutcome>, [hits, partial, misses]: [&mut u64; 3]) {
    match outcome {
        Some(CacheOutcome::Hit) => *hits += 1,
        Some(CacheOutcome::PartialHit) => *partial += 1,
        Some(CacheOutcome::Miss) => *misses += 1,
        None => {}
    }
}

fn write_outcomes(f: &mut fmt::Formatter<'_>, label: &str, hits: u64, partial: u64, misses: u64) -> fmt::Result {
    let lookups = hits + partial + misses;
    write!(
        f,
        "{label:<28}{hits} hits ({:.1}%), {partial} partial hits ({:.1}%), {misses} misses ({:.1}%)",
        percent(hits, lookups),
        percent(partial, lookups),
        percent(misses, lookups),
    )
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
        writeln!(
            f,
            "pyebpf CPU time:            {:.1} ms ({:.1} us per sample)",
            self.own_cpu_ns as f64 / 1e6,
            per(self.own_cpu_ns, self.samples) / 1e3
        )?;
        writeln!(f, "python processes:           {}", self.python_processes)?;
        writeln!(f, "python samples:             {py}")?;
        writeln!(f, "  chain moved:              {} ({:.1}%)", self.chain_moved, percent(self.chain_moved, py))?;
        writeln!(f, "  chain unreadable:         {}", self.chain_errors)?;
        writeln!(f, "frames read from memory:    {} ({:.1} per python sample)", self.frames_read, per(self.frames_read, py))?;
        writeln!(f, "frames served from caches:  {} ({:.1} per python sample)", self.frames_reused, per(self.frames_reused, py))?;
        writeln!(f, "remote reads:               {} ({:.2} per python sample)", self.remote_reads, per(self.remote_reads, py))?;
        writeln!(f, "remote bytes:               {} ({:.0} per python sample)", self.remote_bytes, per(self.remote_bytes, py))?;
        let code = &self.code_cache;
        let code_lookups = code.hits + code.misses;
        writeln!(f, "code object cache hit rate: {:.1}% of {code_lookups}", percent(code.hits, code_lookups))?;
        writeln!(f, "code objects cached:        {} ({:.1} MiB)", code.cached_entries, code.cached_bytes as f64 / (1 << 20) as f64)?;
        writeln!(f, "  evicted (cache budget):   {}", code.evictions)?;
        writeln!(f, "  line tables cut at 64 KiB: {}", code.truncated_linetables)?;
        writeln!(f, "  names cut at 4 KiB:       {}", code.truncated_strings)?;
        write_outcomes(f, "last_profiled_frame:", self.marker_hits, self.marker_partial_hits, self.marker_misses)?;
        writeln!(f)?;
        write_outcomes(f, "frame chain cache:", self.batch_hits, self.batch_partial_hits, self.batch_misses)
    }
}
