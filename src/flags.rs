//! The flag vocabulary every command shares: one spelling per concept, the older spellings kept
//! as hidden aliases, and the value parsers the commands have in common.
//!
//! | concept | flag | hidden aliases |
//! |---|---|---|
//! | expert-parallel ranks | `--ep-size` | `--ep`, `--ranks` |
//! | redundant expert slots per rank | `--redundant-slots` | `--slots` |
//! | balancer (a comma list where a command compares several) | `--balancer` | `--algo`, `--balancers` |
//! | how a step's MoE work overlaps (a comma list where a command compares several) | `--schedule` | |
//! | replica slot memory (likewise) | `--slot-memory` | |
//!
//! Defaults come from the config types (`EpConfig::default()`, `ServerConfig::default()`, ...),
//! never from literals in the clap attributes.

/// Hidden spellings of `--ep-size` (`simulate` and `bench ep` said `--ep`, `plan` `--ranks`).
pub(crate) const EP_SIZE_ALIASES: [&str; 2] = ["ep", "ranks"];
/// Hidden spelling of `--redundant-slots` (`plan`, `bench ep`, `bench balance` and `simulate`).
pub(crate) const REDUNDANT_SLOTS_ALIASES: [&str; 1] = ["slots"];
/// Hidden spellings of `--balancer` (`plan` said `--algo`, `bench ep` and `bench balance`
/// `--balancers`).
pub(crate) const BALANCER_ALIASES: [&str; 2] = ["algo", "balancers"];
/// `help` followed by `[default: a,b]`, for flags taking a comma list: clap joins default values
/// with spaces, which reads as separate arguments.
pub(crate) fn help_with_list_default<T: std::fmt::Display>(help: &str, defaults: &[T]) -> String {
    let list: Vec<String> = defaults.iter().map(T::to_string).collect();
    format!("{help} [default: {}]", list.join(","))
}

/// A positive integer.
pub(crate) fn parse_positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("invalid value '{s}': expected a positive integer")),
    }
}

/// `--reuse-tolerance`: a fraction, or `None` for `off`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReuseTolerance(pub(crate) Option<f64>);

/// `off`, or a non-negative fraction.
pub(crate) fn parse_reuse_tolerance(s: &str) -> Result<ReuseTolerance, String> {
    if s == "off" {
        return Ok(ReuseTolerance(None));
    }
    match s.parse::<f64>() {
        Ok(t) if t.is_finite() && t >= 0.0 => Ok(ReuseTolerance(Some(t))),
        _ => Err(format!(
            "invalid value '{s}': expected off or a non-negative fraction (0.02 is 2%)"
        )),
    }
}

/// `shared` or `per-layer`.
pub(crate) fn parse_slot_memory(s: &str) -> Result<rackfill_engine::SlotMemory, String> {
    s.parse()
}

/// `ultraep`, `pipelined`, `two-batch` or `overlapped` (`--schedule`).
pub(crate) fn parse_schedule(s: &str) -> Result<rackfill_engine::Schedule, String> {
    s.trim().parse()
}

/// A byte count: an integer with an optional binary suffix `K`, `M`, `G` or `T` (`512M` is
/// 512 x 2^20).
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    let bad = || format!("invalid size '{s}': expected bytes, e.g. 1073741824, 512M or 1G");
    let text = s.trim();
    let (digits, shift) = match text.char_indices().last() {
        Some((i, unit)) if unit.is_ascii_alphabetic() => {
            let shift = match unit.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(bad()),
            };
            (&text[..i], shift)
        }
        _ => (text, 0),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    n.checked_mul(1 << shift).ok_or_else(bad)
}

/// Keeps the first occurrence of every value.
pub(crate) fn dedup<T: PartialEq + Copy>(values: &[T]) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(values.len());
    for &v in values {
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

/// Most timed runs or rounds a bench takes: more only re-measures the median, for hours.
const MAX_REPEATS: usize = 1000;

pub(crate) fn parse_repeats(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_REPEATS).contains(&n) => Ok(n),
        _ => Err(format!(
            "invalid value '{s}': expected an integer in 1..={MAX_REPEATS}"
        )),
    }
}

/// `--device`: `cpu`, `cuda`, `cuda:N`, `emulator` (`auto` where a command allows it).
pub(crate) fn parse_device(s: &str) -> Result<rackfill_engine::ModelDevice, String> {
    s.parse()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_take_binary_suffixes_and_refuse_overflow() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("1g"), Ok(1 << 30));
        assert_eq!(parse_bytes("2T"), Ok(2 << 40));
        for bad in ["", "M", "1.5G", "-1", "10X", "99999999999T"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
