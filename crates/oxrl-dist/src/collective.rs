//! The collectives data-parallel training needs, on tensors, behind one trait: the TCP ring
//! for CPU ranks, NCCL for GPU ranks (the `cuda` feature), and a group of one that needs
//! neither.

use crate::error::{DistError, Result};
use crate::ring::{chunk, TcpRing};
use candle_core::{DType, Tensor, WithDType};

/// Collective operations over the ranks of a process group. Every rank must call the same
/// operations in the same order with tensors of the same shape and dtype.
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// The transport's name, for logs: "tcp-ring", "nccl", "single".
    fn transport(&self) -> &'static str;
    /// The element-wise sum over ranks, on every rank.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// The sum over ranks of a flat tensor whose length divides by the world size; each rank
    /// keeps its 1/W: elements `[rank·n/W, (rank+1)·n/W)`.
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// The ranks' flat shards (equal lengths), concatenated in rank order, on every rank.
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor>;
    /// `root`'s tensor, on every rank.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;
    /// Sums host numbers over ranks in place: token totals, metrics.
    fn all_reduce_host(&self, values: &mut [f64]) -> Result<()>;
    /// Every rank's bytes, in rank order: small host messages.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.all_reduce_host(&mut [0.0])
    }
}

/// A group of one process: every collective is the identity.
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn transport(&self) -> &'static str {
        "single"
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.flatten_all()?)
    }
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor> {
        Ok(shard.flatten_all()?)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root != 0 {
            return Err(DistError::Invalid(format!(
                "broadcast from rank {root} in a group of 1"
            )));
        }
        Ok(t.clone())
    }
    fn all_reduce_host(&self, _values: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![mine.to_vec()])
    }
}

/// Runs `$body` with `$T` bound to the Rust type of `$dtype`'s elements.
macro_rules! with_element {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            other => Err(DistError::Invalid(format!(
                "collectives on {other:?} tensors are not supported"
            ))),
        }
    };
}

fn host_elements<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    Ok(t.flatten_all()?.to_vec1::<T>()?)
}

/// The ring moves host memory: a tensor on a GPU goes through the host (correct, and slow;
/// GPU ranks use NCCL).
impl Collective for TcpRing {
    fn rank(&self) -> usize {
        TcpRing::rank(self)
    }
    fn world_size(&self) -> usize {
        TcpRing::world_size(self)
    }
    fn transport(&self) -> &'static str {
        "tcp-ring"
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        with_element!(t.dtype(), T => {
            let mut values = host_elements::<T>(t)?;
            self.all_reduce(&mut values)?;
            Ok(Tensor::from_vec(values, t.shape(), t.device())?)
        })
    }

    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        let (n, w) = (t.elem_count(), TcpRing::world_size(self));
        if n % w != 0 {
            return Err(DistError::Invalid(format!(
                "reduce-scatter of {n} elements over {w} ranks: pad to a multiple of {w}"
            )));
        }
        with_element!(t.dtype(), T => {
            let mut values = host_elements::<T>(t)?;
            let mine = self.reduce_scatter(&mut values)?;
            Ok(Tensor::from_slice(&values[mine], n / w, t.device())?)
        })
    }

    fn all_gather(&self, shard: &Tensor) -> Result<Tensor> {
        let (n, w) = (shard.elem_count(), TcpRing::world_size(self));
        with_element!(shard.dtype(), T => {
            let mut values = vec![<T as bytemuck::Zeroable>::zeroed(); n * w];
            values[chunk(TcpRing::rank(self), n * w, w)].copy_from_slice(&host_elements::<T>(shard)?);
            TcpRing::all_gather(self, &mut values)?;
            Ok(Tensor::from_vec(values, n * w, shard.device())?)
        })
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        with_element!(t.dtype(), T => {
            let mut values = host_elements::<T>(t)?;
            TcpRing::broadcast(self, &mut values, root)?;
            Ok(Tensor::from_vec(values, t.shape(), t.device())?)
        })
    }

    fn all_reduce_host(&self, values: &mut [f64]) -> Result<()> {
        self.all_reduce(values)
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        TcpRing::all_gather_bytes(self, mine)
    }
}
