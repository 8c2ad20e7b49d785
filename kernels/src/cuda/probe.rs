//! Driver probe and the opened device with its compiled kernels.

use super::libs::{self, Lib};
use super::nvrtc::{self, KernelSource};
use super::{guard, CudaError, CudaUnavailable};
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{result, CudaContext, CudaFunction, CudaStream};
use std::collections::HashMap;
use std::sync::Arc;

/// What the probe learned about a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    /// Devices the driver sees.
    pub devices: usize,
    pub name: String,
    /// `(major, minor)`, e.g. `(9, 0)` for H100.
    pub compute_capability: (i32, i32),
    pub multiprocessors: u32,
    pub total_memory_bytes: usize,
    /// Largest dynamic shared memory one block may opt into.
    pub max_shared_per_block: usize,
    /// CUDA version the driver supports, as `major * 1000 + minor * 10` (13000 = 13.0).
    pub driver_version: i32,
}

impl DeviceInfo {
    /// The NVRTC target for this device, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (device {} of {}, {}, {} SMs, {} MiB, driver CUDA {})",
            self.name,
            self.ordinal,
            self.devices,
            self.arch(),
            self.multiprocessors,
            self.total_memory_bytes >> 20,
            version_string(self.driver_version)
        )
    }
}

fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Is there a usable CUDA device 0? Never panics: a missing driver library, a driver that does
/// not initialise and a machine without devices are all [`CudaUnavailable`], which callers log
/// before falling back to the CPU data plane.
pub fn probe() -> Result<DeviceInfo, CudaUnavailable> {
    probe_device(0)
}

pub(crate) fn probe_device(ordinal: usize) -> Result<DeviceInfo, CudaUnavailable> {
    libs::ensure(Lib::Driver).map_err(|searched| CudaUnavailable::NoDriver { searched })?;
    guard(|| query(ordinal)).map_err(CudaUnavailable::Broken)?
}

