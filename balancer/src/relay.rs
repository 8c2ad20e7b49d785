//! (being written) relay planner.
