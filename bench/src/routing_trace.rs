//! Routing traces on disk: the JSON Lines format `rackfill serve --record-routing FILE` writes
//! (engine/src/routing_trace.rs), read back step by step for `rackfill bench balance --trace` and
//! the rack simulator, and written by the synthetic trace generators so their traces replay the
//! same way.
//!
//! One line per step and MoE layer, in step then layer order:
//!
//! ```json
//! {"step": 0, "layer": 1, "ranks": 8, "experts": 64, "load": [[u64; 64]; 8]}
//! ```
//!
//! [`TraceReader`] streams: it holds one line and one step in memory, never the file, so traces of
//! any length replay in constant memory. It checks everything a replay relies on and names the
//! line of the first problem: malformed JSON, a shape (`ranks`, `experts`) that changes between
//! lines, rows of the wrong count or length, steps that go backwards or interleave, layers out of
//! order, duplicated or missing relative to the first step, and an empty file. Step numbers must
//! increase but may skip (a trace cut out of a longer one is still a trace); blank lines are
//! ignored.

use rackfill_balancer::LoadMatrix;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

mod error;

pub use error::TraceError;

/// The load matrices of one step, one per MoE layer, in the order of the trace's layer list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceStep {
    /// The step number recorded in the trace.
    pub step: u64,
    /// `loads[i]` belongs to layer `layers[i]` of the trace.
    pub loads: Vec<LoadMatrix>,
}

/// One line as it is written. Unknown fields are refused, as in every other input file: a
/// misspelt field must not pass for a trace (the engine's recorder writes exactly these five).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LineIn {
    step: u64,
    layer: usize,
    ranks: usize,
    experts: usize,
    load: Vec<Vec<u64>>,
}

/// What a line must be, for lines that are not JSON objects: serde would read a struct from an
/// array of its fields too, and name the Rust type in its error.
const LINE_EXPECTED: &str =
    "expected a JSON object {\"step\", \"layer\", \"ranks\", \"experts\", \"load\"}";

/// serde_json's message without its " at line 1 column N" (a trace line is parsed on its own, so
/// that line is never the file's): the column is kept.
fn without_position(e: &serde_json::Error) -> String {
    let message = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    match message.strip_suffix(&suffix) {
        Some(text) => format!("{text} (column {})", e.column()),
        None => message,
    }
}

/// A checked line: its number, step, layer and matrix.
struct Parsed {
    line: usize,
    step: u64,
    layer: usize,
    load: LoadMatrix,
}

/// Streams a routing trace step by step (see the module docs for what it checks).
///
/// The first step is read when the reader is made, so the shape and the layer list are known
/// before iterating; iteration yields every step (the first included) and stops after the first
/// error.
pub struct TraceReader<R> {
    input: R,
    buf: String,
    /// Lines read so far (the number of the last line read).
    line: usize,
    ranks: usize,
    experts: usize,
    layers: Vec<usize>,
    first_step: u64,
    /// The first step, until iteration hands it out.
    first: Option<TraceStep>,
    /// The first line of the next step, read while finishing the previous one.
    pending: Option<Parsed>,
    previous_step: u64,
    failed: bool,
}

