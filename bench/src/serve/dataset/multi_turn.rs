//! `--dataset multi-turn`: chat sessions as a prefix cache meets them. Every turn resends the
//! whole conversation (turn `k`'s prompt is turn `k - 1`'s prompt, the tokens generated for it
//! and a new user message), and every conversation opens with the same system prompt, so all
//! but the newest user message and the last reply could come from the cache.

use super::{DatasetError, Prompt, RequestSpec};

/// `--multi-turn-*` settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MultiTurnParams {
    /// Tokens of the system prompt every conversation opens with (0: none).
    pub system_len: usize,
    /// Tokens of each user message.
    pub user_len: usize,
    /// Turns (requests) per conversation.
    pub turns: usize,
    /// `max_tokens` of each turn.
    pub output_len: usize,
}

/// `conversations` conversations of `params.turns` turns each, turn after turn in dataset order
/// (the runner sends a conversation's turns one after the other). A turn's `input_len` is its
/// length if every earlier turn generated exactly `output_len` tokens (as with `ignore_eos`);
/// the server's `usage` gives the real one.
pub fn multi_turn(
    params: &MultiTurnParams,
    conversations: usize,
) -> Result<Vec<RequestSpec>, DatasetError> {
    if params.turns == 0 || params.user_len == 0 || params.output_len == 0 {
        return Err(DatasetError::Invalid(
            "--multi-turn-turns, --multi-turn-user-len and --multi-turn-output-len must be at \
             least 1"
                .into(),
        ));
    }
    let turn_len = params.user_len.saturating_add(params.output_len);
    Ok((0..conversations)
        .flat_map(|c| {
            (0..params.turns).map(move |turn| RequestSpec {
                prompt: Prompt::Turn {
                    conversation: c as u64,
                    turn,
                    system_len: params.system_len,
                    user_len: params.user_len,
                },
                input_len: params
                    .system_len
                    .saturating_add(params.user_len)
                    .saturating_add(turn.saturating_mul(turn_len)),
                output_len: params.output_len,
                timestamp_ms: None,
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::dataset::Synthesis;

    #[test]
    fn turns_extend_the_previous_turn_and_share_the_system_prompt() {
        let params = MultiTurnParams {
            system_len: 8,
            user_len: 3,
            turns: 3,
            output_len: 2,
        };
        let specs = multi_turn(&params, 2).unwrap();
        assert_eq!(specs.len(), 6);
        let lens: Vec<usize> = specs.iter().map(|s| s.input_len).collect();
        assert_eq!(lens, [11, 16, 21, 11, 16, 21]);
        let continues: Vec<bool> = specs.iter().map(|s| s.prompt.continues()).collect();
        assert_eq!(continues, [false, true, true, false, true, true]);
        let s = Synthesis::default();
        let first = s.prompt_tokens(&specs[0], &[]).unwrap();
        let other = s.prompt_tokens(&specs[3], &[]).unwrap();
        assert_eq!(first.len(), 11);
        assert_eq!(first[..8], other[..8], "one system prompt");
        assert_ne!(
            first[8..],
            other[8..],
            "each conversation its own user message"
        );
        let mut history = first.clone();
        history.extend([7, 7]);
        let second = s.prompt_tokens(&specs[1], &history).unwrap();
        assert_eq!(second.len(), 16);
        assert_eq!(second[..13], history[..]);
        assert_ne!(second[13..], first[8..], "a new user message");
        for bad in [
            MultiTurnParams { turns: 0, ..params },
            MultiTurnParams {
                user_len: 0,
                ..params
            },
            MultiTurnParams {
                output_len: 0,
                ..params
            },
        ] {
            assert!(multi_turn(&bad, 1).is_err());
        }
    }
}
