//! Stable ranking of u32 keys on the device (`stable_rank_by_key`, permute.cu): each key's
//! position among equal keys and the exclusive prefix of the key counts, what groups rows by
//! destination, instance or expert without the host seeing the keys. Shared by the EP data
//! plane's steps and the grouped expert path.

use super::exec::{DeviceBuffer, Executor, KernelArg, Launch, Stream};
use super::{to_u32, CudaError};

/// Threads the ranking may use (it runs in one block).
const THREADS: usize = 256;
/// Shared memory `stable_rank_by_key` may use without opting in.
const RANK_SHARED: usize = 48 * 1024;

/// A ranking on the device: each key's position among equal keys, and the exclusive prefix of
/// the key counts (`n_keys + 1` words) followed by the count of keys out of range.
pub(crate) struct Ranked {
    /// u32 `[n]`.
    pub pos: DeviceBuffer,
    /// u32 `[n_keys + 2]`.
    pub offsets: DeviceBuffer,
}

/// `stable_rank_by_key` over `n` u32 keys at device address `keys` (each below `n_keys`),
/// queued on `stream`.
pub(crate) fn rank_by_key(
    exec: &dyn Executor,
    stream: Stream,
    keys: u64,
    n: usize,
    n_keys: usize,
) -> Result<Ranked, CudaError> {
    let warps = (RANK_SHARED / 4 / n_keys.max(1))
        .saturating_sub(1)
        .min(THREADS / 32);
    if warps == 0 {
        return Err(CudaError::SharedMemory {
            what: "stable_rank_by_key",
            needed: 8 * n_keys,
            limit: RANK_SHARED,
        });
    }
    let ranked = Ranked {
        pos: exec.alloc_zeroed_on(stream, n * 4)?,
        offsets: exec.alloc_zeroed_on(stream, (n_keys + 2) * 4)?,
    };
    let launch = Launch {
        grid: [1, 1, 1],
        block: warps as u32 * 32,
        shared_bytes: ((warps + 1) * n_keys * 4) as u32,
    };
    let args = [
        KernelArg::Ptr(keys),
        KernelArg::U32(to_u32(n, "keys")?),
        KernelArg::U32(to_u32(n_keys, "key count")?),
        KernelArg::Ptr(ranked.pos.ptr()),
        KernelArg::Ptr(ranked.offsets.ptr()),
        KernelArg::Ptr(ranked.offsets.at((n_keys + 1) * 4)),
    ];
    // SAFETY: `stable_rank_by_key(keys, n, n_keys, out_pos[n], out_offsets[n_keys + 1],
    // out_bad)`; the caller's keys hold `n` words; the shared memory is the kernel's
    // `(warps + 1) * n_keys` words.
    unsafe { exec.launch_on(stream, "stable_rank_by_key", launch, &args) }?;
    Ok(ranked)
}
