//! [`TraceReader`]: a routing trace read back step by step, checked line by line.
//!
//! It holds one line and one step in memory, never the file, so traces of any length replay in
//! constant memory. It checks everything a replay relies on and names the line of the first
//! problem: malformed JSON, a shape (`ranks`, `experts`) that changes between lines, rows of the
//! wrong count or length, steps that go backwards or interleave, layers out of order, duplicated
//! or missing relative to the first step, and an empty file.
//!
//! The one defect it forgives is a cut-short last line (no newline, and JSON that ends early):
//! what a writer killed mid-write or a full disk leaves. That line, and the step it left
//! incomplete, are dropped, and the reader says so on stderr once ([`TruncatedTail`]).

use std::fs::File;
use std::io::{BufRead, BufReader, Write as _};
use std::path::Path;

use rackfill_balancer::LoadMatrix;

use super::error::TraceError;
use super::line::{LineIn, TraceStep, LINE_EXPECTED};
use super::writer::TraceWriter;

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

/// A cut-short last line the reader dropped (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TruncatedTail {
    /// The 1-based number of the cut-short line.
    pub line: usize,
    /// The step that line left incomplete, dropped with it (`None` when the line would have
    /// opened a step of its own).
    pub dropped_step: Option<u64>,
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
    /// Names the input in the truncation warning (`routing trace FILE`).
    origin: String,
    truncated: Option<TruncatedTail>,
    /// Whether the truncation warning went out.
    warned: bool,
}

