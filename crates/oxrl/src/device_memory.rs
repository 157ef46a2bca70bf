//! The most memory a benchmark held: the host's from the kernel, and the GPU's from the
//! driver's free-memory figure, the driver's free-memory figure, polled
//! every few milliseconds from a thread (an allocation that lives shorter than that can be
//! missed, so the figure is a lower bound). Memory other processes hold counts too.

use candle_core::Device;

/// The most resident memory this process has held so far (`VmHWM` of `/proc/self/status`),
/// in bytes; `None` where the kernel does not say (not Linux).
pub fn host_peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Memory a run on `device` may use, in bytes: a GPU's total memory, or on a CPU the host's
/// available memory (`MemAvailable` of `/proc/meminfo`; `None` where the kernel does not say).
pub fn capacity(device: &Device) -> candle_core::Result<Option<u64>> {
    match device {
        Device::Cpu => {
            let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") else {
                return Ok(None);
            };
            let kib = meminfo
                .lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse::<u64>().ok());
            Ok(kib.map(|k| k * 1024))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => gpu::total(gpu).map(Some),
        other => candle_core::bail!("no memory figure for {other:?}"),
    }
}

/// Polls one GPU until [`PeakWatch::stop`]; none on a CPU.
pub struct PeakWatch {
    #[cfg(feature = "cuda")]
    running: gpu::Running,
}

impl PeakWatch {
    /// Starts watching `device`: `None` on a CPU.
    pub fn start(device: &Device) -> candle_core::Result<Option<Self>> {
        match device {
            Device::Cpu => Ok(None),
            #[cfg(feature = "cuda")]
            Device::Cuda(gpu) => Ok(Some(Self {
                running: gpu::Running::start(gpu)?,
            })),
            other => candle_core::bail!("no memory watch for {other:?}"),
        }
    }

    /// Stops the poller; the most bytes it saw in use.
    #[cfg(feature = "cuda")]
    pub fn stop(self) -> u64 {
        self.running.stop()
    }

    /// A CPU build never starts one.
    #[cfg(not(feature = "cuda"))]
    pub fn stop(self) -> u64 {
        0
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    use candle_core::cuda_backend::CudaDevice;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::thread::JoinHandle;
    use std::time::Duration;

    pub struct Running {
        done: Arc<AtomicBool>,
        peak: Arc<AtomicU64>,
        poller: JoinHandle<()>,
    }

    /// The GPU's total memory.
    pub fn total(gpu: &CudaDevice) -> candle_core::Result<u64> {
        let (_, total) = gpu
            .cuda_stream()
            .context()
            .mem_get_info()
            .map_err(|e| candle_core::Error::Msg(format!("cuMemGetInfo: {e:?}")))?;
        Ok(total as u64)
    }

    fn in_use(context: &CudaContext) -> candle_core::Result<u64> {
        let (free, total) = context
            .mem_get_info()
            .map_err(|e| candle_core::Error::Msg(format!("cuMemGetInfo: {e:?}")))?;
        Ok((total - free) as u64)
    }

    impl Running {
        pub fn start(gpu: &CudaDevice) -> candle_core::Result<Self> {
            let context = gpu.cuda_stream().context().clone();
            let peak = Arc::new(AtomicU64::new(in_use(&context)?));
            let done = Arc::new(AtomicBool::new(false));
            let (seen, stop) = (peak.clone(), done.clone());
            let poller = std::thread::Builder::new()
                .name("gpu-memory".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if let Ok(bytes) = in_use(&context) {
                            seen.fetch_max(bytes, Ordering::Relaxed);
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    }
                })
                .map_err(|e| candle_core::Error::Msg(format!("the memory poller: {e}")))?;
            Ok(Self { done, peak, poller })
        }

        pub fn stop(self) -> u64 {
            self.done.store(true, Ordering::Relaxed);
            let _ = self.poller.join();
            self.peak.load(Ordering::Relaxed)
        }
    }
}
