//! Reading `rackfill plan`'s input document, `{"load": [[count; E]; R], "home": [rank; E]?}`.
//!
//! The document streams from a buffered reader straight into one flat `u64` buffer, so memory
//! is the matrix itself (8 bytes per count), never a tree of JSON values (a 40 MB single-row file
//! took about 2 GB as `serde_json::Value`s). Inputs over [`Limits::DEFAULT`] are refused, up front
//! where the file's size shows it, otherwise as soon as a limit is passed. Every problem is one
//! line naming the row, column or field.

use anyhow::{bail, Result};
use rackfill_balancer::LoadMatrix;
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

/// How much input is read at most.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Bytes of input.
    pub bytes: u64,
    /// Counts in the load matrix, and entries in the home map.
    pub counts: usize,
}

impl Limits {
    /// 1 GiB of input and 2^23 counts (64 MiB of them): twice a layer of 1024 ranks x 4096
    /// experts, whose file of 20-digit counts is about 90 MB. Planning costs some tens of bytes
    /// per expert on top, so even a single row of that many experts stays well under a GB.
    pub const DEFAULT: Limits = Limits {
        bytes: 1 << 30,
        counts: 1 << 23,
    };
}

/// A load matrix and its optional explicit home map, as read from the input.
pub struct LoadInput {
    pub load: LoadMatrix,
    /// Home rank of every expert, each checked to be below the load's rank count.
    pub home: Option<Vec<u32>>,
}

/// Reads the document from `path`, or from standard input when `path` is `-`.
pub fn read(path: &Path) -> Result<LoadInput> {
    if path.as_os_str() == "-" {
        return parse(io::stdin().lock(), "standard input", Limits::DEFAULT);
    }
    let name = path.display().to_string();
    let file = File::open(path).map_err(|e| anyhow::anyhow!("cannot read {name}: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| anyhow::anyhow!("cannot read {name}: {e}"))?;
    if meta.is_dir() {
        bail!("cannot read {name}: it is a directory, not a load file");
    }
    let limits = Limits::DEFAULT;
    if meta.len() > limits.bytes {
        bail!(
            "{name} is {} bytes: load files are limited to {} bytes",
            meta.len(),
            limits.bytes
        );
    }
    parse(BufReader::with_capacity(1 << 16, file), &name, limits)
}

/// Parses and checks a document from `input`; `source` names it in read errors.
pub fn parse(input: impl BufRead, source: &str, limits: Limits) -> Result<LoadInput> {
    let input = Limited {
        inner: input,
        read: 0,
        limit: limits.bytes,
    };
    let mut de = serde_json::Deserializer::from_reader(input);
    let doc = Document(limits.counts)
        .deserialize(&mut de)
        .and_then(|doc| de.end().map(|()| doc))
        .map_err(|e| {
            if e.io_error_kind().is_some() {
                anyhow::anyhow!("cannot read {source}: {e}")
            } else {
                anyhow::anyhow!("load file is not a valid load document: {e}")
            }
        })?;
    let Some(rows) = doc.load else {
        bail!("missing field \"load\"");
    };
    if rows.rows == 0 {
        bail!("\"load\" has no rows: at least one rank is needed");
    }
    let experts = rows.counts.len() / rows.rows;
    if experts == 0 {
        bail!("load rows are empty: at least one expert is needed");
    }
    let load = LoadMatrix::from_flat(rows.rows, experts, rows.counts)?;
    let home = match doc.home {
        None => None,
        Some(home) => {
            if home.len() != experts {
                bail!(
                    "\"home\" has {} entries, the load has {experts} experts",
                    home.len()
                );
            }
            let ranks = load.ranks() as u64;
            let home = home
                .into_iter()
                .enumerate()
                .map(|(e, rank)| match u32::try_from(rank) {
                    Ok(r) if rank < ranks => Ok(r),
                    _ => Err(anyhow::anyhow!(
                        "home[{e}] = {rank} is not a rank in 0..{ranks}"
                    )),
                })
                .collect::<Result<Vec<u32>>>()?;
            Some(home)
        }
    };
    Ok(LoadInput { load, home })
}

/// A reader that fails once more than `limit` bytes came through it (standard input has no size
/// to check up front).
struct Limited<R> {
    inner: R,
    read: u64,
    limit: u64,
}

impl<R: Read> Read for Limited<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        if self.read > self.limit {
            return Err(io::Error::other(format!(
                "more than {} bytes: load files are limited to that",
                self.limit
            )));
        }
        Ok(n)
    }
}

/// The document as read: `"load": null` and `"home": null` count as absent.
struct LoadDocument {
    load: Option<Rows>,
    home: Option<Vec<u64>>,
}

/// The fields of [`LoadDocument`]; any other is refused.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum Field {
    Load,
    Home,
}

