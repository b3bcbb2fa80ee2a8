//! The Hugging Face Hub as models ([`crate::hf::resolve`]) and datasets
//! ([`crate::data::hub`]) both reach it: its settings ([`HubEnv`]), repository ids,
//! and the local cache `huggingface_hub` writes (`$HF_HUB_CACHE/models--OWNER--NAME/
//! snapshots/REV/...`, `datasets--OWNER--NAME/...`).

use std::path::{Path, PathBuf};

/// Hugging Face Hub settings: where the cache is, and whether to go online.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubEnv {
    /// The hub cache (the folder holding `models--*`), if one can be named.
    pub cache: Option<PathBuf>,
    /// `HF_HUB_OFFLINE`: use the cache only.
    pub offline: bool,
    /// `HF_ENDPOINT`: another Hub (a mirror).
    pub endpoint: Option<String>,
}

impl HubEnv {
    /// The settings `huggingface_hub` reads: `HF_HUB_CACHE` (or the older
    /// `HUGGINGFACE_HUB_CACHE`), `HF_HOME`, `XDG_CACHE_HOME`, `HOME`;
    /// `HF_HUB_OFFLINE`; `HF_ENDPOINT`.
    pub fn from_process_env() -> HubEnv {
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let cache = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| var("XDG_CACHE_HOME").map(|x| x.join("huggingface").join("hub")))
            .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")));
        let offline = std::env::var("HF_HUB_OFFLINE")
            .map(|v| {
                matches!(
                    v.trim().to_ascii_lowercase().as_str(),
                    "1" | "on" | "yes" | "true"
                )
            })
            .unwrap_or(false);
        let endpoint = std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty());
        HubEnv {
            cache,
            offline,
            endpoint,
        }
    }
}

/// Whether `spec` is an `owner/name` repository id (not a path, not a weights file).
pub fn is_repo_id(spec: &str) -> bool {
    let ok = |part: &str| {
        !part.is_empty()
            && !part.starts_with('.')
            && !part.starts_with('-')
            && part
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch))
    };
    matches!(spec.split_once('/'), Some((owner, name)) if ok(owner) && ok(name) && !name.contains('/'))
        && !spec.ends_with(".safetensors")
}

/// The two kinds of repository the cache holds, each in folders of its own prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepoKind {
    Model,
    Dataset,
}

/// The cache folder of repository `id`: `models--owner--name` or
/// `datasets--owner--name`.
pub fn cache_folder(cache: &Path, kind: RepoKind, id: &str) -> PathBuf {
    let prefix = match kind {
        RepoKind::Model => "models",
        RepoKind::Dataset => "datasets",
    };
    cache.join(format!("{prefix}--{}", id.replace('/', "--")))
}

/// The snapshot folders of a cached repository, the one `refs/main` names first,
/// then the others from the most recently modified.
pub fn snapshots_newest_first(folder: &Path) -> Vec<PathBuf> {
    let snapshots = folder.join("snapshots");
    let mut revs: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&snapshots)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter(|e| e.path().is_dir())
                .map(|e| {
                    let modified = e.metadata().and_then(|m| m.modified());
                    (modified.unwrap_or(std::time::UNIX_EPOCH), e.path())
                })
                .collect()
        })
        .unwrap_or_default();
    revs.sort_by_key(|r| std::cmp::Reverse(r.0));
    let mut revs: Vec<PathBuf> = revs.into_iter().map(|(_, p)| p).collect();
    if let Ok(main) = std::fs::read_to_string(folder.join("refs").join("main")) {
        let main = snapshots.join(main.trim());
        if let Some(i) = revs.iter().position(|p| *p == main) {
            let r = revs.remove(i);
            revs.insert(0, r);
        }
    }
    revs
}

/// A client of the Hub (or of `endpoint`, a mirror) that downloads into `cache`, with
/// progress bars.
#[cfg(feature = "download")]
pub fn api(cache: &Path, endpoint: Option<&str>) -> Result<hf_hub::api::sync::Api, String> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::Cache;
    let mut builder = ApiBuilder::from_cache(Cache::new(cache.to_path_buf())).with_progress(true);
    if let Some(endpoint) = endpoint {
        builder = builder.with_endpoint(endpoint.to_string());
    }
    builder.build().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_are_owner_slash_name() {
        for yes in [
            "openai-community/gpt2",
            "me/my_model.v2",
            "Skylion007/openwebtext",
        ] {
            assert!(is_repo_id(yes), "{yes}");
        }
        for no in [
            "gpt2",
            "out",
            "./gpt2x",
            "/abs/path",
            "a/b/c",
            "../x",
            "w.safetensors",
            "x/y.safetensors",
        ] {
            assert!(!is_repo_id(no), "{no}");
        }
    }

    #[test]
    fn cache_folders_follow_huggingface_hub() {
        let id = "openai-community/gpt2";
        assert_eq!(
            cache_folder(Path::new("/c"), RepoKind::Model, id),
            PathBuf::from("/c/models--openai-community--gpt2")
        );
        assert_eq!(
            cache_folder(Path::new("/c"), RepoKind::Dataset, "me/docs"),
            Path::new("/c/datasets--me--docs")
        );
    }

    #[test]
    fn the_snapshot_refs_main_names_comes_first() {
        let dir = tempfile::tempdir().unwrap();
        let snaps = dir.path().join("snapshots");
        for rev in ["aaa", "bbb", "ccc"] {
            std::fs::create_dir_all(snaps.join(rev)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let names = |v: Vec<PathBuf>| -> Vec<String> {
            v.iter()
                .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(
            names(snapshots_newest_first(dir.path())),
            ["ccc", "bbb", "aaa"]
        );
        std::fs::create_dir_all(dir.path().join("refs")).unwrap();
        std::fs::write(dir.path().join("refs").join("main"), "aaa\n").unwrap();
        assert_eq!(
            names(snapshots_newest_first(dir.path())),
            ["aaa", "ccc", "bbb"]
        );
        assert!(snapshots_newest_first(&dir.path().join("none")).is_empty());
    }
}
