//! What a replica distribution reports: its per-rank byte counts, or the transfer it refused and
//! why (shared by the validation and the callers, so neither depends on the other).

/// What a transfer got wrong; carried by [`crate::KernelError::Transfer`] with the transfer's
/// index.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferFault {
    #[error("rank {rank} is out of range")]
    Rank { rank: u32 },
    #[error("expert {expert} is out of range")]
    Expert { expert: u32 },
    #[error("bytes {offset}..+{len} lie outside the expert's {expert_bytes} bytes")]
    Range {
        offset: u64,
        len: u64,
        expert_bytes: usize,
    },
    #[error("stage {stage} is neither 1 nor 2")]
    Stage { stage: u8 },
    #[error("rank {rank} has no slot holding expert {expert}")]
    NoSlot { rank: u32, expert: u32 },
    #[error("stage-1 copy is sent by rank {src}, but the expert's home is rank {home}")]
    NotFromHome { src: u32, home: u32 },
    #[error(
        "wait_for_chunk_on is {wait:?}, a stage-{stage} copy sent by rank {src} needs {expected:?}"
    )]
    Wait {
        wait: Option<u32>,
        stage: u8,
        src: u32,
        expected: Option<u32>,
    },
    #[error(
        "rank {src} forwards bytes of chunk {chunk} it has not received: no earlier copy \
         delivers exactly these bytes to it"
    )]
    NotRelayed { src: u32, chunk: u32 },
    #[error("chunk {chunk} is delivered to rank {dst} more than once")]
    Duplicate { dst: u32, chunk: u32 },
    #[error("bytes overlap another copy into the same slot of rank {dst}")]
    Overlap { dst: u32 },
}

/// What a distribution moved, per rank and per stage.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicationStats {
    /// Bytes each rank sent (equals the schedule's `send_bytes` for a valid schedule).
    pub sent_bytes: Vec<u64>,
    /// Bytes each rank received (equals the schedule's `recv_bytes`).
    pub received_bytes: Vec<u64>,
    /// Chunk copies executed.
    pub transfers: usize,
    /// Copies read from a home rank's weights.
    pub stage1_copies: usize,
    /// Copies forwarded by a relay out of its slot.
    pub stage2_copies: usize,
}
