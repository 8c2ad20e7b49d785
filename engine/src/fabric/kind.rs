//! Which fabric a process per rank moves its data over: the choice `rackfill serve --fabric`
//! offers, and how `auto` resolves.

use std::fmt;
use std::str::FromStr;

/// The fabric of a process-per-rank world (an MPI launch); a single process holding every rank
/// always uses the in-process [`super::LocalFabric`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FabricKind {
    /// NCCL when the MoE data plane runs on a GPU and the NCCL probe succeeds, else MPI: the
    /// fastest fabric the host can run, never a failure for want of NCCL.
    #[default]
    Auto,
    /// MPI (the system OpenMPI) on the CPU: host buffers, every host.
    Mpi,
    /// NCCL between the processes' GPUs (one GPU per process); needs the GPU build (feature `cuda`) and
    /// the NCCL runtime, and fails at start without them.
    Nccl,
}

impl FabricKind {
    /// Every choice, as spelled on the command line.
    pub const CHOICES: [&'static str; 3] = ["auto", "mpi", "nccl"];

    /// The fabric to build: [`FabricKind::Mpi`] or [`FabricKind::Nccl`]. `gpu_visible` says
    /// whether this process has a GPU of its own (the binary's GPU support and a device for its
    /// local rank); `probe_nccl` is the NCCL probe (called only when the answer depends on it),
    /// whose error is its one-line reason. An explicit `nccl` that cannot run is an error naming
    /// why, never a silent fallback.
    pub fn resolve(
        self,
        gpu_visible: bool,
        probe_nccl: impl FnOnce() -> Result<String, String>,
    ) -> Result<FabricKind, String> {
        match self {
            FabricKind::Mpi => Ok(FabricKind::Mpi),
            FabricKind::Auto if !gpu_visible => Ok(FabricKind::Mpi),
            FabricKind::Auto => Ok(match probe_nccl() {
                Ok(_) => FabricKind::Nccl,
                Err(_) => FabricKind::Mpi,
            }),
            FabricKind::Nccl if !gpu_visible => Err(
                "--fabric nccl needs a GPU for every process (one per local rank) and a binary \
                 with GPU support"
                    .to_string(),
            ),
            FabricKind::Nccl => probe_nccl().map(|_| FabricKind::Nccl),
        }
    }
}

impl fmt::Display for FabricKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FabricKind::Auto => "auto",
            FabricKind::Mpi => "mpi",
            FabricKind::Nccl => "nccl",
        })
    }
}

/// A `--fabric` value that is none of [`FabricKind::CHOICES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown fabric {given:?}: expected one of auto, mpi, nccl")]
pub struct UnknownFabric {
    pub given: String,
}

impl FromStr for FabricKind {
    type Err = UnknownFabric;

    /// Case-insensitive, surrounding spaces ignored.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(FabricKind::Auto),
            "mpi" => Ok(FabricKind::Mpi),
            "nccl" => Ok(FabricKind::Nccl),
            _ => Err(UnknownFabric {
                given: s.to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_choice_parses_back_from_its_display() {
        for choice in FabricKind::CHOICES {
            let kind: FabricKind = choice.parse().unwrap();
            assert_eq!(kind.to_string(), choice);
        }
        assert_eq!(" NCCL ".parse::<FabricKind>(), Ok(FabricKind::Nccl));
        assert_eq!(FabricKind::default(), FabricKind::Auto);
        let err = "ucx".parse::<FabricKind>().unwrap_err().to_string();
        assert_eq!(
            err,
            "unknown fabric \"ucx\": expected one of auto, mpi, nccl"
        );
    }

    #[test]
    fn auto_takes_nccl_only_on_a_gpu_plane_with_nccl() {
        let present = || Ok("NCCL 2.27.3".to_string());
        let absent = || Err("NCCL not available: libnccl.so.2 not found".to_string());
        let not_called = || -> Result<String, String> { panic!("probed for nothing") };
        let auto = FabricKind::Auto;
        assert_eq!(auto.resolve(true, present), Ok(FabricKind::Nccl));
        assert_eq!(auto.resolve(true, absent), Ok(FabricKind::Mpi));
        assert_eq!(auto.resolve(false, not_called), Ok(FabricKind::Mpi));
        assert_eq!(
            FabricKind::Mpi.resolve(true, not_called),
            Ok(FabricKind::Mpi)
        );
        assert_eq!(
            FabricKind::Nccl.resolve(true, present),
            Ok(FabricKind::Nccl)
        );
        let err = FabricKind::Nccl.resolve(true, absent).unwrap_err();
        assert!(err.starts_with("NCCL not available"), "{err}");
        let err = FabricKind::Nccl.resolve(false, not_called).unwrap_err();
        assert!(err.contains("needs a GPU for every process"), "{err}");
    }
}
