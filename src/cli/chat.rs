//! `nanogpt chat`: talk with an instruction-tuned model over stdin and stdout.

use crate::chat::{ChatFormat, Conversation};
use crate::cli::sample::{instruction_stops, ModelArgs, Sampling, StopText, Stops};
use crate::console::exit_if_closed;
use crate::data::chat_template::parse_variable;
use crate::data::instruct::instruct_eot;
use crate::data::Tokenizer;
use crate::model::decode::Decoder;
use crate::model::ParamLayout;
use crate::model_source::LoadedModel;
use crate::sample::{generate_in, SampleOptions};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{BufRead, IsTerminal, Write};

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The template the model was fine-tuned with: chat (the model's own chat
    /// template where its tokenizer has one, else nanogpt's `<|user|>` turns) or
    /// alpaca.
    #[arg(long, default_value = "chat")]
    pub template: TemplateArg,
    /// A system message, first in the context (chat template only).
    #[arg(long)]
    pub system: Option<String>,
    /// A variable of the model's chat template (repeatable), e.g.
    /// enable_thinking=false; VALUE is read as JSON where it is JSON.
    #[arg(long = "template-var", value_name = "KEY=VALUE", value_parser = parse_variable)]
    pub template_vars: Vec<(String, serde_json::Value)>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Print each reply as one line of JSON, `{"reply": TEXT}`, once it is complete
    /// (for scripts: a reply may itself hold newlines, which plain output cannot tell
    /// from the end of the reply).
    #[arg(long)]
    pub json: bool,
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
    if args.system.is_some() && args.template == TemplateArg::Alpaca {
        crate::errln!(
            "note: ignoring --system: Stanford Alpaca's prompt has no system message (use \
             --template chat for one)"
        );
    }
    let src = args.model.source();
    let mut loaded = args.model.load()?;
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        crate::errln!("chatting with {src}; /exit or Ctrl-D ends");
    }
    let input = std::io::stdin().lock();
    converse(
        &args,
        &mut loaded,
        input,
        &mut std::io::stdout().lock(),
        interactive,
    )
}

/// The conversation: one message per line of `input`, each reply streamed to `out`
/// (with a `> ` prompt on stderr when `interactive`). One decoder serves every reply,
/// so its caches and its bf16 weight copy are made once per session.
fn converse(
    args: &ChatArgs,
    loaded: &mut LoadedModel,
    input: impl BufRead,
    out: &mut impl Write,
    interactive: bool,
) -> Result<()> {
    let tokenizer = &loaded.tokenizer;
    let eot = instruct_eot(tokenizer)?;
    let layout = ParamLayout::new(&loaded.config);
    let block = loaded.config.block_size;
    let format = match args.template {
        TemplateArg::Chat if tokenizer.chat_template().is_some() => ChatFormat::Model,
        TemplateArg::Chat => ChatFormat::Chat,
        TemplateArg::Alpaca => ChatFormat::Alpaca,
    };
    let variables = args.template_vars.iter().cloned().collect();
    let mut conversation = Conversation::new(format, args.system.clone()).with_variables(variables);
    let stops = Stops {
        eots: instruction_stops(tokenizer)?,
        strings: args.sampling.stop.clone(),
    };
    // Half the block at most is kept for the reply; the rest holds the history.
    let budget = block - args.max_new_tokens.min(block / 2);
    let mut decoder = Decoder::new(&loaded.config, 1, block);
    if let Some(backend) = &args.sampling.options(1, 1, 0).bf16_weights {
        // This decoder alone reads the weights: the f32 matrices are given back.
        decoder = decoder.with_bf16_weights_releasing(&mut loaded.params, &layout, backend);
    }
    let mut input = input;
    let mut bytes = Vec::new();
    loop {
        if interactive {
            let _ = write!(std::io::stderr(), "> ");
        }
        bytes.clear();
        let read = input
            .read_until(b'\n', &mut bytes)
            .context("cannot read stdin")?;
        if read == 0 {
            break;
        }
        // A line that cannot be a message is skipped with a word; the conversation goes on.
        let Ok(line) = std::str::from_utf8(&bytes) else {
            crate::errln!("(that line is not UTF-8 text: skipped)");
            continue;
        };
        let message = line.trim_end_matches(['\n', '\r']);
        if message.trim() == "/exit" {
            break;
        }
        if message.trim().is_empty() {
            continue;
        }
        let mut context = match conversation.context(message, tokenizer, eot, budget) {
            Ok(context) => context,
            Err(e) => {
                crate::errln!("(the model's vocabulary cannot encode that line: {e:#}; skipped)");
                continue;
            }
        };
        let vocab = loaded.config.vocab_size;
        if let Some(&id) = context.ids.iter().find(|&&id| id as usize >= vocab) {
            crate::errln!(
                "(that line encodes to token {id}, beyond the model's vocabulary of {vocab}: \
                 skipped)"
            );
            continue;
        }
        if context.dropped > 0 {
            conversation.forget(context.dropped);
            crate::errln!(
                "(left out the oldest {} turn(s) to keep the conversation within the \
                 model's block of {block} tokens)",
                context.dropped
            );
        }
        if context.ids.len() > budget {
            let cut = context.ids.len() - budget;
            context.ids.drain(..cut);
            crate::errln!(
                "(that message is {} tokens, more than the {budget} the model's block of \
                 {block} leaves beside a reply of --max-new-tokens {}: only its last {budget} \
                 tokens are read)",
                cut + budget,
                args.max_new_tokens
            );
        }
        let seed = args.sampling.seed.wrapping_add(conversation.turns() as u64);
        let opts = args.sampling.options(1, args.max_new_tokens, seed);
        let model = Model {
            params: &loaded.params,
            layout: &layout,
            config: &loaded.config,
        };
        // With --json the reply is streamed into a buffer, then printed as one line.
        let mut held = Vec::new();
        let mut sink: &mut dyn Write = match args.json {
            true => &mut held,
            false => &mut *out,
        };
        let ids = &context.ids;
        let reply = reply(
            model,
            &mut decoder,
            ids,
            &opts,
            tokenizer,
            &stops,
            &mut sink,
        )?;
        if args.json {
            let line = serde_json::json!({ "reply": reply });
            exit_if_closed(writeln!(out, "{line}").and_then(|()| out.flush()))?;
        }
        conversation.push(message.to_string(), reply);
    }
    Ok(())
}

