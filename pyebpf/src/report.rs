//! Status and error lines on standard error.
//!
//! `eprintln!` panics when standard error is closed or broken (`pyebpf record ... 2>&-`, a reader
//! that went away), which would lose the profile being written; what pyebpf has to say is never
//! worth that, so failed writes are ignored.

use std::fmt;
use std::io::Write;

/// Writes `pyebpf: MESSAGE` and a newline to standard error, ignoring any failure.
pub fn report(message: fmt::Arguments) {
    let _ = writeln!(std::io::stderr().lock(), "pyebpf: {message}");
}

/// Writes text (several lines, no prefix) to standard error, ignoring any failure.
pub fn report_text(text: fmt::Arguments) {
    let _ = writeln!(std::io::stderr().lock(), "{text}");
}

/// `report!("lost {} samples", n)`: a `pyebpf: ` line on standard error that never panics.
#[macro_export]
macro_rules! report {
    ($($arg:tt)*) => {
        $crate::report::report(format_args!($($arg)*))
    };
}
