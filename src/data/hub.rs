//! `nanogpt prepare hf:OWNER/NAME`: a dataset's parquet files from the Hugging Face
//! Hub. First the local cache (the layout `huggingface_hub` writes:
//! `$HF_HUB_CACHE/datasets--OWNER--NAME/snapshots/REV/...`, the same cache folder as
//! model weights, see [`crate::hub::HubEnv`]); then, unless
//! `HF_HUB_OFFLINE=1`, a download into that cache (cargo feature `download`).
//! Short names users type (`hf:openwebtext`) map to their repositories.

use crate::hub::{self, HubEnv, RepoKind};
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

/// The prefix that marks a Hub dataset.
pub const PREFIX: &str = "hf:";

/// Short names and the repositories they stand for.
const SHORT_NAMES: [(&str, &str); 3] = [
    ("openwebtext", "Skylion007/openwebtext"),
    ("tinystories", "roneneldan/TinyStories"),
    ("wikitext", "Salesforce/wikitext"),
];

/// The repository id of `spec` (`hf:OWNER/NAME` or `hf:SHORT`).
pub fn repo_id(spec: &str) -> Result<String> {
    let name = spec.strip_prefix(PREFIX).unwrap_or(spec);
    if let Some((_, id)) = SHORT_NAMES
        .iter()
        .find(|(s, _)| s.eq_ignore_ascii_case(name))
    {
        return Ok(id.to_string());
    }
    if !hub::is_repo_id(name) {
        let shorts: Vec<&str> = SHORT_NAMES.iter().map(|(s, _)| *s).collect();
        bail!(
            "`{spec}` names no Hub dataset: write hf:OWNER/NAME (e.g. hf:Skylion007/openwebtext) \
             or one of hf:{}",
            shorts.join(", hf:")
        );
    }
    Ok(name.to_string())
}

/// The cache folder of dataset repository `id`: `datasets--owner--name`.
pub fn cache_folder(cache: &Path, id: &str) -> PathBuf {
    hub::cache_folder(cache, RepoKind::Dataset, id)
}

/// Whether a parquet file's path inside the repository belongs to `split`: a folder
/// named so (`plain_text/train/0000.parquet`) or a file name starting with it
/// (`data/train-00000-of-00080.parquet`).
pub fn in_split(rel: &str, split: &str) -> bool {
    if !rel.ends_with(".parquet") {
        return false;
    }
    let mut parts: Vec<&str> = rel.split('/').collect();
    let file = parts.pop().unwrap_or("");
    parts.contains(&split)
        || file
            .strip_prefix(split)
            .is_some_and(|rest| rest.starts_with(['-', '_', '.']))
}

/// The split a dataset's file `rel` holds: `split` where a folder of its path is named
/// so, else its file name up to the shard numbering (`train_sft-00000-of-00003.parquet`
/// holds train_sft, `train_0.parquet` train).
fn split_of(rel: &str, split: &str) -> String {
    let mut parts: Vec<&str> = rel.split('/').collect();
    let file = parts.pop().unwrap_or("");
    if parts.contains(&split) {
        return split.to_string();
    }
    let stem = file.split(['-', '.']).next().unwrap_or("");
    let stem = stem.trim_end_matches(|c: char| c.is_ascii_digit());
    stem.trim_end_matches(['_', '.']).to_string()
}

/// Of the files [`in_split`] matched (`rels`, relative paths): those of exactly `split`
/// where there are any; else all of them where they hold one split (`--split train`
/// for `train_sft-*` files alone); else an error naming the splits to choose from
/// (`train` matches ultrachat's train_sft and train_gen).
fn of_split<T>(files: Vec<(String, T)>, split: &str) -> std::result::Result<Vec<T>, String> {
    let files: Vec<(String, T)> = (files.into_iter())
        .map(|(rel, f)| (split_of(&rel, split), f))
        .collect();
    let exact = files.iter().any(|(named, _)| named == split);
    let mut names: Vec<&str> = files.iter().map(|(named, _)| named.as_str()).collect();
    names.sort();
    names.dedup();
    if !exact && names.len() > 1 {
        return Err(format!(
            "split `{split}` matches the files of several splits ({}); choose one with --split",
            names.join(", ")
        ));
    }
    Ok(files
        .into_iter()
        .filter(|(named, _)| !exact || named == split)
        .map(|(_, f)| f)
        .collect())
}

/// The parquet files of `split` in the newest snapshot of a cached dataset (the one
/// `refs/main` names, else the most recently modified), sorted by path.
fn cached_files(folder: &Path, split: &str) -> std::result::Result<Vec<PathBuf>, String> {
    for rev in hub::snapshots_newest_first(folder) {
        let mut files = Vec::new();
        collect(&rev, &rev, split, &mut files);
        if !files.is_empty() {
            files.sort();
            return of_split(files, split);
        }
    }
    Ok(Vec::new())
}

