//! rackfill-engine: continuous batching with chunked prefill, and the expert-parallel runtime that
//! balances every MoE layer on its exact load (count exchange, plan, replica streaming, dispatch,
//! expert compute, combine). Nothing is implemented yet.
