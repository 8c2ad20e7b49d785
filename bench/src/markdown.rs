//! The text pieces every balancer report shares: markdown tables and the failure block.

use std::fmt::Write as _;

/// Failures a report keeps verbatim (all are counted); its failure block lists these.
pub(crate) const MAX_FAILURES_KEPT: usize = 20;

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

/// A markdown table with the first column left-aligned and the others right-aligned, padded so
/// it also reads as plain text.
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
