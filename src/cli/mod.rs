//! The `nanogpt` command line: one subcommand per job.

mod bench;
mod chat;
mod doctor;
mod eval;
mod eval_task;
mod export;
mod launch;
mod plan;
mod prepare;
mod sample;
mod serve;
mod train;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "nanogpt",
    version,
    about = "Train and fine-tune GPT-2 and Llama-family models (Llama 3, SmolLM2, Qwen2.5, \
             Qwen3) on CPUs"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Tokenise text into train.bin / val.bin / meta.json (nanoGPT's format).
    Prepare(prepare::PrepareArgs),
    /// Train or fine-tune; with no arguments, the Shakespeare quick start.
    Train(train::TrainArgs),
    /// Mean loss and perplexity of a model over a token or text file.
    Eval(eval::EvalArgs),
    /// Generate text from a trained model.
    Sample(sample::SampleArgs),
    /// Talk with an instruction-tuned model over stdin/stdout (chat or Alpaca template).
    Chat(chat::ChatArgs),
    /// Serve a model over an OpenAI-compatible HTTP API (completions, chat,
    /// streaming, logprobs), on loopback unless told otherwise.
    Serve(serve::ServeArgs),
    /// Write a trained model as a Hugging Face model directory (transformers opens
    /// it) or a GGUF file (llama.cpp, Ollama).
    Export(export::ExportArgs),
    /// Time training steps on synthetic tokens: ms/step, tokens/s, MFU, peak RSS.
    Bench(bench::BenchArgs),
    /// Predicted peak memory per rank of a training run, against what is available.
    Plan(plan::PlanArgs),
    /// Check a job before training (alone or under mpirun/srun): per rank the host,
    /// binary, CPU, memory, data fingerprint; out_dir; all-reduce speed.
    Doctor(doctor::DoctorArgs),
    /// Run `train` on several hosts: writes, prints and runs the mpirun line for the
    /// MPI installed (Open MPI or MPICH/Intel MPI), after `doctor`.
    Launch(launch::LaunchArgs),
    /// This host's nanogpt build, MPI and networks as one line of JSON: what
    /// `launch` asks every host over SSH before starting.
    #[command(hide = true)]
    HostInfo,
}

/// Runs the command; returns the process's exit status (non-zero only for a
/// training run stopped by a signal: 130 for SIGINT, 143 for SIGTERM).
pub fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Prepare(args) => prepare::run(args).map(|()| 0),
        Command::Train(args) => train::run(args),
        Command::Eval(args) => eval::run(args).map(|()| 0),
        Command::Sample(args) => sample::run(args).map(|()| 0),
        Command::Chat(args) => chat::run(args).map(|()| 0),
        Command::Serve(args) => serve::run(args).map(|()| 0),
        Command::Export(args) => export::run(args).map(|()| 0),
        Command::Bench(args) => bench::run(args).map(|()| 0),
        Command::Plan(args) => plan::run(args).map(|()| 0),
        Command::Doctor(args) => doctor::run(args),
        Command::Launch(args) => launch::run(args),
        Command::HostInfo => {
            crate::outln!(
                "{}",
                serde_json::to_string(&crate::launch::probe::this_host())?
            );
            Ok(0)
        }
    }
}

/// The bf16 back-end of this process for a request by name (`auto` or a kernel's, as
/// `--bf16-kernel` and the `bf16_kernel` key take it; the parser has checked it).
pub fn bf16_backend(request: &str) -> crate::kernels::bf16::Backend {
    use crate::kernels::bf16::{Backend, Kernel};
    Backend::detect(Kernel::parse_request(request).flatten())
}
