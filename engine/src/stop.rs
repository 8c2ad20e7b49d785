//! Stop strings over streamed text.
//!
//! Generated text reaches the client as deltas (from
//! `rackfill_models::Tokenizer::decode_stream`), and a stop string may straddle any number of
//! them. Text that might still turn out to be the start of a stop string is therefore held back
//! until the next delta settles it: a stream never shows the client text that the final response
//! would not contain. As in the OpenAI API, the matched stop string itself is not returned.

/// What one [`StopMatcher::push`] produced.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutcome {
    /// Text that is safe to send now (before the stop string, when one matched).
    pub text: String,
    /// The stop string that ended generation, if this delta completed one.
    pub stop: Option<String>,
}

/// Finds stop strings in a stream of text deltas; one per sequence.
///
/// When several stop strings occur, the one that is *completed* first wins (ties: the longer,
/// which starts earlier). This is what a character-by-character scan would find, so the outcome
/// does not depend on how the text was cut into deltas.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet emitted: the longest suffix that is a proper prefix of a stop
    /// string, so never longer than the longest stop string.
    pending: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`. Empty strings are ignored (request validation rejects them; here
    /// they would match before any text).
    pub fn new(stops: &[String]) -> Self {
        let mut stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        stops.sort_unstable();
        stops.dedup();
        Self {
            stops,
            pending: String::new(),
            stopped: false,
        }
    }

    /// Feeds the next delta of generated text. Once a stop string has matched, the sequence is
    /// over and further deltas produce nothing.
    pub fn push(&mut self, text_delta: &str) -> StopOutcome {
        if self.stopped {
            return StopOutcome::default();
        }
        if self.stops.is_empty() {
            return StopOutcome {
                text: text_delta.to_owned(),
                stop: None,
            };
        }
        self.pending.push_str(text_delta);
        // Held-back text contains no complete stop string, so any match involves the new delta.
        if let Some((start, stop)) = self.first_match() {
            self.pending.truncate(start);
            self.stopped = true;
            return StopOutcome {
                text: std::mem::take(&mut self.pending),
                stop: Some(stop),
            };
        }
        let hold = self
            .stops
            .iter()
            .map(|stop| partial_match_len(&self.pending, stop))
            .max()
            .unwrap_or(0);
        // `hold` bytes end `pending` and equal the start of a valid string, so the cut lies on a
        // character boundary (a UTF-8 string never starts with a continuation byte).
        let held = self.pending.split_off(self.pending.len() - hold);
        StopOutcome {
            text: std::mem::replace(&mut self.pending, held),
            stop: None,
        }
    }

    /// Ends the stream: returns the held-back text, which can no longer become a stop string.
    /// Empty after a stop string matched.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// The stop string completed earliest in `pending` and where it starts.
    fn first_match(&self) -> Option<(usize, String)> {
        self.stops
            .iter()
            .filter_map(|stop| {
                let start = self.pending.find(stop.as_str())?;
                Some((start + stop.len(), start, stop))
            })
            .min_by_key(|&(end, start, _)| (end, start))
            .map(|(_, start, stop)| (start, stop.clone()))
    }
}

/// Length in bytes of the longest suffix of `text` that is a proper, non-empty prefix of `stop`.
fn partial_match_len(text: &str, stop: &str) -> usize {
    let longest = text.len().min(stop.len().saturating_sub(1));
    (1..=longest)
        .rev()
        .find(|&len| stop.get(..len).is_some_and(|prefix| text.ends_with(prefix)))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    /// Feeds `deltas`; returns all emitted text (including the final flush) and the stop.
    fn run(stops: &[&str], deltas: &[&str]) -> (String, Option<String>) {
        let mut m = matcher(stops);
        let mut text = String::new();
        let mut stop = None;
        for d in deltas {
            let out = m.push(d);
            text.push_str(&out.text);
            if out.stop.is_some() {
                assert!(stop.is_none(), "stop reported twice");
                stop = out.stop;
            }
        }
        text.push_str(&m.finish());
        (text, stop)
    }

    #[test]
    fn stop_across_deltas() {
        let mut m = matcher(&["o w"]);
        assert_eq!(m.push("Hel").text, "Hel");
        let out = m.push("lo wor");
        assert_eq!(out.text, "l");
        assert_eq!(out.stop.as_deref(), Some("o w"));
        assert_eq!(m.push("ld"), StopOutcome::default());
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn possible_stop_prefix_is_held_back_then_released() {
        let mut m = matcher(&["o w"]);
        assert_eq!(m.push("Hello").text, "Hell");
        assert_eq!(m.push(" ").text, "");
        assert_eq!(m.push("there").text, "o there");
        assert_eq!(m.push("o").text, "");
        assert_eq!(m.finish(), "o");
    }

    #[test]
    fn no_stop_passes_everything_through() {
        let deltas = ["The ", "quick ", "brown", " fox"];
        assert_eq!(
            run(&["zzz", "xy"], &deltas),
            ("The quick brown fox".into(), None)
        );
        assert_eq!(run(&[], &deltas), ("The quick brown fox".into(), None));
        assert_eq!(run(&[""], &deltas), ("The quick brown fox".into(), None));
    }

    #[test]
    fn earliest_completed_stop_wins() {
        let (text, stop) = run(&["world", "lo"], &["hello world"]);
        assert_eq!((text.as_str(), stop.as_deref()), ("hel", Some("lo")));
        // Overlapping stops: "abc" completes before "bcd".
        let (text, stop) = run(&["bcd", "abc"], &["xab", "cd"]);
        assert_eq!((text.as_str(), stop.as_deref()), ("x", Some("abc")));
        // A stop that is a prefix of another completes first.
        let (text, stop) = run(&["abc", "ab"], &["zabc"]);
        assert_eq!((text.as_str(), stop.as_deref()), ("z", Some("ab")));
        // Same end: the longer stop wins.
        let (text, stop) = run(&["bc", "abc"], &["zabc"]);
        assert_eq!((text.as_str(), stop.as_deref()), ("z", Some("abc")));
    }

    #[test]
    fn outcome_does_not_depend_on_delta_boundaries() {
        let stops = ["abcd", "bc", "cdx", "dd"];
        for text in ["xxabcdd", "abcdxdd", "ddabc", "aabbccdd", "zzz"] {
            let whole = run(&stops, &[text]);
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(run(&stops, &chars), whole, "char by char: {text}");
            for i in 0..=text.len() {
                for j in i..=text.len() {
                    let deltas = [&text[..i], &text[i..j], &text[j..]];
                    assert_eq!(run(&stops, &deltas), whole, "{deltas:?}");
                }
            }
        }
    }

    #[test]
    fn unicode_is_never_split() {
        let (text, stop) = run(&["世界"], &["你好世", "界!"]);
        assert_eq!((text.as_str(), stop.as_deref()), ("你好", Some("世界")));
        let mut m = matcher(&["é!"]);
        assert_eq!(m.push("café").text, "caf");
        assert_eq!(m.push(" ok").text, "é ok");
        // 'è' shares its first byte with 'é' but is not a prefix of "é!".
        let mut m = matcher(&["é!"]);
        assert_eq!(m.push("è").text, "è");
        assert_eq!(
            run(&["🙂x"], &["a🙂", "🙂", "x"]),
            ("a🙂".into(), Some("🙂x".into()))
        );
    }

    #[test]
    fn empty_deltas_change_nothing() {
        let mut m = matcher(&["stop"]);
        assert_eq!(m.push(""), StopOutcome::default());
        assert_eq!(m.push("st").text, "");
        assert_eq!(m.push(""), StopOutcome::default());
        let out = m.push("op");
        assert_eq!((out.text.as_str(), out.stop.as_deref()), ("", Some("stop")));
        assert_eq!(m.push(""), StopOutcome::default());
    }
}
