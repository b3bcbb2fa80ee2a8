//! What chat templates see of Python through transformers' Jinja environment, written
//! for minijinja: `json.dumps` (transformers' `tojson` filter), `str()` of values
//! printed with `{{ }}`, and `str.strip`'s idea of whitespace.

use std::fmt::Write as _;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// How [`json_dumps`] writes: `json.dumps(x, ensure_ascii, indent, separators,
/// sort_keys)`.
#[derive(Clone, Debug, PartialEq)]
pub struct JsonStyle {
    pub ensure_ascii: bool,
    /// `None`: everything on one line.
    pub indent: Option<String>,
    /// Between items and between a key and its value; Python's default is `(", ",
    /// ": ")`, or `(",", ": ")` with an indent.
    pub separators: (String, String),
    pub sort_keys: bool,
}

impl JsonStyle {
    /// Python's defaults for `indent`.
    pub fn new(indent: Option<String>) -> JsonStyle {
        let item = if indent.is_some() { "," } else { ", " };
        JsonStyle {
            ensure_ascii: false,
            indent,
            separators: (item.into(), ": ".into()),
            sort_keys: false,
        }
    }
}

/// `json.dumps(value)` in `style`: byte for byte what Python writes (insertion order of
/// maps, Python's float repr, its string escapes).
pub fn json_dumps(value: &Value, style: &JsonStyle) -> Result<String, Error> {
    let mut out = String::new();
    write_json(&mut out, value, style, 0)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number(value, NumberStyle::Json)),
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default(), style),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, ('[', ']'), &items, style, depth, |out, item, depth| {
                write_json(out, item, style, depth)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            write_container(out, ('{', '}'), &keys, style, depth, |out, key, depth| {
                write_json_key(out, key, style)?;
                out.push_str(&style.separators.1);
                write_json(out, &value.get_item(key)?, style, depth)
            })?;
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of kind {other:?} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// `[a, b]` / `{k: v}` with Python's indentation: a newline and `depth + 1` indents
/// before each item, a newline and `depth` indents before the closing bracket.
fn write_container(
    out: &mut String,
    (open, close): (char, char),
    items: &[Value],
    style: &JsonStyle,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &Value, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &style.indent {
            out.push('\n');
            (0..level).for_each(|_| out.push_str(indent));
        }
    };
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&style.separators.0);
        }
        newline(out, depth + 1);
        write_item(out, item, depth + 1)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// A map key: strings as they are; numbers, booleans and None as Python converts them.
fn write_json_key(out: &mut String, key: &Value, style: &JsonStyle) -> Result<(), Error> {
    let text = match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::Number => number(key, NumberStyle::Json),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
        ValueKind::None => "null".into(),
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {other:?}"),
            ))
        }
    };
    write_json_string(out, &text, style);
    Ok(())
}

/// A JSON string as Python's `json` module escapes it.
fn write_json_string(out: &mut String, s: &str, style: &JsonStyle) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if style.ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Where a number is written: JSON (`NaN`, `Infinity`) or Python's `str()` (`nan`, `inf`).
#[derive(Clone, Copy, PartialEq)]
enum NumberStyle {
    Json,
    Str,
}

fn number(value: &Value, style: NumberStyle) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(x) => float_repr(x, style),
        Err(_) => value.to_string(),
    }
}

/// Python's `repr(float)`: the shortest digits that read back as `x`, in positional
/// notation for exponents -4..16 (always with a fractional part), else as `1e-05`.
fn float_repr(x: f64, style: NumberStyle) -> String {
    if x.is_nan() {
        return (if style == NumberStyle::Json {
            "NaN"
        } else {
            "nan"
        })
        .into();
    }
    if x.is_infinite() {
        let inf = if style == NumberStyle::Json {
            "Infinity"
        } else {
            "inf"
        };
        return if x > 0.0 {
            inf.into()
        } else {
            format!("-{inf}")
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').expect("{:e} writes an exponent");
    let exp: i32 = exp.parse().expect("{:e} writes an integer exponent");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let body = if exp >= 0 {
            let point = exp as usize + 1;
            let int = format!("{digits:0<point$}");
            let (int, frac) = int.split_at(point);
            let frac = if frac.is_empty() { "0" } else { frac };
            format!("{int}.{frac}")
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.abs())
    }
}

/// Python's `str()` of a value a template prints: `True`, `None`, `1.0`, and lists
/// and dicts as their `repr`. `None` for values printed as minijinja prints them
/// (strings, integers, undefined).
pub fn python_str(value: &Value) -> Option<String> {
    match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => {
            let mut out = String::new();
            write_repr(&mut out, value);
            Some(out)
        }
        ValueKind::Number if !value.is_integer() => Some(number(value, NumberStyle::Str)),
        _ => None,
    }
}

