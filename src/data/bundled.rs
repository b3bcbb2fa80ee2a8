//! The tiny Shakespeare text built into the binary, and the mapping from a
//! config's `dataset` name to a prepared directory.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::meta::{Meta, TokenizerKind};
use super::prepare::{prepare_source, PrepareOptions, TokenizerSpec};
#[cfg(test)]
use super::readers::SHAKESPEARE_TEXT;
use super::readers::{Source, BUNDLED_SHAKESPEARE};
use super::Split;
use crate::fsutil::DirLock;

/// Built-in dataset names, as in nanoGPT: the bundled text as characters or as
/// GPT-2 tokens.
const BUILT_IN: [(&str, TokenizerKind); 2] = [
    ("shakespeare_char", TokenizerKind::Char),
    ("shakespeare", TokenizerKind::Gpt2),
];

/// Prepares the bundled Shakespeare into `dir` unless it already holds a prepared
/// dataset (`meta.json`, `train.bin` and `val.bin`) with that tokenizer.
///
/// Several runs started together (ranks sharing a folder, or a user's two runs) must
/// not fail because one of them is preparing it: the others wait for its lock (at
/// most [`PREPARE_WAIT`]) and then use what it prepared.
fn ensure_bundled_shakespeare(dir: &Path, tokenizer: TokenizerKind) -> Result<()> {
    let what = format!("preparing {}", dir.display());
    // A run that takes the lock between our wait and our own prepare makes that
    // prepare fail: wait for it again.
    for attempt in 0..3 {
        DirLock::wait_until_free(dir, &what, PREPARE_WAIT)?;
        if is_prepared(dir, tokenizer)? {
            return Ok(());
        }
        let spec = match tokenizer {
            TokenizerKind::Char => TokenizerSpec::Char,
            _ => TokenizerSpec::Gpt2,
        };
        let options = PrepareOptions {
            tokenizer: spec,
            ..PrepareOptions::new(BUNDLED_SHAKESPEARE, dir)
        };
        match prepare_source(&Source::Bundled, &options) {
            Ok(_) => return Ok(()),
            Err(_) if attempt < 2 && is_locked(dir) => continue,
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "cannot prepare the bundled Shakespeare text in {}",
                        dir.display()
                    )
                })
            }
        }
    }
    unreachable!("the last attempt returns")
}

/// How long a run waits for another one preparing the bundled dataset (it takes
/// seconds).
const PREPARE_WAIT: Duration = Duration::from_secs(300);

/// Whether another process holds the lock on `dir` now.
fn is_locked(dir: &Path) -> bool {
    DirLock::wait_until_free(dir, "", Duration::ZERO).is_err()
}

fn is_prepared(dir: &Path, tokenizer: TokenizerKind) -> Result<bool> {
    let complete = [
        Meta::FILE_NAME,
        Split::Train.file_name(),
        Split::Val.file_name(),
    ]
    .iter()
    .all(|name| dir.join(name).exists());
    if !complete {
        return Ok(false);
    }
    let meta = Meta::load(dir)?;
    if meta.tokenizer != tokenizer {
        bail!(
            "{} holds {} tokens, but this dataset needs {} tokens; delete the folder to \
             have it prepared again",
            dir.display(),
            meta.tokenizer,
            tokenizer
        );
    }
    Ok(true)
}

/// The prepared directory for a config's `dataset`: an existing directory of that
/// name; else for the built-in `shakespeare_char` / `shakespeare`, `data/<name>`
/// under the current directory, prepared on first use; else an existing
/// `data/<name>`. Anything else is an error saying how to prepare it.
pub fn find_or_prepare_dataset(name: &str) -> Result<PathBuf> {
    find_or_prepare_dataset_in(Path::new(""), name)
}

fn find_or_prepare_dataset_in(root: &Path, name: &str) -> Result<PathBuf> {
    if name.is_empty() {
        bail!("the `dataset` key is empty; name a prepared folder or `shakespeare_char`");
    }
    let direct = root.join(name);
    if direct.is_dir() {
        return Ok(direct);
    }
    let under_data = root.join("data").join(name);
    if let Some((_, tokenizer)) = BUILT_IN.iter().find(|(n, _)| *n == name) {
        ensure_bundled_shakespeare(&under_data, *tokenizer)?;
        return Ok(under_data);
    }
    if under_data.is_dir() {
        return Ok(under_data);
    }
    // A name that is already a path (`data/owt`) is prepared where it points, not
    // under data/ again.
    let is_path = Path::new(name).components().count() > 1;
    let (searched, target) = match is_path {
        true => (direct.display().to_string(), &direct),
        false => (
            format!("{} or {}", direct.display(), under_data.display()),
            &under_data,
        ),
    };
    bail!(
        "dataset `{name}`: no folder {searched}; prepare one with `nanogpt prepare SOURCE \
         --out {}`, or use the built-in `shakespeare_char` or `shakespeare`",
        target.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testutil::TempDir;

    #[test]
    fn bundled_text_is_tiny_shakespeare() {
        assert_eq!(SHAKESPEARE_TEXT.chars().count(), 1_115_394);
        assert!(SHAKESPEARE_TEXT.starts_with("First Citizen:\nBefore we proceed"));
    }

    #[test]
    fn built_in_name_is_prepared_once_under_data() {
        let root = TempDir::new("bundled-resolve");
        let dir = find_or_prepare_dataset_in(root.path(), "shakespeare_char").unwrap();
        assert_eq!(dir, root.path().join("data/shakespeare_char"));
        let meta = Meta::load(&dir).unwrap();
        assert_eq!((meta.tokenizer, meta.vocab_size), (TokenizerKind::Char, 65));
        let written = std::fs::metadata(dir.join("train.bin"))
            .unwrap()
            .modified()
            .unwrap();
        find_or_prepare_dataset_in(root.path(), "shakespeare_char").unwrap();
        let again = std::fs::metadata(dir.join("train.bin"))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(written, again, "second use does not prepare again");
    }

    #[test]
    fn existing_folder_wins_and_unknown_name_explains() {
        let root = TempDir::new("bundled-unknown");
        std::fs::create_dir_all(root.path().join("data/owt")).unwrap();
        assert_eq!(
            find_or_prepare_dataset_in(root.path(), "owt").unwrap(),
            root.path().join("data/owt")
        );
        let err = find_or_prepare_dataset_in(root.path(), "openwebtext")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("openwebtext") && err.contains("nanogpt prepare"),
            "{err}"
        );
        // A name that is a path is not put under data/ a second time.
        let err = find_or_prepare_dataset_in(root.path(), "data/owt2")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("data/data"), "{err}");
        let want = format!("--out {}`", root.path().join("data/owt2").display());
        assert!(err.contains(&want), "{err}");
    }

    #[test]
    fn wrong_tokenizer_in_folder_is_reported() {
        let root = TempDir::new("bundled-mismatch");
        let dir = root.path().join("data/shakespeare_char");
        ensure_bundled_shakespeare(&dir, TokenizerKind::Char).unwrap();
        let err = ensure_bundled_shakespeare(&dir, TokenizerKind::Gpt2).unwrap_err();
        assert!(err.to_string().contains("holds char tokens"), "{err}");
    }
}
