//! Peer memory between processes: device memory one process allocates
//! ([`Executor::alloc_shared`](super::Executor::alloc_shared)) and every other process of the
//! group maps into its own address space ([`Executor::open_shared`](super::Executor::open_shared))
//! by a [`SharedHandle`], a few bytes exchanged over the group's transport (MPI). Kernels then
//! load from and store to it as to their own memory: what lets the MoE data plane's copies,
//! ready flags and replica streams cross processes without the host.
//!
//! Mechanisms, by executor:
//! - the GPU: FABRIC handles of CUDA VMM allocations across the hosts of an NVLink domain
//!   (an NVL72 rack, with IMEX), else CUDA IPC between the processes of one host, also several
//!   processes on one GPU (which NCCL refuses): [`super::gpu_shared`];
//! - the host emulator: a `memfd` mapped by every process (opened through `/proc/PID/fd/FD`),
//!   so `mpirun` groups run the same kernels across processes in CI.

use super::super::CudaError;

/// How a process maps another's shared allocation: which mechanism, and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedHandle(Vec<u8>);

/// The mechanisms, as the first byte of a handle.
const MEMFD: u8 = 1;
const CUDA_IPC: u8 = 2;
const CUDA_FABRIC: u8 = 3;

/// Bytes of a boot id (a UUID as text).
pub(super) const BOOT_ID: usize = 36;

/// This host's boot id: what tells a memfd handle of this host from another's.
pub(super) fn boot_id() -> [u8; BOOT_ID] {
    let mut out = [0u8; BOOT_ID];
    if let Ok(text) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        for (o, b) in out.iter_mut().zip(text.trim().bytes()) {
            *o = b;
        }
    }
    out
}

/// A handle's decoded form.
pub(super) enum Decoded {
    /// The emulator: `/proc/{pid}/fd/{fd}`, `bytes` long, on the host whose kernel booted as
    /// `boot` (`/proc/sys/kernel/random/boot_id`: another host's pid and fd name something
    /// else).
    Memfd {
        pid: u32,
        fd: i32,
        bytes: usize,
        boot: [u8; BOOT_ID],
    },
    /// A GPU: a `CUipcMemHandle`, `bytes` long.
    CudaIpc { handle: [u8; 64], bytes: usize },
    /// A GPU: a `CUmemFabricHandle` of an allocation of `size` bytes (whole granules), `bytes`
    /// of them in use.
    CudaFabric {
        handle: [u8; 64],
        size: usize,
        bytes: usize,
    },
}

impl SharedHandle {
    /// The handle's bytes, to send to other processes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// A handle from bytes another process sent (checked when it is opened).
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Self(bytes)
    }

    pub(super) fn memfd(pid: u32, fd: i32, bytes: usize) -> Self {
        let mut out = vec![MEMFD];
        out.extend(pid.to_le_bytes());
        out.extend(fd.to_le_bytes());
        out.extend((bytes as u64).to_le_bytes());
        out.extend(boot_id());
        Self(out)
    }

    pub(super) fn cuda_ipc(handle: [u8; 64], bytes: usize) -> Self {
        let mut out = vec![CUDA_IPC];
        out.extend(handle);
        out.extend((bytes as u64).to_le_bytes());
        Self(out)
    }

    pub(super) fn fabric(handle: [u8; 64], size: usize, bytes: usize) -> Self {
        let mut out = vec![CUDA_FABRIC];
        out.extend(handle);
        out.extend((size as u64).to_le_bytes());
        out.extend((bytes as u64).to_le_bytes());
        Self(out)
    }

    pub(super) fn decode(&self) -> Result<Decoded, CudaError> {
        let bad = || {
            CudaError::Exec(format!(
                "a malformed peer-memory handle of {} bytes",
                self.0.len()
            ))
        };
        let (&kind, rest) = self.0.split_first().ok_or_else(bad)?;
        let u64_at = |b: &[u8]| -> Result<usize, CudaError> {
            let word: [u8; 8] = b.try_into().map_err(|_| bad())?;
            usize::try_from(u64::from_le_bytes(word)).map_err(|_| bad())
        };
        match (kind, rest.len()) {
            (MEMFD, 52) => Ok(Decoded::Memfd {
                pid: u32::from_le_bytes(rest[0..4].try_into().map_err(|_| bad())?),
                fd: i32::from_le_bytes(rest[4..8].try_into().map_err(|_| bad())?),
                bytes: u64_at(&rest[8..16])?,
                boot: rest[16..].try_into().map_err(|_| bad())?,
            }),
            (CUDA_IPC, 72) => Ok(Decoded::CudaIpc {
                handle: rest[..64].try_into().map_err(|_| bad())?,
                bytes: u64_at(&rest[64..72])?,
            }),
            (CUDA_FABRIC, 80) => Ok(Decoded::CudaFabric {
                handle: rest[..64].try_into().map_err(|_| bad())?,
                size: u64_at(&rest[64..72])?,
                bytes: u64_at(&rest[72..80])?,
            }),
            _ => Err(bad()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_survive_their_bytes_and_malformed_ones_are_refused() {
        let h = SharedHandle::memfd(42, 7, 4096);
        match SharedHandle::from_bytes(h.as_bytes().to_vec())
            .decode()
            .unwrap()
        {
            Decoded::Memfd {
                pid,
                fd,
                bytes,
                boot,
            } => assert_eq!((pid, fd, bytes, boot), (42, 7, 4096, boot_id())),
            _ => panic!("not decoded as memfd"),
        }
        let h = SharedHandle::cuda_ipc([9; 64], 1 << 20);
        match h.decode().unwrap() {
            Decoded::CudaIpc { handle, bytes } => assert_eq!((handle, bytes), ([9; 64], 1 << 20)),
            _ => panic!("not decoded as CUDA IPC"),
        }
        match SharedHandle::fabric([7; 64], 2 << 20, 1000)
            .decode()
            .unwrap()
        {
            Decoded::CudaFabric {
                handle,
                size,
                bytes,
            } => assert_eq!((handle, size, bytes), ([7; 64], 2 << 20, 1000)),
            _ => panic!("not decoded as a fabric handle"),
        }
        for bytes in [
            vec![],
            vec![MEMFD, 1, 2],
            vec![3; 17],
            h.as_bytes()[..40].to_vec(),
        ] {
            assert!(SharedHandle::from_bytes(bytes).decode().is_err());
        }
    }
}
