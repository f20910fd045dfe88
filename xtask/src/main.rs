fn main() { eprintln!("usage: cargo xtask <build|run|test>"); std::process::exit(2) }
