//! Which samples a recording keeps: `--comm REGEX` (the process's name) and `--python-only`.

use regex::Regex;

#[derive(Debug, Clone, Default)]
pub struct SampleFilter {
    /// Keep only processes whose `comm` matches (anywhere in the name, as `grep` does).
    pub comm: Option<Regex>,
    /// Keep only samples of CPython 3.8+ processes.
    pub python_only: bool,
}

impl SampleFilter {
    /// Whether a process of this name is profiled at all: pyebpf neither attaches to nor reads
    /// processes this rejects.
    pub fn keeps_process(&self, comm: &str) -> bool {
        self.comm.as_ref().is_none_or(|regex| regex.is_match(comm))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comm_matches_anywhere_unless_anchored() {
        let filter = |pattern: &str| SampleFilter { comm: Some(Regex::new(pattern).unwrap()), python_only: false };
        assert!(filter("python").keeps_process("python3.14"));
        assert!(!filter("^py$").keeps_process("python3.14"));
        assert!(SampleFilter::default().keeps_process("anything"));
    }
}
