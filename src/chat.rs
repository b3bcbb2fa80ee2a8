//! A conversation with an instruction-tuned model: its turns, and the tokens the
//! model sees, built exactly as `prepare` builds training examples (see
//! [`crate::data::instruct`]) and kept within the model's block.

use anyhow::{Context as _, Result};
use serde_json::{json, Map, Value};

use crate::data::instruct::{alpaca_prompt, chat_prompt_message, Example, Part, Role};
use crate::data::{RenderOptions, Tokenizer};

/// The template a conversation is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatFormat {
    /// `<|system|>`, `<|user|>`, `<|assistant|>` turns.
    Chat,
    /// Each turn an Alpaca example (instruction, no input); earlier turns are
    /// whole examples before it.
    Alpaca,
    /// The model's own chat template (its tokenizer's), as transformers'
    /// `apply_chat_template(..., add_generation_prompt=True)` writes the
    /// conversation, tokenized as it tokenizes it (no added special tokens).
    Model,
}

/// A conversation: an optional system message and the finished turns.
#[derive(Clone, Debug)]
pub struct Conversation {
    format: ChatFormat,
    system: Option<String>,
    /// (user, assistant) turns, oldest first.
    turns: Vec<(String, String)>,
    /// Extra variables of the model's chat template.
    variables: Map<String, Value>,
}

/// The context for the next reply.
#[derive(Clone, Debug, PartialEq)]
pub struct Context {
    pub ids: Vec<u32>,
    /// Oldest turns left out to fit the budget.
    pub dropped: usize,
}

impl Conversation {
    pub fn new(format: ChatFormat, system: Option<String>) -> Conversation {
        Conversation {
            format,
            system,
            turns: Vec::new(),
            variables: Map::new(),
        }
    }

    /// The extra variables the model's chat template is rendered with.
    pub fn with_variables(mut self, variables: Map<String, Value>) -> Conversation {
        self.variables = variables;
        self
    }

    /// Records a finished turn.
    pub fn push(&mut self, user: String, assistant: String) {
        self.turns.push((user, assistant));
    }

    pub fn turns(&self) -> usize {
        self.turns.len()
    }

    /// The tokens the model sees before replying to `user`: the system message, the
    /// most recent turns that fit in `budget` tokens, then `user`'s prompt. Oldest
    /// turns go first; the system message and the new message always stay (the
    /// generator crops a context that is still too long).
    pub fn context(
        &mut self,
        user: &str,
        tokenizer: &Tokenizer,
        eot: u32,
        budget: usize,
    ) -> Result<Context> {
        let mut dropped = 0;
        loop {
            let ids = match self.format {
                ChatFormat::Model => self.rendered(&self.turns[dropped..], user, tokenizer)?,
                _ => {
                    let example = self.example(&self.turns[dropped..], user);
                    example.encode(tokenizer, eot, &self.variables)?.0
                }
            };
            if ids.len() <= budget || dropped == self.turns.len() {
                return Ok(Context { ids, dropped });
            }
            dropped += 1;
        }
    }

    /// Forgets the oldest `n` turns (those a context dropped: they never return).
    pub fn forget(&mut self, n: usize) {
        self.turns.drain(..n.min(self.turns.len()));
    }

    /// The messages of `turns` and the new one in the model's chat template, with the
    /// generation prompt, tokenized.
    fn rendered(
        &self,
        turns: &[(String, String)],
        user: &str,
        tokenizer: &Tokenizer,
    ) -> Result<Vec<u32>> {
        let template = tokenizer.chat_template().context(
            "this model's tokenizer has no chat template; use --template chat or alpaca",
        )?;
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        for (u, a) in turns {
            messages.push(json!({"role": "user", "content": u}));
            messages.push(json!({"role": "assistant", "content": a}));
        }
        messages.push(json!({"role": "user", "content": user}));
        let opts = RenderOptions {
            add_generation_prompt: true,
            tools: None,
            variables: Some(&self.variables),
        };
        tokenizer.encode(&template.render(&messages, &opts)?)
    }

    /// The parts of `turns` and the new message, as training examples are written.
    fn example(&self, turns: &[(String, String)], user: &str) -> Example {
        let mut parts = Vec::new();
        let system = match (&self.system, self.format) {
            (Some(s), ChatFormat::Chat) => chat_prompt_message(Role::System, s),
            _ => String::new(),
        };
        let mut prompt = system;
        for (u, a) in turns {
            prompt.push_str(&self.prompt(u));
            parts.push(Part::Prompt(std::mem::take(&mut prompt)));
            parts.push(Part::Response(a.clone()));
        }
        prompt.push_str(&self.prompt(user));
        parts.push(Part::Prompt(prompt));
        Example::from_parts(parts)
    }

    fn prompt(&self, user: &str) -> String {
        match self.format {
            ChatFormat::Alpaca => alpaca_prompt(user, ""),
            _ => format!(
                "{}{}",
                chat_prompt_message(Role::User, user),
                Role::Assistant.tag()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_is_the_training_template_and_drops_oldest_turns() {
        let t = Tokenizer::gpt2();
        let mut c = Conversation::new(ChatFormat::Chat, Some("Be brief.".into()));
        c.push("Hi".into(), "Hello!".into());
        c.push("Bye".into(), "Ciao".into());
        let ctx = c.context("Again", &t, 50256, 1000).unwrap();
        assert_eq!(ctx.dropped, 0);
        let text = t.decode(&ctx.ids);
        assert_eq!(
            text,
            "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello!<|endoftext|>\
             <|user|>\nBye\n<|assistant|>\nCiao<|endoftext|><|user|>\nAgain\n<|assistant|>\n"
        );
        // Each part tokenized on its own, as `prepare` does.
        let mut want = t
            .encode("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n")
            .unwrap();
        want.extend(t.encode("Hello!").unwrap());
        want.push(50256);
        assert_eq!(ctx.ids[..want.len()], want[..]);
        // A budget that fits one turn drops the oldest; the system message stays.
        let one = c.context("Again", &t, 50256, ctx.ids.len() - 1).unwrap();
        assert_eq!(one.dropped, 1);
        let text = t.decode(&one.ids);
        assert!(
            text.starts_with("<|system|>\nBe brief.\n<|user|>\nBye\n"),
            "{text}"
        );
        // Nothing fits: every turn dropped, the new message kept.
        let none = c.context("Again", &t, 50256, 1).unwrap();
        assert_eq!(none.dropped, 2);
        c.forget(1);
        assert_eq!(c.turns(), 1);
    }

    #[test]
    fn alpaca_turns_are_whole_examples() {
        let all = format!("{}\u{3}xyz", alpaca_prompt("", ""));
        let t = Tokenizer::char_level(all.chars()).unwrap();
        let mut c = Conversation::new(ChatFormat::Alpaca, Some("ignored".into()));
        c.push("x".into(), "y".into());
        let ctx = c.context("z", &t, 0, 10_000).unwrap();
        let text = t.decode(&ctx.ids);
        assert_eq!(
            text,
            format!("{}y\u{3}{}", alpaca_prompt("x", ""), alpaca_prompt("z", ""))
        );
    }
}
