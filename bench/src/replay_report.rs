//! Presentation of a [`ReplayReport`]: the markdown table `rackfill bench balance` prints and the
//! imbalance-over-steps chart it plots.

use crate::markdown::{markdown_table, write_validation_failures};
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