fn write_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number(value, NumberStyle::Str)),
        ValueKind::String => write_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &item);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &key);
                out.push_str(": ");
                write_repr(out, &value.get_item(&key).unwrap_or_default());
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
}

/// Python's `repr(str)`: single quotes unless the text holds a single quote and no
/// double quote; backslashes, that quote and control characters escaped.
fn write_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isspace()`: Unicode's White_Space and the separators U+001C..U+001F
/// (which Rust's `char::is_whitespace` leaves out).
pub fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Which ends `strip` works on.
#[derive(Clone, Copy)]
pub enum Ends {
    Both,
    Start,
    End,
}

/// Python's `str.strip(chars)` / `lstrip` / `rstrip` (and Jinja's `trim`): `chars`
/// given, those characters; else Python's whitespace.
pub fn strip<'s>(s: &'s str, chars: Option<&str>, ends: Ends) -> &'s str {
    let set: Vec<char> = chars.map(|c| c.chars().collect()).unwrap_or_default();
    let strip = |c: char| match chars {
        Some(_) => set.contains(&c),
        None => is_python_space(c),
    };
    match ends {
        Ends::Both => s.trim_matches(strip),
        Ends::Start => s.trim_start_matches(strip),
        Ends::End => s.trim_end_matches(strip),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(json: &str) -> Value {
        let value: serde_json::Value = serde_json::from_str(json).unwrap();
        Value::from(minijinja::value::Serde(&value))
    }

    #[test]
    fn floats_print_as_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (123456789012345.6, "123456789012345.6"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.25e100, "1.25e+100"),
            (-0.0, "-0.0"),
            (5e-324, "5e-324"),
        ];
        for (x, want) in cases {
            assert_eq!(float_repr(x, NumberStyle::Str), want, "{x:e}");
        }
        assert_eq!(float_repr(f64::NAN, NumberStyle::Json), "NaN");
        assert_eq!(
            float_repr(f64::NEG_INFINITY, NumberStyle::Json),
            "-Infinity"
        );
        assert_eq!(float_repr(f64::INFINITY, NumberStyle::Str), "inf");
    }

    #[test]
    fn json_dumps_matches_python_formatting() {
        // Each want is what Python 3.11's json.dumps writes (ensure_ascii=False).
        let value =
            v(r#"{"b": [1, 2.0, "ü\n\"x\"", null, true], "a": {}, "c": [], "d": {"e": 1e-05}}"#);
        let one_line = JsonStyle::new(None);
        assert_eq!(
            json_dumps(&value, &one_line).unwrap(),
            r#"{"b": [1, 2.0, "ü\n\"x\"", null, true], "a": {}, "c": [], "d": {"e": 1e-05}}"#
        );
        let indented = JsonStyle::new(Some("    ".into()));
        assert_eq!(
            json_dumps(&v(r#"{"k": [1, {"x": "y"}], "e": []}"#), &indented).unwrap(),
            "{\n    \"k\": [\n        1,\n        {\n            \"x\": \"y\"\n        }\n    ],\n    \"e\": []\n}"
        );
        let ascii = JsonStyle {
            ensure_ascii: true,
            sort_keys: true,
            ..JsonStyle::new(None)
        };
        assert_eq!(
            json_dumps(&v(r#"{"z": "é😀\u0001", "a": 1}"#), &ascii).unwrap(),
            r#"{"a": 1, "z": "\u00e9\ud83d\ude00\u0001"}"#
        );
    }

    #[test]
    fn printed_values_read_as_python_str() {
        assert_eq!(python_str(&Value::from(true)).as_deref(), Some("True"));
        assert_eq!(python_str(&Value::from(())).as_deref(), Some("None"));
        assert_eq!(python_str(&Value::from(2.0)).as_deref(), Some("2.0"));
        assert_eq!(python_str(&Value::from(2)), None);
        assert_eq!(python_str(&Value::from("s")), None);
        assert_eq!(
            python_str(&v(r#"["a", "it's", 1, false, {"k": null}]"#)).as_deref(),
            Some(r#"['a', "it's", 1, False, {'k': None}]"#)
        );
    }

    #[test]
    fn strip_uses_python_whitespace() {
        assert_eq!(strip("\u{1c} a \u{3000}\n", None, Ends::Both), "a");
        assert_eq!(strip("\n\nx\n", Some("\n"), Ends::Start), "x\n");
        assert_eq!(strip("xyzaxy", Some("xy"), Ends::End), "xyza");
    }
}
