use clap::Parser;
use pyebpf::cli::{Cli, Command};

fn main() {
    let cli = Cli::parse();
    let result: anyhow::Result<()> = match cli.command {
        Command::Record(args) => pyebpf::record::run(args),
        Command::Dump(args) => pyebpf::cpython::dump::run(args),
    };
    if let Err(err) = result {
        eprintln!("pyebpf: {err:#}");
        std::process::exit(1);
    }
}