impl TraceReader<BufReader<File>> {
    /// Opens a trace file and reads its first step.
    pub fn open(path: &Path) -> Result<Self, TraceError> {
        let file = File::open(path).map_err(|e| TraceError::Open {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::new(BufReader::with_capacity(1 << 20, file))
    }
}

impl<R: BufRead> TraceReader<R> {
    /// A reader over any buffered input; reads the first step.
    pub fn new(input: R) -> Result<Self, TraceError> {
        let mut reader = Self {
            input,
            buf: String::new(),
            line: 0,
            ranks: 0,
            experts: 0,
            layers: Vec::new(),
            first_step: 0,
            first: None,
            pending: None,
            previous_step: 0,
            failed: false,
        };
        let Some(first) = reader.parse_next()? else {
            return Err(TraceError::Empty);
        };
        reader.ranks = first.load.ranks();
        reader.experts = first.load.experts();
        reader.first_step = first.step;
        let (step, layers) = reader.collect_step(first, None)?;
        reader.layers = layers;
        reader.first = Some(step);
        Ok(reader)
    }

    /// Source ranks `R` of every matrix.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Logical experts `E` of every matrix.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// The MoE layers of every step, in increasing order (as in the first step).
    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// Reads the next non-blank line and checks it on its own and against the trace's shape.
    fn parse_next(&mut self) -> Result<Option<Parsed>, TraceError> {
        loop {
            self.buf.clear();
            let n = self
                .input
                .read_line(&mut self.buf)
                .map_err(|e| TraceError::Io {
                    line: self.line + 1,
                    message: e.to_string(),
                })?;
            if n == 0 {
                return Ok(None);
            }
            self.line += 1;
            if !self.buf.trim().is_empty() {
                break;
            }
        }
        let line = self.line;
        if !self.buf.trim_start().starts_with('{') {
            return Err(TraceError::Json {
                line,
                message: LINE_EXPECTED.into(),
            });
        }
        let parsed: LineIn = serde_json::from_str(&self.buf).map_err(|e| TraceError::Json {
            line,
            message: without_position(&e),
        })?;
        if parsed.ranks == 0 || parsed.experts == 0 {
            return Err(TraceError::ZeroShape {
                line,
                ranks: parsed.ranks,
                experts: parsed.experts,
            });
        }
        if self.ranks != 0 && (parsed.ranks, parsed.experts) != (self.ranks, self.experts) {
            return Err(TraceError::ShapeChanged {
                line,
                ranks: parsed.ranks,
                experts: parsed.experts,
                first_ranks: self.ranks,
                first_experts: self.experts,
            });
        }
        if parsed.load.len() != parsed.ranks {
            return Err(TraceError::RowCount {
                line,
                rows: parsed.load.len(),
                ranks: parsed.ranks,
            });
        }
        if let Some((row, counts)) = parsed
            .load
            .iter()
            .enumerate()
            .find(|(_, counts)| counts.len() != parsed.experts)
        {
            return Err(TraceError::RowLength {
                line,
                row,
                len: counts.len(),
                experts: parsed.experts,
            });
        }
        // Sized from the rows just checked, never from the line's own `ranks x experts`.
        let flat = parsed.load.concat();
        let load = LoadMatrix::from_flat(parsed.ranks, parsed.experts, flat)
            .map_err(|_| TraceError::TooLarge { line })?;
        Ok(Some(Parsed {
            line,
            step: parsed.step,
            layer: parsed.layer,
            load,
        }))
    }

    /// Reads the rest of the step that `first` opens. With `expected` layers (every step after
    /// the first) the step must hold exactly those; without, the step defines them.
    fn collect_step(
        &mut self,
        first: Parsed,
        expected: Option<&[usize]>,
    ) -> Result<(TraceStep, Vec<usize>), TraceError> {
        let step = first.step;
        let mut layers: Vec<usize> = Vec::new();
        let mut loads = Vec::new();
        let mut last_line = first.line;
        let mut next = Some(first);
        while let Some(p) = next.take() {
            if p.step != step {
                self.pending = Some(p);
                break;
            }
            if let Some(&previous) = layers.last() {
                if p.layer <= previous {
                    return Err(TraceError::LayerOrder {
                        line: p.line,
                        step,
                        layer: p.layer,
                        previous,
                    });
                }
            }
            if let Some(expected) = expected {
                match expected.get(layers.len()) {
                    Some(&want) if want != p.layer => {
                        let err = if expected.contains(&p.layer) {
                            TraceError::MissingLayer {
                                line: p.line,
                                step,
                                layer: p.layer,
                                expected: want,
                                first_step: self.first_step,
                            }
                        } else {
                            TraceError::ExtraLayer {
                                line: p.line,
                                step,
                                layer: p.layer,
                                first_step: self.first_step,
                            }
                        };
                        return Err(err);
                    }
                    Some(_) => {}
                    None => {
                        return Err(TraceError::ExtraLayer {
                            line: p.line,
                            step,
                            layer: p.layer,
                            first_step: self.first_step,
                        })
                    }
                }
            }
            last_line = p.line;
            layers.push(p.layer);
            loads.push(p.load);
            next = self.parse_next()?;
        }
        if let Some(p) = &self.pending {
            if p.step < step {
                return Err(TraceError::StepOrder {
                    line: p.line,
                    step: p.step,
                    previous: step,
                });
            }
        }
        if let Some(expected) = expected {
            if let Some(&missing) = expected.get(layers.len()) {
                return Err(TraceError::IncompleteStep {
                    line: last_line,
                    step,
                    missing,
                    first_step: self.first_step,
                });
            }
        }
        self.previous_step = step;
        Ok((TraceStep { step, loads }, layers))
    }

    fn read_step(&mut self) -> Result<Option<TraceStep>, TraceError> {
        if let Some(first) = self.first.take() {
            return Ok(Some(first));
        }
        let Some(opening) = self.pending.take() else {
            return Ok(None);
        };
        debug_assert!(opening.step > self.previous_step);
        let layers = std::mem::take(&mut self.layers);
        let result = self.collect_step(opening, Some(&layers));
        self.layers = layers;
        result.map(|(step, _)| Some(step))
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceStep, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let result = self.read_step();
        self.failed = result.is_err();
        result.transpose()
    }
}

/// A whole trace in memory: for small traces (tests, fixtures). Replays should stream with
/// [`TraceReader`] instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingTrace {
    pub ranks: usize,
    pub experts: usize,
    /// The MoE layers of every step, increasing.
    pub layers: Vec<usize>,
    pub steps: Vec<TraceStep>,
}

impl RoutingTrace {
    /// Reads and checks a whole trace file.
    pub fn read(path: &Path) -> Result<Self, TraceError> {
        Self::from_reader(TraceReader::open(path)?)
    }

