//! `nanogpt eval --init-from SRC --data FILE`.

use crate::data::chat_template::parse_variable;
use crate::data::instruct::instruct_eot;
use crate::data::readers::Source;
use crate::data::Tokenizer;
use crate::data::{eval_window_count, DataFormat, Meta, TokenDtype, TokenFile, TokenMask};
use crate::eval::{evaluate_examples, evaluate_masked_tokens, EvalReport};
use crate::model::Gpt;
use crate::model_source::{load_model_with_adapter, LoadedModel};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// A training run's out_dir, a Hugging Face model directory or name (gpt2, ...),
    /// or a .safetensors file.
    #[arg(long)]
    pub init_from: String,
    /// A PEFT LoRA adapter directory to merge into the model (its base).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// A .bin token file (nanoGPT's format: uint16, or uint32 where the meta.json
    /// beside it or the model's own data says so; with the .mask beside it, the loss
    /// is over the masked tokens, as training's), a .txt file, tokenised with the
    /// model's tokenizer; a .jsonl or .parquet of documents (their --text-column
    /// field, each followed by end-of-text, as `prepare` writes them), or of
    /// instruction examples (Alpaca or chat), each evaluated on its own, the loss over
    /// its response tokens only. With --task, the task's questions (.jsonl).
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
    /// How a .jsonl or .parquet is read (alpaca, chat or text); default: detected from
    /// its first line or its columns.
    #[arg(long)]
    pub format: Option<DataFormat>,
    /// The field of a plain-text .jsonl that holds the text (as `prepare` reads it).
    #[arg(long, default_value = "text")]
    pub text_column: String,
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
    /// A variable of the model's chat template for chat examples (repeatable), e.g.
    /// enable_thinking=false; VALUE is read as JSON where it is JSON.
    #[arg(long = "template-var", value_name = "KEY=VALUE", value_parser = parse_variable)]
    pub template_vars: Vec<(String, serde_json::Value)>,
}