/// Reads a [`LoadDocument`] of at most this many counts. Only a JSON object is a document (a
/// derived struct would also read an array of its fields), and a repeated field is refused
/// instead of silently replacing the first.
struct Document(usize);

impl<'de> DeserializeSeed<'de> for Document {
    type Value = LoadDocument;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<LoadDocument, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Document {
    type Value = LoadDocument;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object with a \"load\" field and an optional \"home\"")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LoadDocument, A::Error> {
        let (mut load, mut home) = (None, None);
        while let Some(field) = map.next_key()? {
            match field {
                Field::Load if load.is_some() => return Err(de::Error::duplicate_field("load")),
                Field::Home if home.is_some() => return Err(de::Error::duplicate_field("home")),
                Field::Load => load = Some(map.next_value_seed(Nullable(RowsSeed(self.0)))?),
                Field::Home => home = Some(map.next_value_seed(Nullable(HomeSeed(self.0)))?),
            }
        }
        Ok(LoadDocument {
            load: load.flatten(),
            home: home.flatten(),
        })
    }
}

/// `null` or the value `T` reads.
struct Nullable<T>(T);

impl<'de, T: DeserializeSeed<'de>> DeserializeSeed<'de> for Nullable<T> {
    type Value = Option<T::Value>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_option(self)
    }
}

impl<'de, T: DeserializeSeed<'de>> Visitor<'de> for Nullable<T> {
    type Value = Option<T::Value>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("null or a value")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        self.0.deserialize(deserializer).map(Some)
    }
}

/// The load rows, read into one row-major buffer; every row has the first row's length.
struct Rows {
    rows: usize,
    counts: Vec<u64>,
}

/// Reads [`Rows`] of at most this many counts in all.
struct RowsSeed(usize);

impl<'de> DeserializeSeed<'de> for RowsSeed {
    type Value = Rows;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Rows, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for RowsSeed {
    type Value = Rows;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("\"load\" to be an array of rows")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Rows, A::Error> {
        let mut counts = Vec::new();
        let mut experts = None;
        let mut rows = 0;
        while let Some(len) = seq.next_element_seed(Row {
            row: rows,
            experts,
            counts: &mut counts,
            max_counts: self.0,
        })? {
            experts.get_or_insert(len);
            rows += 1;
        }
        Ok(Rows { rows, counts })
    }
}

/// One load row, appended to the shared buffer; yields its length.
struct Row<'a> {
    row: usize,
    /// The first row's length, which every later row must have.
    experts: Option<usize>,
    counts: &'a mut Vec<u64>,
    max_counts: usize,
}

impl<'de> DeserializeSeed<'de> for Row<'_> {
    type Value = usize;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<usize, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Row<'_> {
    type Value = usize;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "load row {} to be an array of counts", self.row)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
        let mut len = 0;
        while let Some(count) = seq.next_element_seed(Count(Position::Load(self.row, len)))? {
            if let Some(experts) = self.experts.filter(|&experts| len == experts) {
                return Err(de::Error::custom(format_args!(
                    "load row {} has more than {experts} experts, row 0 has {experts}",
                    self.row
                )));
            }
            if self.counts.len() == self.max_counts {
                return Err(de::Error::custom(format_args!(
                    "the load has more than {} counts",
                    self.max_counts
                )));
            }
            self.counts.push(count);
            len += 1;
        }
        match self.experts {
            Some(experts) if len != experts => Err(de::Error::custom(format_args!(
                "load row {} has {len} experts, row 0 has {experts}",
                self.row
            ))),
            _ => Ok(len),
        }
    }
}

/// Reads the explicit home map of at most this many entries, ranks unchecked (the rank count is
/// known once the load is read).
struct HomeSeed(usize);

impl<'de> DeserializeSeed<'de> for HomeSeed {
    type Value = Vec<u64>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<u64>, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for HomeSeed {
    type Value = Vec<u64>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("\"home\" to be an array of ranks")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
        let mut home = Vec::new();
        while let Some(rank) = seq.next_element_seed(Count(Position::Home(home.len())))? {
            if home.len() == self.0 {
                return Err(de::Error::custom(format_args!(
                    "\"home\" has more than {} entries",
                    self.0
                )));
            }
            home.push(rank);
        }
        Ok(home)
    }
}

/// Where a number sits in the document, for errors.
#[derive(Clone, Copy)]
enum Position {
    /// `load[row][column]`.
    Load(usize, usize),
    /// `home[expert]`.
    Home(usize),
}

/// One whole number from 0 to 2^64-1; anything else (negative, fractional, too large, not a
/// number) is refused naming its position.
struct Count(Position);

impl<'de> DeserializeSeed<'de> for Count {
    type Value = u64;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<u64, D::Error> {
        deserializer.deserialize_u64(self)
    }
}