    /// Collects every step of a reader.
    pub fn from_reader<R: BufRead>(reader: TraceReader<R>) -> Result<Self, TraceError> {
        let (ranks, experts, layers) = (reader.ranks, reader.experts, reader.layers.clone());
        let steps = reader.collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            ranks,
            experts,
            layers,
            steps,
        })
    }

    /// Writes the trace in the recorded format.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let mut writer = TraceWriter::create(path, self.layers.clone())?;
        for step in &self.steps {
            writer.write_step(step)?;
        }
        writer.finish().map(drop)
    }
}

/// One line as it is written (the field order of the engine's recorder).
#[derive(Serialize)]
struct LineOut<'a> {
    step: u64,
    layer: usize,
    ranks: usize,
    experts: usize,
    load: Vec<&'a [u64]>,
}

/// Writes steps in the recorded format, so synthetic traces replay exactly like recorded ones.
pub struct TraceWriter<W: Write> {
    out: W,
    layers: Vec<usize>,
}

impl TraceWriter<BufWriter<File>> {
    /// Creates (truncates) a trace file for steps holding `layers`.
    pub fn create(path: &Path, layers: Vec<usize>) -> std::io::Result<Self> {
        Ok(Self::new(BufWriter::new(File::create(path)?), layers))
    }
}

impl<W: Write> TraceWriter<W> {
    /// A writer for steps holding one matrix per entry of `layers`.
    pub fn new(out: W, layers: Vec<usize>) -> Self {
        Self { out, layers }
    }

    /// Appends one line per layer of `step`.
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
        for (&layer, load) in self.layers.iter().zip(&step.loads) {
            let line = LineOut {
                step: step.step,
                layer,
                ranks: load.ranks(),
                experts: load.experts(),
                load: (0..load.ranks()).map(|r| load.row(r)).collect(),
            };
            serde_json::to_writer(&mut self.out, &line)?;
            self.out.write_all(b"\n")?;
        }
        Ok(())
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

