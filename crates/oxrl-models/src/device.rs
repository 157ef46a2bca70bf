//! Where a run's tensors live, as a config or command line names it: `cpu`, `cuda` (the first
//! GPU) or `cuda:N`. This is the one place that turns a name into a candle [`Device`], so a
//! build without the `cuda` feature refuses a GPU with a clear error instead of failing deep
//! inside a kernel.

use candle_core::Device;

/// The host: where checkpoints are read and written and host-side arithmetic happens.
pub const HOST: Device = Device::Cpu;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device `{0}`: expected \"cpu\", \"cuda\" or \"cuda:N\"")]
    Unknown(String),
    #[error("device `{0}`: this oxrl was built without CUDA; rebuild with `cargo build --release --features cuda`")]
    NoCuda(DeviceSpec),
    #[error("device `{spec}`: {source}")]
    Open {
        spec: DeviceSpec,
        source: candle_core::Error,
    },
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, DeviceError> {
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| DeviceError::Unknown(s.to_string())),
        }
    }
}

impl DeviceSpec {
    /// The candle device; a GPU needs a build with the `cuda` feature.
    pub fn open(self) -> Result<Device, DeviceError> {
        match self {
            DeviceSpec::Cpu => Ok(HOST),
            DeviceSpec::Cuda(ordinal) => open_cuda(self, ordinal),
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(spec: DeviceSpec, ordinal: usize) -> Result<Device, DeviceError> {
    Device::new_cuda(ordinal).map_err(|source| DeviceError::Open { spec, source })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(spec: DeviceSpec, _ordinal: usize) -> Result<Device, DeviceError> {
    Err(DeviceError::NoCuda(spec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print_back() {
        for (name, spec, shown) in [
            ("cpu", DeviceSpec::Cpu, "cpu"),
            ("cuda", DeviceSpec::Cuda(0), "cuda:0"),
            ("cuda:3", DeviceSpec::Cuda(3), "cuda:3"),
        ] {
            let parsed: DeviceSpec = name.parse().unwrap();
            assert_eq!(parsed, spec);
            assert_eq!(parsed.to_string(), shown);
        }
        for bad in ["gpu", "cuda:", "cuda:x", "CPU", ""] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(e.to_string().contains("expected \"cpu\""), "{e}");
        }
    }

    #[test]
    fn cpu_opens() {
        assert!(DeviceSpec::Cpu.open().unwrap().is_cpu());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_needs_the_feature() {
        let e = DeviceSpec::Cuda(0).open().unwrap_err().to_string();
        assert!(
            e.contains("built without CUDA") && e.contains("--features cuda"),
            "{e}"
        );
    }
}
