//! Host memory standing in for device memory on the emulator: shared anonymous mappings, so
//! that the processes of a concurrent grid (forked blocks) read and write the same bytes.

use std::ffi::c_void;

use crate::cuda::CudaError;

/// Zeroed host memory standing in for a device allocation: a shared anonymous mapping, so that
/// the blocks of a concurrent grid (forked processes) read and write the same bytes. Its pages
/// count as the process's shared memory, not its anonymous memory.
pub(crate) struct Mapping {
    base: *mut c_void,
    len: usize,
    /// The memfd behind a mapping other processes may open ([`Mapping::shared`]).
    _memfd: Option<std::os::fd::OwnedFd>,
}

// SAFETY: the mapping is plain memory owned by this value; access is synchronised by the
// executor's contract like any device buffer.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(crate) fn new(bytes: usize) -> Result<Self, CudaError> {
        let len = bytes.max(1);
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(CudaError::Exec(format!(
                "the emulator could not map {len} bytes of device memory: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(Self {
            base,
            len,
            _memfd: None,
        })
    }

    /// Zeroed memory backed by a memfd, which every process of this host that knows this
    /// process's id and the returned descriptor can map ([`Mapping::open`]): the emulator's
    /// peer memory.
    pub(crate) fn shared(bytes: usize) -> Result<(Self, i32), CudaError> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let len = bytes.max(1);
        // SAFETY: a plain system call with a NUL-terminated name; the descriptor is owned below.
        let fd = unsafe { libc::memfd_create(c"rackfill-peer".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error("create a memfd for peer memory"));
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: resizing the memfd just created.
        if unsafe { libc::ftruncate(memfd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_error("size the peer-memory memfd"));
        }
        let mut mapping = Self::map_fd(memfd.as_raw_fd(), len)?;
        mapping._memfd = Some(memfd);
        Ok((mapping, fd))
    }

    /// Maps the memfd another process of this host made with [`Mapping::shared`] (`bytes`
    /// long), through `/proc/{pid}/fd/{fd}`.
    pub(crate) fn open(pid: u32, fd: i32, bytes: usize) -> Result<Self, CudaError> {
        use std::os::fd::AsRawFd;
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| CudaError::Exec(format!("peer memory {path}: {e}")))?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if len < bytes.max(1) as u64 {
            return Err(CudaError::Exec(format!(
                "peer memory {path} holds {len} bytes, expected {bytes}"
            )));
        }
        Self::map_fd(file.as_raw_fd(), bytes.max(1))
    }

    fn map_fd(fd: i32, len: usize) -> Result<Self, CudaError> {
        // SAFETY: maps `len` bytes of a descriptor at least that long; no existing memory is
        // touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(os_error("map peer memory"));
        }
        Ok(Self {
            base,
            len,
            _memfd: None,
        })
    }
}

fn os_error(what: &str) -> CudaError {
    CudaError::Exec(format!(
        "the emulator could not {what}: {}",
        std::io::Error::last_os_error()
    ))
}

impl Mapping {
    /// The first byte's address.
    pub(crate) fn address(&self) -> u64 {
        self.base as u64
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.base, self.len) };
    }
}
