use clap::error::ErrorKind;
use clap::Parser;
use pyebpf::cli::{Cli, Command};
use pyebpf::report;

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // A bad value is one line, like every other error; clap's usage help stays for the rest.
        Err(err) if err.kind() == ErrorKind::ValueValidation => {
            let rendered = err.to_string();
            let line = rendered.lines().next().unwrap_or_default();
            report!("{}", line.strip_prefix("error: ").unwrap_or(line));
            std::process::exit(2);
        }
        Err(err) => err.exit(),
    };
    let result: anyhow::Result<()> = match cli.command {
        Command::Record(args) => pyebpf::record::run(args),
        Command::Dump(args) => pyebpf::cpython::dump::run(args),
        Command::Top(args) => pyebpf::top::run(args),
    };
    if let Err(err) = result {
        report!("{err:#}");
        std::process::exit(1);
    }
}
