//! [`RoutingRecorder`]: `--record-routing FILE`, bounded by `--record-routing-max-bytes`.
//!
//! A recording serving for hours grows by about 150 MB an hour at a light load, so it is capped:
//! the recorder stops before the step that would take the file past [`RoutingTraceConfig::max_bytes`]
//! (it does not rotate: the file keeps the first steps, a complete trace). Each step is encoded
//! whole and handed to the file in one write; when a write fails (a full disk) the file is cut
//! back to the last whole step and recording stops. Either way the trace on disk reads back in
//! full, and the gauge `rackfill:routing_trace_recording` drops from 1 to 0 (see
//! [`crate::metrics`]).

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::PathBuf;

use rackfill_balancer::LoadMatrix;

use super::line::encode_step;
use crate::metrics;

/// Where and how much to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingTraceConfig {
    /// The trace file, created (truncated) when the engine starts.
    pub path: PathBuf,
    /// Largest size the file may reach; recording stops before the step that would pass it.
    pub max_bytes: u64,
}

impl RoutingTraceConfig {
    /// 1 GiB: several hours at a light load, a size any replay reads in minutes.
    pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

    /// Records to `path` with the default cap.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            max_bytes: Self::DEFAULT_MAX_BYTES,
        }
    }
}

/// An output a recorder can cut back after a failed write: a file, or a test double that fails
/// on purpose.
pub trait TraceSink: Write {
    /// Shortens the output to its first `len` bytes and continues writing there.
    fn truncate(&mut self, len: u64) -> std::io::Result<()>;
}

impl TraceSink for File {
    fn truncate(&mut self, len: u64) -> std::io::Result<()> {
        self.set_len(len)?;
        self.seek(SeekFrom::Start(len)).map(drop)
    }
}

/// In memory (tests, and callers that ship the trace elsewhere).
impl TraceSink for Vec<u8> {
    fn truncate(&mut self, len: u64) -> std::io::Result<()> {
        Vec::truncate(self, usize::try_from(len).unwrap_or(usize::MAX));
        Ok(())
    }
}

/// Why recording stopped (returned once, by the step that stopped it; the file holds the steps
/// before it).
#[derive(Debug, thiserror::Error)]
pub enum RecordingStopped {
    #[error(
        "routing trace {name}: step {step} ({step_bytes} bytes) would take the file past \
         --record-routing-max-bytes {max_bytes} ({written} bytes written); recording stopped"
    )]
    Cap {
        name: String,
        step: u64,
        step_bytes: usize,
        written: u64,
        max_bytes: u64,
    },
    #[error(
        "routing trace {name}: cannot write step {step}: {error}; recording stopped{}",
        after_failed_write(.cut_back, .written)
    )]
    Write {
        name: String,
        step: u64,
        written: u64,
        error: std::io::Error,
        /// Whether the file could be cut back to the last whole step.
        cut_back: Result<(), std::io::Error>,
    },
}

/// What a failed write left: whole steps, or a partial step that could not be cut off.
fn after_failed_write(cut_back: &Result<(), std::io::Error>, written: &u64) -> String {
    match cut_back {
        Ok(()) => format!(" with {written} bytes of whole steps"),
        Err(why) => format!(", and the partial step cannot be cut off ({why})"),
    }
}

/// Appends every step's load matrices to a routing trace, whole steps only, up to a byte cap.
pub struct RoutingRecorder<S: TraceSink = File> {
    sink: S,
    /// Names the trace in messages (its path).
    name: String,
    max_bytes: u64,
    /// Bytes of whole steps in the sink.
    written: u64,
    recording: bool,
    /// The step being written (kept to reuse its allocation).
    buf: Vec<u8>,
}

impl RoutingRecorder<File> {
    /// Creates (truncates) the trace file of `config`.
    pub fn create(config: &RoutingTraceConfig) -> std::io::Result<Self> {
        let file = File::create(&config.path)?;
        Ok(Self::new(
            file,
            config.path.display().to_string(),
            config.max_bytes,
        ))
    }
}

impl<S: TraceSink> RoutingRecorder<S> {
    /// Records into `sink` (empty) up to `max_bytes`; `name` names it in messages. Sets the
    /// recording gauge to 1.
    pub fn new(sink: S, name: String, max_bytes: u64) -> Self {
        metrics::routing_trace_recording(true);
        Self {
            sink,
            name,
            max_bytes,
            written: 0,
            recording: true,
            buf: Vec::new(),
        }
    }

    /// Appends the lines of step `step`, one per `(layer, load)`. Once recording has stopped this
    /// does nothing; the call that stops it returns why.
    pub fn record<'a>(
        &mut self,
        step: u64,
        layers: impl IntoIterator<Item = (usize, &'a LoadMatrix)>,
    ) -> Result<(), RecordingStopped> {
        if !self.recording {
            return Ok(());
        }
        self.buf.clear();
        encode_step(&mut self.buf, step, layers);
        let step_bytes = self.buf.len();
        if self.written.saturating_add(step_bytes as u64) > self.max_bytes {
            self.stop();
            return Err(RecordingStopped::Cap {
                name: self.name.clone(),
                step,
                step_bytes,
                written: self.written,
                max_bytes: self.max_bytes,
            });
        }
        if let Err(error) = self.sink.write_all(&self.buf) {
            let cut_back = self.sink.truncate(self.written);
            self.stop();
            return Err(RecordingStopped::Write {
                name: self.name.clone(),
                step,
                written: self.written,
                error,
                cut_back,
            });
        }
        self.written += step_bytes as u64;
        metrics::routing_trace_written(step_bytes as u64);
        // Again every step: an exporter installed after the engine started (the server's is)
        // missed the first setting.
        metrics::routing_trace_recording(true);
        Ok(())
    }

