//! A model's tokenizer files, as bytes: read from a model folder (or beside a
//! `tokenizer.json`), built in memory (from a GGUF file's metadata, say), copied into
//! a dataset or a training run's folder, and identified by the SHA-256 of
//! `tokenizer.json`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

/// The files of a Hugging Face tokenizer that nanogpt reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenizerFiles {
    /// Where they come from, for messages: a folder, or a description such as
    /// `the metadata of model.gguf`.
    pub origin: String,
    /// `tokenizer.json`: the tokenizer itself (normalizer, pre-tokenizer, model,
    /// post-processor, decoder, added tokens).
    pub tokenizer_json: Vec<u8>,
    /// `tokenizer_config.json`: the special tokens' names (`bos_token`, `eos_token`,
    /// ...) and, in most models, the chat template.
    pub tokenizer_config: Option<Vec<u8>>,
    /// `chat_template.jinja`: the chat template, where a model keeps it apart (it
    /// then wins over `tokenizer_config.json`'s, as in transformers).
    pub chat_template: Option<String>,
    /// `generation_config.json`: its `eos_token_id` (one id or a list) says where
    /// generation ends (Llama 3 Instruct: `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`).
    pub generation_config: Option<Vec<u8>>,
}

/// The file names, in the order of [`TokenizerFiles`]'s fields.
pub const TOKENIZER_JSON: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
pub const CHAT_TEMPLATE: &str = "chat_template.jinja";
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// Every file a [`TokenizerFiles`] may hold.
pub const FILE_NAMES: [&str; 4] = [
    TOKENIZER_JSON,
    TOKENIZER_CONFIG,
    CHAT_TEMPLATE,
    GENERATION_CONFIG,
];

impl TokenizerFiles {
    /// Reads the files of a model folder holding `tokenizer.json`, or those beside a
    /// tokenizer file named by `path` (which may have another name).
    pub fn read(path: &Path) -> Result<TokenizerFiles> {
        let (dir, json) = match path.is_dir() {
            true => (path.to_path_buf(), path.join(TOKENIZER_JSON)),
            false => (parent(path), path.to_path_buf()),
        };
        if !path.exists() {
            bail!(
                "{} does not exist; --tokenizer takes gpt2, char, a model folder holding \
                 tokenizer.json, or the path of a tokenizer.json",
                path.display()
            );
        }
        if !json.is_file() {
            bail!(
                "{} has no {TOKENIZER_JSON} (the Hugging Face tokenizer file); a model that \
                 ships only tokenizer.model or vocab.json + merges.txt can be converted with \
                 transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)",
                dir.display()
            );
        }
        let tokenizer_json =
            std::fs::read(&json).with_context(|| format!("cannot read {}", json.display()))?;
        let chat_template = read_optional(&dir.join(CHAT_TEMPLATE))?
            .map(|bytes| {
                String::from_utf8(bytes).with_context(|| {
                    format!("{} is not UTF-8 text", dir.join(CHAT_TEMPLATE).display())
                })
            })
            .transpose()?;
        Ok(TokenizerFiles {
            origin: dir.display().to_string(),
            tokenizer_json,
            tokenizer_config: read_optional(&dir.join(TOKENIZER_CONFIG))?,
            chat_template,
            generation_config: read_optional(&dir.join(GENERATION_CONFIG))?,
        })
    }

    /// The SHA-256 of `tokenizer.json`, in lowercase hex: the identity of the ids.
    pub fn sha256(&self) -> String {
        sha256_hex(&self.tokenizer_json)
    }

    /// The path a file of these would have in their origin, for messages.
    pub fn path_of(&self, name: &str) -> String {
        Path::new(&self.origin).join(name).display().to_string()
    }

    /// The files as (name, bytes), those present only.
    pub fn entries(&self) -> Vec<(&'static str, &[u8])> {
        let mut entries = vec![(TOKENIZER_JSON, self.tokenizer_json.as_slice())];
        let optional = [
            (TOKENIZER_CONFIG, self.tokenizer_config.as_deref()),
            (
                CHAT_TEMPLATE,
                self.chat_template.as_deref().map(str::as_bytes),
            ),
            (GENERATION_CONFIG, self.generation_config.as_deref()),
        ];
        entries.extend(
            optional
                .into_iter()
                .filter_map(|(name, bytes)| Some((name, bytes?))),
        );
        entries
    }

