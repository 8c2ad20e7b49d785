//! Device time per phase of a workload: [`Profiled`] wraps any [`Executor`] and brackets every
//! kernel launch, GEMM and device-side copy it queues with a pair of events, filed under the
//! phase its classifier names. Nothing is synchronised per call, so the workload runs as it
//! would unwrapped; [`Profiled::take`] waits for the events once and sums them.
//!
//! What `rackfill bench forward` splits a step into (attention, expert GEMMs, dense GEMMs,
//! routing and balancing, norms and elementwise): the model code stays unaware of it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{DeviceBuffer, Event, Executor, Gemm, KernelArg, Launch, SharedHandle, Stream};
use crate::cuda::CudaError;

/// The name a span is classified by: a kernel's entry point, or one of these for the
/// operations that have none.
pub const GEMM: &str = "gemm";
pub const COPY: &str = "copy";

/// A phase name for an operation (a kernel's entry point, [`GEMM`] or [`COPY`]).
pub type Classifier = fn(&str) -> &'static str;

/// An executor that files the device time of what it queues under phases.
pub struct Profiled {
    inner: Arc<dyn Executor>,
    classify: Classifier,
    enabled: AtomicBool,
    spans: Mutex<Vec<(&'static str, Event, Event)>>,
}

impl Profiled {
    /// Wraps `inner`; while enabled (from the start), every operation is filed under
    /// `classify(its name)`.
    pub fn new(inner: Arc<dyn Executor>, classify: Classifier) -> Self {
        Self {
            inner,
            classify,
            enabled: AtomicBool::new(true),
            spans: Mutex::new(Vec::new()),
        }
    }

    /// Starts (`true`) or stops recording spans; stopped, calls pass straight through.
    pub fn set_enabled(&self, enabled: bool) {
        self.enabled.store(enabled, Ordering::Relaxed);
    }

    /// Device time per phase of everything queued since the last call (waits for it), phases
    /// in name order.
    pub fn take(&self) -> Result<BTreeMap<&'static str, Duration>, CudaError> {
        let spans = std::mem::take(&mut *self.spans.lock().unwrap_or_else(|e| e.into_inner()));
        let mut phases = BTreeMap::new();
        for (phase, from, to) in &spans {
            *phases.entry(*phase).or_insert(Duration::ZERO) += self.inner.elapsed(from, to)?;
        }
        Ok(phases)
    }

    /// Runs `op` on `stream` between two events filed under `name`'s phase.
    fn span(
        &self,
        stream: Stream,
        name: &str,
        op: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        if !self.enabled.load(Ordering::Relaxed) {
            return op();
        }
        let from = self.inner.record(stream)?;
        op()?;
        let to = self.inner.record(stream)?;
        let phase = (self.classify)(name);
        self.spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((phase, from, to));
        Ok(())
    }
}

impl Executor for Profiled {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn multiprocessors(&self) -> u32 {
        self.inner.multiprocessors()
    }

    fn shared_limit(&self, kernel: &str) -> Result<usize, CudaError> {
        self.inner.shared_limit(kernel)
    }

    fn new_stream(&self) -> Result<Stream, CudaError> {
        self.inner.new_stream()
    }

    fn alloc_zeroed_on(&self, stream: Stream, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        self.inner.alloc_zeroed_on(stream, bytes)
    }

    fn write_on(
        &self,
        stream: Stream,
        dst: &DeviceBuffer,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), CudaError> {
        self.inner.write_on(stream, dst, offset, bytes)
    }

    fn read_on(
        &self,
        stream: Stream,
        src: &DeviceBuffer,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), CudaError> {
        self.inner.read_on(stream, src, offset, out)
    }

    fn zero_on(
        &self,
        stream: Stream,
        dst: &DeviceBuffer,
        offset: usize,
        bytes: usize,
    ) -> Result<(), CudaError> {
        self.span(stream, COPY, || {
            self.inner.zero_on(stream, dst, offset, bytes)
        })
    }

    fn copy_on(
        &self,
        stream: Stream,
        src: (&DeviceBuffer, usize),
        dst: (&DeviceBuffer, usize),
        bytes: usize,
    ) -> Result<(), CudaError> {
        self.span(stream, COPY, || self.inner.copy_on(stream, src, dst, bytes))
    }

    unsafe fn launch_on(
        &self,
        stream: Stream,
        kernel: &str,
        launch: Launch,
        args: &[KernelArg],
    ) -> Result<(), CudaError> {
        // SAFETY: the caller's contract, passed on unchanged.
        self.span(stream, kernel, || unsafe {
            self.inner.launch_on(stream, kernel, launch, args)
        })
    }

    unsafe fn gemm_on(&self, stream: Stream, gemm: &Gemm) -> Result<(), CudaError> {
        // SAFETY: the caller's contract, passed on unchanged.
        self.span(stream, GEMM, || unsafe { self.inner.gemm_on(stream, gemm) })
    }

    fn record(&self, stream: Stream) -> Result<Event, CudaError> {
        self.inner.record(stream)
    }

    fn wait_for(&self, stream: Stream, event: &Event) -> Result<(), CudaError> {
        self.inner.wait_for(stream, event)
    }

    fn elapsed(&self, from: &Event, to: &Event) -> Result<Duration, CudaError> {
        self.inner.elapsed(from, to)
    }

    fn synchronize(&self) -> Result<(), CudaError> {
        self.inner.synchronize()
    }

    fn bytes_uploaded(&self) -> u64 {
        self.inner.bytes_uploaded()
    }

    fn peer_memory(&self) -> Option<&'static str> {
        self.inner.peer_memory()
    }

    fn alloc_shared(&self, bytes: usize) -> Result<(DeviceBuffer, SharedHandle), CudaError> {
        self.inner.alloc_shared(bytes)
    }

    fn open_shared(&self, handle: &SharedHandle) -> Result<DeviceBuffer, CudaError> {
        self.inner.open_shared(handle)
    }
}
