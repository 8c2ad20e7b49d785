//! The balance replay on a tiny grid.

use rackfill_balancer::{Algo, Settings};
use rackfill_bench::balance::{run_balance, suite_seed, BalanceRun};
use rackfill_bench::stats::percentile;
use rackfill_bench::synthetic::{default_grid, Shape};

fn tiny_run() -> BalanceRun {
    // Two shapes (one with uneven expert runs) x two token counts, 2 steps each; the 1024-token
    // suites only on the small shape to keep debug builds fast.
    let mut suites = default_grid(&[Shape::new(4, 16, 2)], &[16, 1024], 2);
    suites.extend(default_grid(&[Shape::new(3, 10, 1)], &[16], 2));
    BalanceRun::new(suites, 42, Settings::default())
}

#[test]
fn tiny_grid_reports_every_balancer_with_no_failures() {
    let run = tiny_run();
    let mut seen = 0;
    let report = run_balance(&run, |p| {
        seen += 1;
        assert_eq!((p.done, p.total), (seen, run.suites.len()));
    })
    .unwrap();
    assert_eq!(seen, run.suites.len());
    assert_eq!(report.validation_failures, 0, "{:#?}", report.failures);
    assert!(report.failures.is_empty());
    assert_eq!(report.suites, 3 * 11);
    assert_eq!(report.steps, 3 * 11 * 2);
    let names: Vec<&str> = Algo::ALL.iter().map(|a| a.name()).collect();
    assert_eq!(report.balancers, names);

    let all = report.group("all", "all").unwrap();
    assert_eq!(all.steps, report.steps);
    assert_eq!(all.balancers.len(), Algo::ALL.len());
    for (stats, name) in all.balancers.iter().zip(&names) {
        assert_eq!(stats.balancer, *name);
        assert_eq!(stats.plans, report.steps);
        assert_eq!(stats.validation_failures, 0);
        assert!(stats.imbalance_mean >= 1.0 && stats.imbalance_mean <= stats.imbalance_max);
        assert!(stats.imbalance_p99 <= stats.imbalance_max);
        assert!(stats.gap_mean >= 1.0 - 1e-9 && stats.gap_mean <= stats.gap_max);
        assert!(stats.solve_us_median <= stats.solve_us_p99);
        assert!((0.0..=1.0).contains(&stats.inflight_ratio_mean));
    }
    // `none` creates nothing and changes nothing.
    let none = &all.balancers[0];
    assert_eq!(none.replicas_mean, 0.0);
    assert_eq!(none.max_fanout_max, 0);
    assert!((none.imbalance_mean - none.imbalance_before_mean).abs() < 1e-12);

    // Groups: exact-load holds only the 1024-token half; shapes, tokens, families, patterns.
    let exact = report.group("exact-load", "tokens 1024-4096").unwrap();
    assert_eq!(exact.steps, report.steps / 3);
    assert_eq!(report.group("shape", "4/16/2").unwrap().suites, 22);
    assert_eq!(report.group("shape", "3/10/1").unwrap().suites, 11);
    assert_eq!(report.group("tokens", "16").unwrap().suites, 22);
    assert_eq!(report.group("pattern", "switching").unwrap().suites, 6);
    assert_eq!(report.group("family", "zipf-1.0").unwrap().suites, 9);
    let kinds: Vec<&str> = report.groups.iter().map(|g| g.kind.as_str()).collect();
    let mut sorted = kinds.clone();
    sorted.sort_by_key(|k| {
        ["all", "exact-load", "shape", "tokens", "family", "pattern"]
            .iter()
            .position(|x| x == k)
    });
    assert_eq!(kinds, sorted);

    // Printable and serializable.
    let table = report.to_table();
    assert!(table.contains("## all"), "{table}");
    assert!(table.contains("| eplb-history"));
    assert!(!table.contains("FAILED"));
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["validation_failures"], 0);
    assert!(json["groups"][0]["balancers"][1]["imbalance_p99"].is_number());
}

#[test]
fn replay_is_deterministic_apart_from_timings() {
    let mut run = tiny_run();
    run.suites.truncate(5);
    let strip = |mut r: rackfill_bench::BalanceReport| {
        r.generate_ms = 0.0;
        r.wall_ms = 0.0;
        for g in &mut r.groups {
            for b in &mut g.balancers {
                b.solve_us_median = 0.0;
                b.solve_us_p99 = 0.0;
            }
        }
        r
    };
    let a = strip(run_balance(&run, |_| {}).unwrap());
    let b = strip(run_balance(&run, |_| {}).unwrap());
    assert_eq!(a, b);
}

#[test]
fn bad_suites_are_errors_not_panics() {
    let mut run = tiny_run();
    run.suites[0].top_k = 0;
    let err = run_balance(&run, |_| {}).unwrap_err().to_string();
    assert!(err.contains("top-k") && !err.contains('\n'), "{err}");
}

#[test]
fn helpers() {
    assert_eq!(percentile(&[], 0.5), 0.0);
    let v: Vec<f64> = (1..=100).map(f64::from).collect();
    assert_eq!(percentile(&v, 0.5), 50.0);
    assert_eq!(percentile(&v, 0.99), 99.0);
    assert_eq!(percentile(&v, 1.0), 100.0);
    assert_eq!(percentile(&[3.0], 0.99), 3.0);
    assert_ne!(suite_seed(1, "a"), suite_seed(1, "b"));
    assert_ne!(suite_seed(1, "a"), suite_seed(2, "a"));
}
