use clap::Parser;

fn main() {
    let cli = nanogpt::cli::Cli::parse();
    if let Err(err) = nanogpt::cli::run(cli) {
        // `{:#}` prints the whole context chain on one line: file, problem, fix.
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
