//! Which modules of a model an `adapter_config.json` puts LoRA adapters on, as PEFT
//! decides it (`check_target_module_exists` in peft's `tuners_utils`), so that an
//! adapter is applied here exactly where PEFT applies it:
//!
//! - `target_modules`: a list of names, each matching a module whose name is it or
//!   ends with `.NAME`; or one string, a regular expression the whole name must
//!   match (`re.fullmatch`); or `"all-linear"`, every linear layer but the output.
//! - `exclude_modules`: the same forms, for modules that get none.
//! - `layers_to_transform` (a layer index or a list) with `layers_pattern`: only
//!   modules of those layers, the layer read from the name (`….h.3.…`). As in PEFT,
//!   it applies only with a list of `target_modules`.
//!
//! Module names are the Hugging Face model's, e.g. `transformer.h.0.attn.c_attn`.

use anyhow::{bail, Context, Result};
use regex::Regex;
use serde_json::Value;

/// The module selection of one adapter config.
#[derive(Debug)]
pub struct Selection {
    targets: Names,
    exclude: Option<Names>,
    /// `layers_to_transform`, with the patterns of `layers_pattern` (none: any).
    layers: Option<(Vec<u64>, Vec<Regex>)>,
}

#[derive(Debug)]
enum Names {
    List(Vec<String>),
    Pattern(Regex),
    AllLinear,
}

impl Names {
    /// Reads `key` of the config (a list of strings or one string); `None` if unset.
    fn read(json: &Value, key: &str) -> Result<Option<Names>> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s == "all-linear" && key == "target_modules" => {
                Ok(Some(Names::AllLinear))
            }
            Some(Value::String(s)) => {
                let re = Regex::new(&format!("^(?:{s})$")).with_context(|| {
                    format!("{key} {s:?} is not a regular expression nanogpt can read")
                })?;
                Ok(Some(Names::Pattern(re)))
            }
            Some(Value::Array(items)) => {
                let names = items
                    .iter()
                    .map(|v| v.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .with_context(|| format!("{key} must be a list of module names"))?;
                Ok(Some(Names::List(names)))
            }
            Some(other) => bail!("{key} must be a list of module names or a pattern, got {other}"),
        }
    }

    /// Whether the module `name` (with `linear`: a linear layer) is one of these.
    fn matches(&self, name: &str, linear: bool) -> bool {
        match self {
            Names::List(list) => list
                .iter()
                .any(|n| name == n || name.ends_with(&format!(".{n}"))),
            Names::Pattern(re) => re.is_match(name),
            Names::AllLinear => linear,
        }
    }
}

impl Selection {
    /// The selection of the adapter config `json`; an error names the key at fault.
    pub fn read(json: &Value) -> Result<Selection> {
        let targets = Names::read(json, "target_modules")?
            .context("target_modules is missing (the modules that carry adapters)")?;
        let exclude = Names::read(json, "exclude_modules")?;
        let layers = match json.get("layers_to_transform") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if a.is_empty() => None,
            Some(v) => {
                let list = match v {
                    Value::Array(a) => a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>(),
                    other => other.as_u64().map(|i| vec![i]),
                }
                .context("layers_to_transform must be a layer index or a list of them")?;
                let patterns = match json.get("layers_pattern") {
                    None | Some(Value::Null) => vec![],
                    Some(Value::String(s)) if s.is_empty() => vec![],
                    Some(Value::String(s)) => vec![s.clone()],
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|v| v.as_str().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                        .context("layers_pattern must be a name or a list of names")?,
                    Some(other) => bail!("layers_pattern must be a name, got {other}"),
                };
                let patterns = patterns
                    .iter()
                    .map(|p| Regex::new(&format!(r"^.*\.{p}\.(\d+)\.")))
                    .collect::<Result<Vec<_>, _>>()
                    .context("layers_pattern is not a name nanogpt can read")?;
                Some((list, patterns))
            }
        };
        Ok(Selection {
            targets,
            exclude,
            layers,
        })
    }

    /// Whether PEFT puts an adapter on the module `name` (a linear layer when
    /// `linear`).
    pub fn selects(&self, name: &str, linear: bool) -> bool {
        if self
            .exclude
            .as_ref()
            .is_some_and(|e| e.matches(name, linear))
        {
            return false;
        }
        if !self.targets.matches(name, linear) {
            return false;
        }
        let (Names::List(_), Some((layers, patterns))) = (&self.targets, &self.layers) else {
            return true;
        };
        let any_layer = Regex::new(r"^.*\.[^.]*\.(\d+)\.").expect("a valid pattern");
        let found = match patterns.is_empty() {
            true => any_layer.captures(name),
            false => patterns.iter().find_map(|p| p.captures(name)),
        };
        found
            .and_then(|c| c[1].parse::<u64>().ok())
            .is_some_and(|layer| layers.contains(&layer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn picks(config: Value) -> Vec<String> {
        let s = Selection::read(&config).unwrap();
        let mut out = Vec::new();
        for layer in 0..3 {
            for m in ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"] {
                let name = format!("transformer.h.{layer}.{m}");
                if s.selects(&name, true) {
                    out.push(format!("{layer}.{m}"));
                }
            }
        }
        out
    }

    #[test]
    fn names_patterns_layers_and_exclusions_select_as_peft_does() {
        let c_proj = picks(json!({"target_modules": ["c_proj"]}));
        assert_eq!(c_proj.len(), 6, "both c_proj, every layer: {c_proj:?}");
        assert_eq!(
            picks(json!({"target_modules": ["c_attn"], "layers_to_transform": [0, 2]})),
            ["0.attn.c_attn", "2.attn.c_attn"]
        );
        assert_eq!(
            picks(
                json!({"target_modules": ["c_attn"], "layers_to_transform": 1, "layers_pattern": "h"})
            ),
            ["1.attn.c_attn"]
        );
        // A pattern names whole module names; layers_to_transform does not apply to it.
        assert_eq!(
            picks(
                json!({"target_modules": r".*\.1\.mlp\.c_(fc|proj)", "layers_to_transform": [0]})
            ),
            ["1.mlp.c_fc", "1.mlp.c_proj"]
        );
        assert_eq!(
            picks(
                json!({"target_modules": "all-linear", "exclude_modules": ["mlp.c_proj", "c_fc"]})
            ),
            [
                "0.attn.c_attn",
                "0.attn.c_proj",
                "1.attn.c_attn",
                "1.attn.c_proj",
                "2.attn.c_attn",
                "2.attn.c_proj"
            ]
        );
        assert!(picks(json!({"target_modules": ["q_proj"]})).is_empty());
        let err = Selection::read(&json!({"target_modules": "(unclosed"})).unwrap_err();
        assert!(
            err.to_string().contains("not a regular expression"),
            "{err}"
        );
        let err =
            Selection::read(&json!({"target_modules": ["c_attn"], "layers_to_transform": "x"}));
        assert!(err.is_err());
    }
}
