//! Presentation of a [`ReplayReport`]: the markdown table `rackfill bench balance` prints and the
//! imbalance-over-steps chart it plots.

use crate::plot::{Chart, Series};
use crate::replay::ReplayReport;
use std::fmt::Write as _;

impl ReplayReport {
    /// The report as markdown: a header, a loud failure section when any plan failed, and one row
    /// per balancer.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# balance replay ({}): {} steps x {} layers, {} ranks, {} experts, {} slots per rank",
            self.source,
            self.steps,
            self.layers.len(),
            self.ranks,
            self.experts,
            self.slots_per_rank
        );
        let bytes = match self.expert_bytes {
            Some(b) => format!("expert bytes {b}"),
            None => "expert bytes unknown (replica counts only; give --expert-bytes)".into(),
        };
        let _ = writeln!(
            out,
            "u_min {}, history window {}, rebalance interval {}, {bytes}; wall {:.1} s",
            self.u_min,
            self.history_window,
            self.rebalance_interval,
            self.wall_ms / 1e3
        );
        write_validation_failures(
            &mut out,
            self.validation_failures,
            self.failures.iter().map(|f| {
                format!(
                    "{} on step {} layer {}: {}",
                    f.balancer, f.step, f.layer, f.error
                )
            }),
        );
        let before = self.stats.first().map_or(0.0, |s| s.imbalance_before_mean);
        let _ = writeln!(
            out,
            "\nimbalance before balancing (main experts only): {before:.3} mean\n"
        );
        let mut header = vec![
            "balancer",
            "imb mean",
            "imb p50",
            "imb p99",
            "imb max",
            "gap mean",
            "replicas",
            "fanout max",
            "slot changes/step",
        ];
        if self.expert_bytes.is_some() {
            header.extend(["MB streamed/step", "MB changed/step"]);
        }
        header.extend([
            "inflight",
            "straggler",
            "solve mean us",
            "solve p99 us",
            "fails",
        ]);
        let mb = |b: Option<f64>| b.map_or("-".into(), |b| format!("{:.1}", b / 1e6));
        let rows: Vec<Vec<String>> = self
            .stats
            .iter()
            .map(|s| {
                let mut row = vec![
                    s.balancer.clone(),
                    format!("{:.3}", s.imbalance_mean),
                    format!("{:.3}", s.imbalance_p50),
                    format!("{:.3}", s.imbalance_p99),
                    format!("{:.3}", s.imbalance_max),
                    format!("{:.3}", s.gap_mean),
                    format!("{:.1}", s.replicas_mean),
                    s.max_fanout_max.to_string(),
                    format!("{:.1}", s.slot_changes_per_step),
                ];
                if self.expert_bytes.is_some() {
                    row.push(mb(s.replica_bytes_per_step));
                    row.push(mb(s.slot_change_bytes_per_step));
                }
                row.extend([
                    format!("{:.3}", s.inflight_ratio_mean),
                    format!("{:.0}", s.token_straggler_mean),
                    format!("{:.1}", s.solve_us_mean),
                    format!("{:.1}", s.solve_us_p99),
                    s.validation_failures.to_string(),
                ]);
                row
            })
            .collect();
        out.push_str(&markdown_table(&header, &rows));
        out
    }

    /// Imbalance over steps: per step the mean over layers, one series per balancer (plus the
    /// imbalance before balancing when `none` is not among them).
    pub fn imbalance_chart(&self) -> Chart {
        let x = |i: usize| self.step_ids[i] as f64;
        // `none` is the imbalance before balancing; draw it separately only when `none` is not run.
        let mut series = Vec::new();
        if !self.balancers.iter().any(|b| b == "none") {
            series.push(Series {
                label: "before (main experts only)".into(),
                points: (0..self.steps)
                    .map(|i| (x(i), self.imbalance_before_series[i]))
                    .collect(),
            });
        }
        series.extend(self.stats.iter().map(|s| {
            Series {
                label: s.balancer.clone(),
                points: s
                    .series
                    .imbalance_mean
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| v.is_finite())
                    .map(|(i, &v)| (x(i), v))
                    .collect(),
            }
        }));
        Chart {
            title: format!(
                "imbalance over steps: {} layers, R={}, E={}, {} slots",
                self.layers.len(),
                self.ranks,
                self.experts,
                self.slots_per_rank
            ),
            x_label: "step".into(),
            y_label: "imbalance max L / mean L (mean over layers)".into(),
            series,
            log_x: false,
        }
    }
}

/// A markdown table with the first column left-aligned and the others right-aligned, padded so
/// it also reads as plain text.
/// The loud block a report opens with when plans failed validation: the count, then the first
/// failures kept, one bullet each.
pub(crate) fn write_validation_failures(
    out: &mut String,
    total: usize,
    shown: impl ExactSizeIterator<Item = String>,
) {
    if total == 0 {
        return;
    }
    let _ = writeln!(
        out,
        "\n**!!! {total} PLANS FAILED VALIDATION !!!** (first {} below)\n",
        shown.len()
    );
    for line in shown {
        let _ = writeln!(out, "- {line}");
    }
}

pub(crate) fn markdown_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|row| row[c].len())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    let line = |out: &mut String, row: &[&str]| {
        out.push('|');
        for (c, cell) in row.iter().enumerate() {
            if c == 0 {
                let _ = write!(out, " {cell:<w$} |", w = widths[c]);
            } else {
                let _ = write!(out, " {cell:>w$} |", w = widths[c]);
            }
        }
        out.push('\n');
    };
    line(&mut out, header);
    out.push('|');
    for (c, w) in widths.iter().enumerate() {
        if c == 0 {
            let _ = write!(out, ":{}|", "-".repeat(w + 1));
        } else {
            let _ = write!(out, "{}:|", "-".repeat(w + 1));
        }
    }
    out.push('\n');
    for row in rows {
        let row: Vec<&str> = row.iter().map(String::as_str).collect();
        line(&mut out, &row);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_failures_are_reported_only_when_there_are_some() {
        let mut out = String::new();
        write_validation_failures(&mut out, 0, std::iter::empty());
        assert!(out.is_empty());
        let shown = ["quota on step 1 layer 2: bad".to_string(), "b".to_string()];
        write_validation_failures(&mut out, 5, shown.into_iter());
        assert!(
            out.contains("**!!! 5 PLANS FAILED VALIDATION !!!** (first 2 below)"),
            "{out}"
        );
        assert!(
            out.contains("\n- quota on step 1 layer 2: bad\n- b\n"),
            "{out}"
        );
    }
}
