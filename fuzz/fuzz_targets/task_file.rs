//! A multiple-choice task file (`eval --task`, `eval_tasks`): HellaSwag's jsonl or the
//! generic form (chosen by the first byte), read and encoded for a GPT-2 model.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::data::Tokenizer;
use nanogpt::tasks::{load_task, TaskKind, TaskSpec};

fuzz_target!(|data: &[u8]| {
    let Some((&kind, bytes)) = data.split_first() else {
        return;
    };
    let kind = match kind % 2 {
        0 => TaskKind::Hellaswag,
        _ => TaskKind::Choice,
    };
    let spec = TaskSpec {
        kind,
        path: "task.jsonl".into(),
    };
    let Ok(questions) = load_task(&spec, bytes, Some(64), &Tokenizer::gpt2(), 50257) else {
        return;
    };
    for q in questions {
        assert!(!q.context.is_empty() && q.choices.iter().all(|c| !c.is_empty()));
        assert!(q.label < q.choices.len());
    }
});
