//! The decode side of the protocol, as `rackfill bench serve --remote-decode` plays it: for a
//! response's [`KvTransferParams`], ask the prefill engine's side channel for its agent's
//! metadata (once per engine), load it, READ the named blocks of every layer into this
//! process's registered memory and have NIXL notify the prefill side, which frees them; as a
//! vLLM decode instance does, with one READ at a time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use zeromq::{Socket, SocketRecv, SocketSend};

use super::error::KvExportError;
use super::nixl::{find_library, Agent};
use super::side_channel::{AgentMetadata, HandshakePayload};
use super::transfer_params::KvTransferParams;

/// How long the side channel may take to answer (vLLM's decode waits 5 s).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one READ may take.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// What one pull moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pulled {
    pub bytes: usize,
    /// The READ alone (handshake excluded).
    pub read: Duration,
}

/// A prefill engine this puller has loaded.
struct Remote {
    agent: String,
    metadata: AgentMetadata,
}

/// What the pulls share: the landing buffer (registered, grown as needed) and the engines.
struct State {
    /// Every buffer registered so far (a grown one replaces the last; all stay registered).
    buffers: Vec<Box<[u8]>>,
    remotes: HashMap<String, Remote>,
}

/// A decode-side NIXL agent.
pub struct Puller {
    agent: Agent,
    state: Mutex<State>,
}

impl Puller {
    /// A decode agent named `name` over UCX (the `nixl` wheel's library, found as the prefill
    /// side finds it).
    pub fn new(name: &str) -> Result<Arc<Self>, KvExportError> {
        let agent = Agent::new(&find_library()?, name)?;
        Ok(Arc::new(Self {
            agent,
            state: Mutex::new(State {
                buffers: Vec::new(),
                remotes: HashMap::new(),
            }),
        }))
    }

    /// Pulls the blocks `params` names and notifies their prefill side.
    pub async fn pull(
        self: &Arc<Self>,
        params: &KvTransferParams,
    ) -> Result<Pulled, KvExportError> {
        let known = self
            .state
            .lock()
            .map(|s| s.remotes.contains_key(&params.remote_engine_id))
            .unwrap_or(false);
        let metadata = match known {
            true => None,
            false => Some(handshake(&params.remote_host, params.remote_port).await?),
        };
        let this = Arc::clone(self);
        let params = params.clone();
        tokio::task::spawn_blocking(move || this.read(&params, metadata))
            .await
            .map_err(|e| KvExportError::SideChannel(format!("the READ task failed: {e}")))?
    }

    fn read(
        &self,
        params: &KvTransferParams,
        metadata: Option<AgentMetadata>,
    ) -> Result<Pulled, KvExportError> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| KvExportError::Config("the puller's lock was poisoned".into()))?;
        if let Some(metadata) = metadata {
            if metadata.engine_id != params.remote_engine_id {
                return Err(KvExportError::SideChannel(format!(
                    "engine id mismatch: expected {}, the side channel says {}",
                    params.remote_engine_id, metadata.engine_id
                )));
            }
            let agent = self.agent.add_remote(&metadata.agent_metadata)?;
            state
                .remotes
                .insert(params.remote_engine_id.clone(), Remote { agent, metadata });
        }
        let blocks = params
            .remote_block_ids
            .first()
            .ok_or_else(|| KvExportError::Config("no block ids".into()))?
            .clone();
        let (agent, remote) = {
            let remote = &state.remotes[&params.remote_engine_id];
            let m = &remote.metadata;
            let mut descs: Vec<(usize, usize)> =
                Vec::with_capacity(m.kv_caches_base_addr.len() * blocks.len());
            for (region, &base) in m.kv_caches_base_addr.iter().enumerate() {
                let (len, stride) = (m.block_lens[region] as usize, m.block_strides[region]);
                for &block in &blocks {
                    let addr = (base + u64::from(block) * stride) as usize;
                    // Consecutive blocks of a packed region are one descriptor (the local side
                    // is contiguous too): far fewer for NIXL to match and post.
                    match descs.last_mut() {
                        Some(last) if last.0 + last.1 == addr => last.1 += len,
                        _ => descs.push((addr, len)),
                    }
                }
            }
            (remote.agent.clone(), descs)
        };
        let bytes: usize = remote.iter().map(|&(_, len)| len).sum();
        if state.buffers.last().is_none_or(|b| b.len() < bytes) {
            let buffer = vec![0u8; bytes.next_power_of_two()].into_boxed_slice();
            // SAFETY: the buffer is kept in `state` as long as the agent lives.
            unsafe {
                self.agent
                    .register_host(buffer.as_ptr() as usize, buffer.len())?
            };
            state.buffers.push(buffer);
        }
        let base = state.buffers.last().map_or(0, |b| b.as_ptr() as usize);
        let mut offset = 0;
        let local: Vec<(usize, usize)> = remote
            .iter()
            .map(|&(_, len)| {
                offset += len;
                (base + offset - len, len)
            })
            .collect();
        let notification = format!("{}:1", params.remote_request_id);
        let started = Instant::now();
        self.agent.read(
            &local,
            &remote,
            &agent,
            notification.as_bytes(),
            READ_TIMEOUT,
        )?;
        Ok(Pulled {
            bytes,
            read: started.elapsed(),
        })
    }
}

/// The side channel's handshake: the prefill agent's metadata.
async fn handshake(host: &str, port: u16) -> Result<AgentMetadata, KvExportError> {
    let fail = |what: String| KvExportError::SideChannel(format!("tcp://{host}:{port}: {what}"));
    let exchange = async {
        let mut socket = zeromq::ReqSocket::new();
        socket
            .connect(&format!("tcp://{host}:{port}"))
            .await
            .map_err(|e| fail(format!("cannot connect: {e}")))?;
        let request = rmp_serde::to_vec(&(serde_bytes::Bytes::new(b"get_meta_msg"), 0u32, 0u32))
            .map_err(|e| fail(e.to_string()))?;
        socket
            .send(request.into())
            .await
            .map_err(|e| fail(format!("cannot send: {e}")))?;
        let reply = socket
            .recv()
            .await
            .map_err(|e| fail(format!("no reply: {e}")))?;
        let frames = reply.into_vec();
        if frames.len() != 2 {
            return Err(fail(format!("a reply of {} frames, not 2", frames.len())));
        }
        let payload: HandshakePayload =
            rmp_serde::from_slice(&frames[0]).map_err(|e| fail(format!("bad payload: {e}")))?;
        rmp_serde::from_slice(&payload.agent_metadata_bytes)
            .map_err(|e| fail(format!("bad agent metadata: {e}")))
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, exchange)
        .await
        .map_err(|_| fail(format!("no answer within {HANDSHAKE_TIMEOUT:?}")))?
}
