//! `--dataset eval`: the requests an evaluation harness (lm-evaluation-harness's
//! `loglikelihood` on a multiple-choice task) sends: every context is scored against several
//! continuations, one request each, with `echo: true`, `logprobs: 1` and `max_tokens: 0`, so the
//! server computes the prompt's logprobs and generates nothing. The continuations of one context
//! share the whole context, which a prefix cache can compute once.

use super::{DatasetError, Prompt, RequestSpec};

/// `--eval-*` settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalParams {
    /// Tokens of each context.
    pub context_len: usize,
    /// Continuations scored per context.
    pub continuations: usize,
    /// Tokens of each continuation.
    pub continuation_len: usize,
}

/// `contexts` contexts times `params.continuations` requests, the continuations of a context
/// next to each other in dataset order.
pub fn eval(params: &EvalParams, contexts: usize) -> Result<Vec<RequestSpec>, DatasetError> {
    if params.context_len == 0 || params.continuations == 0 || params.continuation_len == 0 {
        return Err(DatasetError::Invalid(
            "--eval-context-len, --eval-continuations and --eval-continuation-len must be at \
             least 1"
                .into(),
        ));
    }
    Ok((0..contexts as u64)
        .flat_map(|context| {
            (0..params.continuations as u64).map(move |continuation| RequestSpec {
                prompt: Prompt::Scored {
                    context,
                    context_len: params.context_len,
                    continuation,
                },
                input_len: params.context_len.saturating_add(params.continuation_len),
                output_len: 0,
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
    fn continuations_share_their_context_only() {
        let params = EvalParams {
            context_len: 6,
            continuations: 3,
            continuation_len: 2,
        };
        let specs = eval(&params, 2).unwrap();
        assert_eq!(specs.len(), 6);
        assert!(specs.iter().all(|s| s.input_len == 8 && s.output_len == 0));
        let s = Synthesis::default();
        let ids: Vec<Vec<u32>> = specs
            .iter()
            .map(|spec| s.prompt_tokens(spec, &[]).unwrap())
            .collect();
        assert!(ids.iter().all(|p| p.len() == 8));
        assert_eq!(ids[0][..6], ids[2][..6]);
        assert_ne!(ids[0][6..], ids[1][6..]);
        assert_ne!(ids[0][..6], ids[3][..6]);
        assert!(!specs.iter().any(|spec| spec.prompt.continues()));
        assert!(eval(
            &EvalParams {
                continuations: 0,
                ..params
            },
            1
        )
        .is_err());
    }
}
