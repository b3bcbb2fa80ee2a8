//! HellaSwag (Zellers et al., 2019) as lm-evaluation-harness's `hellaswag` task reads
//! it: the context is `activity_label + ": " + ctx_a + " " + capitalize(ctx_b)`, and
//! the context and each ending are cleaned of WikiHow's markup the same way
//! ([`preprocess`]).

use super::{is_python_space, label_field, string_field, strings_field, Question};
use anyhow::Result;
use serde_json::{Map, Value};

/// One line of HellaSwag's jsonl (`ctx_a`, `ctx_b`, `activity_label`, `endings`,
/// `label`; other keys are ignored) as a question.
pub fn question(object: &Map<String, Value>) -> Result<Question> {
    let ctx = format!(
        "{} {}",
        string_field(object, "ctx_a")?,
        capitalize(&string_field(object, "ctx_b")?)
    );
    let activity = string_field(object, "activity_label")?;
    let endings = strings_field(object, "endings")?;
    let label = label_field(object, "label", endings.len())?;
    Ok(Question {
        context: preprocess(&format!("{activity}: {ctx}")),
        choices: endings.iter().map(|e| preprocess(e)).collect(),
        label,
    })
}

/// The harness's cleaning of HellaSwag text, step by step: surrounding whitespace
/// removed, `" [title]"` made `". "`, every `[...]` (not across a line break)
/// removed, then each double space made single (one pass, left to right).
pub fn preprocess(text: &str) -> String {
    let text = text.trim_matches(is_python_space).replace(" [title]", ". ");
    drop_brackets(&text).replace("  ", " ")
}

/// Python's `re.sub(r"\[.*?\]", "", text)`: from each `[`, the shortest run up to a
/// `]` with no line break inside is removed; a `[` with a line break before its
/// next `]` (or no `]`) stays, and the search goes on after it.
fn drop_brackets(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('[') {
        let after = &rest[open + 1..];
        match after.find([']', '\n']) {
            Some(end) if after.as_bytes()[end] == b']' => {
                out.push_str(&rest[..open]);
                rest = &after[end + 1..];
            }
            _ => {
                out.push_str(&rest[..=open]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Python's `str.capitalize`: the first character in title case, the rest in lower
/// case (a final sigma included, which looks back at the first character).
pub fn capitalize(text: &str) -> String {
    let Some(first) = text.chars().next() else {
        return String::new();
    };
    let lower = text.to_lowercase();
    let first_lower: usize = first.to_lowercase().map(char::len_utf8).sum();
    let mut out = title_case(first);
    out.push_str(&lower[first_lower..]);
    out
}

/// A character's title case (Unicode's, as Python has it): its upper case, except
/// where the title case differs: the first letter alone of an upper case that
/// spells several (`ß` → `Ss`, `ﬁ` → `Fi`), the Latin digraphs (`ǆ` → `ǅ`),
/// Georgian letters (themselves) and Greek letters with a subscript iota.
fn title_case(c: char) -> String {
    let special = match c as u32 {
        0x1C4..=0x1C6 => "\u{1C5}",
        0x1C7..=0x1C9 => "\u{1C8}",
        0x1CA..=0x1CC => "\u{1CB}",
        0x1F1..=0x1F3 => "\u{1F2}",
        0x149 => "\u{2BC}N",
        0x10D0..=0x10FA | 0x10FD..=0x10FF => return c.into(),
        // ᾀ..ᾯ: the capital with its iota subscript, 8 code points on.
        0x1F80..=0x1FAF => return char::from_u32(c as u32 | 8).map_or(c.into(), String::from),
        0x1FB3 | 0x1FBC => "\u{1FBC}",
        0x1FC3 | 0x1FCC => "\u{1FCC}",
        0x1FF3 | 0x1FFC => "\u{1FFC}",
        0x1FB2 => "\u{1FBA}\u{345}",
        0x1FC2 => "\u{1FCA}\u{345}",
        0x1FF2 => "\u{1FFA}\u{345}",
        0x1FB4 => "\u{386}\u{345}",
        0x1FC4 => "\u{389}\u{345}",
        0x1FF4 => "\u{38F}\u{345}",
        0x1FB7 => "\u{391}\u{342}\u{345}",
        0x1FC7 => "\u{397}\u{342}\u{345}",
        0x1FF7 => "\u{3A9}\u{342}\u{345}",
        _ => {
            let mut upper = c.to_uppercase();
            let mut out: String = upper.next().into_iter().collect();
            out.extend(upper.flat_map(char::to_lowercase));
            return out;
        }
    };
    special.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected values from the harness's `preprocess` and Python's `capitalize`
    /// (lm_eval/tasks/hellaswag/utils.py, Python 3.11).
    #[test]
    fn preprocess_matches_the_harness() {
        let cases = [
            (
                "  Making a cake: [header] How to bake [title] Mix the flour. [step] Stir.  ",
                "Making a cake: How to bake. Mix the flour. Stir.",
            ),
            ("a [b [c] d] e", "a d] e"),
            (
                "keep [across\nlines] and [drop] this",
                "keep [across\nlines] and this",
            ),
            ("unclosed [bracket", "unclosed [bracket"),
            ("three   spaces", "three  spaces"),
            ("\u{1c}sep\u{1f}", "sep"),
        ];
        for (input, want) in cases {
            assert_eq!(preprocess(input), want, "{input:?}");
        }
    }

    #[test]
    fn capitalize_is_python_s() {
        assert_eq!(capitalize("then, THE man SITS."), "Then, the man sits.");
        assert_eq!(capitalize(""), "");
        assert_eq!(capitalize("ǆungla ΟΔΟΣ"), "ǅungla οδος");
        assert_eq!(capitalize("ßtraße"), "Sstraße");
        assert_eq!(capitalize("ﬁne AΣ"), "Fine aς");
        assert_eq!(capitalize("ᾳ"), "ᾼ");
    }

    #[test]
    fn a_line_becomes_the_harness_s_question() {
        let line = r#"{"ind": 4, "activity_label": "Removing ice from car",
            "ctx_a": "Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes smiles.",
            "ctx_b": "then", "ctx": "ignored",
            "endings": [", the man adds wax to the windshield and cuts it.", ", a person board a ski lift, while two men supporting the head of the person wearing winter clothes snow as the we girls sled.", ", the man puts on a christmas coat, knitted with netting.", ", the man continues removing the snow on his car."],
            "source_id": "activitynet~v_-1IBHYS3L-Y", "split": "train", "split_type": "indomain", "label": "3"}"#;
        let object: Map<String, Value> = serde_json::from_str(line).unwrap();
        let q = question(&object).unwrap();
        assert_eq!(
            q.context,
            "Removing ice from car: Then, the man writes over the snow covering the window of \
             a car, and a woman wearing winter clothes smiles. Then"
        );
        assert_eq!(
            q.choices[3],
            ", the man continues removing the snow on his car."
        );
        assert_eq!(q.label, 3);
    }
}
