//! `nanogpt sample`: generate text from a trained model, streamed as it comes.

use crate::console::exit_if_closed;
use crate::data::chat_template::parse_variable;
use crate::data::instruct::{alpaca_prompt, instruct_eot, Role};
use crate::data::{RenderOptions, Tokenizer};
use crate::model::{ModelConfig, ParamLayout};
use crate::model_source::{load_model_with_adapter, LoadedModel};
use crate::sample::{generate_until, Held, SampleOptions};
pub use crate::sample::{StopText, Stops};
use crate::train::Trainer;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::Write;
use std::path::{Path, PathBuf};

/// nanoGPT sample.py's defaults.
#[derive(Args, Debug)]
pub struct SampleArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt, or FILE:path to read it from a file.
    #[arg(long, default_value = "\n")]
    pub start: String,
    #[arg(long, default_value_t = 10)]
    pub num_samples: usize,
    #[arg(long, default_value_t = 500)]
    pub max_new_tokens: usize,
    #[command(flatten)]
    pub sampling: Sampling,
    /// Wrap --start in an instruction template and stop at end-of-text: alpaca
    /// (Stanford Alpaca's prompt, no input) or chat (one user message in the model's
    /// own chat template where its tokenizer has one, else `<|user|>` …
    /// `<|assistant|>`).
    #[arg(long, default_value = "none")]
    pub template: Template,
    /// A variable of the model's chat template (repeatable), e.g.
    /// enable_thinking=false; VALUE is read as JSON where it is JSON.
    #[arg(long = "template-var", value_name = "KEY=VALUE", value_parser = parse_variable)]
    pub template_vars: Vec<(String, serde_json::Value)>,
}

/// The model to generate with: the options `sample` and `chat` share.
#[derive(Args, Debug)]
pub struct ModelArgs {
    /// The training run whose model to use.
    #[arg(long, default_value = "out")]
    pub out_dir: PathBuf,
    /// Another model source instead of --out-dir.
    #[arg(long, conflicts_with = "out_dir")]
    pub init_from: Option<String>,
    /// A PEFT LoRA adapter directory to merge into the model (its base).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
}

impl ModelArgs {
    /// Where the model comes from: --init-from, else --out-dir.
    pub fn source(&self) -> String {
        self.init_from
            .clone()
            .unwrap_or_else(|| self.out_dir.to_string_lossy().into_owned())
    }

    /// The model, with the adapter merged in.
    pub fn load(&self) -> Result<LoadedModel> {
        load_model_with_adapter(&self.source(), self.adapter.as_deref())
    }
}

/// How tokens are drawn: the options `sample` and `chat` share.
#[derive(Args, Debug)]
pub struct Sampling {
    /// Below 1 sharpens the distribution, above 1 flattens it; 0 is greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 keeps all).
    #[arg(long, default_value_t = 200)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Nucleus sampling: keep the most likely tokens whose probabilities add up to P
    /// (0 < P ≤ 1; 1 keeps all), after top-k.
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Divide the logit of every token already in the text by this when positive,
    /// multiply when negative (Hugging Face's repetition_penalty; 1 is off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    /// Stop a sample when its text contains this string, which is not printed
    /// (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Precision of the weight matrices: float32, or bfloat16 (rounded once at start
    /// and the f32 copies freed: half the bytes per token and half the memory;
    /// activations stay f32).
    #[arg(long, default_value = "float32", value_parser = clap::builder::PossibleValuesParser::new(crate::model::Dtype::NAMES))]
    pub dtype: String,
    /// With --dtype bfloat16: the kernel of a prompt's bf16 products (auto: the
    /// fastest this CPU has; amx, avx512bf16, onednn or f32 ask for one).
    #[arg(long, default_value = "auto", value_parser = clap::builder::PossibleValuesParser::new(crate::kernels::bf16::Kernel::REQUEST_NAMES))]
    pub bf16_kernel: String,
}

