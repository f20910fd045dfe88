use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::Parser;
use pyebpf::cli::{Cli, Command};
use pyebpf::report;

#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// musl's `memcpy` and `memmove` replaced (see `pyebpf::mem_copy`): both, since musl's `memmove`
/// would bring its `memcpy` along.
#[cfg(all(target_env = "musl", target_arch = "x86_64"))]
mod musl_mem {
    /// # Safety
    /// As C's `memcpy`.
    #[no_mangle]
    pub unsafe extern "C" fn memcpy(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
        // SAFETY: the caller's promise is memcpy's, which covers copy_bytes'.
        unsafe { pyebpf::mem_copy::copy_bytes(dest, src, n) };
        dest
    }

    /// # Safety
    /// As C's `memmove`.
    #[no_mangle]
    pub unsafe extern "C" fn memmove(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
        // SAFETY: as memcpy; copy_bytes allows overlapping ranges.
        unsafe { pyebpf::mem_copy::copy_bytes(dest, src, n) };
        dest
    }
}

fn main() {
    // Before anything else, so a stop signal has the same effect at every moment of the run.
    if let Err(err) = pyebpf::stop_signals::install() {
        report!("cannot install the stop-signal handlers: {err}");
        std::process::exit(1);
    }
    // Diagnostics (why a process's maps or memory could not be read, and the like) only when asked
    // for, e.g. RUST_LOG=pyebpf=debug: a profile's users see `record --stats` and the summary.
    env_logger::Builder::new().filter_level(log::LevelFilter::Off).parse_env("RUST_LOG").init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // A bad value is one line, like every other error; clap's usage help stays for the rest.
        Err(err) if matches!(err.kind(), ErrorKind::ValueValidation | ErrorKind::InvalidValue) => {
            report!("{}", bad_value_line(&err));
            std::process::exit(2);
        }
        Err(err) => err.exit(),
    };
    let result: anyhow::Result<()> = match cli.command {
        Command::Record(args) => pyebpf::record::run(args),
        Command::Dump(args) => {
            // dump writes as it goes: a stop signal ends it at once.
            pyebpf::stop_signals::exit_at_once();
            pyebpf::cpython::dump::run(args)
        }
        Command::Top(args) => pyebpf::top::run(args),
        Command::Man { dir } => {
            pyebpf::cli::write_man_pages(&dir).map_err(|err| anyhow::anyhow!("cannot write the manual pages into {}: {err}", dir.display()))
        }
    };
    if let Err(err) = result {
        report!("{err:#}");
        std::process::exit(1);
    }
}

/// clap's first line, with the values a choice allows (clap lists those on a line of their own).
fn bad_value_line(err: &clap::Error) -> String {
    let rendered = err.to_string();
    let line = rendered.lines().next().unwrap_or_default();
    let line = line.strip_prefix("error: ").unwrap_or(line);
    match err.get(ContextKind::ValidValue) {
        Some(ContextValue::Strings(values)) if !values.is_empty() => format!("{line} (possible values: {})", values.join(", ")),
        _ => line.to_string(),
    }
}
