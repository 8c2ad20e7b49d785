//! rackfill-bench (being written)