    /// Whether steps are still being recorded.
    pub fn is_recording(&self) -> bool {
        self.recording
    }

    /// Bytes of whole steps recorded.
    pub fn bytes_written(&self) -> u64 {
        self.written
    }

    #[cfg(test)]
    fn into_sink(self) -> S {
        self.sink
    }

    fn stop(&mut self) {
        self.recording = false;
        metrics::routing_trace_recording(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing_trace::{RoutingTrace, TraceReader};

    /// Accepts `room` bytes, then fails every write, having taken whatever part of the failing
    /// write still fit (as a disk that fills mid-write does).
    struct FillingDisk {
        bytes: Vec<u8>,
        room: usize,
        truncatable: bool,
    }

    impl Write for FillingDisk {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            let fits = data.len().min(self.room - self.bytes.len());
            if fits == 0 {
                return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
            }
            self.bytes.extend_from_slice(&data[..fits]);
            Ok(fits)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl TraceSink for FillingDisk {
        fn truncate(&mut self, len: u64) -> std::io::Result<()> {
            if !self.truncatable {
                return Err(std::io::Error::other("cannot truncate"));
            }
            self.bytes.truncate(len as usize);
            Ok(())
        }
    }

    fn load(seed: u64) -> LoadMatrix {
        LoadMatrix::from_rows(&[[seed, 1, 2], [3, seed + 4, 5]]).unwrap()
    }

    /// Records steps 0.. of two layers each until the recorder stops; returns what stopped it.
    fn record_until_stopped<S: TraceSink>(recorder: &mut RoutingRecorder<S>) -> RecordingStopped {
        for step in 0..1000u64 {
            let (a, b) = (load(step), load(step + 1));
            if let Err(stopped) = recorder.record(step, [(0, &a), (2, &b)]) {
                assert!(!recorder.is_recording());
                // Later steps are ignored.
                recorder.record(step + 1, [(0, &a), (2, &b)]).unwrap();
                return stopped;
            }
        }
        panic!("the recorder never stopped");
    }

    fn read(bytes: &[u8]) -> RoutingTrace {
        RoutingTrace::from_reader(TraceReader::new(bytes).unwrap()).unwrap()
    }

    #[test]
    fn a_cap_stops_recording_before_the_step_that_would_pass_it() {
        let mut recorder = RoutingRecorder::new(Vec::new(), "cap".into(), 1000);
        let stopped = record_until_stopped(&mut recorder);
        let message = stopped.to_string();
        assert!(matches!(stopped, RecordingStopped::Cap { .. }), "{message}");
        assert!(
            message.contains("--record-routing-max-bytes 1000"),
            "{message}"
        );
        let written = recorder.bytes_written();
        let bytes = recorder.into_sink();
        assert_eq!(bytes.len() as u64, written);
        assert!(written <= 1000 && written > 500, "{written}");
        assert!(bytes.ends_with(b"\n"));
        let trace = read(&bytes);
        assert_eq!(trace.layers, vec![0, 2]);
        let steps: Vec<u64> = trace.steps.iter().map(|s| s.step).collect();
        assert_eq!(steps, (0..steps.len() as u64).collect::<Vec<_>>());
        assert_eq!(trace.steps[3].loads, vec![load(3), load(4)]);
    }

    #[test]
    fn a_failed_write_cuts_the_file_back_to_whole_steps() {
        let disk = FillingDisk {
            bytes: Vec::new(),
            room: 700,
            truncatable: true,
        };
        let mut recorder = RoutingRecorder::new(disk, "disk".into(), u64::MAX);
        let stopped = record_until_stopped(&mut recorder);
        let message = stopped.to_string();
        assert!(
            matches!(stopped, RecordingStopped::Write { .. }),
            "{message}"
        );
        assert!(message.contains("No space left on device"), "{message}");
        let written = recorder.bytes_written();
        let disk = recorder.into_sink();
        // The failing step reached the disk in part and was cut off again.
        assert!(written > 0 && written < 700, "{written}");
        assert_eq!(disk.bytes.len() as u64, written);
        let lines = disk.bytes.iter().filter(|&&b| b == b'\n').count();
        assert!(disk.bytes.ends_with(b"\n"));
        assert_eq!(read(&disk.bytes).steps.len() * 2, lines);
    }

    #[test]
    fn a_partial_step_that_cannot_be_cut_off_is_reported() {
        let disk = FillingDisk {
            bytes: Vec::new(),
            room: 700,
            truncatable: false,
        };
        let mut recorder = RoutingRecorder::new(disk, "disk".into(), u64::MAX);
        let message = record_until_stopped(&mut recorder).to_string();
        assert!(
            message.contains("cannot be cut off (cannot truncate)"),
            "{message}"
        );
        assert!(!message.contains('\n'), "{message}");
    }
}
