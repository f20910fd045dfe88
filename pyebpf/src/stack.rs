//! The profile model every stage shares: resolved frames, samples and their counts.
//! Frames are stored innermost first, as the kernel and pprof order them.

use std::collections::HashMap;
use std::sync::Arc;

/// A loaded file in a process's address space (one executable mapping of `/proc/PID/maps`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Module {
    /// Path as the process sees it (`/usr/lib/libc.so.6`), or a pseudo name (`[vdso]`).
    pub path: Arc<str>,
    /// Start and end of the mapping in the process.
    pub start: u64,
    pub limit: u64,
    /// File offset of `start`.
    pub file_offset: u64,
    /// GNU build ID as lowercase hex, where the ELF has one.
    pub build_id: Option<Arc<str>>,
}

/// A user-space native frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NativeFrame {
    /// Address in the process (return addresses already adjusted to the call instruction).
    pub addr: u64,
    pub module: Option<Arc<Module>>,
    /// Demangled function name, where known.
    pub symbol: Option<Arc<str>>,
    /// Source file and line from DWARF, where present.
    pub file: Option<Arc<str>>,
    pub line: Option<u32>,
}

/// A kernel frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelFrame {
    pub addr: u64,
    pub symbol: Option<Arc<str>>,
}

/// A Python function activation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PythonFrame {
    pub qualname: Arc<str>,
    pub filename: Arc<str>,
    /// `co_firstlineno`.
    pub first_line: u32,
    /// The line being executed; 0 where it could not be computed.
    pub line: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Frame {
    Native(NativeFrame),
    Kernel(KernelFrame),
    Python(PythonFrame),
}

/// Everything that tells one sample's stack apart: the labels pprof keeps plus the frames.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StackKey {
    pub pid: u32,
    pub tid: u32,
    pub comm: Arc<str>,
    /// Innermost first.
    pub frames: Vec<Frame>,
    /// The Python chain was cut at the first frame that could not be proven; the frames kept
    /// are exact, the callers beyond them are missing.
    pub truncated: bool,
    /// Where the process runs (container labels), when known.
    pub labels: Option<Arc<ProcessLabels>>,
}

/// Where a process runs: its PID inside its own PID namespace (when that is not the host's) and
/// its cgroup path (which names the container, for most container runtimes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ProcessLabels {
    pub ns_pid: Option<u32>,
    pub cgroup: Option<Arc<str>>,
}

/// Aggregated samples of one recording.
#[derive(Debug, Default)]
pub struct Profile {
    pub counts: HashMap<StackKey, u64>,
    /// Sampling frequency per CPU, in Hz.
    pub frequency_hz: u64,
    /// Wall-clock start (ns since the Unix epoch) and length of the recording.
    pub start_unix_ns: i64,
    pub duration_ns: i64,
    /// Collapsed output starts each stack at the process's container (`--group-by container`).
    pub group_by_container: bool,
}

impl Profile {
    pub fn new(frequency_hz: u64) -> Self {
        Profile { frequency_hz, ..Default::default() }
    }

    pub fn add(&mut self, key: StackKey, count: u64) {
        *self.counts.entry(key).or_insert(0) += count;
    }

    /// Nanoseconds of CPU time one sample stands for.
    pub fn period_ns(&self) -> u64 {
        1_000_000_000 / self.frequency_hz.max(1)
    }

    pub fn total_samples(&self) -> u64 {
        self.counts.values().sum()
    }

    /// The profile with Python frames aggregated per function (`--function`): line numbers are
    /// dropped, so stacks that differed only in the executing lines become one.
    pub fn by_function(&self) -> Profile {
        let mut merged = Profile {
            counts: HashMap::with_capacity(self.counts.len()),
            frequency_hz: self.frequency_hz,
            start_unix_ns: self.start_unix_ns,
            duration_ns: self.duration_ns,
            group_by_container: self.group_by_container,
        };
        for (key, &count) in &self.counts {
            let mut key = key.clone();
            for frame in &mut key.frames {
                if let Frame::Python(python) = frame {
                    python.line = 0;
                }
            }
            merged.add(key, count);
        }
        merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn python(line: u32) -> Frame {
        Frame::Python(PythonFrame { qualname: "work".into(), filename: "/w.py".into(), first_line: 3, line })
    }

    #[test]
    fn by_function_merges_stacks_that_differ_only_in_lines() {
        let key = |line| StackKey { pid: 1, tid: 1, comm: "python3".into(), frames: vec![python(line), python(20)], truncated: false, labels: None };
        let mut profile = Profile::new(99);
        profile.add(key(4), 2);
        profile.add(key(5), 3);
        let merged = profile.by_function();
        assert_eq!(merged.frequency_hz, 99);
        assert_eq!(merged.counts.len(), 1);
        let (key, count) = merged.counts.iter().next().unwrap();
        assert_eq!(*count, 5);
        assert!(key.frames.iter().all(|f| matches!(f, Frame::Python(p) if p.line == 0 && p.first_line == 3)));
    }
}
