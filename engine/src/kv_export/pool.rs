//! The export arena: blocks registered once with NIXL, handed to finished prompts, and held
//! until the decode side says it has read them or their lease runs out.
//!
//! The arena is one allocation of `layers * num_blocks * block_bytes` bytes, layer-major: layer
//! `l`'s region (what the handshake's `kv_caches_base_addr[l]` names) starts at
//! `l * num_blocks * block_bytes`, and block `b` of it at `b * block_bytes` within. A block id is
//! the same in every layer, as in vLLM's `remote_block_ids`.
//!
//! Lease rules (vLLM 0.33's producer side): a request's blocks are held for the lease from when
//! it finished; a heartbeat `"HB:id,id"` extends each listed lease to at least two thirds of
//! the lease from now; a notification `"id:n"` counts one reader, and the blocks are freed when
//! `n` readers have notified; a lease that runs out frees them with a warning.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use metrics::{counter, gauge, histogram};

use super::error::KvExportError;

/// Counters and gauges of the arena (exported as metrics, per rank in a group).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExportStats {
    /// Blocks held for requests whose KV waits for a decode side.
    pub held_blocks: usize,
    /// Bytes those blocks take, every layer.
    pub held_bytes: u64,
    /// The most bytes ever held at once.
    pub peak_held_bytes: u64,
    /// Requests whose KV was exported.
    pub exported: u64,
    /// Requests freed by the decode side's notification.
    pub released: u64,
    /// Requests freed because their lease ran out with no notification.
    pub expired: u64,
    /// Notifications for requests this rank does not hold (late, repeated or foreign).
    pub unknown_notifications: u64,
    /// Exports refused because the arena had no free blocks.
    pub refused: u64,
}

/// Blocks of the KV export arena held for a decode side (`rank` label).
pub const KV_EXPORT_HELD_BLOCKS: &str = "rackfill:kv_export_held_blocks";
/// Bytes those blocks take, every layer (`rank` label).
pub const KV_EXPORT_HELD_BYTES: &str = "rackfill:kv_export_held_bytes";
/// The most bytes held at once since start (`rank` label).
pub const KV_EXPORT_PEAK_HELD_BYTES: &str = "rackfill:kv_export_peak_held_bytes";
/// Requests by what happened to their exported KV (`rank`; `event` = exported, released
/// (the decode side read it), expired (no notification within --kv-export-timeout), refused
/// (the arena was full), unknown_notification).
pub const KV_EXPORT_REQUESTS: &str = "rackfill:kv_export_requests_total";

/// Records rank `rank`'s KV export arena.
pub fn record_metrics(rank: usize, stats: &ExportStats) {
    let rank = rank.to_string();
    gauge!(KV_EXPORT_HELD_BLOCKS, "rank" => rank.clone()).set(stats.held_blocks as f64);
    gauge!(KV_EXPORT_HELD_BYTES, "rank" => rank.clone()).set(stats.held_bytes as f64);
    gauge!(KV_EXPORT_PEAK_HELD_BYTES, "rank" => rank.clone()).set(stats.peak_held_bytes as f64);
    for (event, count) in [
        ("exported", stats.exported),
        ("released", stats.released),
        ("expired", stats.expired),
        ("refused", stats.refused),
        ("unknown_notification", stats.unknown_notifications),
    ] {
        counter!(KV_EXPORT_REQUESTS, "rank" => rank.clone(), "event" => event).absolute(count);
    }
}

/// Seconds the engine thread spends copying one request's KV into the arena.
pub const KV_EXPORT_COPY_SECONDS: &str = "rackfill:kv_export_copy_seconds";

/// Records one export's copy time.
pub fn record_copy(took: Duration) {
    histogram!(KV_EXPORT_COPY_SECONDS).record(took.as_secs_f64());
}

/// One request's held blocks.
struct Lease {
    blocks: Vec<u32>,
    deadline: Instant,
    /// Readers that notified so far.
    notified: u32,
}

/// The arena's memory and book-keeping. Not thread-safe by itself: the exporter keeps it
/// behind a mutex.
pub struct ExportPool {
    memory: Box<[u8]>,
    layers: usize,
    num_blocks: usize,
    block_bytes: usize,
    free: Vec<u32>,
    leases: HashMap<String, Lease>,
    lease: Duration,
    stats: ExportStats,
}

