use clap::Parser;

fn main() {
    let cli = nanogpt::cli::Cli::parse();
    if let Err(err) = nanogpt::cli::run(cli) {
        // `error: ...` with the whole context chain on one line (file, problem,
        // fix); in a multi-rank job it names the rank and aborts every rank.
        nanogpt::dist::fail(&err);
    }
    nanogpt::dist::finish();
}
