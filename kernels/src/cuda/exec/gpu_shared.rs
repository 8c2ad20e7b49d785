//! Peer memory on a GPU ([`super::shared`]): device memory other processes map, by one of two
//! mechanisms the CUDA driver offers.
//!
//! - **FABRIC handles** (CUDA VMM: `cuMemCreate` with `CU_MEM_HANDLE_TYPE_FABRIC`, exported to a
//!   64-byte handle any process of the same NVLink domain imports): what crosses the hosts of
//!   an NVL72 rack. Needs the IMEX daemon and a channel (`/dev/nvidia-caps-imex-channels`); the
//!   executor tries one allocation when it opens and uses them when it works.
//! - **CUDA IPC** (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`): between the processes of one
//!   host, several on one GPU too (which NCCL refuses). The fallback everywhere else.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::super::CudaError;
use super::shared::SharedHandle;

/// Device memory shared between processes: allocated here (freed on drop), or another
/// process's, mapped here (unmapped on drop).
pub(super) struct SharedMemory {
    ptr: u64,
    kind: Kind,
    context: Arc<CudaContext>,
}

enum Kind {
    /// `cuMemAlloc`, exported by IPC.
    IpcAllocated,
    /// Another process's IPC allocation, opened here.
    IpcOpened,
    /// A VMM allocation (created here or imported), mapped at `ptr` for `size` bytes.
    Fabric {
        handle: sys::CUmemGenericAllocationHandle,
        size: usize,
    },
}

impl SharedMemory {
    pub(super) fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // A failure here leaves the memory to the process's exit; there is no one to tell.
        if self.context.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: the allocation, mapping or handle this value owns, released once.
        unsafe {
            match self.kind {
                Kind::IpcAllocated => {
                    let _ = sys::cuMemFree_v2(self.ptr);
                }
                Kind::IpcOpened => {
                    let _ = sys::cuIpcCloseMemHandle(self.ptr);
                }
                Kind::Fabric { handle, size } => {
                    let _ = sys::cuMemUnmap(self.ptr, size);
                    let _ = sys::cuMemAddressFree(self.ptr, size);
                    let _ = sys::cuMemRelease(handle);
                }
            }
        }
    }
}

/// `bytes` of zeroed memory exported by CUDA IPC. The context must be current.
pub(super) fn alloc_ipc(
    context: &Arc<CudaContext>,
    bytes: usize,
) -> Result<(SharedMemory, SharedHandle), CudaError> {
    let len = bytes.max(1);
    let mut ptr = 0;
    // SAFETY: plain driver calls on the current context. A `cuMemAlloc` allocation (never a
    // stream-ordered pool's, which IPC cannot export), owned by the `SharedMemory` below.
    unsafe { sys::cuMemAlloc_v2(&mut ptr, len) }.result()?;
    let memory = SharedMemory {
        ptr,
        kind: Kind::IpcAllocated,
        context: Arc::clone(context),
    };
    // SAFETY: zeroes the allocation just made, synchronously.
    unsafe { sys::cuMemsetD8_v2(ptr, 0, len) }.result()?;
    let mut handle = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
    // SAFETY: writes the handle of the allocation's base address.
    unsafe { sys::cuIpcGetMemHandle(handle.as_mut_ptr(), ptr) }.result()?;
    // SAFETY: initialised by the call above (and zeroed before it).
    let handle = unsafe { handle.assume_init() };
    Ok((
        memory,
        SharedHandle::cuda_ipc(handle.reserved.map(|c| c as u8), bytes),
    ))
}

/// Maps another process's IPC allocation. The context must be current.
pub(super) fn open_ipc(
    context: &Arc<CudaContext>,
    raw: [u8; 64],
) -> Result<SharedMemory, CudaError> {
    let handle = sys::CUipcMemHandle {
        reserved: raw.map(|b| b as std::ffi::c_char),
    };
    let mut ptr = 0;
    // SAFETY: maps another process's allocation into this context; closed on drop.
    unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            handle,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    }
    .result()?;
    Ok(SharedMemory {
        ptr,
        kind: Kind::IpcOpened,
        context: Arc::clone(context),
    })
}

