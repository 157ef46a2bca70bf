//! The CUDA side of [`crate::logprob`]: `logprob.cu`'s kernels, compiled by NVRTC the first time
//! a GPU needs them (no CUDA compiler at build time), one block of 256 threads per row, every sum
//! in f32 whatever the logits' dtype (f32 or bf16).
//!
//! The CPU functions in `logprob.rs` are their reference: the same formulas, row by row.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Layout, Result, Shape, Storage, Tensor};
use std::sync::OnceLock;

const SOURCE: &str = include_str!("logprob.cu");
const MODULE: &str = "oxrl_logprob";
const THREADS: u32 = 256;

fn cuda_error(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("{what}: {e:?}"))
}

/// `logprob.cu` as PTX, compiled once per process.
fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        nvrtc::compile_ptx(SOURCE)
            .map(|ptx| ptx.to_src())
            .map_err(|e| format!("{e:?}"))
    })
    .as_deref()
    .map_err(|e| cuda_error("NVRTC compiling oxrl-nn's logprob.cu", e))
}

fn one_block_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The contiguous elements of `[N, V]` logits, and `V`.
fn rows_of<'a, T: CudaDType>(
    storage: &'a CudaStorage,
    layout: &Layout,
) -> Result<(CudaView<'a, T>, usize, usize)> {
    let (n, v) = layout.shape().dims2()?;
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("target-logprob: logits must be contiguous");
    };
    Ok((storage.as_cuda_slice::<T>()?.slice(start..end), n, v))
}

/// The kernel for the logits' dtype: `{stem}_f32` or `{stem}_bf16`.
fn kernel_name(stem: &str, dtype: DType) -> Result<String> {
    match dtype {
        DType::F32 => Ok(format!("{stem}_f32")),
        DType::BF16 => Ok(format!("{stem}_bf16")),
        other => {
            candle_core::bail!("target-logprob on CUDA takes f32 or bf16 logits, not {other:?}")
        }
    }
}

/// Per row: the target's log-probability and (when `with_entropy`, else zeros) the entropy.
pub(crate) fn logprob_entropy(
    logits: &CudaStorage,
    layout: &Layout,
    targets: &CudaView<'_, u32>,
    with_entropy: bool,
) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
    let dtype = logits.dtype();
    let name = kernel_name("logprob_entropy", dtype)?;
    match dtype {
        DType::BF16 => {
            launch_logprob_entropy::<half::bf16>(&name, logits, layout, targets, with_entropy)
        }
        _ => launch_logprob_entropy::<f32>(&name, logits, layout, targets, with_entropy),
    }
}

#[allow(unsafe_code)] // a kernel launch: cudarc cannot check the kernel's arguments
fn launch_logprob_entropy<T: CudaDType + DeviceRepr>(
    name: &str,
    logits: &CudaStorage,
    layout: &Layout,
    targets: &CudaView<'_, u32>,
    with_entropy: bool,
) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
    let device = &logits.device;
    let (z, n, v) = rows_of::<T>(logits, layout)?;
    let mut lp = device.alloc_zeros::<f32>(n)?;
    let mut entropy = device.alloc_zeros::<f32>(if with_entropy { n } else { 1 })?;
    if n > 0 {
        let func = device.get_or_load_custom_func(name, MODULE, ptx()?)?;
        let (vocab, with_entropy) = (v as i32, with_entropy as i32);
        let mut launch = func.builder();
        launch
            .arg(&z)
            .arg(targets)
            .arg(&mut lp)
            .arg(&mut entropy)
            .arg(&vocab)
            .arg(&with_entropy);
        // SAFETY: the kernel reads n·v logits and n targets and writes n floats to each
        // output (entropy only when asked), all allocated above with those lengths.
        unsafe { launch.launch(one_block_per_row(n)) }
            .map_err(|e| cuda_error(&format!("launching {name}"), e))?;
    }
    Ok((lp, entropy))
}

/// `g_i·(1[j = t_i] − softmax(z_i)_j)` for every logit, in the logits' dtype.
pub(crate) fn logprob_grad(
    logits: &CudaStorage,
    layout: &Layout,
    targets: &CudaView<'_, u32>,
    lp: &CudaView<'_, f32>,
    grad_lp: &CudaView<'_, f32>,
) -> Result<CudaStorage> {
    let dtype = logits.dtype();
    let name = kernel_name("logprob_grad", dtype)?;
    let device = logits.device.clone();
    Ok(match dtype {
        DType::BF16 => CudaStorage::wrap_cuda_slice(
            launch_grad::<half::bf16>(&name, logits, layout, targets, lp, grad_lp)?,
            device,
        ),
        _ => CudaStorage::wrap_cuda_slice(
            launch_grad::<f32>(&name, logits, layout, targets, lp, grad_lp)?,
            device,
        ),
    })
}

