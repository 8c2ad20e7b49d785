//! ShareGPT datasets: the first human turn of each conversation and the length of the reply.

use std::fmt;
use std::path::Path;

use rackfill_models::Tokenizer;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::de::{IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::{DatasetError, Prompt, RequestSpec};

/// How ShareGPT lengths are known and which conversations are kept.
#[derive(Debug, Clone, Copy)]
pub struct ShareGptParams<'a> {
    /// Counts prompt and reply tokens exactly; without it lengths are `ceil(chars / 4)`, the
    /// usual rule of thumb for English text.
    pub tokenizer: Option<&'a Tokenizer>,
    /// Fixed `max_tokens` instead of the reply's length (vLLM's `--sharegpt-output-len`).
    pub output_len: Option<usize>,
}

/// vLLM's ShareGPT filter: minimum prompt and reply length, maximum prompt and total length.
const SHAREGPT_MIN_LEN: usize = 4;
const SHAREGPT_MAX_PROMPT: usize = 1024;
const SHAREGPT_MAX_TOTAL: usize = 2048;

/// Up to `n` requests from a ShareGPT file (fewer when fewer conversations pass the filter).
pub fn load_sharegpt(
    path: &Path,
    params: ShareGptParams<'_>,
    n: usize,
    seed: u64,
) -> Result<Vec<RequestSpec>, DatasetError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| DatasetError::Io {
        path: name.clone(),
        source,
    })?;
    parse_sharegpt(&text, &name, params, n, seed)
}

/// [`load_sharegpt`] on the file's contents; `origin` names it in errors.
pub fn parse_sharegpt(
    text: &str,
    origin: &str,
    params: ShareGptParams<'_>,
    n: usize,
    seed: u64,
) -> Result<Vec<RequestSpec>, DatasetError> {
    let file_error = |message: String| DatasetError::File {
        path: origin.to_string(),
        message,
    };
    if params.output_len == Some(0) {
        return Err(DatasetError::Invalid(
            "--sharegpt-output-len must be at least 1".into(),
        ));
    }
    // A byte-order mark, as some editors and Windows tools write, is not part of the JSON.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let entries: Vec<ShareGptEntry> = serde_json::from_str(text)
        .map_err(|e| file_error(format!("not a ShareGPT JSON list of conversations: {e}")))?;
    let mut pairs: Vec<(String, String)> = entries
        .into_iter()
        .filter_map(|e| e.conversations.and_then(|c| c.0))
        .collect();
    if pairs.is_empty() {
        return Err(file_error(
            "no conversation has a human turn followed by a gpt reply".into(),
        ));
    }
    pairs.shuffle(&mut StdRng::seed_from_u64(seed));
    let count = |text: &str| -> Result<usize, DatasetError> {
        match params.tokenizer {
            Some(tokenizer) => tokenizer
                .encode(text, false)
                .map(|ids| ids.len())
                .map_err(|e| file_error(format!("cannot tokenize a prompt: {e}"))),
            None => Ok(text.chars().count().div_ceil(4)),
        }
    };
    let mut out = Vec::with_capacity(n.min(pairs.len()));
    for (prompt, reply) in pairs {
        if out.len() == n {
            break;
        }
        let input_len = count(&prompt)?;
        let output_len = match params.output_len {
            Some(fixed) => fixed,
            None => count(&reply)?,
        };
        let short = input_len < SHAREGPT_MIN_LEN
            || (params.output_len.is_none() && output_len < SHAREGPT_MIN_LEN);
        let long = input_len > SHAREGPT_MAX_PROMPT || input_len + output_len > SHAREGPT_MAX_TOTAL;
        if short || long || output_len == 0 {
            continue;
        }
        out.push(RequestSpec {
            prompt: Prompt::Text(prompt),
            input_len,
            output_len,
            timestamp_ms: None,
        });
    }
    if out.is_empty() {
        return Err(file_error(format!(
            "every conversation was filtered out (prompt and reply need at least \
             {SHAREGPT_MIN_LEN} tokens, the prompt at most {SHAREGPT_MAX_PROMPT}, both at most \
             {SHAREGPT_MAX_TOTAL})"
        )));
    }
    Ok(out)
}

#[derive(Deserialize)]
struct ShareGptEntry {
    #[serde(default)]
    conversations: Option<FirstExchange>,
}

/// The first human turn and the gpt reply right after it; the rest of the conversation is
/// skipped without being kept (ShareGPT files run to hundreds of megabytes).
struct FirstExchange(Option<(String, String)>);

#[derive(Deserialize)]
struct Turn {
    from: String,
    #[serde(default)]
    value: Option<String>,
}

