//! Timestamped JSONL request traces (the Mooncake format).

use std::io::BufRead;
use std::path::Path;

use super::{DatasetError, Prompt, RequestSpec};

/// The first `limit` requests (all when `None`) of a JSONL trace file.
pub fn load_trace(
    path: &Path,
    block_size: usize,
    limit: Option<usize>,
) -> Result<Vec<RequestSpec>, DatasetError> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| DatasetError::Io {
        path: name.clone(),
        source,
    })?;
    parse_trace(std::io::BufReader::new(file), &name, block_size, limit)
}

/// [`load_trace`] on a reader; `origin` names it in errors. Blank lines are skipped; every other
/// line must be one JSON object with a finite, non-negative `timestamp`, positive
/// `input_length` and `output_length`, and at most `ceil(input_length / block_size)` hash ids.
pub fn parse_trace(
    reader: impl BufRead,
    origin: &str,
    block_size: usize,
    limit: Option<usize>,
) -> Result<Vec<RequestSpec>, DatasetError> {
    if block_size == 0 {
        return Err(DatasetError::Invalid(
            "--block-size must be at least 1".into(),
        ));
    }
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let at = |message: String| DatasetError::Line {
            path: origin.to_string(),
            line: i + 1,
            message,
        };
        let line = line.map_err(|e| at(format!("cannot read: {e}")))?;
        // A byte-order mark, as some editors and Windows tools write, is not part of the JSON.
        let line = if i == 0 {
            line.strip_prefix('\u{feff}').unwrap_or(&line)
        } else {
            &line
        };
        if line.trim().is_empty() {
            continue;
        }
        let entry: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(format!("not JSON: {e}")))?;
        let field = |name: &str| {
            entry
                .get(name)
                .ok_or_else(|| at(format!("missing field `{name}`")))
        };
        let timestamp = field("timestamp")?;
        let timestamp_ms = timestamp
            .as_f64()
            .filter(|t| t.is_finite() && *t >= 0.0)
            .ok_or_else(|| {
                at(format!(
                    "`timestamp` must be a non-negative number of milliseconds, got {timestamp}"
                ))
            })?;
        let length = |name: &str| -> Result<usize, DatasetError> {
            let value = field(name)?;
            value
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n >= 1)
                .ok_or_else(|| at(format!("`{name}` must be a positive integer, got {value}")))
        };
        let input_len = length("input_length")?;
        let output_len = length("output_length")?;
        let hash_ids = match entry.get("hash_ids") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(value) => value
                .as_array()
                .and_then(|ids| ids.iter().map(serde_json::Value::as_u64).collect())
                .ok_or_else(|| {
                    at(format!(
                        "`hash_ids` must be a list of non-negative integers, got {value}"
                    ))
                })?,
        };
        let blocks = input_len.div_ceil(block_size);
        if hash_ids.len() > blocks {
            return Err(at(format!(
                "{} hash_ids but input_length {input_len} fills only {blocks} blocks of \
                 {block_size} tokens (is --block-size right?)",
                hash_ids.len()
            )));
        }
        out.push(RequestSpec {
            prompt: Prompt::Synthetic {
                hash_ids,
                unique: i as u64,
            },
            input_len,
            output_len,
            timestamp_ms: Some(timestamp_ms),
        });
    }
    if out.is_empty() {
        return Err(DatasetError::File {
            path: origin.to_string(),
            message: "the trace has no requests".into(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(text: &str) -> Result<Vec<RequestSpec>, DatasetError> {
        parse_trace(text.as_bytes(), "t.jsonl", 4, None)
    }

    #[test]
    fn trace_lines_parse_and_blank_lines_are_skipped() {
        let specs = trace(
            "{\"timestamp\": 0, \"input_length\": 6, \"output_length\": 2, \"hash_ids\": [7, 8]}\n\
             \n\
             {\"timestamp\": 12.5, \"input_length\": 3, \"output_length\": 1, \"extra\": true}\n",
        )
        .unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].timestamp_ms, Some(0.0));
        assert_eq!(
            specs[0].prompt,
            Prompt::Synthetic {
                hash_ids: vec![7, 8],
                unique: 0
            }
        );
        assert_eq!((specs[1].input_len, specs[1].output_len), (3, 1));
        assert_eq!(specs[1].timestamp_ms, Some(12.5));
        let bom = trace("\u{feff}{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1}\n")
            .unwrap();
        assert_eq!(bom.len(), 1);
        let limited = parse_trace(
            "{\"timestamp\":0,\"input_length\":1,\"output_length\":1}\n"
                .repeat(5)
                .as_bytes(),
            "t",
            4,
            Some(3),
        )
        .unwrap();
        assert_eq!(limited.len(), 3);
    }

    #[test]
    fn bad_trace_lines_name_their_line() {
        let good = "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1}\n";
        let cases = [
            ("not json", "not JSON"),
            ("[1, 2]", "missing field `timestamp`"),
            ("{\"timestamp\": 0, \"output_length\": 1}", "missing field `input_length`"),
            ("{\"timestamp\": -5, \"input_length\": 4, \"output_length\": 1}", "non-negative"),
            ("{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1}", "`input_length` must be a positive integer, got 0"),
            (
                "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": -1}",
                "`output_length` must be a positive integer, got -1",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [\"a\"]}",
                "`hash_ids` must be a list",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1,2,3]}",
                "is --block-size right?",
            ),
            ("{\"timestamp\": \"soon\", \"input_length\": 4, \"output_length\": 1}", "timestamp"),
        ];
        for (bad, expected) in cases {
            let err = trace(&format!("{good}\n{bad}\n{good}")).unwrap_err();
            let text = err.to_string();
            assert!(text.starts_with("t.jsonl:3: "), "{text}");
            assert!(text.contains(expected), "{bad}: {text}");
        }
        let empty = trace("\n\n").unwrap_err();
        assert!(empty.to_string().contains("no requests"), "{empty}");
        assert!(parse_trace(good.as_bytes(), "t", 0, None).is_err());
    }
}
