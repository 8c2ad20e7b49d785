//! Where a rank's model runs: the CPU (candle, f32; the reference) or a GPU (the whole model in
//! bf16 on rackfill's CUDA kernels, `rackfill_models::gpu`, its MoE layers on the device's data
//! plane, `rackfill_kernels::cuda::moe`).

/// The device of every rank's model: embedding, attention, norms, dense MLPs, shared experts,
/// LM head, and the routed experts with their MoE data plane.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ModelDevice {
    #[default]
    Cpu,
    /// GPU `ordinal`; `None`: the process's local rank under a launcher, else GPU 0.
    Cuda { ordinal: Option<usize> },
    /// The GPU path's kernels on the host emulator: a check of that path on a machine without a
    /// GPU (needs a C++ compiler; far slower than any GPU).
    Emulator,
}

impl ModelDevice {
    /// The GPU this process uses for `self`, with local rank `local_rank` under a launcher.
    pub fn gpu_ordinal(self, local_rank: Option<usize>) -> Option<usize> {
        match self {
            Self::Cpu | Self::Emulator => None,
            Self::Cuda { ordinal } => Some(ordinal.or(local_rank).unwrap_or(0)),
        }
    }
}

impl std::fmt::Display for ModelDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda { ordinal: None } => f.write_str("cuda"),
            Self::Cuda { ordinal: Some(n) } => write!(f, "cuda:{n}"),
            Self::Emulator => f.write_str("emulator"),
        }
    }
}

impl std::str::FromStr for ModelDevice {
    type Err = String;

    /// `cpu`, `cuda`, `cuda:N` or `emulator`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda { ordinal: None }),
            "emulator" => Ok(Self::Emulator),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(|n| Self::Cuda { ordinal: Some(n) })
                .ok_or_else(|| format!("expected cpu, cuda, cuda:N or emulator, got '{other}'")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_back() {
        for text in ["cpu", "cuda", "cuda:3", "emulator"] {
            assert_eq!(text.parse::<ModelDevice>().unwrap().to_string(), text);
        }
        for bad in ["", "gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            assert!(bad.parse::<ModelDevice>().is_err(), "{bad}");
        }
        assert_eq!(ModelDevice::Cpu.gpu_ordinal(Some(2)), None);
        assert_eq!(ModelDevice::Emulator.gpu_ordinal(Some(2)), None);
        assert_eq!(
            ModelDevice::Cuda { ordinal: None }.gpu_ordinal(Some(2)),
            Some(2)
        );
        assert_eq!(
            ModelDevice::Cuda { ordinal: None }.gpu_ordinal(None),
            Some(0)
        );
        assert_eq!(
            ModelDevice::Cuda { ordinal: Some(1) }.gpu_ordinal(Some(2)),
            Some(1)
        );
    }
}
