//! `--remote-decode`: the benchmark plays the decode tier of a disaggregated deployment. Every
//! request asks the prefill server for its KV (`kv_transfer_params.do_remote_decode`); when a
//! response names the blocks, this pulls them over NIXL after `delay` (a decode side that
//! picks requests up late), one READ at a time as one decode instance does, and the prefill
//! side frees them on the READ's notification. What it measured is summarised with the peak
//! KV the prefill side held waiting (its `rackfill:kv_export_peak_held_bytes`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rackfill_engine::kv_export::puller::{Pulled, Puller};
use rackfill_engine::kv_export::KvTransferParams;
use serde::Serialize;
use tokio::task::JoinHandle;

use super::error::ServeBenchError;

/// The decode side of a run.
pub struct RemoteDecode {
    puller: Arc<Puller>,
    delay: Duration,
    /// One READ at a time.
    reading: Arc<tokio::sync::Mutex<()>>,
    pending: Mutex<Vec<JoinHandle<Result<PullTiming, String>>>>,
}

impl std::fmt::Debug for RemoteDecode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteDecode")
            .field("delay", &self.delay)
            .finish_non_exhaustive()
    }
}

/// One pull.
struct PullTiming {
    pulled: Pulled,
    /// From the response to the data landed (the delay, the queue, the handshake, the READ).
    pickup: Duration,
}

/// What the decode side did over a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RemoteDecodeSummary {
    pub pulled: usize,
    pub failed: usize,
    /// The first failure, if any.
    pub first_error: Option<String>,
    pub bytes: u64,
    /// READ time summed over pulls (handshakes excluded).
    pub read_seconds: f64,
    /// `bytes / read_seconds`, GB/s.
    pub read_gbps: f64,
    /// Mean time from a response to its KV landed, ms.
    pub mean_pickup_ms: f64,
    /// The prefill server's `rackfill:kv_export_peak_held_bytes`, summed over ranks.
    pub server_peak_held_bytes: Option<f64>,
}

impl RemoteDecode {
    /// A decode agent that pulls each response's KV `delay` after it arrives.
    pub fn new(delay: Duration) -> Result<Arc<Self>, ServeBenchError> {
        let name = format!("rackfill-bench-decode-{}", std::process::id());
        let puller = Puller::new(&name)
            .map_err(|e| ServeBenchError::Config(format!("--remote-decode: {e}")))?;
        Ok(Arc::new(Self {
            puller,
            delay,
            reading: Arc::default(),
            pending: Mutex::new(Vec::new()),
        }))
    }

    /// Pulls the KV a response names, `delay` from now, in the background.
    pub fn pull_later(&self, params: serde_json::Value) {
        let (puller, reading, delay) = (
            Arc::clone(&self.puller),
            Arc::clone(&self.reading),
            self.delay,
        );
        let arrived = Instant::now();
        let task = tokio::spawn(async move {
            let params: KvTransferParams = serde_json::from_value(params)
                .map_err(|e| format!("kv_transfer_params not in vLLM's fields: {e}"))?;
            tokio::time::sleep(delay).await;
            let _one_at_a_time = reading.lock().await;
            let pulled = puller.pull(&params).await.map_err(|e| e.to_string())?;
            Ok(PullTiming {
                pulled,
                pickup: arrived.elapsed(),
            })
        });
        if let Ok(mut pending) = self.pending.lock() {
            pending.push(task);
        }
    }

    /// Waits for every pull so far; what they did.
    pub async fn finish(&self) -> RemoteDecodeSummary {
        let tasks = self
            .pending
            .lock()
            .map(|mut p| std::mem::take(&mut *p))
            .unwrap_or_default();
        let mut summary = RemoteDecodeSummary::default();
        let mut pickup = Duration::ZERO;
        for task in tasks {
            match task.await.map_err(|e| e.to_string()).and_then(|r| r) {
                Ok(timing) => {
                    summary.pulled += 1;
                    summary.bytes += timing.pulled.bytes as u64;
                    summary.read_seconds += timing.pulled.read.as_secs_f64();
                    pickup += timing.pickup;
                }
                Err(error) => {
                    summary.failed += 1;
                    summary.first_error.get_or_insert(error);
                }
            }
        }
        if summary.read_seconds > 0.0 {
            summary.read_gbps = summary.bytes as f64 / summary.read_seconds / 1e9;
        }
        if summary.pulled > 0 {
            summary.mean_pickup_ms = pickup.as_secs_f64() * 1e3 / summary.pulled as f64;
        }
        summary
    }
}

/// The sum over ranks of `rackfill:kv_export_peak_held_bytes` in a `/metrics` text.
pub fn peak_held_bytes(metrics: &str) -> Option<f64> {
    let values: Vec<f64> = metrics
        .lines()
        .filter(|l| l.starts_with("rackfill:kv_export_peak_held_bytes"))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_summed_over_ranks() {
        let text = "# HELP x\nrackfill:kv_export_peak_held_bytes{rank=\"0\"} 100\n\
                    rackfill:kv_export_peak_held_bytes{rank=\"1\"} 50\nother 3\n";
        assert_eq!(peak_held_bytes(text), Some(150.0));
        assert_eq!(peak_held_bytes("other 3\n"), None);
    }
}
