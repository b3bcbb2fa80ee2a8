//! From what the user wrote (`gpt2`, a path, `openai-community/gpt2`) to files.
//!
//! In order: an existing local path (directory or `.safetensors` file); the Hugging
//! Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`: `models--gpt2/snapshots/<commit>/`); a download
//! into that cache through the `hf-hub` crate (cargo feature `download`, on by
//! default), unless `HF_HUB_OFFLINE=1`. When nothing works the error says where it
//! looked and how to get the files.

use crate::hub::{self, HubEnv, RepoKind};
use crate::model::config::PRESETS;
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

/// Where a model's files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Located {
    /// A model directory (`config.json` + safetensors weights), local or a cache snapshot.
    Dir(PathBuf),
    /// A lone weights file.
    File(PathBuf),
}

/// Whether `spec` can name a model on the Hub: one of the GPT-2 presets or an
/// `owner/name` id.
pub fn is_hub_id(spec: &str) -> bool {
    PRESETS.contains(&spec) || hub::is_repo_id(spec)
}

/// Repository ids to look for in the cache: the name as given and, for the GPT-2
/// presets, the id they have moved to (`openai-community/gpt2`).
fn cache_ids(spec: &str) -> Vec<String> {
    let mut ids = vec![spec.to_string()];
    if PRESETS.contains(&spec) {
        ids.push(format!("openai-community/{spec}"));
    }
    ids
}

/// The cache folder of model repository `id`: `models--owner--name`.
pub fn cache_folder(cache: &Path, id: &str) -> PathBuf {
    hub::cache_folder(cache, RepoKind::Model, id)
}

/// Resolves `spec` to files (see the module docs for the order).
pub fn locate(spec: &str, env: &HubEnv) -> Result<Located> {
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok(Located::Dir(path.to_path_buf()));
    }
    if path.is_file() {
        return Ok(Located::File(path.to_path_buf()));
    }
    if !is_hub_id(spec) {
        bail!(
            "{spec} is not a file or directory, nor a pretrained model name ({}, or a Hugging Face \
             id such as openai-community/gpt2)",
            PRESETS.join(", ")
        );
    }
    let mut looked = Vec::new();
    let mut incomplete = None;
    if let Some(cache) = &env.cache {
        for id in cache_ids(spec) {
            let folder = cache_folder(cache, &id);
            looked.push(folder.join("snapshots").display().to_string());
            match find_snapshot(&folder) {
                Snapshot::Complete(dir) => return Ok(Located::Dir(dir)),
                Snapshot::Incomplete(dir) => {
                    incomplete.get_or_insert(dir);
                }
                Snapshot::None => {}
            }
        }
    }
    let download = if env.offline {
        Err("HF_HUB_OFFLINE is set, so nothing is downloaded".to_string())
    } else {
        match &env.cache {
            Some(cache) => download(spec, cache, env.endpoint.as_deref()),
            None => Err("no cache folder (set HF_HUB_CACHE or HOME)".to_string()),
        }
    };
    let why = match download {
        Ok(dir) => return Ok(Located::Dir(dir)),
        Err(why) => why,
    };
    // Let the loader say what the cached copy lacks (e.g. only pickle weights).
    if let Some(dir) = incomplete {
        return Ok(Located::Dir(dir));
    }
    let looked = match looked.is_empty() {
        true => "no Hugging Face cache folder is known (HOME is unset)".to_string(),
        false => format!(
            "not in the Hugging Face cache (looked in {})",
            looked.join(" and ")
        ),
    };
    let folder = env
        .cache
        .as_ref()
        .map(|c| cache_folder(c, spec).display().to_string())
        .unwrap_or_else(|| format!("models--{}", spec.replace('/', "--")));
    bail!(
        "cannot find the pretrained model {spec}: there is no file or directory {spec} here; \
         {looked}; not downloaded: {why}. Get the files on a machine with network access with \
         `huggingface-cli download {spec} config.json model.safetensors` (the cache folder \
         {folder} can be copied here, or point HF_HUB_CACHE at it), or pass the path of a model \
         directory (config.json + model.safetensors)"
    )
}

