//! pyebpf: a system-wide sampling profiler for Python on Linux.

pub mod bpf;
pub mod budget;
pub mod chain;
pub mod cli;
pub mod cpython;
pub mod filter;
pub mod kernel_btf;
pub mod merge;
pub mod native_ids;
pub mod output;
pub mod process;
pub mod processes;
pub mod progress;
pub mod python_sampling;
pub mod reader;
pub mod record;
pub mod report;
pub mod stack;
pub mod stats;
pub mod stop_signals;
pub mod summary;
pub mod symbolize;
pub mod target_file;
pub mod top;
pub mod unwind;
pub mod waits;
