//! vLLM's torch-free NCCL weight transfer (`sync = "nccl"`): the HTTP half, which tells the
//! servers what is coming, and the [`Broadcaster`] seam, which sends it.
//!
//! The trainer is rank 0 of an NCCL group that every worker of every server joins. Joining has no
//! store barrier: the trainer mints an NCCL unique id, posts it to each server's
//! `/init_weight_transfer_engine` (`init_info = {nccl_unique_id_b64, rank_offset, world_size,
//! packed: false}`) and joins the group *while* those requests are open, then issues the
//! one-element f32 sum all-reduce that vLLM's workers issue right after joining. Per update:
//! `/start_weight_update`, then `/update_weights` with the parameters' names, dtypes and shapes
//! *while* the trainer broadcasts each tensor in that order (unpacked: one broadcast each), then
//! `/finish_weight_update` with the new version. The names are Hugging Face's; vLLM maps them.
//! The servers must run with `--weight-transfer-config '{"backend":"nccl"}'` and dev mode.
//!
//! The request bodies, the ranks and the order here are what vLLM 0.32–0.34 read
//! (`vllm/distributed/weight_transfer/nccl_common.py`, `nccl_engine.py`). The transport behind
//! [`Broadcaster`] needs GPUs; on a CPU build `sync = "nccl"` is refused before anything starts.

use crate::engine::{EngineError, Result, WeightVersion};
use base64::Engine as _;
use candle_core::{DType, Tensor};
use serde_json::{json, Value};

/// The bytes of an `ncclUniqueId`.
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// The trainer's end of the NCCL group: rank 0, the only sender.
pub trait Broadcaster: Send {
    /// A fresh `ncclGetUniqueId` for a new group.
    fn unique_id(&mut self) -> Result<[u8; NCCL_UNIQUE_ID_BYTES]>;
    /// Joins the group `id` as rank 0 of `world_size`, then runs the warm-up all-reduce (one f32,
    /// sum) that every vLLM worker issues after joining. Returns once every rank has joined.
    fn join(&mut self, id: &[u8; NCCL_UNIQUE_ID_BYTES], world_size: usize) -> Result<()>;
    /// Broadcasts `tensor` from rank 0 to every worker.
    fn broadcast(&mut self, tensor: &Tensor) -> Result<()>;
}

/// The body of `/init_weight_transfer_engine` for a server whose first worker is rank
/// `rank_offset` of `world_size` (the trainer is rank 0; the id goes as standard base64).
pub fn init_body(id: &[u8; NCCL_UNIQUE_ID_BYTES], rank_offset: usize, world_size: usize) -> Value {
    json!({"init_info": {
        "nccl_unique_id_b64": base64::engine::general_purpose::STANDARD.encode(id),
        "rank_offset": rank_offset,
        "world_size": world_size,
        "packed": false,
    }})
}

/// Each server's first rank, and the group's size: the trainer is rank 0, then the servers'
/// workers (tensor × pipeline × data parallel) in `server_urls` order.
pub fn rank_offsets(workers_per_server: &[usize]) -> (Vec<usize>, usize) {
    let mut next = 1;
    let offsets = workers_per_server
        .iter()
        .map(|w| {
            let first = next;
            next += w;
            first
        })
        .collect();
    (offsets, next)
}

/// The body of `/update_weights` for `params`, broadcast in this order.
pub fn update_body(params: &[(String, Tensor)]) -> Result<Value> {
    let mut names = Vec::with_capacity(params.len());
    let mut dtype_names = Vec::with_capacity(params.len());
    let mut shapes = Vec::with_capacity(params.len());
    for (name, tensor) in params {
        names.push(name.clone());
        dtype_names.push(torch_dtype_name(tensor.dtype()).ok_or_else(|| {
            EngineError::InvalidRequest(format!(
                "{name}: NCCL weight transfer sends f32, bf16 or f16 tensors, not {:?}",
                tensor.dtype()
            ))
        })?);
        shapes.push(tensor.dims().to_vec());
    }
    Ok(json!({"update_info": {
        "names": names,
        "dtype_names": dtype_names,
        "shapes": shapes,
    }}))
}

/// The body of `/finish_weight_update`: the version later samples are stamped with.
pub fn finish_body(version: WeightVersion) -> Value {
    json!({ "weight_version": version.to_string() })
}

/// The `torch` attribute name vLLM allocates a received tensor with.
fn torch_dtype_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("float32"),
        DType::BF16 => Some("bfloat16"),
        DType::F16 => Some("float16"),
        _ => None,
    }
}

/// The number of workers a server's `/get_world_size` answer (`{"world_size": N}`) names.
pub fn world_size_of(answer: &Value) -> Option<usize> {
    answer
        .get("world_size")?
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n >= 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_trainer_is_rank_0_and_each_server_starts_after_the_last() {
        assert_eq!(rank_offsets(&[2, 1, 4]), (vec![1, 3, 4], 8));
        assert_eq!(rank_offsets(&[1]), (vec![1], 2));
    }

    #[test]
    fn the_init_body_carries_the_id_as_standard_base64() {
        let mut id = [0u8; NCCL_UNIQUE_ID_BYTES];
        id[0] = 0xfb;
        id[1] = 0xff;
        let body = init_body(&id, 3, 8);
        let info = &body["init_info"];
        let b64 = info["nccl_unique_id_b64"].as_str().unwrap();
        assert!(
            b64.starts_with("+/8"),
            "standard alphabet, not URL-safe: {b64}"
        );
        let back = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        assert_eq!(back, id);
        assert_eq!(info["rank_offset"], 3);
        assert_eq!(info["world_size"], 8);
        assert_eq!(info["packed"], false);
    }

    #[test]
    fn the_update_body_lists_names_dtypes_and_shapes_in_broadcast_order() {
        let d = &Device::Cpu;
        let params = vec![
            (
                "model.norm.weight".to_string(),
                Tensor::zeros(4, DType::F32, d).unwrap(),
            ),
            (
                "lm_head.weight".to_string(),
                Tensor::zeros((3, 4), DType::BF16, d).unwrap(),
            ),
        ];
        let body = update_body(&params).unwrap();
        assert_eq!(
            body,
            json!({"update_info": {
                "names": ["model.norm.weight", "lm_head.weight"],
                "dtype_names": ["float32", "bfloat16"],
                "shapes": [[4], [3, 4]],
            }})
        );
        let ints = vec![("x".to_string(), Tensor::zeros(2, DType::U32, d).unwrap())];
        let err = update_body(&ints).unwrap_err().to_string();
        assert!(err.contains("x:") && err.contains("U32"), "{err}");
        assert_eq!(
            finish_body(WeightVersion(7)),
            json!({"weight_version": "v7"})
        );
        assert_eq!(world_size_of(&json!({"world_size": 2})), Some(2));
        assert_eq!(world_size_of(&json!({"world_size": 0})), None);
    }
}
