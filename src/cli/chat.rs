//! `nanogpt chat`: talk with an instruction-tuned model over stdin and stdout.

use crate::chat::{ChatTemplate, Conversation};
use crate::cli::sample::{Sampling, StopText, Stops};
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
    #[command(flatten)]
    pub sampling: Sampling,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TemplateArg {
    Chat,
    Alpaca,
}

pub fn run(args: ChatArgs) -> Result<()> {
    crate::threads::init_pool(args.sampling.threads, 1)?;
    args.sampling.check()?;
    if args.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
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
        strings: args.sampling.stop.clone(),
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
        let seed = args.sampling.seed.wrapping_add(conversation.turns() as u64);
        let opts = args.sampling.options(1, args.max_new_tokens, seed);
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