impl TraceReader<BufReader<File>> {
    /// Opens a trace file and reads its first step.
    pub fn open(path: &Path) -> Result<Self, TraceError> {
        let file = File::open(path).map_err(|e| TraceError::Open {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::with_origin(
            BufReader::with_capacity(1 << 20, file),
            format!("routing trace {}", path.display()),
        )
    }
}

impl<R: BufRead> TraceReader<R> {
    /// A reader over any buffered input; reads the first step.
    pub fn new(input: R) -> Result<Self, TraceError> {
        Self::with_origin(input, "routing trace".into())
    }

    fn with_origin(input: R, origin: String) -> Result<Self, TraceError> {
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
            origin,
            truncated: None,
            warned: false,
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

    /// The cut-short last line dropped so far, if any (known once iteration reached the end).
    pub fn truncated_tail(&self) -> Option<&TruncatedTail> {
        self.truncated.as_ref()
    }

    /// Reads the next non-blank line into `buf`; false at the end of the input.
    fn read_line(&mut self) -> Result<bool, TraceError> {
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
                return Ok(false);
            }
            self.line += 1;
            if !self.buf.trim().is_empty() {
                return Ok(true);
            }
        }
    }

    /// Reads the next non-blank line and checks it on its own and against the trace's shape.
    /// A cut-short last line ends the input (and is remembered as the trace's truncated tail).
    fn parse_next(&mut self) -> Result<Option<Parsed>, TraceError> {
        if !self.read_line()? {
            return Ok(None);
        }
        let line = self.line;
        if !self.buf.trim_start().starts_with('{') {
            return Err(TraceError::Json {
                line,
                message: LINE_EXPECTED.into(),
            });
        }
        match serde_json::from_str::<LineIn>(&self.buf) {
            Ok(parsed) => self.check_line(line, parsed).map(Some),
            // No newline and JSON that ends early: a line cut short at the end of the file.
            Err(e) if e.is_eof() && !self.buf.ends_with('\n') => {
                self.truncated = Some(TruncatedTail {
                    line,
                    dropped_step: None,
                });
                Ok(None)
            }
            Err(e) => Err(TraceError::Json {
                line,
                message: without_position(&e),
            }),
        }
    }

    /// Checks a parsed line against itself and the trace's shape.
    fn check_line(&self, line: usize, parsed: LineIn) -> Result<Parsed, TraceError> {
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
        Ok(Parsed {
            line,
            step: parsed.step,
            layer: parsed.layer,
            load,
        })
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
                self.check_expected_layer(&p, step, expected, layers.len())?;
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

    /// Checks that `p`, the `index`-th line of step `step`, holds the layer the first step has
    /// at `index`.
    fn check_expected_layer(
        &self,
        p: &Parsed,
        step: u64,
        expected: &[usize],
        index: usize,
    ) -> Result<(), TraceError> {
        match expected.get(index) {
            Some(&want) if want == p.layer => Ok(()),
            Some(&want) if expected.contains(&p.layer) => Err(TraceError::MissingLayer {
                line: p.line,
                step,
                layer: p.layer,
                expected: want,
                first_step: self.first_step,
            }),
            _ => Err(TraceError::ExtraLayer {
                line: p.line,
                step,
                layer: p.layer,
                first_step: self.first_step,
            }),
        }
    }

    fn read_step(&mut self) -> Result<Option<TraceStep>, TraceError> {
        if let Some(first) = self.first.take() {
            return Ok(Some(first));
        }
        let Some(opening) = self.pending.take() else {
            self.warn_truncated();
            return Ok(None);
        };
        debug_assert!(opening.step > self.previous_step);
        let layers = std::mem::take(&mut self.layers);
        let result = self.collect_step(opening, Some(&layers));
        self.layers = layers;
        match (result, &mut self.truncated) {
            // Cut short by the truncated tail (nothing follows it): dropped with it.
            (Err(TraceError::IncompleteStep { step, .. }), Some(tail)) => {
                tail.dropped_step = Some(step);
                self.warn_truncated();
                Ok(None)
            }
            (result, _) => result.map(|(step, _)| Some(step)),
        }
    }

    /// Says on stderr, once, that a cut-short last line was dropped.
    fn warn_truncated(&mut self) {
        let Some(tail) = &self.truncated else { return };
        if std::mem::replace(&mut self.warned, true) {
            return;
        }
        let step = match tail.dropped_step {
            Some(step) => format!(", and with it step {step}, which it left incomplete"),
            None => String::new(),
        };
        let _ = writeln!(
            std::io::stderr(),
            "warning: {}: line {} is cut short (the recording stopped mid-write); ignoring it{step}",
            self.origin,
            tail.line
        );
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
    fn a_cut_short_last_line_is_dropped_with_the_step_it_left_incomplete() {
        let whole = trace(&[line(0, 0, A), line(0, 1, B), line(1, 0, B), line(1, 1, A)]);
        let cut = line(2, 1, A);
        // Step 2's first line is whole, its second cut short: step 2 goes.
        let text = format!("{whole}{}{}", line(2, 0, A), &cut[..cut.len() / 2]);
        let mut reader = TraceReader::new(text.as_bytes()).unwrap();
        let steps: Vec<u64> = reader.by_ref().map(|s| s.unwrap().step).collect();
        assert_eq!(steps, vec![0, 1]);
        let tail = TruncatedTail {
            line: 6,
            dropped_step: Some(2),
        };
        assert_eq!(reader.truncated_tail(), Some(&tail));

        // Cut short at the opening line of a step: every earlier step stays.
        let text = format!("{whole}{}", &cut[..10]);
        let mut reader = TraceReader::new(text.as_bytes()).unwrap();
        assert_eq!(reader.by_ref().count(), 2);
        let tail = TruncatedTail {
            line: 5,
            dropped_step: None,
        };
        assert_eq!(reader.truncated_tail(), Some(&tail));

        // A whole last line without its newline is not cut short.
        let text = trace(&[line(0, 0, A), line(1, 0, B)]);
        let mut reader = TraceReader::new(text.trim_end().as_bytes()).unwrap();
        assert_eq!(reader.by_ref().count(), 2);
        assert_eq!(reader.truncated_tail(), None);
    }

    #[test]
    fn only_the_last_line_may_be_cut_short() {
        let cut = line(1, 0, A);
        // Followed by a newline, or by more lines, a cut-short line is an error.
        for text in [
            format!("{}{}\n", line(0, 0, A), &cut[..20]),
            format!("{}{}\n{}", line(0, 0, A), &cut[..20], line(2, 0, A)),
        ] {
            let e = err(&text);
            assert_eq!(e.line(), Some(2), "{e}");
            assert!(e.to_string().contains("not a routing-trace line"), "{e}");
        }
        // A cut-short first line leaves nothing to read.
        assert_eq!(err(&cut[..20]), TraceError::Empty);
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