/// The model a reply is generated with.
#[derive(Clone, Copy)]
struct Model<'a> {
    params: &'a [f32],
    layout: &'a ParamLayout,
    config: &'a crate::model::ModelConfig,
}

/// Generates and streams one reply on the session's decoder; returns its text
/// (without the stop).
fn reply(
    model: Model,
    decoder: &mut Decoder,
    ids: &[u32],
    opts: &SampleOptions,
    tokenizer: &Tokenizer,
    stops: &Stops,
    out: &mut impl Write,
) -> Result<String> {
    let mut print = |text: &str| exit_if_closed(write!(out, "{text}").and_then(|()| out.flush()));
    let mut text = StopText::new(tokenizer);
    let mut streamed = Ok(());
    let (params, layout, config) = (model.params, model.layout, model.config);
    generate_in(decoder, params, layout, config, ids, opts, |_, token| {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::sample::Sampling;
    use crate::data::{Meta, TokenDtype, TokenizerKind};
    use crate::model::decode::bf16_copies_on_this_thread;
    use crate::model::decode::tests::{random_gpt, small};

    /// A random tiny model whose characters cover the chat template.
    fn chat_model() -> LoadedModel {
        let mut chars: Vec<char> = "<|>systemuserassistant\nhi ?\u{3}".chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let chars: String = chars.into_iter().collect();
        let mut config = small(false);
        config.block_size = 64;
        config.vocab_size = chars.chars().count();
        let gpt = random_gpt(config, 1, 5);
        let meta = Meta {
            tokenizer: TokenizerKind::Char,
            vocab_size: chars.chars().count(),
            dtype: TokenDtype::Uint16,
            train_tokens: 0,
            val_tokens: 0,
            chars: Some(chars),
            tokenizer_sha256: None,
            source: String::new(),
        };
        LoadedModel {
            tokenizer: Tokenizer::from_meta(&meta, std::path::Path::new("")).unwrap(),
            config: gpt.config().clone(),
            params: gpt.params.clone(),
            meta,
        }
    }

    fn args(dtype: &str) -> ChatArgs {
        ChatArgs {
            model: ModelArgs {
                out_dir: "unused".into(),
                init_from: None,
                adapter: None,
            },
            template: TemplateArg::Chat,
            system: None,
            template_vars: Vec::new(),
            max_new_tokens: 6,
            json: false,
            sampling: Sampling {
                temperature: 1.0,
                top_k: 0,
                seed: 3,
                threads: 0,
                top_p: None,
                repetition_penalty: 1.0,
                // One line per reply, however it ends.
                stop: vec!["\n".into()],
                dtype: dtype.into(),
                bf16_kernel: "auto".into(),
            },
        }
    }

    #[test]
    fn a_bf16_session_rounds_the_weights_once_for_every_reply() {
        let before = bf16_copies_on_this_thread();
        let mut out = Vec::new();
        let input = "hi\nhi?\nhis\n".as_bytes();
        converse(&args("bfloat16"), &mut chat_model(), input, &mut out, false).unwrap();
        let replies = String::from_utf8(out).unwrap();
        assert_eq!(replies.matches('\n').count(), 3, "{replies:?}");
        assert_eq!(
            bf16_copies_on_this_thread() - before,
            1,
            "one copy per session"
        );
        // f32 makes none.
        converse(
            &args("float32"),
            &mut chat_model(),
            input,
            &mut Vec::new(),
            false,
        )
        .unwrap();
        assert_eq!(bf16_copies_on_this_thread() - before, 1);
    }
}
