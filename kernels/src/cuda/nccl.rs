//! NCCL, loaded at run time: the probe, and a communicator with the few calls a fabric needs
//! (all-gather and grouped send/recv of bytes on the communicator's stream).
//!
//! The library is located like the CUDA libraries (`super::libs`) and its entry points are
//! resolved from that handle here, with cudarc's NCCL types (`cudarc::nccl::sys`) for the
//! arguments: cudarc's own loader would panic on a missing library and does not try
//! `libnccl.so.2`, the one name every NCCL install provides. A host without NCCL gets
//! [`NcclError::Unavailable`], never a panic.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ops::Range;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError};
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclUniqueId};

use super::libs::{self, guard};
use super::probe::probe_device;

/// Why NCCL cannot be used, or which call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NcclError {
    /// The library is missing or lacks an entry point (one line, for the CLI and the logs).
    #[error("NCCL not available: {0}")]
    Unavailable(String),
    /// An NCCL call returned an error.
    #[error("{call} failed: {why}")]
    Call { call: &'static str, why: String },
    /// The CUDA side of a call (binding the device's context) failed.
    #[error("CUDA: {0}")]
    Cuda(String),
}

/// What the probe learned about the NCCL library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclInfo {
    /// `(major, minor, patch)`, e.g. `(2, 27, 3)`.
    pub version: (u32, u32, u32),
    /// Where the library was found (a path, or a name on the loader path).
    pub found_at: String,
}

impl std::fmt::Display for NcclInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor, patch) = self.version;
        write!(f, "NCCL {major}.{minor}.{patch} ({})", self.found_at)
    }
}

/// Can this process use NCCL? Loads the library (once per process) and reads its version with
/// `ncclGetVersion`. Needs no GPU: a host whose library loads passes, whatever its devices.
pub fn probe() -> Result<NcclInfo, NcclError> {
    let api = api()?;
    let mut code: c_int = 0;
    // SAFETY: writes one int.
    check(api, "ncclGetVersion", unsafe {
        (api.get_version)(&mut code)
    })?;
    Ok(NcclInfo {
        version: decode_version(code),
        found_at: api.found_at.clone(),
    })
}

