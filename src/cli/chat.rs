//! `nanogpt chat`: talk with an instruction-tuned model over stdin and stdout.

use crate::chat::{ChatTemplate, Conversation};
use crate::cli::sample::{StopText, Stops};
use crate::console::exit_if_closed;
use crate::data::instruct::instruct_eot;
use crate::data::Tokenizer;
use crate::model::ParamLayout;
use crate::model_source::load_model_with_adapter;
use crate::sample::{generate_until, SampleOptions};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// The training run to talk to.
    #[arg(long, default_value = "out")]
    pub out_dir: PathBuf,
    /// Another model source instead of --out-dir.
    #[arg(long, conflicts_with = "out_dir")]
    pub init_from: Option<String>,
    /// A PEFT LoRA adapter directory to merge into the model (its base).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// The template the model was fine-tuned with.
    #[arg(long, default_value = "chat")]
    pub template: TemplateArg,
    /// A system message, first in the context (chat template only).
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 keeps all).
    #[arg(long, default_value_t = 200)]
    pub top_k: usize,
    /// Nucleus sampling (0 < P ≤ 1).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Hugging Face's repetition_penalty (1 is off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Also end a reply at this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TemplateArg {
    Chat,
    Alpaca,
}

pub fn run(args: ChatArgs) -> Result<()> {
    crate::threads::init_pool(args.threads, 1)?;
    check(&args)?;
    let src = args
        .init_from
        .clone()
        .unwrap_or_else(|| args.out_dir.to_string_lossy().into_owned());
    let loaded = load_model_with_adapter(&src, args.adapter.as_deref())?;
    let tokenizer = Tokenizer::from_meta(&loaded.meta)?;
    let eot = instruct_eot(&tokenizer)?;
    let layout = ParamLayout::new(&loaded.config);
    let block = loaded.config.block_size;
    let template = match args.template {
        TemplateArg::Chat => ChatTemplate::Chat,
        TemplateArg::Alpaca => ChatTemplate::Alpaca,
    };
    let mut conversation = Conversation::new(template, args.system.clone());
    let stops = Stops {
        eot: Some(eot),
        strings: args.stop.clone(),
    };
    // Half the block at most is kept for the reply; the rest holds the history.
    let budget = block - args.max_new_tokens.min(block / 2);
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        crate::errln!("chatting with {src}; /exit or Ctrl-D ends");
    }
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("cannot read stdin (must be UTF-8 text)")?;
        let message = line.trim_end_matches('\r');
        if message.trim() == "/exit" {
            break;
        }
        if message.trim().is_empty() {
            continue;
        }
        let context = conversation.context(message, &tokenizer, eot, budget)?;
        if context.dropped > 0 {
            conversation.forget(context.dropped);
            crate::errln!(
                "(left out the oldest {} turn(s) to keep the conversation within the \
                 model's block of {block} tokens)",
                context.dropped
            );
        }
        if let Some(&id) = context
            .ids
            .iter()
            .find(|&&id| id as usize >= loaded.config.vocab_size)
        {
            bail!("the message encodes to token {id}, beyond the model's vocabulary");
        }
        let opts = SampleOptions {
            num_samples: 1,
            max_new_tokens: args.max_new_tokens,
            temperature: args.temperature,
            top_k: (args.top_k > 0).then_some(args.top_k),
            seed: args.seed.wrapping_add(conversation.turns() as u64),
            top_p: args.top_p,
            repetition_penalty: args.repetition_penalty,
        };
        let reply = reply(
            &loaded.params,
            &layout,
            &loaded.config,
            &context.ids,
            &opts,
            &tokenizer,
            &stops,
        )?;
        conversation.push(message.to_string(), reply);
    }
    Ok(())
}

fn check(args: &ChatArgs) -> Result<()> {
    if args.temperature < 0.0 || !args.temperature.is_finite() {
        bail!(
            "--temperature must be 0 or more (0 is greedy), got {}",
            args.temperature
        );
    }
    if args.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        bail!("--top-p must be above 0 and at most 1 (e.g. 0.9)");
    }
    if !(args.repetition_penalty > 0.0 && args.repetition_penalty.is_finite()) {
        bail!("--repetition-penalty must be above 0 (1 is off)");
    }
    if args.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    if args.stop.iter().any(String::is_empty) {
        bail!("--stop needs a non-empty string");
    }
    Ok(())
}

/// Generates and streams one reply; returns its text (without the stop).
fn reply(
    params: &[f32],
    layout: &ParamLayout,
    config: &crate::model::ModelConfig,
    ids: &[u32],
    opts: &SampleOptions,
    tokenizer: &Tokenizer,
    stops: &Stops,
) -> Result<String> {
    let mut out = std::io::stdout().lock();
    let mut print = |text: &str| exit_if_closed(write!(out, "{text}").and_then(|()| out.flush()));
    let mut text = StopText::new(tokenizer);
    let mut streamed = Ok(());
    generate_until(params, layout, config, ids, opts, |_, token| {
        let stop = text.push(token, stops);
        if streamed.is_ok() {
            streamed = print(text.take_printable(stops));
        }
        stop
    });
    streamed?;
    let whole = text.whole();
    print(&format!("{}\n", text.finish()))?;
    Ok(whole)
}