impl Sampling {
    /// Refuses values no sampler takes, naming the flag.
    pub fn check(&self) -> Result<()> {
        if self.temperature < 0.0 || !self.temperature.is_finite() {
            bail!(
                "--temperature must be 0 or more (0 is greedy), got {}",
                self.temperature
            );
        }
        if self.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
            bail!(
                "--top-p must be above 0 and at most 1 (e.g. 0.9), got {}",
                self.top_p.unwrap_or_default()
            );
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            bail!(
                "--repetition-penalty must be above 0 (1 is off, e.g. 1.2 discourages repeats), got {}",
                self.repetition_penalty
            );
        }
        if self.stop.iter().any(String::is_empty) {
            bail!("--stop needs a non-empty string");
        }
        Ok(())
    }

    /// The generation options for `num_samples` of `max_new_tokens`, drawn from `seed`.
    pub fn options(&self, num_samples: usize, max_new_tokens: usize, seed: u64) -> SampleOptions {
        SampleOptions {
            num_samples,
            max_new_tokens,
            temperature: self.temperature,
            top_k: (self.top_k > 0).then_some(self.top_k),
            seed,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            bf16_weights: (self.dtype == "bfloat16")
                .then(|| super::bf16_backend(&self.bf16_kernel)),
        }
    }
}

/// The prompt templates of instruction-tuned models (docs/finetune.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Template {
    /// The prompt as given.
    None,
    /// Stanford Alpaca's prompt without input.
    Alpaca,
    /// One user turn of the chat template.
    Chat,
}

impl Template {
    /// `text` wrapped in nanogpt's own templates.
    pub fn wrap(self, text: &str) -> String {
        match self {
            Template::None => text.to_string(),
            Template::Alpaca => alpaca_prompt(text, ""),
            Template::Chat => format!("{}{text}\n{}", Role::User.tag(), Role::Assistant.tag()),
        }
    }

    /// The prompt's text and ids: `text` in the template, encoded as a prompt; a chat
    /// with a model's own chat template is one user message in it with the
    /// generation prompt, encoded as transformers encodes it (the template writes
    /// any BOS itself).
    pub fn prompt(
        self,
        text: &str,
        tokenizer: &Tokenizer,
        variables: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<(String, Vec<u32>)> {
        if let (Template::Chat, Some(template)) = (self, tokenizer.chat_template()) {
            let message = serde_json::json!({"role": "user", "content": text});
            let opts = RenderOptions {
                add_generation_prompt: true,
                tools: None,
                variables: Some(variables),
            };
            let rendered = template.render(&[message], &opts)?;
            let ids = tokenizer.encode(&rendered)?;
            return Ok((rendered, ids));
        }
        let prompt = self.wrap(text);
        let ids = tokenizer
            .encode_prompt(&prompt)
            .context("cannot encode the prompt")?;
        Ok((prompt, ids))
    }
}

pub fn run(args: SampleArgs) -> Result<()> {
    let sampling = &args.sampling;
    crate::threads::init_pool(sampling.threads, 1)?;
    sampling.check()?;
    if args.num_samples == 0 {
        bail!("--num-samples must be at least 1");
    }
    let mut loaded = args.model.load()?;
    let tokenizer = &loaded.tokenizer;
    let variables = args.template_vars.iter().cloned().collect();
    let (prompt, ids) = args
        .template
        .prompt(&read_prompt(&args.start)?, tokenizer, &variables)?;
    let opts = sampling.options(args.num_samples, args.max_new_tokens, sampling.seed);
    let eots = match args.template {
        Template::None => Vec::new(),
        _ => instruction_stops(tokenizer)?,
    };
    let stops = Stops {
        eots,
        strings: sampling.stop.clone(),
    };
    let layout = ParamLayout::new(&loaded.config);
    let config = &loaded.config;
    check_prompt(&ids, config)?;
    // The loaded weights serve this generation alone: in bf16 the f32 matrices are
    // given back as their copy is made.
    let params = &mut loaded.params;
    stream(tokenizer, &prompt, &opts, &stops, |on_token| {
        generate_until(Held::Own(params), &layout, config, &ids, &opts, on_token)
    })
}

/// The ids an instruction-tuned model's reply ends at: the end-of-text of nanogpt's
/// templates, and every end-of-generation id of a model's own tokenizer.
pub fn instruction_stops(tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let mut eots = tokenizer.stops();
    let eot = instruct_eot(tokenizer)?;
    if !eots.contains(&eot) {
        eots.push(eot);
    }
    Ok(eots)
}

/// Prints a short sample from the model being trained (the quick start's finale).
pub fn print_sample(trainer: &mut Trainer, max_new_tokens: usize) -> Result<()> {
    let opts = SampleOptions {
        num_samples: 1,
        max_new_tokens,
        temperature: 0.8,
        top_k: Some(200),
        seed: trainer.cfg.seed,
        ..SampleOptions::default()
    };
    let tokenizer = trainer.tokenizer();
    let prompt = closing_prompt(tokenizer);
    let ids = tokenizer.encode_prompt(&prompt)?;
    // With LoRA, the base with the adapters merged in.
    let params = trainer.merged_params()?;
    let m = &trainer.model;
    let (layout, config) = (m.base_layout(), m.config());
    check_prompt(&ids, config)?;
    stream(tokenizer, &prompt, &opts, &Stops::default(), |on_token| {
        generate_until(Held::Shared(&params), layout, config, &ids, &opts, on_token)
    })
}

/// The closing sample's prompt: a newline, as nanoGPT's sample.py starts, or where
/// the vocabulary has none (a character set without `\n`), its first character.
fn closing_prompt(tokenizer: &Tokenizer) -> String {
    if tokenizer
        .encode_prompt("\n")
        .is_ok_and(|ids| !ids.is_empty())
    {
        return "\n".into();
    }
    tokenizer.decode(&[0])
}

/// Whether `ids` can prompt `config`'s model: not empty, and within its vocabulary.
fn check_prompt(ids: &[u32], config: &ModelConfig) -> Result<()> {
    if ids.is_empty() {
        bail!("the prompt is empty after tokenisation; pass some text with --start");
    }
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= config.vocab_size) {
        bail!(
            "the prompt encodes to token {id}, beyond this model's vocabulary of {}; use a prompt the model's tokenizer covers",
            config.vocab_size
        );
    }
    Ok(())
}