pub fn run(args: EvalArgs) -> Result<()> {
    if let Some(kind) = args.task {
        let task = super::eval_task::TaskArgs {
            init_from: args.init_from,
            adapter: args.adapter,
            data: args.data,
            limit: args.limit,
            threads: args.threads,
            json: args.json,
        };
        return super::eval_task::run(&task, kind);
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
    let vocab = loaded.config.vocab_size;
    let (tokens, mask) = match record_source(&args)? {
        Some(source) if source.is_instruct() => {
            let vars = args.template_vars.iter().cloned().collect();
            let examples = read_examples(&source, &loaded.tokenizer, &vars, vocab)?;
            let mut model = Gpt::from_params(loaded.config, loaded.params, 1, t)?;
            let report = evaluate_examples(&mut model, &examples, t, |_, _| {})?;
            return print_report(&args, &report, &format!(" of {} examples", examples.len()));
        }
        Some(source) => (read_documents(&source, &loaded.tokenizer, vocab)?, None),
        None => read_tokens(&args, &loaded, vocab)?,
    };
    // No batch larger than the file's windows (a larger one would only allocate more).
    let batch = args
        .batch_size
        .min(eval_window_count(tokens.len(), t).max(1));
    let mut model = Gpt::from_params(loaded.config, loaded.params, batch, t)?;
    let report = evaluate_masked_tokens(&mut model, &tokens, mask.as_deref(), t, batch, |_, _| {})?;
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

/// The source of a `.jsonl` or `.parquet` `--data`: instruction examples, or
/// plain-text documents in the `--text-column` field; `None` for any other file.
fn record_source(args: &EvalArgs) -> Result<Option<Source>> {
    let path = &args.data;
    if path
        .extension()
        .is_none_or(|e| e != "jsonl" && e != "parquet")
    {
        if let Some(f) = args.format.filter(|&f| f != DataFormat::Text) {
            bail!(
                "--format {f} reads .jsonl and .parquet files, but --data {} is neither",
                path.display()
            );
        }
        return Ok(None);
    }
    crate::fsutil::check_regular_file(path, "--data")?;
    let source = Source::resolve_as(&path.to_string_lossy(), &args.text_column, args.format)?;
    Ok(Some(source))
}

/// The tokens of plain-text documents, each followed by end-of-text where the
/// tokenizer has one: what `prepare` writes for them.
fn read_documents(source: &Source, tokenizer: &Tokenizer, vocab: usize) -> Result<Vec<u32>> {
    let mut tokens = Vec::new();
    for piece in source.pieces()? {
        let ids = tokenizer
            .encode(&piece?.text)
            .with_context(|| format!("cannot tokenise {}", source.describe()))?;
        if ids.is_empty() {
            continue;
        }
        tokens.extend(ids.into_iter().chain(tokenizer.eot()));
    }
    if tokens.is_empty() {
        bail!(
            "{} holds no text (no line with a non-empty `{}` field); check the file, or name \
             the text field with --text-column",
            source.describe(),
            match source {
                Source::Jsonl { field, .. } => field.as_str(),
                Source::Parquet { column, .. } => column.as_str(),
                _ => "text",
            }
        );
    }
    check_vocab(tokens, &source.describe(), vocab)
}

/// Token ids the model reads, each checked to be below its vocabulary.
fn check_vocab(ids: Vec<u32>, what: &str, vocab: usize) -> Result<Vec<u32>> {
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        bail!(
            "{what} encodes to token {id}, beyond the model's vocabulary of {vocab}; evaluate \
             text the model's tokenizer covers"
        );
    }
    Ok(ids)
}

/// Every example's tokens and mask, with the model's tokenizer.
fn read_examples(
    source: &Source,
    tokenizer: &Tokenizer,
    variables: &serde_json::Map<String, serde_json::Value>,
    vocab: usize,
) -> Result<Vec<(Vec<u32>, Vec<u8>)>> {
    let eot = instruct_eot(tokenizer)?;
    let mut examples = Vec::new();
    for example in source.examples() {
        let (example, _) = example?;
        let (ids, mask) = example
            .encode(tokenizer, eot, variables)
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

/// The tokens of `--data`: a .bin file as is (with the loss mask beside it, if any:
/// instruction data), anything else read as UTF-8 text.
fn read_tokens(
    args: &EvalArgs,
    loaded: &LoadedModel,
    vocab: usize,
) -> Result<(Vec<u32>, Option<Vec<u8>>)> {
    let path = &args.data;
    if path.extension().is_some_and(|e| e == "bin") {
        let file = TokenFile::open(path, bin_dtype(path, &loaded.meta)?)?;
        file.check_vocab(vocab)?;
        let mask = match TokenMask::open_beside(path, file.len())? {
            None => None,
            Some(mask) => {
                crate::errln!(
                    "note: using {} beside {}: the loss is over the {} tokens it trains (the \
                     responses), as training's val loss is",
                    mask.path().display(),
                    path.display(),
                    mask.trained()
                );
                Some(mask.read_all()?)
            }
        };
        return Ok((file.read_all()?, mask));
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(
        &mut crate::fsutil::open_regular(path, "--data")?,
        &mut bytes,
    )
    .with_context(|| format!("cannot read {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not UTF-8 text (invalid byte at offset {}); convert it, e.g. with iconv -t UTF-8",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let ids = loaded
        .tokenizer
        .encode_single_document(&text)
        .with_context(|| format!("cannot tokenise {}", path.display()))?;
    check_vocab(ids, &path.display().to_string(), vocab).map(|ids| (ids, None))
}

/// The width of the ids in a `.bin` `--data`: what the `meta.json` beside it says
/// (a prepared dataset's split), else that of the model's own data (uint16 for
/// GPT-2 and nanoGPT's files).
/// A dataset's `meta.json` that names another tokenizer than the model's is refused.
fn bin_dtype(path: &Path, model_meta: &Meta) -> Result<TokenDtype> {
    let dir = path.parent().unwrap_or(Path::new("."));
    if !dir.join(Meta::FILE_NAME).is_file() {
        return Ok(model_meta.dtype);
    }
    let data = Meta::load(dir)?;
    let this = format!("dataset {}", dir.display());
    if let Some(what) = model_meta.tokenizer_difference(&data, "the model", &this) {
        bail!(
            "cannot evaluate on {}: {what}, so its ids mean other text to the model; \
             prepare the text with the model's tokenizer",
            path.display()
        );
    }
    Ok(data.dtype)
}
