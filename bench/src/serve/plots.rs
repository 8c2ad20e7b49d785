//! The two charts of a rate sweep: achieved requests/s versus TTFT (mean and the highest
//! percentile asked for), and the TTFT CDF of every rate.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::plot::{write_chart, Chart, PlotError, Series};

use super::report::percentile_label;
use super::sweep::RateReport;

/// Image format of the charts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlotFormat {
    Png,
    Svg,
}

impl PlotFormat {
    fn extension(self) -> &'static str {
        match self {
            Self::Png => "png",
            Self::Svg => "svg",
        }
    }
}

/// Most points drawn per CDF (the curve is sampled evenly beyond that).
const MAX_CDF_POINTS: usize = 512;

/// Writes `PREFIX-ttft-vs-rps.EXT` and `PREFIX-ttft-cdf.EXT`; returns their paths.
pub fn write_plots(
    prefix: &Path,
    format: PlotFormat,
    reports: &[RateReport],
) -> Result<Vec<PathBuf>, PlotError> {
    let path = |name: &str| {
        let mut os = OsString::from(prefix.as_os_str());
        os.push(format!("-{name}.{}", format.extension()));
        PathBuf::from(os)
    };
    let rps = path("ttft-vs-rps");
    write_chart(&rps, &ttft_versus_rps(reports))?;
    let cdf = path("ttft-cdf");
    write_chart(&cdf, &ttft_cdf(reports))?;
    Ok(vec![rps, cdf])
}

fn ttft_versus_rps(reports: &[RateReport]) -> Chart {
    let mut mean = Vec::new();
    let mut top = Vec::new();
    for r in reports {
        let s = &r.summary;
        mean.push((s.request_throughput, s.ttft.mean));
        if let Some((_, v)) = s.ttft.highest() {
            top.push((s.request_throughput, v));
        }
    }
    mean.sort_by(|a, b| a.0.total_cmp(&b.0));
    top.sort_by(|a, b| a.0.total_cmp(&b.0));
    let xs: Vec<f64> = mean.iter().map(|p| p.0).filter(|x| *x > 0.0).collect();
    let spread =
        xs.iter().copied().fold(f64::NAN, f64::max) / xs.iter().copied().fold(f64::NAN, f64::min);
    let mut series = vec![Series {
        label: "mean TTFT".into(),
        points: mean,
    }];
    let top_label = reports
        .first()
        .and_then(|r| r.summary.ttft.highest())
        .map(|(p, _)| format!("p{} TTFT", percentile_label(p)));
    if let Some(label) = top_label {
        series.push(Series { label, points: top });
    }
    Chart {
        title: "TTFT versus achieved request rate".into(),
        x_label: "completed requests/s".into(),
        y_label: "TTFT (ms)".into(),
        series,
        log_x: spread >= 10.0 && xs.len() == reports.len(),
    }
}

fn ttft_cdf(reports: &[RateReport]) -> Chart {
    let series = reports
        .iter()
        .map(|r| {
            let mut ttfts: Vec<f64> = r
                .run
                .records
                .iter()
                .filter(|rec| rec.outcome.error.is_none())
                .map(|rec| rec.outcome.ttft.unwrap_or(rec.outcome.e2el).as_secs_f64() * 1000.0)
                .collect();
            ttfts.sort_by(f64::total_cmp);
            let n = ttfts.len();
            let step = n.div_ceil(MAX_CDF_POINTS).max(1);
            let points = (0..n)
                .filter(|i| i % step == 0 || i + 1 == n)
                .map(|i| (ttfts[i], (i + 1) as f64 / n as f64))
                .collect();
            let label = match (r.summary.request_rate, r.summary.trace_speedup) {
                (Some(rate), _) => format!("rate {rate} req/s"),
                (None, Some(speedup)) => format!("trace x{speedup}"),
                (None, None) => "run".into(),
            };
            Series { label, points }
        })
        .collect();
    Chart {
        title: "TTFT distribution".into(),
        x_label: "TTFT (ms)".into(),
        y_label: "fraction of requests".into(),
        series,
        log_x: false,
    }
}
