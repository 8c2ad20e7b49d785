//! [`TraceWriter`]: steps in the recorded format, so synthetic traces replay exactly like
//! recorded ones.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use super::line::{encode_step, TraceStep};

/// Writes steps with a fixed layer list, each step as one write of its whole lines.
pub struct TraceWriter<W: Write> {
    out: W,
    layers: Vec<usize>,
    /// The lines of the step being written (kept to reuse its allocation).
    buf: Vec<u8>,
}

impl TraceWriter<File> {
    /// Creates (truncates) a trace file for steps holding `layers`. Unbuffered: every step is
    /// already one write.
    pub fn create(path: &Path, layers: Vec<usize>) -> std::io::Result<Self> {
        Ok(Self::new(File::create(path)?, layers))
    }
}

impl<W: Write> TraceWriter<W> {
    /// A writer for steps holding one matrix per entry of `layers`.
    pub fn new(out: W, layers: Vec<usize>) -> Self {
        Self {
            out,
            layers,
            buf: Vec::new(),
        }
    }

    /// Appends one line per layer of `step`; a step with the wrong number of matrices is refused
    /// before anything is written.
    pub fn write_step(&mut self, step: &TraceStep) -> std::io::Result<()> {
        if step.loads.len() != self.layers.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "step {} has {} load matrices for {} layers",
                    step.step,
                    step.loads.len(),
                    self.layers.len()
                ),
            ));
        }
        self.buf.clear();
        encode_step(
            &mut self.buf,
            step.step,
            self.layers.iter().copied().zip(&step.loads),
        );
        self.out.write_all(&self.buf)
    }

    /// Flushes and returns the output.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfill_balancer::LoadMatrix;

    #[test]
    fn writer_refuses_a_step_with_the_wrong_layer_count() {
        let mut writer = TraceWriter::new(Vec::new(), vec![0, 1]);
        let step = TraceStep {
            step: 0,
            loads: vec![LoadMatrix::from_rows(&[[1u64, 2]]).unwrap()],
        };
        assert!(writer.write_step(&step).is_err());
        assert!(writer.finish().unwrap().is_empty());
    }
}
