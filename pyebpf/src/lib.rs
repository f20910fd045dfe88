//! pyebpf: a system-wide sampling profiler for Python on Linux.

pub mod bpf;
pub mod budget;
pub mod chain;
pub mod cli;
pub mod cpython;
pub mod filter;
pub mod kernel_btf;
pub mod kernel_maps;
pub mod ktime;
pub mod maps;
// The static binary's memcpy (see main.rs); built elsewhere only to be tested.
#[cfg(all(target_arch = "x86_64", any(test, target_env = "musl")))]
pub mod mem_copy;
pub mod merge;
pub mod mode;
pub mod native_ids;
pub mod otlp;
pub mod output;
pub mod process;
pub mod progress;
pub mod python;
pub mod reader;
pub mod record;
pub mod report;
pub mod sampling_clock;
pub mod session;
pub mod stack;
pub mod stats;
pub mod stop_signals;
pub mod summary;
pub mod symbolize;
pub mod target_file;
pub mod timer_clock;
pub mod top;
pub mod unwind;
pub mod waits;
pub mod wake_timer;
