//! The GPU transport: NCCL through cudarc, its communicator built on candle's stream so every
//! collective is ordered after the kernels that produced its input. Host-side messages (token
//! totals, metrics, byte gathers) go over the TCP ring beside it, which also carried the NCCL
//! unique id's exchange partners to each other.
//!
//! Compile-checked in CI (the `cuda` feature); running it needs GPUs (see docs/distributed.md).

use crate::collective::Collective;
use crate::error::{DistError, Result};
use crate::rendezvous::Rendezvous;
use crate::ring::TcpRing;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Shape, Storage, Tensor};
use std::sync::{Arc, Mutex};

/// The communicator, movable between threads.
struct Communicator(Comm);

// SAFETY: NCCL communicators may be used from any thread as long as calls on one are not
// concurrent; the `Mutex` in `NcclCollective` makes every use exclusive.
#[allow(unsafe_code)]
unsafe impl Send for Communicator {}

/// NCCL between this process's GPU and the other ranks'.
pub struct NcclCollective {
    comm: Mutex<Communicator>,
    stream: Arc<CudaStream>,
    gpu: CudaDevice,
    host: TcpRing,
}

fn nccl(what: &str, e: impl std::fmt::Debug) -> DistError {
    DistError::Invalid(format!("NCCL {what}: {e:?}"))
}

/// The operation one call runs.
#[derive(Clone, Copy)]
enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast(usize),
}

impl NcclCollective {
    /// Joins the NCCL group of `rendezvous`'s ranks on `device` (a GPU): rank 0 draws the unique
    /// id and publishes it through the store; every rank builds its communicator from it.
    pub fn join(rendezvous: &mut Rendezvous, host: TcpRing, device: &Device) -> Result<Self> {
        let Device::Cuda(gpu) = device else {
            return Err(DistError::Invalid(format!(
                "NCCL runs between GPUs, and this rank's device is {device:?}"
            )));
        };
        let (rank, world_size) = (host.rank(), host.world_size());
        let id = if rank == 0 {
            let id = Id::new().map_err(|e| nccl("ncclGetUniqueId", e))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            rendezvous.set("nccl_id", &bytes)?;
            id
        } else {
            let bytes = rendezvous.get("nccl_id")?;
            let mut internal = [0 as std::ffi::c_char; 128];
            if bytes.len() != internal.len() {
                return Err(DistError::Invalid(format!(
                    "the NCCL unique id rank 0 published has {} bytes, not 128",
                    bytes.len()
                )));
            }
            for (c, b) in internal.iter_mut().zip(bytes) {
                *c = b as std::ffi::c_char;
            }
            Id::uninit(internal)
        };
        let stream = gpu.cuda_stream();
        let comm = Comm::from_rank(stream.clone(), rank, world_size, id)
            .map_err(|e| nccl("ncclCommInitRank", e))?;
        Ok(NcclCollective {
            comm: Mutex::new(Communicator(comm)),
            stream,
            gpu: gpu.clone(),
            host,
        })
    }

    fn run(&self, t: &Tensor, op: Op) -> Result<Tensor> {
        match t.dtype() {
            DType::F32 => self.run_typed::<f32>(t, op),
            DType::BF16 => self.run_typed::<half::bf16>(t, op),
            DType::F16 => self.run_typed::<half::f16>(t, op),
            DType::F64 => self.run_typed::<f64>(t, op),
            other => Err(DistError::Invalid(format!(
                "NCCL collectives on {other:?} tensors are not supported"
            ))),
        }
    }

    /// One collective on `t`'s elements into a fresh buffer, waited for, as a new tensor.
    fn run_typed<T>(&self, t: &Tensor, op: Op) -> Result<Tensor>
    where
        T: CudaDType + NcclType + DeviceRepr + ValidAsZeroBits,
    {
        let t = t.contiguous()?;
        // The tensor may come from another stream than the communicator's: wait for its
        // kernels before NCCL reads it.
        t.device().synchronize()?;
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(on_gpu) = &*storage else {
            return Err(DistError::Invalid(
                "NCCL moves GPU tensors; this one is on the host".into(),
            ));
        };
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| DistError::Invalid("NCCL on a non-contiguous tensor".into()))?;
        let n = end - start;
        let w = self.host.world_size();
        let (len, shape): (usize, Shape) = match op {
            Op::AllReduce | Op::Broadcast(_) => (n, t.shape().clone()),
            Op::ReduceScatter => (n / w, Shape::from(n / w)),
            Op::AllGather => (n * w, Shape::from(n * w)),
        };
        let src = on_gpu.as_cuda_slice::<T>()?.slice(start..end);
        let mut dst = self
            .stream
            .alloc_zeros::<T>(len)
            .map_err(|e| nccl("allocating the result", e))?;
        let comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        let done = match op {
            Op::AllReduce => comm.0.all_reduce(&src, &mut dst, &ReduceOp::Sum),
            Op::ReduceScatter => comm.0.reduce_scatter(&src, &mut dst, &ReduceOp::Sum),
            Op::AllGather => comm.0.all_gather(&src, &mut dst),
            Op::Broadcast(root) => comm.0.broadcast(Some(&src), &mut dst, root as i32),
        };
        done.map_err(|e| nccl("collective", e))?;
        // The source belongs to a tensor that may be freed once this returns.
        self.stream
            .synchronize()
            .map_err(|e| nccl("waiting for the collective", e))?;
        drop(comm);
        let storage = CudaStorage::wrap_cuda_slice(dst, self.gpu.clone());
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            shape,
            BackpropOp::none(),
            false,
        ))
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn world_size(&self) -> usize {
        self.host.world_size()
    }
    fn transport(&self) -> &'static str {
        "nccl"
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.run(t, Op::AllReduce)
    }
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        let (n, w) = (t.elem_count(), self.host.world_size());
        if n % w != 0 {
            return Err(DistError::Invalid(format!(
                "reduce-scatter of {n} elements over {w} ranks: pad to a multiple of {w}"
            )));
        }
        self.run(t, Op::ReduceScatter)
    }
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor> {
        self.run(shard, Op::AllGather)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.host.world_size() {
            return Err(DistError::Invalid(format!(
                "broadcast from rank {root} in a group of {}",
                self.host.world_size()
            )));
        }
        self.run(t, Op::Broadcast(root))
    }
    fn all_reduce_host(&self, values: &mut [f64]) -> Result<()> {
        self.host.all_reduce(values)
    }
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.host.all_gather_bytes(mine)
    }
}