fn fabric_prop(ordinal: usize) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; every field zero is its default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal as i32;
    prop
}

/// Maps `size` bytes of VMM allocation `handle` into this context, readable and writable by
/// device `ordinal`. The context must be current.
fn map_fabric(
    context: &Arc<CudaContext>,
    ordinal: usize,
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
) -> Result<SharedMemory, CudaError> {
    let mut ptr = 0;
    // SAFETY: reserves a fresh range for the mapping; released on drop.
    let reserved = unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) }.result();
    if let Err(err) = reserved {
        // SAFETY: the handle this call was given to own.
        let _ = unsafe { sys::cuMemRelease(handle) };
        return Err(err.into());
    }
    let memory = SharedMemory {
        ptr,
        kind: Kind::Fabric { handle, size },
        context: Arc::clone(context),
    };
    // SAFETY: maps the whole allocation at the reserved range (unmapped on drop).
    unsafe { sys::cuMemMap(ptr, size, 0, handle, 0) }.result()?;
    let access = sys::CUmemAccessDesc {
        location: fabric_prop(ordinal).location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: grants this device access to the mapping just made.
    unsafe { sys::cuMemSetAccess(ptr, size, &access, 1) }.result()?;
    Ok(memory)
}

/// `bytes` of zeroed memory exported as a FABRIC handle. The context must be current.
pub(super) fn alloc_fabric(
    context: &Arc<CudaContext>,
    ordinal: usize,
    bytes: usize,
) -> Result<(SharedMemory, SharedHandle), CudaError> {
    let prop = fabric_prop(ordinal);
    let mut granularity = 0;
    // SAFETY: reads the granularity of allocations like `prop`.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .result()?;
    let size = bytes.max(1).div_ceil(granularity.max(1)) * granularity.max(1);
    let mut handle = 0;
    // SAFETY: creates an allocation owned by the mapping below (released on drop).
    unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) }.result()?;
    let memory = map_fabric(context, ordinal, handle, size)?;
    // SAFETY: zeroes the mapping just made, synchronously.
    unsafe { sys::cuMemsetD8_v2(memory.ptr, 0, size) }.result()?;
    let mut fabric = sys::CUmemFabricHandle { data: [0; 64] };
    // SAFETY: writes the allocation's 64-byte fabric handle.
    unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fabric as *mut sys::CUmemFabricHandle).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            0,
        )
    }
    .result()?;
    Ok((memory, SharedHandle::fabric(fabric.data, size, bytes)))
}

/// Imports and maps another process's FABRIC allocation of `size` bytes. The context must be
/// current.
pub(super) fn open_fabric(
    context: &Arc<CudaContext>,
    ordinal: usize,
    raw: [u8; 64],
    size: usize,
) -> Result<SharedMemory, CudaError> {
    let mut fabric = sys::CUmemFabricHandle { data: raw };
    let mut handle = 0;
    // SAFETY: imports the handle's allocation (released on drop of the mapping).
    unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            (&mut fabric as *mut sys::CUmemFabricHandle).cast(),
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
        )
    }
    .result()?;
    map_fabric(context, ordinal, handle, size)
}

/// Whether this device can export FABRIC handles here: the device says it supports them and a
/// small allocation succeeds (it does not without an IMEX channel). The context must be current.
pub(super) fn fabric_usable(context: &Arc<CudaContext>, ordinal: usize) -> bool {
    let mut supported = 0;
    // SAFETY: reads one attribute of device `ordinal`.
    let asked = unsafe {
        sys::cuDeviceGetAttribute(
            &mut supported,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
            ordinal as i32,
        )
    };
    asked == sys::CUresult::CUDA_SUCCESS
        && supported == 1
        && alloc_fabric(context, ordinal, 1).is_ok()
}
