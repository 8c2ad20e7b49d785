//! When each request is sent: a seeded Poisson or gamma arrival process at a request rate (as
//! vLLM's `benchmark_serving.py`), everything at once for rate `inf`, or a trace's own timestamps
//! sped up by a factor.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Gamma};
use serde::{Serialize, Serializer};

use super::dataset::RequestSpec;

/// Requests per second of an arrival process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RequestRate {
    /// A positive, finite rate.
    PerSecond(f64),
    /// Every request at time zero (a burst bounded only by `--max-concurrency`).
    Infinite,
}

impl FromStr for RequestRate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if matches!(s.to_ascii_lowercase().as_str(), "inf" | "infinity") {
            return Ok(Self::Infinite);
        }
        match s.parse::<f64>() {
            Ok(rate) if rate.is_finite() && rate > 0.0 => Ok(Self::PerSecond(rate)),
            Ok(rate) if rate.is_infinite() && rate > 0.0 => Ok(Self::Infinite),
            _ => Err(format!(
                "invalid request rate '{s}': expected a positive number of requests/s or inf"
            )),
        }
    }
}

impl fmt::Display for RequestRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PerSecond(rate) => write!(f, "{rate}"),
            Self::Infinite => f.write_str("inf"),
        }
    }
}

/// A number, or the string `"inf"` as vLLM writes it.
impl Serialize for RequestRate {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::PerSecond(rate) => serializer.serialize_f64(*rate),
            Self::Infinite => serializer.serialize_str("inf"),
        }
    }
}

/// How request send times are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// Gaps drawn from a gamma distribution with shape `burstiness` and mean `1 / rate`
    /// (`burstiness` 1 is a Poisson process; smaller is burstier, larger more regular).
    Rate { rate: RequestRate, burstiness: f64 },
    /// The trace's timestamps, relative to its first, divided by `speedup`.
    Replay { speedup: f64 },
}

/// Why no schedule could be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ArrivalError {
    #[error("--burstiness must be a positive number, got {0}")]
    Burstiness(f64),
    #[error("--trace-speedup must be a positive number, got {0}")]
    Speedup(f64),
    #[error("request {0} has no timestamp; replay needs a trace dataset (or use a request rate)")]
    NoTimestamp(usize),
    /// A send time too late to represent (a rate or speed-up far too small).
    #[error(
        "request {request} would be sent {seconds:e} s after the run starts: too late to schedule \
         (the rate or speed-up is too small)"
    )]
    TooLate { request: usize, seconds: f64 },
}

/// `seconds` after the start as a [`Duration`], or why request `request` cannot be scheduled.
fn offset(request: usize, seconds: f64) -> Result<Duration, ArrivalError> {
    Duration::try_from_secs_f64(seconds).map_err(|_| ArrivalError::TooLate { request, seconds })
}

