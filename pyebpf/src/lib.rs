//! pyebpf: a system-wide sampling profiler for Python on Linux.

pub mod cli;
pub mod stack;
