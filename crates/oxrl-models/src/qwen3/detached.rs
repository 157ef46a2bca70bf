//! A second handle on a model's weights without autograd tracking.

use super::visual::Vision;
use super::Qwen3;
use candle_core::Tensor;

impl Qwen3 {
    /// A second handle on the same weights without autograd tracking, for the rollout engine
    /// and no-grad scoring: the tensors share storage, so an optimizer's in-place update
    /// (`Var::set`) shows in both.
    /// Its adapters (if any) get a switch of their own, set as this model's is now.
    pub fn detached(&self) -> Self {
        let d = |t: &Tensor| t.detach();
        let mut detached = Self {
            config: self.config.clone(),
            config_json: self.config_json.clone(),
            model: self.model.map(&d),
            lm_head: d(&self.lm_head),
            tied: self.tied,
            vision: self.vision.as_ref().map(|v| Vision {
                tower: v.tower.map_weights(d),
                tokens: v.tokens,
                processor: v.processor.clone(),
                frozen: v.frozen,
            }),
            dtype: self.dtype,
            device: self.device.clone(),
            kv_cache: self.kv_cache,
            gradient_checkpointing: self.gradient_checkpointing,
            logit_chunk_elements: self.logit_chunk_elements,
            lora: self.lora.clone(),
        };
        detached.own_adapter_switch();
        detached
    }
}
