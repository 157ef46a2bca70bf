//! The CUDA build's [`Broadcaster`]: the trainer's GPU as rank 0 of the NCCL group vLLM's
//! workers join for `sync = "nccl"` (cudarc's NCCL bindings, on the stream candle's kernels run
//! on, so a broadcast is ordered after the update that produced the weights).
//!
//! Compile-checked in CI; never run here (NCCL needs a GPU on each end). Link against the
//! libnccl vLLM itself loads, so both ends speak one NCCL version.

use crate::engine::{EngineError, Result};
use crate::weight_transfer::{Broadcaster, NCCL_UNIQUE_ID_BYTES};
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{DType, Device, Layout, Storage, Tensor};
use std::sync::Arc;

/// Rank 0 on one GPU; joins a group on [`Broadcaster::join`].
pub struct NcclBroadcaster {
    stream: Arc<CudaStream>,
    comm: Option<Comm>,
}

// SAFETY: the communicator is used by one thread at a time (the engine holds the broadcaster
// and calls it from the thread that syncs); NCCL communicators may move between threads.
#[allow(unsafe_code)]
unsafe impl Send for NcclBroadcaster {}

impl NcclBroadcaster {
    /// The broadcaster of the policy's device, which must be a GPU.
    pub fn new(device: &Device) -> Result<Self> {
        match device {
            Device::Cuda(gpu) => Ok(Self {
                stream: gpu.cuda_stream(),
                comm: None,
            }),
            other => Err(EngineError::InvalidRequest(format!(
                "sync = \"nccl\" broadcasts from the trainer's GPU, and the policy is on {other:?}: \
                 use [model] device = \"cuda\", or sync = \"disk\""
            ))),
        }
    }
}

fn nccl(what: &str, e: impl std::fmt::Debug) -> EngineError {
    EngineError::InvalidRequest(format!("NCCL weight transfer, {what}: {e:?}"))
}

impl Broadcaster for NcclBroadcaster {
    fn unique_id(&mut self) -> Result<[u8; NCCL_UNIQUE_ID_BYTES]> {
        let id = Id::new().map_err(|e| nccl("ncclGetUniqueId", e))?;
        Ok(id.internal().map(|c| c as u8))
    }

    fn join(&mut self, id: &[u8; NCCL_UNIQUE_ID_BYTES], world_size: usize) -> Result<()> {
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        let comm = Comm::from_rank(self.stream.clone(), 0, world_size, id)
            .map_err(|e| nccl("joining the group", e))?;
        // vLLM's workers all-reduce one f32 right after joining; every rank must match it.
        let one = self
            .stream
            .clone_htod(&[1f32])
            .map_err(|e| nccl("the warm-up buffer", e))?;
        let mut sum = self
            .stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| nccl("the warm-up buffer", e))?;
        comm.all_reduce(&one, &mut sum, &ReduceOp::Sum)
            .map_err(|e| nccl("the warm-up all-reduce", e))?;
        self.stream
            .synchronize()
            .map_err(|e| nccl("the warm-up all-reduce", e))?;
        self.comm = Some(comm);
        Ok(())
    }

    fn broadcast(&mut self, tensor: &Tensor) -> Result<()> {
        let comm = self.comm.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest("NCCL broadcast before the group was joined".into())
        })?;
        let tensor = tensor.contiguous()?;
        let (storage, layout) = tensor.storage_and_layout();
        let Storage::Cuda(gpu) = &*storage else {
            return Err(EngineError::InvalidRequest(
                "sync = \"nccl\" sends GPU tensors; this one is on the host".into(),
            ));
        };
        match tensor.dtype() {
            DType::BF16 => send::<half::bf16>(comm, gpu, layout),
            DType::F16 => send::<half::f16>(comm, gpu, layout),
            DType::F32 => send::<f32>(comm, gpu, layout),
            other => Err(EngineError::InvalidRequest(format!(
                "NCCL weight transfer sends f32, bf16 or f16 tensors, not {other:?}"
            ))),
        }
    }
}

/// One broadcast from rank 0 of the tensor's elements; waits for it, so the tensor may be
/// freed or updated afterwards.
fn send<T>(comm: &Comm, storage: &CudaStorage, layout: &Layout) -> Result<()>
where
    T: CudaDType + NcclType + DeviceRepr + ValidAsZeroBits,
{
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
        EngineError::InvalidRequest("NCCL broadcast of a non-contiguous tensor".into())
    })?;
    let elements = storage.as_cuda_slice::<T>()?.slice(start..end);
    // Rank 0 needs a receive buffer too (NCCL writes the root's data there as well).
    let mut received = comm
        .stream()
        .alloc_zeros::<T>(end - start)
        .map_err(|e| nccl("the receive buffer", e))?;
    comm.broadcast(Some(&elements), &mut received, 0)
        .map_err(|e| nccl("broadcast", e))?;
    comm.stream()
        .synchronize()
        .map_err(|e| nccl("broadcast", e))?;
    Ok(())
}