/// NCCL's version code: `major * 10000 + minor * 100 + patch` since 2.9, `major * 1000 + minor *
/// 100 + patch` before.
fn decode_version(code: c_int) -> (u32, u32, u32) {
    let code = code.max(0) as u32;
    if code >= 10_000 {
        (code / 10_000, (code % 10_000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

/// The identifier every rank of one communicator is created with: made on one rank
/// ([`UniqueId::new`]), its bytes sent to the others by any means ([`UniqueId::from_bytes`]).
#[derive(Debug, Clone, Copy)]
pub struct UniqueId(ncclUniqueId);

impl UniqueId {
    /// Bytes in an id.
    pub const BYTES: usize = 128;

    /// A fresh id (`ncclGetUniqueId`; NCCL starts its bootstrap listener here).
    pub fn new() -> Result<Self, NcclError> {
        let api = api()?;
        let mut id = ncclUniqueId {
            internal: [0; Self::BYTES],
        };
        // SAFETY: writes one ncclUniqueId.
        check(api, "ncclGetUniqueId", unsafe {
            (api.get_unique_id)(&mut id)
        })?;
        Ok(Self(id))
    }

    /// The id's bytes, to broadcast.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        self.0.internal.map(|c| c as u8)
    }

    /// The id another rank made, from its bytes.
    pub fn from_bytes(bytes: [u8; Self::BYTES]) -> Self {
        Self(ncclUniqueId {
            internal: bytes.map(|b| b as c_char),
        })
    }
}

/// One rank's NCCL communicator, its operations enqueued on one CUDA stream. Aborted on drop
/// (`ncclCommAbort`, which never waits on peers that may be gone).
#[derive(Debug)]
pub struct Comm {
    api: &'static Api,
    comm: ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time, and every
// method binds the device's context to the calling thread before its first CUDA or NCCL call.
// `Comm` is not `Sync`: NCCL forbids concurrent calls on one communicator, so a `Comm` shared
// between threads must sit behind a lock (the engine's NCCL fabric holds it in a mutex).
unsafe impl Send for Comm {}

impl Comm {
    /// Joins the communicator `id` as `rank` of `world_size` (`ncclCommInitRank`, which blocks
    /// until every rank has joined) on CUDA device `device`, with a stream of its own. One GPU
    /// per rank: each process picks its device (its local rank on the host).
    pub fn init_rank(
        device: usize,
        rank: usize,
        world_size: usize,
        id: UniqueId,
    ) -> Result<Self, NcclError> {
        let api = api()?;
        let (Ok(nranks), Ok(rank_i)) = (c_int::try_from(world_size), c_int::try_from(rank)) else {
            return Err(NcclError::Call {
                call: "ncclCommInitRank",
                why: format!("rank {rank} of {world_size} does not fit a C int"),
            });
        };
        probe_device(device).map_err(|e| NcclError::Cuda(e.to_string()))?;
        let stream = guard(|| CudaContext::new(device).and_then(|ctx| ctx.new_stream()))
            .map_err(NcclError::Cuda)?
            .map_err(|e| NcclError::Cuda(format!("device {device}: {e}")))?;
        // NCCL uses the calling thread's current device.
        bind(&stream)?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` receives the new communicator; the id is passed by value.
        check(api, "ncclCommInitRank", unsafe {
            (api.comm_init_rank)(&mut comm, nranks, id.0, rank_i)
        })?;
        Ok(Self {
            api,
            comm,
            stream,
            rank,
            world_size,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The stream every operation of this communicator is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `ncclAllGather` of bytes: `send`'s bytes from every rank into `recv` in rank order
    /// (`recv` holds `world_size * send.len()` bytes). Enqueued on the stream.
    pub fn all_gather(
        &self,
        send: &CudaSlice<u8>,
        recv: &mut CudaSlice<u8>,
    ) -> Result<(), NcclError> {
        if recv.len() != send.len() * self.world_size {
            return Err(NcclError::Call {
                call: "ncclAllGather",
                why: format!(
                    "a receive buffer of {} bytes for {} ranks of {} bytes",
                    recv.len(),
                    self.world_size,
                    send.len()
                ),
            });
        }
        bind(&self.stream)?;
        let (src, _read) = send.device_ptr(&self.stream);
        let (dst, _write) = recv.device_ptr_mut(&self.stream);
        // SAFETY: both pointers are live device buffers of the stated sizes on this
        // communicator's device, kept alive by the borrows until the caller synchronises.
        check(self.api, "ncclAllGather", unsafe {
            (self.api.all_gather)(
                src as *const c_void,
                dst as *mut c_void,
                send.len(),
                ncclDataType_t::ncclUint8,
                self.comm,
                self.stream.cu_stream() as cudaStream_t,
            )
        })
    }

    /// [`Comm::all_gather`] of host bytes, staged through the device; returns every rank's
    /// bytes in rank order once they have landed. Nothing moves when `send` is empty (every
    /// rank must then pass an empty `send`).
    pub fn all_gather_host(&self, send: &[u8]) -> Result<Vec<u8>, NcclError> {
        if send.is_empty() {
            return Ok(Vec::new());
        }
        let staged = self.stream.clone_htod(send).map_err(cuda)?;
        let mut gathered = self
            .stream
            .alloc_zeros::<u8>(send.len() * self.world_size)
            .map_err(cuda)?;
        self.all_gather(&staged, &mut gathered)?;
        let host = self.stream.clone_dtoh(&gathered).map_err(cuda)?;
        self.finish()?;
        Ok(host)
    }

    /// Host bytes moved by waves of sends and receives, staged through the device: the sent
    /// ranges of `buffer` are uploaded once, each wave runs as one group
    /// ([`Comm::send_recv`]) after the previous one on the stream (so a wave may forward what
    /// an earlier wave received), and the received ranges are copied back once all have
    /// landed. Two ranks list the operations between them in the same waves, in the same order.
    pub fn send_recv_host(
        &self,
        buffer: &mut [u8],
        waves: &[Vec<PeerOp>],
    ) -> Result<(), NcclError> {
        let ranges = |want_send: bool| {
            waves
                .iter()
                .flatten()
                .filter_map(move |op| match op {
                    PeerOp::Send { range, .. } if want_send => Some(range.clone()),
                    PeerOp::Recv { range, .. } if !want_send => Some(range.clone()),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        let (sent, received) = (merged(ranges(true)), merged(ranges(false)));
        if sent.is_empty() && received.is_empty() {
            return Ok(());
        }
        for wave in waves {
            check_ranges(buffer.len(), self.world_size, wave)?;
        }
        let mut staged = self.stream.alloc_zeros::<u8>(buffer.len()).map_err(cuda)?;
        for range in &sent {
            let mut view = staged.slice_mut(range.clone());
            self.stream
                .memcpy_htod(&buffer[range.clone()], &mut view)
                .map_err(cuda)?;
        }
        for wave in waves {
            self.send_recv(&mut staged, wave)?;
        }
        for range in &received {
            self.stream
                .memcpy_dtoh(&staged.slice(range.clone()), &mut buffer[range.clone()])
                .map_err(cuda)?;
        }
        self.finish()
    }

    /// Waits for the stream, then reports an error NCCL raised asynchronously meanwhile.
    fn finish(&self) -> Result<(), NcclError> {
        self.stream.synchronize().map_err(cuda)?;
        self.check_async()
    }

    /// Issues `ops`, sends and receives between ranges of one device buffer, as one NCCL group
    /// (`ncclGroupStart`, `ncclSend`/`ncclRecv` in order, `ncclGroupEnd`), enqueued on the
    /// stream. Each peer matches the sends and receives between two ranks in the order both
    /// listed them, so a rank may send to and receive from the same peer in one group. Received
    /// ranges must not overlap each other nor any sent range (checked). Operations on empty
    /// ranges are skipped, so both ends of one must agree that it is empty.
    pub fn send_recv(&self, buffer: &mut CudaSlice<u8>, ops: &[PeerOp]) -> Result<(), NcclError> {
        check_ranges(buffer.len(), self.world_size, ops)?;
        bind(&self.stream)?;
        let (base, _write) = buffer.device_ptr_mut(&self.stream);
        let stream = self.stream.cu_stream() as cudaStream_t;
        // SAFETY: no arguments.
        check(self.api, "ncclGroupStart", unsafe {
            (self.api.group_start)()
        })?;
        let mut issued = Ok(());
        // Empty ranges move nothing: both ends know the size, so both skip them.
        for op in ops.iter().filter(|op| !op.range().is_empty()) {
            let (call, code) = match op {
                // SAFETY: `range` lies within `buffer` (checked above), which stays allocated
                // and borrowed until the caller synchronises the stream.
                PeerOp::Send { peer, range } => ("ncclSend", unsafe {
                    (self.api.send)(
                        (base + range.start as u64) as *const c_void,
                        range.len(),
                        ncclDataType_t::ncclUint8,
                        *peer as c_int,
                        self.comm,
                        stream,
                    )
                }),
                // SAFETY: as for sends; no other operation of the group touches `range`.
                PeerOp::Recv { peer, range } => ("ncclRecv", unsafe {
                    (self.api.recv)(
                        (base + range.start as u64) as *mut c_void,
                        range.len(),
                        ncclDataType_t::ncclUint8,
                        *peer as c_int,
                        self.comm,
                        stream,
                    )
                }),
            };
            issued = check(self.api, call, code);
            if issued.is_err() {
                break;
            }
        }
        // The group is closed even after a failed call, so the next one starts at depth zero.
        // SAFETY: closes the group opened above.
        let ended = check(self.api, "ncclGroupEnd", unsafe { (self.api.group_end)() });
        issued.and(ended)
    }

    /// An error a peer or the network raised since the last call (`ncclCommGetAsyncError`).
    pub fn check_async(&self) -> Result<(), NcclError> {
        let mut code: c_int = 0;
        // SAFETY: writes one ncclResult_t (an int).
        check(self.api, "ncclCommGetAsyncError", unsafe {
            (self.api.comm_get_async_error)(self.comm, &mut code)
        })?;
        check(self.api, "an NCCL operation", code)
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: the communicator was created by ncclCommInitRank and is not used again.
        // Nothing to report on failure: the communicator is gone either way.
        let _ = unsafe { (self.api.comm_abort)(self.comm) };
    }
}

/// One point-to-point operation of [`Comm::send_recv`] on a range of its buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerOp {
    /// Send the bytes of `range` to `peer`.
    Send { peer: usize, range: Range<usize> },
    /// Receive `range.len()` bytes from `peer` into `range`.
    Recv { peer: usize, range: Range<usize> },
}

impl PeerOp {
    /// The bytes the operation reads or writes.
    pub fn range(&self) -> &Range<usize> {
        let (PeerOp::Send { range, .. } | PeerOp::Recv { range, .. }) = self;
        range
    }
}

/// `ranges` sorted, the overlapping and adjacent ones merged, the empty ones dropped.
fn merged(mut ranges: Vec<Range<usize>>) -> Vec<Range<usize>> {
    ranges.retain(|r| !r.is_empty());
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Every range inside a buffer of `len` bytes, every peer a rank of `world`, received ranges
/// disjoint from each other and from sent ones.
fn check_ranges(len: usize, world: usize, ops: &[PeerOp]) -> Result<(), NcclError> {
    let bad = |why: String| NcclError::Call {
        call: "ncclSend/ncclRecv",
        why,
    };
    let mut received: Vec<&Range<usize>> = Vec::new();
    let mut sent: Vec<&Range<usize>> = Vec::new();
    for op in ops {
        let (PeerOp::Send { peer, range } | PeerOp::Recv { peer, range }) = op;
        if *peer >= world || c_int::try_from(*peer).is_err() {
            return Err(bad(format!("peer {peer} of {world} ranks")));
        }
        if range.start > range.end || range.end > len {
            return Err(bad(format!("bytes {range:?} of a {len}-byte buffer")));
        }
        match op {
            PeerOp::Send { .. } => sent.push(range),
            PeerOp::Recv { .. } => received.push(range),
        }
    }
    // Empty ranges move nothing and overlap nothing.
    received.retain(|r| !r.is_empty());
    received.sort_by_key(|r| r.start);
    for pair in received.windows(2) {
        if pair[0].end > pair[1].start {
            return Err(bad(format!(
                "received ranges {:?} and {:?} overlap",
                pair[0], pair[1]
            )));
        }
    }
    for s in sent.iter().filter(|s| !s.is_empty()) {
        // Received ranges are sorted and disjoint: the first one ending after `s` starts is the
        // only one that can overlap it.
        let at = received.partition_point(|r| r.end <= s.start);
        if let Some(r) = received.get(at).filter(|r| r.start < s.end) {
            return Err(bad(format!(
                "sent bytes {s:?} overlap received bytes {r:?}"
            )));
        }
    }
    Ok(())
}

fn cuda(e: DriverError) -> NcclError {
    NcclError::Cuda(e.to_string())
}

/// Makes the stream's device current on this thread (NCCL calls use the current device).
fn bind(stream: &CudaStream) -> Result<(), NcclError> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| NcclError::Cuda(e.to_string()))
}

/// `code` (an `ncclResult_t`) as a result, with NCCL's own description.
fn check(api: &Api, call: &'static str, code: c_int) -> Result<(), NcclError> {
    // ncclSuccess and ncclInProgress (a non-blocking call still running) are not failures.
    if code == 0 || code == 7 {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let text = unsafe { (api.get_error_string)(code) };
    let why = if text.is_null() {
        format!("NCCL error {code}")
    } else {
        // SAFETY: non-null, NUL-terminated, static.
        let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        format!("{text} (NCCL error {code})")
    };
    Err(NcclError::Call { call, why })
}

/// The NCCL entry points rackfill calls, resolved once from the located library. Results are
/// declared as `int` (what `ncclResult_t` is in C), so a code newer than cudarc's enum is still
/// a plain number.
#[derive(Debug)]
struct Api {
    found_at: String,
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int,
    comm_abort: unsafe extern "C" fn(ncclComm_t) -> c_int,
    comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        cudaStream_t,
    ) -> c_int,
    send: unsafe extern "C" fn(
        *const c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> c_int,
    recv: unsafe extern "C" fn(
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
}

/// The entry points, or why NCCL cannot be used; resolved once per process.
fn api() -> Result<&'static Api, NcclError> {
    static API: OnceLock<Result<Api, NcclError>> = OnceLock::new();
    API.get_or_init(resolve).as_ref().map_err(Clone::clone)
}

fn resolve() -> Result<Api, NcclError> {
    let opened = libs::nccl().map_err(|searched| {
        NcclError::Unavailable(format!(
            "libnccl.so.2 not found (searched {searched}; install the NCCL runtime, e.g. \
             libnccl2 or the nvidia-nccl-cu13 wheel, or use --fabric mpi)"
        ))
    })?;
    let library = &opened.library;
    macro_rules! entry {
        ($name:literal) => {
            // SAFETY: the declared type is the C prototype of the NCCL 2 entry point `$name`.
            *unsafe { library.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                NcclError::Unavailable(format!(
                    "{} lacks {} ({e}); NCCL 2.7 or newer is needed",
                    opened.found_at, $name
                ))
            })?
        };
    }
    Ok(Api {
        found_at: opened.found_at.clone(),
        get_version: entry!("ncclGetVersion"),
        get_unique_id: entry!("ncclGetUniqueId"),
        comm_init_rank: entry!("ncclCommInitRank"),
        comm_abort: entry!("ncclCommAbort"),
        comm_get_async_error: entry!("ncclCommGetAsyncError"),
        get_error_string: entry!("ncclGetErrorString"),
        all_gather: entry!("ncclAllGather"),
        send: entry!("ncclSend"),
        recv: entry!("ncclRecv"),
        group_start: entry!("ncclGroupStart"),
        group_end: entry!("ncclGroupEnd"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_of_both_eras() {
        assert_eq!(decode_version(22703), (2, 27, 3));
        assert_eq!(decode_version(2804), (2, 8, 4));
    }

    #[test]
    fn ids_round_trip_through_bytes() {
        let mut bytes = [0u8; UniqueId::BYTES];
        bytes[0] = 0xff;
        bytes[127] = 7;
        assert_eq!(UniqueId::from_bytes(bytes).to_bytes(), bytes);
    }

    #[test]
    fn peer_ops_stay_in_their_buffer_and_never_overlap_a_receive() {
        let send = |peer, range| PeerOp::Send { peer, range };
        let recv = |peer, range| PeerOp::Recv { peer, range };
        // Sends may overlap each other; receives may touch (not overlap) sends; empty is free.
        let fine = [
            send(1, 0..8),
            send(1, 4..8),
            recv(1, 8..16),
            recv(0, 16..16),
            recv(1, 4..4),
        ];
        assert_eq!(check_ranges(16, 2, &fine), Ok(()));
        let refused = [
            vec![send(2, 0..1)],
            vec![recv(1, 8..17)],
            vec![recv(1, 0..8), recv(0, 7..9)],
            vec![send(1, 0..8), recv(1, 7..9)],
            vec![recv(1, 7..9), send(1, 8..9)],
        ];
        for ops in refused {
            assert!(check_ranges(16, 2, &ops).is_err(), "{ops:?}");
        }
    }

    #[test]
    fn merged_ranges_cover_the_same_bytes_once() {
        assert_eq!(
            merged(vec![8..12, 0..4, 4..6, 10..16, 20..20]),
            vec![0..6, 8..16]
        );
    }

    #[test]
    fn probe_answers_without_panicking() {
        match probe() {
            Ok(info) => assert!(info.version.0 >= 2, "{info}"),
            Err(NcclError::Unavailable(why)) => assert!(why.contains("libnccl.so.2"), "{why}"),
            Err(other) => panic!("unexpected probe error: {other}"),
        }
    }
}
