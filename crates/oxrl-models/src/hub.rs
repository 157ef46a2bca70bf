//! Model references: a local directory, or a Hugging Face hub id (`Qwen/Qwen3-0.6B`) resolved from
//! the local hub cache and downloaded with `hf-hub` only when the cache lacks it and the machine is
//! online (`HF_HUB_OFFLINE=1` forbids the download).

use crate::error::{ModelError, Result};
use hf_hub::api::sync::ApiError;
use std::path::{Path, PathBuf};

/// Hub cache folders in the order transformers consults them: `HF_HUB_CACHE`, `HF_HOME/hub`,
/// `~/.cache/huggingface/hub`.
pub fn cache_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(p) = std::env::var_os("HF_HUB_CACHE") {
        dirs.push(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("HF_HOME") {
        dirs.push(PathBuf::from(p).join("hub"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cache/huggingface/hub"));
    }
    dirs.dedup();
    dirs
}

/// `org/name` with no path-like parts: what the hub accepts as a model id.
fn is_hub_id(reference: &str) -> bool {
    let parts: Vec<&str> = reference.split('/').collect();
    parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
}

/// The snapshot of `id` in the cache folder `cache`: the one `refs/main` names, else any snapshot
/// that holds a `config.json`.
fn cached_snapshot(cache: &Path, id: &str) -> Option<PathBuf> {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let snapshots = repo.join("snapshots");
    if let Ok(hash) = std::fs::read_to_string(repo.join("refs/main")) {
        let dir = snapshots.join(hash.trim());
        if dir.join("config.json").exists() {
            return Some(dir);
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(&snapshots)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("config.json").exists())
        .collect();
    found.sort();
    found.pop()
}

/// Why fetching a checkpoint from the hub failed.
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("neither model.safetensors nor an index: {0}")]
    NoWeights(#[source] ApiError),
    #[error("{shard}: {source}")]
    Shard { shard: String, source: ApiError },
    #[error(transparent)]
    Index(Box<ModelError>),
}

/// Fetches the files a checkpoint directory needs; returns the snapshot folder they landed in.
fn download(id: &str) -> std::result::Result<PathBuf, DownloadError> {
    let api = hf_hub::api::sync::ApiBuilder::from_env()
        .with_progress(true)
        .build()?;
    let repo = api.model(id.to_string());
    let config = repo.get("config.json")?;
    if repo.get("model.safetensors").is_err() {
        let index = repo
            .get("model.safetensors.index.json")
            .map_err(DownloadError::NoWeights)?;
        let v = crate::config::read_json(&index).map_err(|e| DownloadError::Index(Box::new(e)))?;
        let mut shards: Vec<&str> = v["weight_map"]
            .as_object()
            .map(|m| m.values().filter_map(|f| f.as_str()).collect())
            .unwrap_or_default();
        shards.sort_unstable();
        shards.dedup();
        for shard in shards {
            repo.get(shard).map_err(|source| DownloadError::Shard {
                shard: shard.to_string(),
                source,
            })?;
        }
    }
    for optional in crate::checkpoint::SIDE_FILES {
        let _ = repo.get(optional);
    }
    Ok(config.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// Resolves a model reference to a local checkpoint directory.
pub fn resolve_model(reference: &str) -> Result<PathBuf> {
    let path = Path::new(reference);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if !is_hub_id(reference) {
        return Err(ModelError::Hub(format!(
            "model `{reference}`: no such directory, and not a hub id of the form org/name"
        )));
    }
    let caches = cache_dirs();
    if let Some(dir) = caches.iter().find_map(|c| cached_snapshot(c, reference)) {
        return Ok(dir);
    }
    let looked = caches
        .iter()
        .map(|c| c.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let offline = std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1" || v == "true");
    if offline {
        return Err(ModelError::Hub(format!(
            "model `{reference}` is not in the local hub cache (looked in {looked}) and HF_HUB_OFFLINE is set"
        )));
    }
    download(reference).map_err(|source| ModelError::HubDownload {
        reference: reference.to_string(),
        looked,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_org_slash_name() {
        assert!(is_hub_id("Qwen/Qwen3-0.6B"));
        assert!(!is_hub_id("./models/x"));
        assert!(!is_hub_id("/abs/path"));
        assert!(!is_hub_id("a/b/c"));
        assert!(!is_hub_id("plain"));
    }

    #[test]
    fn finds_the_snapshot_refs_main_names() {
        let cache = std::env::temp_dir().join(format!("oxrl-hub-test-{}", std::process::id()));
        let repo = cache.join("models--Org--Tiny");
        let snap = repo.join("snapshots/abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        std::fs::write(repo.join("refs/main"), "abc123\n").unwrap();
        assert_eq!(cached_snapshot(&cache, "Org/Tiny"), Some(snap));
        assert_eq!(cached_snapshot(&cache, "Org/Other"), None);
        std::fs::remove_dir_all(&cache).unwrap();
    }
}