fn query(ordinal: usize) -> Result<DeviceInfo, CudaUnavailable> {
    let init = |e: result::DriverError| CudaUnavailable::Init(e.to_string());
    result::init().map_err(init)?;
    let count = usize::try_from(result::device::get_count().map_err(init)?).unwrap_or(0);
    if count == 0 {
        return Err(CudaUnavailable::NoDevice);
    }
    if ordinal >= count {
        return Err(CudaUnavailable::NoSuchDevice { ordinal, count });
    }
    let dev = result::device::get(ordinal as i32).map_err(init)?;
    // SAFETY: `dev` is a valid device handle from cuDeviceGet.
    let attr = |a: Attr| unsafe { result::device::get_attribute(dev, a) }.map_err(init);
    let mut driver_version = 0;
    // SAFETY: writes one int.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(init)?;
    Ok(DeviceInfo {
        ordinal,
        devices: count,
        name: result::device::get_name(dev).map_err(init)?,
        compute_capability: (
            attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        multiprocessors: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32,
        // SAFETY: as above.
        total_memory_bytes: unsafe { result::device::total_mem(dev) }.map_err(init)?,
        max_shared_per_block: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            .max(0) as usize,
        driver_version,
    })
}

/// The CUDA major version of cudarc's driver bindings (feature `cuda-13000`).
const BINDINGS_MAJOR: i32 = 13;

/// An opened device: its context, a stream, and every kernel compiled for its architecture:
/// what [`super::exec::GpuExecutor`] runs on (nothing else holds one).
#[derive(Debug, Clone)]
pub(crate) struct Gpu {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: HashMap<&'static str, Kernel>,
}

/// A loaded entry point and the dynamic shared memory a launch of it may take.
#[derive(Debug, Clone)]
struct Kernel {
    function: CudaFunction,
    /// The device's opt-in maximum less the kernel's static shared memory. Set as the
    /// function's limit once, when it is loaded, and never changed: a limit set per launch
    /// could be lowered by another thread between its set and its launch (the attribute
    /// belongs to the function, which every clone of a [`Gpu`] shares).
    dynamic_shared_limit: usize,
}

impl Gpu {
    /// Opens device `ordinal`, compiles every kernel source for its exact architecture with
    /// NVRTC (to CUBIN) and loads them.
    pub(crate) fn open(ordinal: usize) -> Result<Self, CudaError> {
        let info = probe_device(ordinal)?;
        let (major, minor) = nvrtc::nvrtc_version().map_err(nvrtc::CompileFailure::from)?;
        // Kernels load as CUBINs, which any driver of NVRTC's major version runs (minor
        // version compatibility); PTX would need a driver at least as new as NVRTC. cudarc's
        // bindings are CUDA 13's: an older driver lacks entry points they call (e.g.
        // `cuEventElapsedTime_v2`, 12.8+), and a missing one would panic mid-layer.
        let needed = major.max(BINDINGS_MAJOR);
        if info.driver_version / 1000 < needed {
            return Err(CudaError::DriverTooOld {
                driver: version_string(info.driver_version),
                needed: format!("{needed}.0"),
                nvrtc: format!("{major}.{minor}"),
            });
        }
        let (ctx, stream) = guard(|| -> Result<_, CudaError> {
            let ctx = CudaContext::new(ordinal)?;
            retain_pool_memory(&ctx)?;
            let stream = ctx.new_stream()?;
            Ok((ctx, stream))
        })
        .map_err(CudaUnavailable::Broken)??;
        // cuFuncSetAttribute (in load_source) does not make the context current by itself.
        ctx.bind_to_thread()?;
        let mut kernels = HashMap::new();
        for source in nvrtc::SOURCES {
            load_source(&ctx, &source, &info, &mut kernels)?;
        }
        Ok(Self {
            info,
            ctx,
            stream,
            kernels,
        })
    }

    /// What the probe found.
    pub(crate) fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The context (for allocating buffers the kernels read and write).
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launcher of this module enqueues on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A loaded entry point by a name not known at compile time (the executor's launches), with
    /// its dynamic shared memory limit; `None` for a name no source defines.
    pub(crate) fn function_named(&self, name: &str) -> Option<(&CudaFunction, usize)> {
        self.kernels
            .get(name)
            .map(|k| (&k.function, k.dynamic_shared_limit))
    }
}

/// Keeps device memory freed into the stream-ordered pool there instead of returning it to the
/// OS at every synchronisation (the pool's default threshold is 0): each layer allocates and
/// frees its scratch buffers, which would otherwise be mapped afresh layer after layer.
fn retain_pool_memory(ctx: &CudaContext) -> Result<(), CudaError> {
    use cudarc::driver::sys;
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the device handle is the context's; the driver writes a pool handle it owns.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result()?;
    let mut threshold = u64::MAX;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // SAFETY: the release threshold is a cuuint64_t, read from `value` during the call.
    unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&mut threshold as *mut u64).cast()) }
        .result()?;
    Ok(())
}

/// Compiles `source` for the device, loads its entry points and lets each take all the
/// dynamic shared memory the device leaves it ([`Kernel::dynamic_shared_limit`]).
fn load_source(
    ctx: &Arc<CudaContext>,
    source: &KernelSource,
    info: &DeviceInfo,
    kernels: &mut HashMap<&'static str, Kernel>,
) -> Result<(), CudaError> {
    use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    let compiled = nvrtc::compile_to(source, &info.arch(), nvrtc::Output::Cubin)?;
    let module = ctx.load_module(compiled.image)?;
    for &entry in source.entry_points {
        let function = module.load_function(entry)?;
        let static_bytes = usize::try_from(function.shared_size_bytes()?).unwrap_or(usize::MAX);
        let limit = info.max_shared_per_block.saturating_sub(static_bytes);
        function.set_attribute(
            CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            i32::try_from(limit).unwrap_or(i32::MAX),
        )?;
        kernels.insert(
            entry,
            Kernel {
                function,
                dynamic_shared_limit: limit,
            },
        );
    }
    Ok(())
}