    fn line(step: u64, layer: usize, load: &[&[u64]]) -> String {
        let experts = load.first().map_or(0, |r| r.len());
        format!(
            "{{\"step\":{step},\"layer\":{layer},\"ranks\":{},\"experts\":{experts},\"load\":{}}}\n",
            load.len(),
            serde_json::to_string(load).unwrap()
        )
    }

    fn trace(lines: &[String]) -> String {
        lines.concat()
    }

    fn read(text: &str) -> Result<RoutingTrace, TraceError> {
        RoutingTrace::from_reader(TraceReader::new(text.as_bytes())?)
    }

    fn err(text: &str) -> TraceError {
        read(text).unwrap_err()
    }

    const A: &[&[u64]] = &[&[1, 2, 3], &[4, 5, 6]];
    const B: &[&[u64]] = &[&[0, 0, 9], &[7, 0, 0]];

    #[test]
    fn groups_lines_by_step_and_layer() {
        let text = trace(&[
            line(0, 1, A),
            line(0, 3, B),
            "\n".into(),
            line(2, 1, B),
            line(2, 3, A),
        ]);
        let t = read(&text).unwrap();
        assert_eq!((t.ranks, t.experts), (2, 3));
        assert_eq!(t.layers, vec![1, 3]);
        assert_eq!(t.steps.len(), 2);
        assert_eq!(t.steps[1].step, 2);
        assert_eq!(t.steps[0].loads[1], LoadMatrix::from_rows(B).unwrap());
        assert_eq!(t.steps[1].loads[1], LoadMatrix::from_rows(A).unwrap());
    }

    #[test]
    fn writer_output_reads_back_identically() {
        let original = read(&trace(&[line(5, 0, A), line(6, 0, B)])).unwrap();
        let mut writer = TraceWriter::new(Vec::new(), original.layers.clone());
        for step in &original.steps {
            writer.write_step(step).unwrap();
        }
        let bytes = writer.finish().unwrap();
        let text = String::from_utf8(bytes).unwrap();
        assert_eq!(text, trace(&[line(5, 0, A), line(6, 0, B)]));
        assert_eq!(read(&text).unwrap(), original);
    }

    #[test]
    fn writer_refuses_a_step_with_the_wrong_layer_count() {
        let mut writer = TraceWriter::new(Vec::new(), vec![0, 1]);
        let step = TraceStep {
            step: 0,
            loads: vec![LoadMatrix::from_rows(A).unwrap()],
        };
        assert!(writer.write_step(&step).is_err());
    }