/// Prints the samples `generate` draws in one batch (it hands each token to the
/// callback it is given, which says whether that sample stops), after the prompt's
/// text `prompt`: the first is streamed token by token, the others are printed when
/// done.
fn stream(
    tokenizer: &Tokenizer,
    prompt: &str,
    opts: &SampleOptions,
    stops: &Stops,
    generate: impl FnOnce(&mut dyn FnMut(usize, u32) -> bool) -> Vec<Vec<u32>>,
) -> Result<()> {
    // The samples are this command's product: a reader that has gone (`| head`) ends
    // the command at once, quietly (console::exit_if_closed).
    let mut out = std::io::stdout().lock();
    let mut print = |text: &str| exit_if_closed(write!(out, "{text}").and_then(|()| out.flush()));
    print(prompt)?;
    let mut texts: Vec<StopText> = (0..opts.num_samples)
        .map(|_| StopText::new(tokenizer))
        .collect();
    let mut streamed = Ok(());
    let samples = generate(&mut |sample, token| {
        let text = &mut texts[sample];
        let stop = text.push(token, stops);
        if sample == 0 && streamed.is_ok() {
            streamed = print(text.take_printable(stops));
        }
        stop
    });
    streamed?;
    let mut texts = texts.into_iter();
    if let Some(first) = texts.next() {
        print(&format!("{}\n", first.finish()))?;
    }
    for rest in texts {
        print(&format!("---------------\n{prompt}{}\n", rest.finish_all()))?;
    }
    if samples.len() > 1 {
        print("---------------\n")?;
    }
    Ok(())
}

/// The `--start` text, or the contents of the file it names as `FILE:path`.
fn read_prompt(start: &str) -> Result<String> {
    match start.strip_prefix("FILE:") {
        Some(path) => {
            let bytes = crate::fsutil::read_limited(Path::new(path), "prompt file", 1 << 30)?;
            String::from_utf8(bytes).map_err(|e| {
                anyhow::anyhow!(
                    "the prompt file {path} is not UTF-8 text (invalid byte at offset {}); save \
                     it as UTF-8",
                    e.utf8_error().valid_up_to()
                )
            })
        }
        None => Ok(start.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_wrap_the_prompt() {
        assert_eq!(Template::None.wrap("hi"), "hi");
        assert_eq!(Template::Chat.wrap("hi"), "<|user|>\nhi\n<|assistant|>\n");
        let a = Template::Alpaca.wrap("hi");
        assert!(
            a.starts_with("Below is an instruction")
                && a.ends_with("### Instruction:\nhi\n\n### Response:")
        );
    }
}
