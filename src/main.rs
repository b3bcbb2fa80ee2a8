use clap::Parser;

fn main() {
    let cli = nanogpt::cli::Cli::parse();
    let code = match nanogpt::cli::run(cli) {
        Ok(code) => code,
        // `error: ...` with the whole context chain on one line (file, problem,
        // fix); in a multi-rank job it names the rank and aborts every rank.
        Err(err) => nanogpt::dist::fail(&err),
    };
    nanogpt::dist::finish(code);
    std::process::exit(code)
}