    #[test]
    fn every_problem_names_its_line() {
        let cases: Vec<(String, usize, &str)> = vec![
            (String::new(), 1, "empty"),
            // Blank lines only: line 1, where the first load line belongs (as documented).
            ("\n \n\n".into(), 1, "empty"),
            (
                trace(&[line(0, 0, A), "{\"step\": 1,\n".into()]),
                2,
                "not a routing-trace line",
            ),
            (
                trace(&[line(0, 0, A), "[1, 2]\n".into()]),
                2,
                "not a routing-trace line: expected a JSON object {\"step\"",
            ),
            // An array of the five fields is not a line either (serde would read it as one).
            (
                trace(&[line(0, 0, A), "[1, 0, 2, 3, [[1,2,3],[4,5,6]]]\n".into()]),
                2,
                "expected a JSON object",
            ),
            (
                r#"{"step":0,"layer":0,"ranks":2,"experts":3,"load":[[1,2,3],[4,5,-6]]}"#.into(),
                1,
                "not a routing-trace line",
            ),
            (
                r#"{"step":0,"layer":0,"ranks":3,"experts":3,"load":[[1,2,3],[4,5,6]]}"#.into(),
                1,
                "2 rows, \"ranks\" is 3",
            ),
            (
                r#"{"step":0,"layer":0,"ranks":2,"experts":3,"load":[[1,2,3],[4,5]]}"#.into(),
                1,
                "row 1 has 2 counts",
            ),
            (
                r#"{"step":0,"layer":0,"ranks":0,"experts":3,"load":[]}"#.into(),
                1,
                "at least one rank",
            ),
            // A misspelt or foreign field is refused, named with its column.
            (
                trace(&[
                    line(0, 0, A),
                    r#"{"step":1,"layer":0,"ranks":2,"experts":3,"lood":[],"load":[[1,2,3],[4,5,6]]}"#
                        .into(),
                ]),
                2,
                "not a routing-trace line: unknown field `lood`, expected one of `step`, `layer`, \
                 `ranks`, `experts`, `load` (column 48)",
            ),
            // `experts` is checked against the rows before anything is sized from it.
            (
                r#"{"step":0,"layer":0,"ranks":1,"experts":1000000000000000,"load":[[1]]}"#.into(),
                1,
                "load row 0 has 1 counts, \"experts\" is 1000000000000000",
            ),
            (
                trace(&[line(0, 0, A), line(1, 0, &[&[1, 2], &[3, 4]])]),
                2,
                "shape must not change",
            ),
            (
                trace(&[line(0, 0, A), line(1, 0, &[&[u64::MAX, 1, 0], &[0, 0, 0]])]),
                2,
                "overflow",
            ),
            (
                trace(&[line(3, 0, A), line(2, 0, A)]),
                2,
                "steps out of order",
            ),
            (
                trace(&[line(0, 0, A), line(1, 0, A), line(0, 1, A)]),
                3,
                "steps out of order",
            ),
            (trace(&[line(0, 1, A), line(0, 0, A)]), 2, "after layer 1"),
            (trace(&[line(0, 1, A), line(0, 1, A)]), 2, "after layer 1"),
            (
                trace(&[line(0, 0, A), line(0, 1, A), line(1, 1, A)]),
                3,
                "missing layer 0",
            ),
            (
                trace(&[line(0, 0, A), line(0, 1, A), line(1, 0, A), line(1, 2, A)]),
                4,
                "layer 2, which step 0 does not have",
            ),
            (
                trace(&[line(0, 0, A), line(1, 0, A), line(1, 1, A)]),
                3,
                "layer 1, which step 0 does not have",
            ),
            (
                trace(&[line(0, 0, A), line(0, 1, A), line(1, 0, A), line(2, 0, A)]),
                3,
                "step 1 ends without layer 1",
            ),
            (
                trace(&[line(0, 0, A), line(0, 1, A), line(1, 0, A)]),
                3,
                "step 1 ends without layer 1",
            ),
        ];
        for (text, at, needle) in cases {
            let e = err(&text);
            let msg = e.to_string();
            assert_eq!(e.line(), Some(at), "{msg}\n{text}");
            assert!(msg.starts_with(&format!("line {at}: ")), "{msg}");
            assert!(msg.contains(needle), "{msg} lacks '{needle}'");
            assert!(!msg.contains('\n'), "{msg}");
            assert!(!msg.contains("LineIn"), "{msg} names a Rust type");
        }
    }

    #[test]
    fn iteration_stops_after_the_first_error() {
        let text = trace(&[line(0, 0, A), line(1, 0, A), "oops\n".into(), line(2, 0, A)]);
        let mut reader = TraceReader::new(text.as_bytes()).unwrap();
        assert!(reader.next().unwrap().is_ok());
        assert_eq!(reader.next().unwrap().unwrap_err().line(), Some(3));
        assert!(reader.next().is_none());
    }

    #[test]
    fn missing_file_is_an_open_error() {
        let e = TraceReader::open(Path::new("/nonexistent/trace.jsonl"))
            .err()
            .unwrap();
        assert!(e
            .to_string()
            .starts_with("cannot open routing trace /nonexistent"));
        assert_eq!(e.line(), None);
    }
}
