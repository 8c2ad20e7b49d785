//! The MoE data plane on the device (feature `cuda`): the engine's side of
//! [`rackfill_kernels::cuda::moe::DeviceMoe`]. It builds the plane for the runtime's layout and
//! schedule, and carries what crosses to ranks held by other processes over the runtime's
//! [`Fabric`] ([`FabricExchange`], through host buffers until peer memory replaces it).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use rackfill_balancer::quota::TargetRule;
use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::{Algo, Layout, Plan};
use rackfill_kernels::cuda::exec::Executor;
use rackfill_kernels::cuda::moe::{DeviceMoe, HomeExperts, HostExchange, MoeConfig};
use rackfill_kernels::cuda::CudaError;

use super::work::PlaneConfig;
use crate::error::{EngineError, Result};
use crate::fabric::{Fabric, Message, ReplicaBuffers};

/// The device plane for `layout`'s `local` ranks over `homes` (their home experts, already in
/// device memory), `(hidden, inter)` the experts' dimensions. With `plan_on_device` the quota
/// balancers solve on the device; every other plan comes from the host.
pub(crate) fn open_device_plane(
    exec: Arc<dyn Executor>,
    (layout, local): (&Layout, Range<usize>),
    dims: (usize, usize),
    homes: HomeExperts,
    config: &PlaneConfig,
) -> Result<DeviceMoe> {
    let device_solver = match config.balancer {
        _ if !config.plan_on_device => None,
        Algo::Quota => Some((config.u_min, TargetRule::BestFit)),
        Algo::QuotaPaper => Some((config.u_min, TargetRule::LargestSlack)),
        _ => None,
    };
    let moe = MoeConfig {
        relay: config.relay,
        device_solver,
        pipelined_experts: config.pipelined_experts,
        per_layer_slots: config.slot_memory == crate::rack_cost::SlotMemory::PerLayer,
        lanes: config.micro_batches,
        verify: config.verify,
    };
    DeviceMoe::new(exec, layout, local, dims, homes, moe).map_err(gpu_error)
}

/// A device error as the engine reports it.
pub(crate) fn gpu_error(err: CudaError) -> EngineError {
    EngineError::Gpu(err.to_string())
}

/// The runtime's fabric as the device plane's way to ranks of other processes: byte messages
/// ride in a [`Message`]'s ids (a length word, then the bytes four to a word), replica bytes
/// stream between host images.
pub(crate) struct FabricExchange<'f> {
    pub fabric: &'f dyn Fabric,
}

impl HostExchange for FabricExchange<'_> {
    fn all_to_all(
        &self,
        send: Vec<Vec<Vec<u8>>>,
    ) -> std::result::Result<Vec<Vec<Vec<u8>>>, String> {
        let messages = send
            .into_iter()
            .map(|per_dst| per_dst.iter().map(|bytes| pack(bytes)).collect())
            .collect();
        let received = self
            .fabric
            .all_to_all_v(messages)
            .map_err(|e| e.to_string())?;
        received
            .into_iter()
            .map(|per_src| per_src.iter().map(unpack).collect())
            .collect()
    }

    fn stream_replicas(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        homes: &BTreeMap<u32, Vec<u8>>,
        slots: Vec<&mut [u8]>,
        expert_bytes: usize,
    ) -> std::result::Result<Vec<u64>, String> {
        let source = |e: u32| -> Vec<&[u8]> {
            homes
                .get(&e)
                .map(|bytes| vec![bytes.as_slice()])
                .unwrap_or_default()
        };
        self.fabric
            .stream_replicas(
                plan,
                schedule,
                ReplicaBuffers {
                    source: &source,
                    slots,
                    slot_bytes: expert_bytes,
                    expert_bytes,
                },
            )
            .map_err(|e| e.to_string())
    }
}

/// Bytes as a message: their length, then the bytes little-endian four to a word.
fn pack(bytes: &[u8]) -> Message {
    let mut ids = Vec::with_capacity(1 + bytes.len().div_ceil(4));
    ids.push(bytes.len() as u32);
    ids.extend(bytes.chunks(4).map(|c| {
        let mut word = [0u8; 4];
        word[..c.len()].copy_from_slice(c);
        u32::from_le_bytes(word)
    }));
    Message {
        rows: Vec::new(),
        ids,
    }
}

/// The bytes [`pack`] put in a message.
fn unpack(message: &Message) -> std::result::Result<Vec<u8>, String> {
    let Some((&len, words)) = message.ids.split_first() else {
        return Ok(Vec::new());
    };
    let len = len as usize;
    if words.len() != len.div_ceil(4) || !message.rows.is_empty() {
        return Err(format!(
            "a device message of {} words does not hold {len} bytes",
            words.len()
        ));
    }
    let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    bytes.truncate(len);
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_survive_a_message_of_any_length() {
        for len in [0usize, 1, 3, 4, 5, 17] {
            let bytes: Vec<u8> = (0..len as u8).map(|b| b.wrapping_mul(37)).collect();
            assert_eq!(unpack(&pack(&bytes)).unwrap(), bytes);
        }
        assert_eq!(unpack(&Message::default()).unwrap(), Vec::<u8>::new());
        let mut short = pack(&[1, 2, 3, 4, 5]);
        short.ids.pop();
        assert!(unpack(&short).is_err());
    }
}
