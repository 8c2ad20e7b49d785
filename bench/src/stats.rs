//! Numbers every balancer report computes the same way.

/// Microseconds rounded to whole nanoseconds, the timers' resolution, for reports: sums and means
/// of nanosecond samples otherwise print float noise (`0.39499999999999996`).
pub fn round_us(us: f64) -> f64 {
    (us * 1e3).round() / 1e3
}

/// Nearest-rank percentile of sorted samples (0 for none).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