    /// Writes the files into `dir` (each atomically) and removes the tokenizer files
    /// these do not have, so that what `dir` holds is exactly this tokenizer. The
    /// caller owns `dir` (a dataset being prepared, a training run's folder).
    pub fn write_into(&self, dir: &Path) -> Result<()> {
        let entries = self.entries();
        for (name, bytes) in &entries {
            crate::fsutil::write_bytes_atomic(&dir.join(name), bytes)?;
        }
        let absent = FILE_NAMES
            .iter()
            .filter(|name| entries.iter().all(|(present, _)| present != *name));
        remove_files(dir, absent)
    }

    /// Whether `dir` holds these files (by `tokenizer.json`'s hash and the other
    /// files' bytes).
    pub fn is_in(&self, dir: &Path) -> bool {
        let same = |name: &str, bytes: Option<&[u8]>| {
            let found = std::fs::read(dir.join(name)).ok();
            found.as_deref() == bytes
        };
        let entries = self.entries();
        FILE_NAMES.iter().all(|name| {
            let bytes = entries.iter().find(|(n, _)| n == name).map(|(_, b)| *b);
            same(name, bytes)
        })
    }
}

/// Removes the tokenizer files of an earlier tokenizer from `dir` (a dataset being
/// prepared with GPT-2's or a char vocabulary).
pub fn remove_tokenizer_files(dir: &Path) -> Result<()> {
    remove_files(dir, FILE_NAMES.iter())
}

fn remove_files<'a>(dir: &Path, names: impl Iterator<Item = &'a &'a str>) -> Result<()> {
    for name in names {
        let path = dir.join(name);
        if path.exists() {
            std::fs::remove_file(&path).with_context(|| {
                format!(
                    "cannot remove {}, left by an earlier tokenizer; remove it by hand or \
                     choose another folder",
                    path.display()
                )
            })?;
        }
    }
    Ok(())
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn parent(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn read_optional(path: &Path) -> Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::TempDir;

    #[test]
    fn sha256_is_the_standard_digest() {
        // FIPS 180-2's example.
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn read_takes_a_folder_or_a_file_and_write_into_replaces_the_set() {
        let dir = TempDir::new("tokfiles");
        dir.write("m/tokenizer.json", "{}");
        dir.write("m/tokenizer_config.json", "{\"eos_token\": \"x\"}");
        dir.write("m/chat_template.jinja", "{{ messages }}");
        let from_dir = TokenizerFiles::read(&dir.path().join("m")).unwrap();
        let from_file = TokenizerFiles::read(&dir.path().join("m/tokenizer.json")).unwrap();
        assert_eq!(from_dir, from_file);
        assert_eq!(from_dir.chat_template.as_deref(), Some("{{ messages }}"));
        assert_eq!(from_dir.generation_config, None);
        assert_eq!(from_dir.sha256(), sha256_hex(b"{}"));

        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join(GENERATION_CONFIG), "stale").unwrap();
        from_dir.write_into(&out).unwrap();
        assert!(from_dir.is_in(&out));
        assert!(
            !out.join(GENERATION_CONFIG).exists(),
            "a stale file is removed"
        );
        assert_eq!(
            TokenizerFiles::read(&out).unwrap().entries(),
            from_dir.entries()
        );
        remove_tokenizer_files(&out).unwrap();
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
    }

    #[test]
    fn a_folder_without_tokenizer_json_is_named_with_the_fix() {
        let dir = TempDir::new("tokfiles-missing");
        dir.write("m/vocab.json", "{}");
        let err = TokenizerFiles::read(&dir.path().join("m"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("has no tokenizer.json") && err.contains("save_pretrained"));
        let err = TokenizerFiles::read(&dir.path().join("nowhere"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("nowhere does not exist"), "{err}");
    }
}