fn collect(root: &Path, dir: &Path, split: &str, out: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            collect(root, &path, split, out);
        } else if let Ok(rel) = path.strip_prefix(root) {
            let rel = rel.to_string_lossy().into_owned();
            if in_split(&rel, split) {
                out.push((rel, path));
            }
        }
    }
}

/// The parquet files of `split` of the dataset `spec`, from the cache or downloaded.
pub fn parquet_files(spec: &str, split: &str, env: &HubEnv) -> Result<Vec<PathBuf>> {
    let id = repo_id(spec)?;
    let Some(cache) = &env.cache else {
        bail!("{spec}: no Hugging Face cache folder (set HF_HUB_CACHE or HF_HOME)");
    };
    let folder = cache_folder(cache, &id);
    let files = cached_files(&folder, split).map_err(|e| anyhow::anyhow!("{spec}: {e}"))?;
    if !files.is_empty() {
        crate::errln!(
            "{spec}: {} parquet file(s) of split `{split}` from the cache {}",
            files.len(),
            folder.display()
        );
        return Ok(files);
    }
    let why = match env.offline {
        true => "HF_HUB_OFFLINE is set, so nothing is downloaded".to_string(),
        false => match download(&id, split, cache, env.endpoint.as_deref()) {
            Ok(files) if !files.is_empty() => return Ok(files),
            Ok(_) => format!("the repository has no parquet files of split `{split}`"),
            Err(e) => e,
        },
    };
    bail!(
        "{spec}: no parquet files of split `{split}` in {} and {why}; download them with \
         `huggingface-cli download --repo-type dataset {id}` (or choose --split), or give the \
         parquet folder's path to `nanogpt prepare`",
        folder.display()
    )
}

/// Downloads the parquet files of `split` into the cache; returns their paths.
#[cfg(feature = "download")]
fn download(
    id: &str,
    split: &str,
    cache: &Path,
    endpoint: Option<&str>,
) -> std::result::Result<Vec<PathBuf>, String> {
    let repo = hub::api(cache, endpoint)?.dataset(id.to_string());
    let info = repo
        .info()
        .map_err(|e| format!("the Hub did not answer ({e})"))?;
    let names = (info.siblings.into_iter())
        .map(|s| s.rfilename)
        .filter(|n| in_split(n, split))
        .map(|n| (n.clone(), n))
        .collect();
    let names: Vec<String> = of_split(names, split)?;
    crate::errln!(
        "downloading {} parquet file(s) of {id} (split `{split}`) into {}",
        names.len(),
        cache.display()
    );
    names
        .iter()
        .map(|n| {
            repo.get(n)
                .map_err(|e| format!("download of {n} failed ({e})"))
        })
        .collect()
}

#[cfg(not(feature = "download"))]
fn download(
    _id: &str,
    _split: &str,
    _cache: &Path,
    _endpoint: Option<&str>,
) -> std::result::Result<Vec<PathBuf>, String> {
    Err("this nanogpt was built without the `download` feature".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_splits() {
        assert_eq!(repo_id("hf:openwebtext").unwrap(), "Skylion007/openwebtext");
        assert_eq!(repo_id("hf:me/docs").unwrap(), "me/docs");
        let err = repo_id("hf:nonesuch").unwrap_err().to_string();
        assert!(
            err.contains("hf:OWNER/NAME") && err.contains("hf:openwebtext"),
            "{err}"
        );
        assert!(in_split("data/train-00000-of-00080.parquet", "train"));
        assert!(in_split("plain_text/train/0000.parquet", "train"));
        assert!(!in_split("plain_text/test/0000.parquet", "train"));
        assert!(!in_split("data/trainer-0.parquet", "train"));
        assert!(!in_split("data/train-0.json", "train"));
        let pick = |rels: &[&str], split: &str| {
            let files = rels
                .iter()
                .map(|r| (r.to_string(), r.to_string()))
                .collect();
            of_split(files, split)
        };
        // ultrachat_200k's layout: `train` names no split of its own there.
        let ultrachat = [
            "data/train_gen-0.parquet",
            "data/train_sft-0.parquet",
            "data/train_sft-1.parquet",
        ];
        let err = pick(&ultrachat, "train").unwrap_err();
        assert!(
            err.contains("several splits (train_gen, train_sft)"),
            "{err}"
        );
        assert_eq!(pick(&ultrachat, "train_sft").unwrap(), &ultrachat[1..]);
        // An exact split beats the ones it prefixes; numbered shards are one split.
        let mixed = [
            "data/train-00000-of-00002.parquet",
            "data/train_extra-0.parquet",
        ];
        assert_eq!(pick(&mixed, "train").unwrap(), &mixed[..1]);
        let shards = [
            "train_0.parquet",
            "train_1.parquet",
            "en/train/0000.parquet",
        ];
        assert_eq!(pick(&shards, "train").unwrap(), shards);
        assert_eq!(pick(&ultrachat[1..], "train").unwrap(), &ultrachat[1..]);
        assert_eq!(
            cache_folder(Path::new("/c"), "me/docs"),
            Path::new("/c/datasets--me--docs")
        );
    }
}