#[allow(unsafe_code)] // an uninitialised buffer and a kernel launch
fn launch_grad<T: CudaDType + DeviceRepr>(
    name: &str,
    logits: &CudaStorage,
    layout: &Layout,
    targets: &CudaView<'_, u32>,
    lp: &CudaView<'_, f32>,
    grad_lp: &CudaView<'_, f32>,
) -> Result<CudaSlice<T>> {
    let device: &CudaDevice = &logits.device;
    let (z, n, v) = rows_of::<T>(logits, layout)?;
    // SAFETY: the kernel writes every one of the n·v elements before anything reads them.
    let mut grad = unsafe { device.alloc::<T>(n * v)? };
    if n > 0 {
        let func = device.get_or_load_custom_func(name, MODULE, ptx()?)?;
        let vocab = v as i32;
        let mut launch = func.builder();
        launch
            .arg(&z)
            .arg(targets)
            .arg(lp)
            .arg(grad_lp)
            .arg(&mut grad)
            .arg(&vocab);
        // SAFETY: n·v logits read and gradients written, n targets, log-probs and upstream
        // gradients read, all of those lengths.
        unsafe { launch.launch(one_block_per_row(n)) }
            .map_err(|e| cuda_error(&format!("launching {name}"), e))?;
    }
    Ok(grad)
}

/// The GPU storage of a tensor's guard, or an error naming the op.
fn on_gpu(storage: &Storage) -> Result<&CudaStorage> {
    match storage {
        Storage::Cuda(gpu) => Ok(gpu),
        _ => candle_core::bail!("target-logprob: every input must be on the logits' GPU"),
    }
}

/// The contiguous elements of a 1-D tensor's storage.
fn elements<'a, T: CudaDType>(
    storage: &'a CudaStorage,
    layout: &Layout,
) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("target-logprob: inputs must be contiguous");
    };
    Ok(storage.as_cuda_slice::<T>()?.slice(start..end))
}

/// `TargetLogprob`'s forward on a GPU: `[N]` f32 log-probabilities.
pub(crate) fn target_logprobs_fwd(
    logits: &CudaStorage,
    logits_layout: &Layout,
    targets: &CudaStorage,
    targets_layout: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let n = logits_layout.shape().dims2()?.0;
    let targets = elements::<u32>(targets, targets_layout)?;
    let (lp, _) = logprob_entropy(logits, logits_layout, &targets, false)?;
    Ok((
        CudaStorage::wrap_cuda_slice(lp, logits.device.clone()),
        Shape::from(n),
    ))
}

/// `TargetLogprob`'s backward on a GPU: the gradient of the `[N, V]` logits.
pub(crate) fn target_logprobs_bwd(
    logits: &Tensor,
    targets: &Tensor,
    lp: &Tensor,
    grad_lp: &Tensor,
) -> Result<Tensor> {
    let (logits, grad_lp) = (
        logits.contiguous()?,
        grad_lp.contiguous()?.to_dtype(DType::F32)?,
    );
    let shape = logits.shape().clone();
    let (z_guard, z_layout) = logits.storage_and_layout();
    let (t_guard, t_layout) = targets.storage_and_layout();
    let (lp_guard, lp_layout) = lp.storage_and_layout();
    let (g_guard, g_layout) = grad_lp.storage_and_layout();
    let z = on_gpu(&z_guard)?;
    let grad = logprob_grad(
        z,
        z_layout,
        &elements::<u32>(on_gpu(&t_guard)?, t_layout)?,
        &elements::<f32>(on_gpu(&lp_guard)?, lp_layout)?,
        &elements::<f32>(on_gpu(&g_guard)?, g_layout)?,
    )?;
    Ok(Tensor::from_storage(
        Storage::Cuda(grad),
        shape,
        BackpropOp::none(),
        false,
    ))
}

/// [`crate::logprob_entropy`] on a GPU: one kernel, two `[N]` copies back to the host.
pub(crate) fn logprob_entropy_to_host(
    logits: &Tensor,
    targets: &[u32],
    with_entropy: bool,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let logits = logits.contiguous()?;
    let (z_guard, z_layout) = logits.storage_and_layout();
    let z = on_gpu(&z_guard)?;
    let device = &z.device;
    let on_device = device.clone_htod(targets)?;
    let (lp, entropy) = logprob_entropy(z, z_layout, &on_device.slice(..), with_entropy)?;
    let lp = device.clone_dtoh(&lp)?;
    let entropy = if with_entropy {
        device.clone_dtoh(&entropy)?
    } else {
        vec![0.0; lp.len()]
    };
    Ok((lp, entropy))
}
