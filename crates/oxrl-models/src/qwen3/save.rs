//! Saving a model as a Hugging Face checkpoint directory.

use super::Qwen3;
use crate::error::Result;
use std::path::Path;

impl Qwen3 {
    /// Saves the model as a Hugging Face checkpoint directory in its compute dtype (see
    /// [`crate::checkpoint::save_checkpoint`]), copying tokenizer and generation files from `copy_from`.
    pub fn save(&self, out: &Path, copy_from: Option<&Path>) -> Result<()> {
        self.save_sharded(out, copy_from, crate::checkpoint::MAX_SHARD_BYTES)
    }

    /// [`Qwen3::save`] with shards of at most `max_shard_bytes` (a single tensor may exceed it).
    pub fn save_sharded(
        &self,
        out: &Path,
        copy_from: Option<&Path>,
        max_shard_bytes: usize,
    ) -> Result<()> {
        self.save_with(out, copy_from, max_shard_bytes, &|_| Ok(()))
    }

    /// [`Qwen3::save_sharded`] with `extra` writing more files into the checkpoint before it
    /// becomes visible under its name. A model with LoRA adapters saves them merged (a plain
    /// checkpoint; [`Qwen3::save_adapter`] writes the adapters alone).
    pub fn save_with(
        &self,
        out: &Path,
        copy_from: Option<&Path>,
        max_shard_bytes: usize,
        extra: &dyn Fn(&Path) -> Result<()>,
    ) -> Result<()> {
        let mut config = self.config_json.clone();
        let dtype_key = match config.get("torch_dtype") {
            Some(_) => "torch_dtype",
            None => "dtype",
        };
        config[dtype_key] = crate::checkpoint::dtype_name(self.dtype).into();
        config["tie_word_embeddings"] = self.tied.into();
        crate::checkpoint::save_checkpoint(
            out,
            &self.merged_parameters()?,
            &config,
            copy_from,
            max_shard_bytes,
            extra,
        )
    }
}