impl Visitor<'_> for Count {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self.0 {
            Position::Load(r, e) => write!(f, "a whole number from 0 to 2^64-1 in load[{r}][{e}]"),
            Position::Home(e) => write!(f, "a rank number in home[{e}]"),
        }
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(text: &str) -> Result<LoadInput> {
        parse(text.as_bytes(), "test input", Limits::DEFAULT)
    }

    fn err(text: &str) -> String {
        match parse_str(text) {
            Ok(_) => panic!("{text} was accepted"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn reads_rows_and_home() {
        let text = r#" {"home": [1, 0, 0], "load": [[9, 1, 1], [18446744073709551604, 0, 0]]}"#;
        let input = parse_str(text).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!((input.load.ranks(), input.load.experts()), (2, 3));
        assert_eq!(input.load.row(1), &[u64::MAX - 11, 0, 0]);
        assert_eq!(input.home, Some(vec![1, 0, 0]));
        let input = parse_str(r#"{"load": [[1]], "home": null}"#).unwrap();
        assert_eq!(input.home, None);
    }

    #[test]
    fn every_problem_is_named() {
        let cases = [
            ("", "EOF while parsing"),
            ("[[[1, 2]]]", "expected a JSON object with a \"load\" field"),
            ("{", "EOF while parsing"),
            (r#"{"load": [[1]]} x"#, "trailing characters"),
            (r#"{"load": null}"#, "missing field \"load\""),
            (r#"{"home": [0]}"#, "missing field \"load\""),
            (r#"{"load": 5}"#, "expected \"load\" to be an array of rows"),
            (
                r#"{"load": [[1], 2]}"#,
                "expected load row 1 to be an array",
            ),
            (
                r#"{"load": [[1, -2]]}"#,
                "integer `-2`, expected a whole number",
            ),
            (
                r#"{"load": [[1, 2.5]]}"#,
                "expected a whole number from 0 to 2^64-1 in load[0][1]",
            ),
            (
                r#"{"load": [[1], [18446744073709551616]]}"#,
                "in load[1][0]",
            ),
            (r#"{"load": [[1, "2"]]}"#, "string \"2\""),
            (
                r#"{"load": [[1, 2], [3]]}"#,
                "load row 1 has 1 experts, row 0 has 2",
            ),
            (
                r#"{"load": [[1], [3, 4]]}"#,
                "load row 1 has more than 1 experts, row 0 has 1",
            ),
            (r#"{"load": []}"#, "no rows"),
            (r#"{"load": [[], []]}"#, "rows are empty"),
            (
                r#"{"load": [[1]], "load": [[1]]}"#,
                "duplicate field `load`",
            ),
            (
                r#"{"home": null, "load": [[1]], "home": [0]}"#,
                "duplicate field `home`",
            ),
            (r#"{"load": [[1]], "slots": 1}"#, "unknown field `slots`"),
            (
                r#"{"load": [[1, 2]], "home": [0]}"#,
                "\"home\" has 1 entries",
            ),
            (
                r#"{"load": [[1, 2]], "home": [0, 1]}"#,
                "home[1] = 1 is not a rank in 0..1",
            ),
            (
                r#"{"load": [[1]], "home": [-1]}"#,
                "a rank number in home[0]",
            ),
            (r#"{"load": [[1]], "home": {}}"#, "\"home\" to be an array"),
            (r#"{"load": [[18446744073709551615, 1]]}"#, "overflow"),
        ];
        for (text, needle) in cases {
            let msg = err(text);
            assert!(msg.contains(needle), "{text}: {msg} lacks {needle:?}");
            assert!(!msg.contains('\n'), "{msg}");
        }
    }

    #[test]
    fn limits_stop_reading_at_once() {
        let small = Limits {
            bytes: 1 << 20,
            counts: 6,
        };
        let read = |text: &str| match parse(text.as_bytes(), "standard input", small) {
            Ok(input) => Ok(input.load.as_flat().len()),
            Err(e) => Err(format!("{e:#}")),
        };
        assert_eq!(read(r#"{"load": [[1, 2, 3], [4, 5, 6]]}"#), Ok(6));
        let msg = read(r#"{"load": [[1, 2, 3], [4, 5, 6], [7"#).unwrap_err();
        assert!(msg.contains("the load has more than 6 counts"), "{msg}");
        let msg = read(r#"{"load": [[1]], "home": [0, 0, 0, 0, 0, 0, 0"#).unwrap_err();
        assert!(msg.contains("\"home\" has more than 6 entries"), "{msg}");
        // Standard input has no size to check up front: reading stops at the limit.
        let blanks = " ".repeat(1 << 20);
        let msg = read(&format!("{{\"load\": [[1]]{blanks}}}")).unwrap_err();
        assert!(
            msg.starts_with("cannot read standard input: more than 1048576 bytes"),
            "{msg}"
        );
    }
}
