//! `nanogpt eval --init-from SRC --data FILE`.

use crate::data::instruct::instruct_eot;
use crate::data::readers::Source;
use crate::data::{eval_window_count, DataFormat, TokenFile, Tokenizer};
use crate::eval::{evaluate_examples, evaluate_tokens, EvalReport};
use crate::model::Gpt;
use crate::model_source::load_model_with_adapter;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// A training run's out_dir, a Hugging Face model directory or name (gpt2, ...),
    /// or a .safetensors file.
    #[arg(long)]
    pub init_from: String,
    /// A PEFT LoRA adapter directory to merge into the model (its base).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// A .bin token file (uint16, nanoGPT's format) or a .txt file, tokenised with
    /// the model's tokenizer; or a .jsonl of instruction examples (Alpaca or chat),
    /// each evaluated on its own, the loss over its response tokens only. With
    /// --task, the task's questions (.jsonl).
    #[arg(long)]
    pub data: PathBuf,
    /// Score multiple-choice questions instead of the loss: hellaswag (HellaSwag's
    /// jsonl) or choice ({"context", "choices", "label"} per line); reports acc,
    /// acc_norm, acc_bytes and acc_token as lm-evaluation-harness computes them.
    #[arg(long)]
    pub task: Option<crate::tasks::TaskKind>,
    /// With --task: only the first N questions.
    #[arg(long, requires = "task")]
    pub limit: Option<usize>,
    /// How a .jsonl is read (alpaca, chat or text); default: detected from its first line.
    #[arg(long)]
    pub format: Option<DataFormat>,
    /// Window length (default: the model's block size).
    #[arg(long)]
    pub block_size: Option<usize>,
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Print one JSON object {"loss", "perplexity", "tokens"} (with --task: the
    /// task's metrics and their standard errors).
    #[arg(long)]
    pub json: bool,
    /// Threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

pub fn run(args: EvalArgs) -> Result<()> {
    if let Some(kind) = args.task {
        return super::eval_task::run(&args, kind);
    }
    crate::threads::init_pool(args.threads, 1)?;
    let loaded = load_model_with_adapter(&args.init_from, args.adapter.as_deref())?;
    let t = args.block_size.unwrap_or(loaded.config.block_size);
    if t == 0 || t > loaded.config.block_size || args.batch_size == 0 {
        bail!(
            "--block-size must be 1..={} (the model's block size) and --batch-size at least 1",
            loaded.config.block_size
        );
    }
    if let Some(source) = instruct_source(&args)? {
        let examples = read_examples(&source, &loaded.meta, loaded.config.vocab_size)?;
        let mut model = Gpt::from_params(loaded.config, loaded.params, 1, t)?;
        let report = evaluate_examples(&mut model, &examples, t, |_, _| {})?;
        return print_report(&args, &report, &format!(" of {} examples", examples.len()));
    }
    let tokens = read_tokens(&args, &loaded.meta, loaded.config.vocab_size)?;
    // No batch larger than the file's windows (a larger one would only allocate more).
    let batch = args
        .batch_size
        .min(eval_window_count(tokens.len(), t).max(1));
    let mut model = Gpt::from_params(loaded.config, loaded.params, batch, t)?;
    let report = evaluate_tokens(&mut model, &tokens, t, batch, |_, _| {})?;
    print_report(&args, &report, "")
}

fn print_report(args: &EvalArgs, report: &EvalReport, of: &str) -> Result<()> {
    if args.json {
        crate::outln!("{}", serde_json::to_string(report)?);
    } else {
        crate::outln!(
            "loss {:.4}, perplexity {:.2}, over {} tokens{of}",
            report.loss,
            report.perplexity,
            report.tokens
        );
    }
    Ok(())
}

/// The instruction examples of a `.jsonl` `--data` (`None` for any other file, and
/// for a `.jsonl` of plain text, which is read as text as before).
fn instruct_source(args: &EvalArgs) -> Result<Option<Source>> {
    let path = &args.data;
    if path.extension().is_none_or(|e| e != "jsonl") {
        if let Some(f) = args.format.filter(|&f| f != DataFormat::Text) {
            bail!(
                "--format {f} reads .jsonl files, but --data {} is not one",
                path.display()
            );
        }
        return Ok(None);
    }
    crate::fsutil::check_regular_file(path, "--data")?;
    let source = Source::resolve_as(&path.to_string_lossy(), "text", args.format)?;
    Ok(source.is_instruct().then_some(source))
}

/// Every example's tokens and mask, with the model's tokenizer.
fn read_examples(
    source: &Source,
    meta: &crate::data::Meta,
    vocab: usize,
) -> Result<Vec<(Vec<u32>, Vec<u8>)>> {
    let tokenizer = Tokenizer::from_meta(meta)?;
    let eot = instruct_eot(&tokenizer)?;
    let mut examples = Vec::new();
    for example in source.examples() {
        let (example, _) = example?;
        let (ids, mask) = example
            .encode(&tokenizer, eot)
            .with_context(|| format!("cannot tokenise {}", source.describe()))?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            bail!(
                "{} encodes to token {id}, beyond the model's vocabulary of {vocab}",
                source.describe()
            );
        }
        examples.push((ids, mask));
    }
    if examples.is_empty() {
        bail!("{} holds no examples", source.describe());
    }
    Ok(examples)
}

/// The tokens of `--data`: a .bin file as is, anything else read as UTF-8 text.
fn read_tokens(args: &EvalArgs, meta: &crate::data::Meta, vocab: usize) -> Result<Vec<u16>> {
    let path = &args.data;
    crate::fsutil::check_regular_file(path, "--data")?;
    if path.extension().is_some_and(|e| e == "bin") {
        let file = TokenFile::open(path)?;
        file.check_vocab(vocab)?;
        return file.read_all();
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not UTF-8 text (invalid byte at offset {}); convert it, e.g. with iconv -t UTF-8",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let ids = Tokenizer::from_meta(meta)?
        .encode(&text)
        .with_context(|| format!("cannot tokenise {}", path.display()))?;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        bail!(
            "{} encodes to token {id}, beyond the model's vocabulary of {vocab}; evaluate text the model's tokenizer covers",
            path.display()
        );
    }
    Ok(ids.into_iter().map(|id| id as u16).collect())
}
