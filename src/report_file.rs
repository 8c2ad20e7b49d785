//! Report files the benches write with `--json FILE`.

use std::io::Write as _;
use std::path::Path;

use anyhow::Context as _;

/// Opens a report file up front, so an unwritable path fails before minutes of work.
pub(crate) fn create_report_file(path: Option<&Path>) -> anyhow::Result<Option<std::fs::File>> {
    path.map(|path| {
        std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))
    })
    .transpose()
}

/// Writes a report as pretty JSON with a trailing newline.
pub(crate) fn write_json(
    file: std::fs::File,
    path: &Path,
    report: &impl serde::Serialize,
) -> anyhow::Result<()> {
    let mut w = std::io::BufWriter::new(file);
    serde_json::to_writer_pretty(&mut w, report)
        .and_then(|()| w.write_all(b"\n").map_err(serde_json::Error::io))
        .and_then(|()| w.flush().map_err(serde_json::Error::io))
        .with_context(|| format!("cannot write {}", path.display()))?;
    note!("report written to {}", path.display());
    Ok(())
}