enum Snapshot {
    Complete(PathBuf),
    /// Has a config.json but not (all) its safetensors weights.
    Incomplete(PathBuf),
    None,
}

/// A usable snapshot of a cached repository: the one `refs/main` names if it is
/// complete, else the most recently modified complete one.
fn find_snapshot(folder: &Path) -> Snapshot {
    let mut incomplete = None;
    for dir in hub::snapshots_newest_first(folder) {
        if is_complete(&dir) {
            return Snapshot::Complete(dir);
        }
        if dir.join("config.json").is_file() {
            incomplete.get_or_insert(dir);
        }
    }
    incomplete.map_or(Snapshot::None, Snapshot::Incomplete)
}

/// config.json and safetensors weights (all shards, if sharded) are present.
fn is_complete(dir: &Path) -> bool {
    use super::weights::{INDEX_FILE, SINGLE_FILE};
    if !dir.join("config.json").is_file() {
        return false;
    }
    if dir.join(SINGLE_FILE).is_file() {
        return true;
    }
    shard_names(&dir.join(INDEX_FILE))
        .is_some_and(|shards| shards.iter().all(|s| dir.join(s).is_file()))
}

/// The shard files a safetensors index lists.
fn shard_names(index: &Path) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(index).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    let mut names: Vec<String> = json
        .get("weight_map")?
        .as_object()?
        .values()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    names.sort();
    names.dedup();
    Some(names)
}

/// Downloads `config.json`, the safetensors weights and the tokenizer files (where
/// the repository has them) of `id` into the cache;
/// returns the snapshot directory.
#[cfg(feature = "download")]
fn download(
    id: &str,
    cache: &Path,
    endpoint: Option<&str>,
) -> std::result::Result<PathBuf, String> {
    let repo = hub::api(cache, endpoint)?.model(id.to_string());
    crate::errln!(
        "downloading {id} from the Hugging Face Hub into {}",
        cache.display()
    );
    let config = repo
        .get("config.json")
        .map_err(|e| format!("download failed ({e})"))?;
    if let Err(single) = repo.get(super::weights::SINGLE_FILE) {
        let index = repo
            .get(super::weights::INDEX_FILE)
            .map_err(|_| format!("{id} has no model.safetensors ({single})"))?;
        for shard in shard_names(&index).unwrap_or_default() {
            repo.get(&shard)
                .map_err(|e| format!("download of {shard} failed ({e})"))?;
        }
    }
    // Not needed to load the weights, but part of what a model directory hands on:
    // a Llama family's tokenizer (sample, chat, eval and export read it), the chat
    // template, the end-of-turn ids. A repository may lack any of them.
    for optional in [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        let _ = repo.get(optional);
    }
    config
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| "unexpected cache layout".to_string())
}

#[cfg(not(feature = "download"))]
fn download(
    _id: &str,
    _cache: &Path,
    _endpoint: Option<&str>,
) -> std::result::Result<PathBuf, String> {
    Err("this nanogpt was built without the `download` feature".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_presets_or_owner_slash_name() {
        // What is an `owner/name` id is hub.rs's test; here what the presets add.
        for yes in ["gpt2", "gpt2-xl", "openai-community/gpt2", "me/my_model.v2"] {
            assert!(is_hub_id(yes), "{yes}");
        }
        for no in ["gpt3", "out", "./gpt2x", "x/y.safetensors"] {
            assert!(!is_hub_id(no), "{no}");
        }
    }

    #[test]
    fn cache_folder_follows_huggingface_hub() {
        assert_eq!(
            cache_folder(Path::new("/c"), "openai-community/gpt2"),
            PathBuf::from("/c/models--openai-community--gpt2")
        );
    }
}
