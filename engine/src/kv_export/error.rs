//! Why KV could not be exported.

use super::nixl::NixlError;

/// Why KV could not be exported.
#[derive(Debug, thiserror::Error)]
pub enum KvExportError {
    #[error(transparent)]
    Nixl(#[from] NixlError),
    #[error("KV export side channel: {0}")]
    SideChannel(String),
    #[error("KV export: {0}")]
    Config(String),
    #[error("KV export layout: {0}")]
    Layout(String),
    #[error("KV export: {0}")]
    Tensor(#[from] candle_core::Error),
    #[error(
        "KV export arena full: this prompt needs {needed} blocks, {free} are free and {held} \
         requests wait for their decode side (raise --kv-export-blocks, or lower \
         --kv-export-timeout)"
    )]
    Full {
        needed: usize,
        free: usize,
        held: usize,
    },
}