impl<'de> Deserialize<'de> for FirstExchange {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TurnsVisitor;
        impl<'de> Visitor<'de> for TurnsVisitor {
            type Value = FirstExchange;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of {\"from\", \"value\"} turns")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut prompt: Option<String> = None;
                let mut found = None;
                while found.is_none() {
                    let Some(turn) = seq.next_element::<Turn>()? else {
                        return Ok(FirstExchange(None));
                    };
                    match (prompt.take(), turn.from.as_str()) {
                        (None, "human" | "user") => prompt = Some(turn.value.unwrap_or_default()),
                        (Some(p), "gpt" | "assistant" | "chatgpt" | "bard" | "bing") => {
                            found = Some((p, turn.value.unwrap_or_default()));
                        }
                        // A human turn not answered by gpt: look for the next human turn.
                        (Some(_), "human" | "user") => {
                            prompt = Some(turn.value.unwrap_or_default())
                        }
                        _ => {}
                    }
                }
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(FirstExchange(found))
            }
        }
        deserializer.deserialize_seq(TurnsVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::dataset::load_tokenizer;

    fn sharegpt(text: &str, output_len: Option<usize>) -> Result<Vec<RequestSpec>, DatasetError> {
        let params = ShareGptParams {
            tokenizer: None,
            output_len,
        };
        parse_sharegpt(text, "s.json", params, 100, 0)
    }

    #[test]
    fn sharegpt_takes_the_first_human_turn_and_its_reply() {
        let long = "x".repeat(40);
        let text = format!(
            r#"[
              {{"id": "a", "conversations": [
                {{"from": "system", "value": "ignored"}},
                {{"from": "human", "value": "{long}"}},
                {{"from": "gpt", "value": "{long}{long}"}},
                {{"from": "human", "value": "later"}}]}},
              {{"id": "short", "conversations": [
                {{"from": "human", "value": "hi"}}, {{"from": "gpt", "value": "{long}"}}]}},
              {{"id": "unanswered", "conversations": [{{"from": "human", "value": "{long}"}}]}},
              {{"id": "none"}}
            ]"#
        );
        let specs = sharegpt(&text, None).unwrap();
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].prompt, Prompt::Text(long.clone()));
        assert_eq!((specs[0].input_len, specs[0].output_len), (10, 20));
        let fixed = sharegpt(&text, Some(7)).unwrap();
        assert_eq!(fixed[0].output_len, 7);
    }

    #[test]
    fn sharegpt_counts_with_a_tokenizer() {
        let tokenizer = load_tokenizer(rackfill_models::BUILTIN_MODEL_NAME).unwrap();
        let prompt = "The quick brown fox jumps over the lazy dog near the river bank.";
        let reply = "It was a sunny day and everyone in the village went outside to play.";
        let text = format!(
            r#"[{{"conversations": [{{"from": "human", "value": "{prompt}"}},
                {{"from": "gpt", "value": "{reply}"}}]}}]"#
        );
        let params = ShareGptParams {
            tokenizer: Some(&tokenizer),
            output_len: None,
        };
        let specs = parse_sharegpt(&text, "s", params, 10, 0).unwrap();
        assert_eq!(
            specs[0].input_len,
            tokenizer.encode(prompt, false).unwrap().len()
        );
        assert_eq!(
            specs[0].output_len,
            tokenizer.encode(reply, false).unwrap().len()
        );
    }

    #[test]
    fn bad_sharegpt_files_say_why() {
        let cases = [
            ("{\"conversations\": []}", "not a ShareGPT JSON list"),
            ("[{\"conversations\": [{\"from\": 3}]}]", "line 1"),
            ("[1, 2", "not a ShareGPT JSON list"),
            ("[]", "no conversation"),
            (
                "[{\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}, \
                 {\"from\": \"gpt\", \"value\": \"yo\"}]}]",
                "filtered out",
            ),
        ];
        for (text, expected) in cases {
            let err = sharegpt(text, None).unwrap_err().to_string();
            assert!(err.starts_with("s.json: "), "{err}");
            assert!(err.contains(expected), "{text}: {err}");
        }
        let ok = "[{\"conversations\": [{\"from\": \"human\", \"value\": \"hello there you\"}, \
                  {\"from\": \"gpt\", \"value\": \"hello there you\"}]}]";
        assert_eq!(sharegpt(ok, Some(1)).unwrap().len(), 1);
        let bom = format!("\u{feff}{ok}");
        assert_eq!(sharegpt(&bom, Some(1)).unwrap().len(), 1);
        let err = sharegpt(ok, Some(0)).unwrap_err().to_string();
        assert_eq!(err, "--sharegpt-output-len must be at least 1");
        let missing = load_sharegpt(
            Path::new("/no/such/file.json"),
            ShareGptParams {
                tokenizer: None,
                output_len: None,
            },
            1,
            0,
        )
        .unwrap_err();
        assert!(
            missing
                .to_string()
                .contains("cannot read /no/such/file.json"),
            "{missing}"
        );
        assert!(load_tokenizer("/no/such/dir").is_err());
    }
}