impl ExportPool {
    /// An arena of `num_blocks` blocks of `block_bytes` bytes in each of `layers` layers, whose
    /// requests are held for `lease`.
    pub fn new(
        layers: usize,
        num_blocks: usize,
        block_bytes: usize,
        lease: Duration,
    ) -> Result<Self, KvExportError> {
        let bytes = layers
            .checked_mul(num_blocks)
            .and_then(|n| n.checked_mul(block_bytes))
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                KvExportError::Config(format!(
                    "an export arena of {layers} layers x {num_blocks} blocks x {block_bytes} bytes"
                ))
            })?;
        Ok(Self {
            memory: vec![0u8; bytes].into_boxed_slice(),
            layers,
            num_blocks,
            block_bytes,
            // Popped from the end: block 0 first.
            free: (0..num_blocks as u32).rev().collect(),
            leases: HashMap::new(),
            lease,
            stats: ExportStats::default(),
        })
    }

    /// The arena's address and length (what NIXL registers).
    pub fn memory(&self) -> (usize, usize) {
        (self.memory.as_ptr() as usize, self.memory.len())
    }

    /// Each layer's region start address.
    pub fn region_addresses(&self) -> Vec<u64> {
        let base = self.memory.as_ptr() as u64;
        let region = (self.num_blocks * self.block_bytes) as u64;
        (0..self.layers as u64).map(|l| base + l * region).collect()
    }

    pub fn stats(&self) -> ExportStats {
        self.stats
    }

    /// Takes `count` free blocks for request `id`, fills them with `write(layer, blocks)` (one
    /// `block_bytes` slice per block, in order), and holds them under a new lease. Nothing is
    /// held when `write` fails or there are not enough free blocks.
    pub fn hold(
        &mut self,
        id: &str,
        count: usize,
        now: Instant,
        mut write: impl FnMut(usize, &mut [&mut [u8]]) -> Result<(), KvExportError>,
    ) -> Result<Vec<u32>, KvExportError> {
        if self.leases.contains_key(id) {
            return Err(KvExportError::Config(format!(
                "request {id} is already held"
            )));
        }
        if count > self.free.len() {
            self.stats.refused += 1;
            return Err(KvExportError::Full {
                needed: count,
                free: self.free.len(),
                held: self.leases.len(),
            });
        }
        let blocks: Vec<u32> = (0..count).filter_map(|_| self.free.pop()).collect();
        let written = (0..self.layers).try_for_each(|layer| {
            let mut slices = self.block_slices(layer, &blocks);
            write(layer, &mut slices)
        });
        if let Err(err) = written {
            self.free.extend(blocks.iter().rev());
            return Err(err);
        }
        self.leases.insert(
            id.to_owned(),
            Lease {
                blocks: blocks.clone(),
                deadline: now + self.lease,
                notified: 0,
            },
        );
        self.stats.exported += 1;
        self.update_held();
        Ok(blocks)
    }

    /// Disjoint mutable slices of `blocks` in `layer`'s region, in the order of `blocks`.
    fn block_slices(&mut self, layer: usize, blocks: &[u32]) -> Vec<&mut [u8]> {
        let region = layer * self.num_blocks * self.block_bytes;
        let bb = self.block_bytes;
        let region = &mut self.memory[region..region + self.num_blocks * bb];
        let mut by_id: Vec<Option<&mut [u8]>> = region.chunks_mut(bb).map(Some).collect();
        blocks
            .iter()
            .filter_map(|&b| by_id.get_mut(b as usize).and_then(Option::take))
            .collect()
    }

    /// Applies one notification from a decode side; returns the request freed, if one was.
    pub fn notify(&mut self, message: &str, now: Instant) -> Option<String> {
        if let Some(ids) = message.strip_prefix("HB:") {
            let until = now + self.lease * 2 / 3;
            for id in ids.split(',').filter(|id| !id.is_empty()) {
                match self.leases.get_mut(id) {
                    Some(lease) => lease.deadline = lease.deadline.max(until),
                    None => self.stats.unknown_notifications += 1,
                }
            }
            return None;
        }
        let (id, readers) = match message.rsplit_once(':') {
            Some((id, n)) => (id, n.parse::<u32>().unwrap_or(1).max(1)),
            None => (message, 1),
        };
        let Some(lease) = self.leases.get_mut(id) else {
            self.stats.unknown_notifications += 1;
            tracing::warn!(
                request = id,
                "KV export: a notification for a request not held here (already freed, \
                 expired, or never exported); ignored"
            );
            return None;
        };
        lease.notified += 1;
        if lease.notified < readers {
            return None;
        }
        self.release(id);
        self.stats.released += 1;
        Some(id.to_owned())
    }

    /// Frees every request whose lease ran out; returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        let expired: Vec<String> = self
            .leases
            .iter()
            .filter(|(_, lease)| lease.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &expired {
            self.release(id);
            self.stats.expired += 1;
        }
        expired
    }

    /// Whether request `id` still holds blocks.
    pub fn holds(&self, id: &str) -> bool {
        self.leases.contains_key(id)
    }

    fn release(&mut self, id: &str) {
        if let Some(lease) = self.leases.remove(id) {
            self.free.extend(lease.blocks.iter().rev());
        }
        self.update_held();
    }

    fn update_held(&mut self) {
        let held = self.num_blocks - self.free.len();
        self.stats.held_blocks = held;
        self.stats.held_bytes = (held * self.block_bytes * self.layers) as u64;
        self.stats.peak_held_bytes = self.stats.peak_held_bytes.max(self.stats.held_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(blocks: usize) -> ExportPool {
        ExportPool::new(2, blocks, 8, Duration::from_secs(30)).unwrap()
    }

    fn fill(id: u8) -> impl FnMut(usize, &mut [&mut [u8]]) -> Result<(), KvExportError> {
        move |layer, blocks| {
            for block in blocks.iter_mut() {
                block.fill(id * 10 + layer as u8);
            }
            Ok(())
        }
    }

    #[test]
    fn held_blocks_carry_the_written_bytes_in_each_layers_region() {
        let mut p = pool(4);
        let now = Instant::now();
        let a = p.hold("a", 1, now, fill(1)).unwrap();
        let b = p.hold("b", 2, now, fill(2)).unwrap();
        assert_eq!((a, b.clone()), (vec![0], vec![1, 2]));
        let regions = p.region_addresses();
        assert_eq!(regions[1] - regions[0], 4 * 8);
        // Layer 1, block 2 holds request b's layer-1 bytes.
        assert!(p.memory[32 + 16..32 + 24].iter().all(|&x| x == 21));
        assert_eq!(p.stats().held_blocks, 3);
        assert_eq!(p.stats().held_bytes, 3 * 8 * 2);
    }

    #[test]
    fn a_notification_frees_after_the_named_readers_and_unknown_ones_are_counted() {
        let mut p = pool(4);
        let now = Instant::now();
        p.hold("req-1", 2, now, fill(1)).unwrap();
        assert_eq!(p.notify("req-1:2", now), None);
        assert!(p.holds("req-1"));
        assert_eq!(p.notify("req-1:2", now).as_deref(), Some("req-1"));
        assert!(!p.holds("req-1"));
        assert_eq!(p.notify("req-1:1", now), None);
        assert_eq!(p.stats().unknown_notifications, 1);
        assert_eq!((p.stats().held_blocks, p.stats().released), (0, 1));
        assert_eq!(p.stats().peak_held_bytes, 2 * 8 * 2);
    }

    #[test]
    fn leases_expire_unless_a_heartbeat_extends_them() {
        let mut p = pool(4);
        let now = Instant::now();
        p.hold("a", 1, now, fill(1)).unwrap();
        p.hold("b", 1, now, fill(2)).unwrap();
        p.notify("HB:b,zzz", now + Duration::from_secs(25));
        assert_eq!(
            p.expire(now + Duration::from_secs(31)),
            vec!["a".to_string()]
        );
        assert!(p.holds("b"));
        assert_eq!(
            p.expire(now + Duration::from_secs(46)),
            vec!["b".to_string()]
        );
        assert_eq!((p.stats().expired, p.stats().unknown_notifications), (2, 1));
    }

    #[test]
    fn a_full_arena_refuses_and_a_failed_write_holds_nothing() {
        let mut p = pool(2);
        let now = Instant::now();
        let err = p.hold("a", 3, now, fill(1)).unwrap_err();
        assert!(
            matches!(
                err,
                KvExportError::Full {
                    needed: 3,
                    free: 2,
                    ..
                }
            ),
            "{err}"
        );
        let failed = p.hold("b", 2, now, |_, _| {
            Err(KvExportError::Layout("boom".into()))
        });
        assert!(failed.is_err());
        assert_eq!(p.stats().held_blocks, 0);
        assert_eq!(p.hold("c", 2, now, fill(3)).unwrap(), vec![0, 1]);
    }
}
