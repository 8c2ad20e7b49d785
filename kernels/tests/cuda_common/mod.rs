//! Shared by the device kernel tests: the executors to run on (the host emulator with a test's
//! settings, GPU 0 where there is one), device buffer helpers, and test data.

#![allow(dead_code)]

#[path = "../common/mod.rs"]
pub mod common;

pub use common::{random_layout, Rng};
use rackfill_balancer::{Layout, LoadMatrix};
use rackfill_kernels::cuda::exec::{
    self, DeviceBuffer, Emulator, EmulatorSettings, Executor, ExecutorExt,
};
use std::sync::Arc;

/// One executor a test runs its kernels on.
pub struct Device {
    pub exec: Arc<dyn Executor>,
    /// The same executor when it is the host emulator (its counters, its settings).
    pub emulator: Option<Arc<Emulator>>,
}

impl Device {
    /// Whether this is the host emulator.
    pub fn emulated(&self) -> bool {
        self.emulator.is_some()
    }

    /// What runs the kernels, for assertion messages.
    pub fn name(&self) -> String {
        self.exec.describe()
    }
}

/// Every executor this machine runs ([`exec::available`]), the host emulator launching with
/// `settings` (an emulator of its own, so its counters are this test's).
pub fn devices(settings: EmulatorSettings) -> Vec<Device> {
    let shared = Emulator::shared();
    exec::available()
        .into_iter()
        .map(|exec| match &shared {
            Some(emu) if std::ptr::addr_eq(Arc::as_ptr(&exec), Arc::as_ptr(emu)) => {
                let emulator = Arc::new(emu.with_settings(settings));
                Device {
                    exec: Arc::clone(&emulator) as Arc<dyn Executor>,
                    emulator: Some(emulator),
                }
            }
            _ => Device {
                exec,
                emulator: None,
            },
        })
        .collect()
}

/// Every executor with the emulator's default settings.
pub fn default_devices() -> Vec<Device> {
    devices(EmulatorSettings::default())
}

/// The host emulator alone with `settings`; `None` (after the emulator printed why) without a
/// C++ compiler.
pub fn emulator(settings: EmulatorSettings) -> Option<Arc<Emulator>> {
    Emulator::shared().map(|emu| Arc::new(emu.with_settings(settings)))
}

/// A buffer holding `values` as little-endian `u32` (one zero word for an empty slice, so that
/// kernels always get a valid address).
pub fn upload_u32(exec: &dyn Executor, values: &[u32]) -> DeviceBuffer {
    exec.upload_u32(if values.is_empty() { &[0] } else { values })
        .unwrap()
}

/// As [`upload_u32`] for `u64`.
pub fn upload_u64(exec: &dyn Executor, values: &[u64]) -> DeviceBuffer {
    exec.upload_u64(if values.is_empty() { &[0] } else { values })
        .unwrap()
}

/// As [`upload_u32`] for `i32`.
pub fn upload_i32(exec: &dyn Executor, values: &[i32]) -> DeviceBuffer {
    let words: Vec<u32> = values.iter().map(|&v| v as u32).collect();
    upload_u32(exec, &words)
}

/// A zeroed buffer of `bytes` (at least one).
pub fn zeroed(exec: &dyn Executor, bytes: usize) -> DeviceBuffer {
    exec.alloc_zeroed(bytes.max(1)).unwrap()
}

/// The first `n` `u32`s of a buffer.
pub fn read_u32(exec: &dyn Executor, buffer: &DeviceBuffer, n: usize) -> Vec<u32> {
    let mut bytes = vec![0u8; 4 * n];
    exec.read(buffer, 0, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The first `n` `u64`s of a buffer.
pub fn read_u64(exec: &dyn Executor, buffer: &DeviceBuffer, n: usize) -> Vec<u64> {
    let mut bytes = vec![0u8; 8 * n];
    exec.read(buffer, 0, &mut bytes).unwrap();
    bytes
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The first `n` bytes of a buffer.
pub fn read_bytes(exec: &dyn Executor, buffer: &DeviceBuffer, n: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; n];
    exec.read(buffer, 0, &mut bytes).unwrap();
    bytes
}

/// A load with a few hot experts over a noisy background.
pub fn skewed_load(rng: &mut Rng, ranks: usize, experts: usize, hot: usize) -> LoadMatrix {
    let hot: Vec<usize> = (0..hot)
        .map(|_| rng.below(experts as u64) as usize)
        .collect();
    let rows: Vec<Vec<u64>> = (0..ranks)
        .map(|_| {
            (0..experts)
                .map(|e| {
                    if hot.contains(&e) {
                        300 + rng.below(900)
                    } else {
                        rng.below(40)
                    }
                })
                .collect()
        })
        .collect();
    LoadMatrix::from_rows(&rows).unwrap()
}

/// Whether the quota solver may pick targets by packed 32-bit keys for this layer
/// (`SolveStats::packed_keys`): a rank index takes `ceil(log2 R)` bits, and every slack (below
/// the largest rank load before balancing) must fit in the rest.
pub fn packs_keys(layout: &Layout, load: &LoadMatrix) -> bool {
    let totals = load.expert_totals();
    let max_rank_load = (0..layout.ranks())
        .map(|r| {
            layout
                .main_experts(r)
                .iter()
                .map(|&e| totals[e as usize])
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    let rank_bits = layout.ranks().next_power_of_two().trailing_zeros();
    rank_bits < 32 && max_rank_load < 1u64 << (32 - rank_bits)
}
