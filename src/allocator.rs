//! The process allocator: mimalloc, told to keep freed memory for a while before returning it
//! to the OS.
//!
//! Prefill allocates and frees multi-megabyte activation buffers every layer. glibc's allocator
//! returned them to the OS, so each layer paid page faults and kernel zeroing again (a tenth of
//! a 4096-token prefill's profile); mimalloc keeps them, but by default only for 1 s after they
//! are freed, and buffers of a size used once per forward pass (or once per engine step) come
//! back fresh from the OS: 124,000-145,000 page faults in a 512/2048/4096-token `bench forward`
//! run, 16,000-22,000 with a 10 s delay (docs/performance.md).

use std::ffi::{c_int, c_long};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc.h's `mi_option_purge_delay` (libmimalloc-sys names no constant for it): how long,
/// in milliseconds, freed memory stays committed before it is returned to the OS.
const MI_OPTION_PURGE_DELAY: c_int = 15;

/// Freed memory is kept this long: a serving engine that steps continuously reuses it, an idle
/// one gives it back after this delay.
const PURGE_DELAY_MS: c_long = 10_000;

extern "C" {
    // Linked from the mimalloc library libmimalloc-sys builds for the allocator above.
    fn mi_option_set(option: c_int, value: c_long);
}

/// Sets the purge delay, unless `MIMALLOC_PURGE_DELAY` in the environment already chose one
/// (mimalloc reads it itself).
pub fn configure() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: mimalloc's option setter takes any option id and value; options are plain
        // integers it reads atomically.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::{c_int, c_long};

    extern "C" {
        fn mi_option_get(option: c_int) -> c_long;
    }

    /// The purge delay in force, in milliseconds.
    fn purge_delay_ms() -> c_long {
        // SAFETY: reads an option, a plain integer mimalloc reads atomically.
        unsafe { mi_option_get(super::MI_OPTION_PURGE_DELAY) }
    }

    #[test]
    fn option_15_is_the_purge_delay_and_is_set() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        // mimalloc's own default (1000 ms in v3) identifies the option before we change it.
        assert_eq!(purge_delay_ms(), 1000);
        super::configure();
        assert_eq!(purge_delay_ms(), super::PURGE_DELAY_MS);
    }
}
