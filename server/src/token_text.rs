//! How tokens read in logprobs: the raw bytes behind a token's display text, and the character
//! offset of each token in the text the tokens spell (completions' `text_offset`).

/// The UTF-8 bytes of a token shown as `text` by `Backend::token_text`: `bytes:\xNN..` texts
/// (a token that is only part of a character) are turned back into their raw bytes.
pub(crate) fn token_bytes(text: &str) -> Vec<u8> {
    match text.strip_prefix("bytes:") {
        Some(hex) if hex.starts_with("\\x") => hex
            .split("\\x")
            .filter(|h| !h.is_empty())
            .filter_map(|h| u8::from_str_radix(h, 16).ok())
            .collect(),
        _ => text.as_bytes().to_vec(),
    }
}

/// Running character offsets of a token sequence in its text: a token's offset is the number
/// of characters its predecessors' bytes decode to. A token holding part of a multi-byte
/// character points at that character, so offsets index the text and never pass its end
/// (a `bytes:\xNN` display text is ten characters long, the byte it stands for is not).
#[derive(Debug, Default, Clone)]
pub(crate) struct TextOffsets {
    /// Characters decoded so far.
    chars: usize,
    /// Leading bytes of a character still incomplete.
    pending: Vec<u8>,
}

impl TextOffsets {
    /// The offset of the next token, whose bytes are `bytes`: the index of the character its
    /// first byte belongs to. Then counts its bytes.
    pub fn next(&mut self, bytes: &[u8]) -> usize {
        // Where this token's bytes begin in `pending` (after an incomplete character, if any).
        let first = self.pending.len();
        self.pending.extend_from_slice(bytes);
        let mut offset = None;
        // Decodes character after character; `start` is where the next one begins.
        let mut start = 0;
        loop {
            let rest = &self.pending[start..];
            let (valid, bad) = match std::str::from_utf8(rest) {
                Ok(_) => (rest.len(), None),
                Err(err) => (err.valid_up_to(), err.error_len()),
            };
            let text = std::str::from_utf8(&rest[..valid]).unwrap_or_default();
            for (at, c) in text.char_indices() {
                if offset.is_none() && start + at + c.len_utf8() > first {
                    offset = Some(self.chars);
                }
                self.chars += 1;
            }
            start += valid;
            // Bytes that can never form a character read as one U+FFFD each; an incomplete
            // character at the end waits for the next token's bytes.
            let Some(bad) = bad else { break };
            if offset.is_none() && start + bad > first {
                offset = Some(self.chars);
            }
            self.chars += 1;
            start += bad;
        }
        self.pending.drain(..start);
        // Still unset: the token's first byte is in the incomplete character (or it has none).
        offset.unwrap_or(self.chars)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_characters_decode_back_to_their_bytes() {
        assert_eq!(token_bytes("bytes:\\xc3\\xa9"), vec![0xc3, 0xa9]);
        assert_eq!(token_bytes("bytes:\\xc3"), vec![0xc3]);
        assert_eq!(token_bytes("é"), vec![0xc3, 0xa9]);
        assert_eq!(token_bytes("bytes: x"), b"bytes: x".to_vec());
    }

    #[test]
    fn offsets_count_characters_of_the_decoded_text() {
        // "héllo wörld" as a byte-level tokenizer splits it: é and ö each across two tokens.
        let tokens: [&[u8]; 10] = [
            b"h", b"\xc3", b"\xa9", b"l", b"lo", b" w", b"\xc3", b"\xb6", b"r", b"ld",
        ];
        let mut offsets = TextOffsets::default();
        let got: Vec<usize> = tokens.iter().map(|t| offsets.next(t)).collect();
        assert_eq!(got, [0, 1, 1, 2, 3, 5, 7, 7, 8, 9]);
        let text = "héllo wörld";
        assert_eq!(offsets.next(b""), text.chars().count());
        // Every offset starts the token's character in the text.
        let chars: Vec<char> = text.chars().collect();
        assert_eq!(chars[got[1]], 'é');
        assert_eq!(chars[got[6]], 'ö');
        assert_eq!(chars[got[5]], ' ');
    }

    #[test]
    fn four_byte_characters_and_stray_bytes() {
        let mut offsets = TextOffsets::default();
        // 😀 is F0 9F 98 80, here in three tokens; then a lone continuation byte (U+FFFD), "a".
        let got: Vec<usize> = [&b"\xf0"[..], b"\x9f\x98", b"\x80x", b"\x80", b"a"]
            .iter()
            .map(|t| offsets.next(t))
            .collect();
        assert_eq!(got, [0, 0, 0, 2, 3]);
        assert_eq!(offsets.next(b""), 4);
        // A character cut short by a byte that cannot continue it: one U+FFFD, then the byte.
        let mut offsets = TextOffsets::default();
        assert_eq!(offsets.next(b"\xc3"), 0);
        assert_eq!(offsets.next(b"a"), 1);
        assert_eq!(offsets.next(b""), 2);
    }
}
