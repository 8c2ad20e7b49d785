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
        Ok(Self { base, len })
    }
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