/// Send offsets from the start of the run, one per request; deterministic in `seed`. A
/// rate-driven run's offsets are non-decreasing and its first request goes at zero; a replay's
/// follow the trace's timestamps, which may be out of order (the earliest goes at zero).
pub fn schedule(
    arrivals: Arrivals,
    requests: &[RequestSpec],
    seed: u64,
) -> Result<Vec<Duration>, ArrivalError> {
    match arrivals {
        Arrivals::Rate { rate, burstiness } => {
            if !(burstiness.is_finite() && burstiness > 0.0) {
                return Err(ArrivalError::Burstiness(burstiness));
            }
            let RequestRate::PerSecond(rate) = rate else {
                return Ok(vec![Duration::ZERO; requests.len()]);
            };
            let gaps = Gamma::new(burstiness, 1.0 / (rate * burstiness))
                .map_err(|_| ArrivalError::Burstiness(burstiness))?;
            let mut rng = StdRng::seed_from_u64(seed);
            let mut t = 0.0f64;
            (0..requests.len())
                .map(|i| {
                    if i > 0 {
                        t += gaps.sample(&mut rng);
                    }
                    offset(i, t)
                })
                .collect()
        }
        Arrivals::Replay { speedup } => {
            if !(speedup.is_finite() && speedup > 0.0) {
                return Err(ArrivalError::Speedup(speedup));
            }
            let stamps = requests
                .iter()
                .enumerate()
                .map(|(i, r)| r.timestamp_ms.ok_or(ArrivalError::NoTimestamp(i)))
                .collect::<Result<Vec<_>, _>>()?;
            let first = stamps.iter().copied().fold(f64::INFINITY, f64::min);
            stamps
                .iter()
                .enumerate()
                .map(|(i, &ms)| offset(i, (ms - first) / 1000.0 / speedup))
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::dataset::Prompt;

    fn specs(stamps: &[Option<f64>]) -> Vec<RequestSpec> {
        stamps
            .iter()
            .map(|&timestamp_ms| RequestSpec {
                prompt: Prompt::Text("x".into()),
                input_len: 1,
                output_len: 1,
                timestamp_ms,
            })
            .collect()
    }

    #[test]
    fn rates_parse() {
        assert_eq!("inf".parse(), Ok(RequestRate::Infinite));
        assert_eq!(" Infinity ".parse(), Ok(RequestRate::Infinite));
        assert_eq!("2.5".parse(), Ok(RequestRate::PerSecond(2.5)));
        for bad in ["0", "-1", "nan", "fast", ""] {
            let err = bad.parse::<RequestRate>().unwrap_err();
            assert!(err.contains("positive"), "{err}");
        }
        assert_eq!(
            serde_json::to_string(&RequestRate::Infinite).unwrap(),
            "\"inf\""
        );
        assert_eq!(
            serde_json::to_string(&RequestRate::PerSecond(4.0)).unwrap(),
            "4.0"
        );
    }

    #[test]
    fn poisson_gaps_average_one_over_rate() {
        let requests = specs(&[None; 20_000]);
        for burstiness in [1.0, 0.25, 4.0] {
            let arrivals = Arrivals::Rate {
                rate: RequestRate::PerSecond(50.0),
                burstiness,
            };
            let times = schedule(arrivals, &requests, 7).unwrap();
            assert_eq!(times[0], Duration::ZERO);
            assert!(times.windows(2).all(|w| w[0] <= w[1]));
            let mean_gap = times.last().unwrap().as_secs_f64() / (times.len() - 1) as f64;
            assert!(
                (mean_gap - 0.02).abs() < 0.02 * 0.05,
                "{burstiness}: {mean_gap}"
            );
            // Coefficient of variation of a gamma gap is 1 / sqrt(shape).
            let gaps: Vec<f64> = times
                .windows(2)
                .map(|w| (w[1] - w[0]).as_secs_f64())
                .collect();
            let var = gaps.iter().map(|g| (g - mean_gap).powi(2)).sum::<f64>() / gaps.len() as f64;
            let cv = var.sqrt() / mean_gap;
            assert!(
                (cv - 1.0 / burstiness.sqrt()).abs() < 0.1,
                "{burstiness}: cv {cv}"
            );
            assert_eq!(times, schedule(arrivals, &requests, 7).unwrap());
            assert_ne!(times, schedule(arrivals, &requests, 8).unwrap());
        }
        let burst = Arrivals::Rate {
            rate: RequestRate::Infinite,
            burstiness: 1.0,
        };
        assert!(schedule(burst, &requests[..5], 0)
            .unwrap()
            .iter()
            .all(|t| t.is_zero()));
        let bad = Arrivals::Rate {
            rate: RequestRate::PerSecond(1.0),
            burstiness: 0.0,
        };
        assert_eq!(
            schedule(bad, &requests, 0),
            Err(ArrivalError::Burstiness(0.0))
        );
        let glacial = Arrivals::Rate {
            rate: RequestRate::PerSecond(1e-30),
            burstiness: 1.0,
        };
        let err = schedule(glacial, &requests[..3], 0).unwrap_err();
        assert!(
            matches!(err, ArrivalError::TooLate { request: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("too late to schedule"), "{err}");
    }

    #[test]
    fn replay_is_relative_to_the_first_timestamp_and_sped_up() {
        let requests = specs(&[Some(1000.0), Some(1500.0), Some(3000.0)]);
        let times = schedule(Arrivals::Replay { speedup: 2.0 }, &requests, 0).unwrap();
        let ms: Vec<u128> = times.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [0, 250, 1000]);
        assert_eq!(
            schedule(Arrivals::Replay { speedup: 0.0 }, &requests, 0),
            Err(ArrivalError::Speedup(0.0))
        );
        // Checked, not a panic: send times past what a Duration holds.
        assert!(matches!(
            schedule(Arrivals::Replay { speedup: 1e-300 }, &requests, 0),
            Err(ArrivalError::TooLate { request: 1, .. })
        ));
        let untimed = specs(&[Some(0.0), None]);
        assert_eq!(
            schedule(Arrivals::Replay { speedup: 1.0 }, &untimed, 0),
            Err(ArrivalError::NoTimestamp(1))
        );
    }
}
