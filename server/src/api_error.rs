//! Everything that can be wrong with a request, as one typed error mapped to OpenAI's error
//! envelope `{"error": {"message", "type", "param", "code"}}`, naming the offending field
//! (`param`). The checks of the request's JSON shape are in [`crate::request_json`]; what its
//! values may be (sampling ranges, token ids, lengths) the engine checks once
//! ([`rackfill_engine::RequestError`], mapped here).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use rackfill_engine::sampling::SamplingError;
use rackfill_engine::{EngineError, RequestError};

use crate::api_types::{ErrorBody, ErrorEnvelope};

/// The request field that holds the prompts, for the `param` of errors about them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PromptField {
    /// `prompt` of `/v1/completions` (and `/tokenize`): sequence `s` of the request is a choice
    /// of `prompt[s / n]`.
    Prompt { n: usize },
    /// The chat's `messages`: one prompt.
    Messages,
}

impl PromptField {
    /// The field's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Prompt { .. } => "prompt",
            Self::Messages => "messages",
        }
    }

    /// The request field of the engine's sampling parameter `param`: the chat API names the
    /// number of alternatives `top_logprobs`.
    fn sampling_field(self, param: &'static str) -> &'static str {
        match (self, param) {
            (Self::Messages, "logprobs") => "top_logprobs",
            _ => param,
        }
    }

    /// The field that holds sequence `sequence`'s prompt (`prompt[1]`).
    fn of_sequence(self, sequence: usize) -> String {
        match self {
            Self::Prompt { n } => format!("prompt[{}]", sequence / n.max(1)),
            Self::Messages => "messages".into(),
        }
    }
}

/// A request that cannot be served, with the HTTP status and OpenAI error fields it maps to.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// Malformed JSON, a field of the wrong type or out of range (400). `param` names the field.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
        code: Option<&'static str>,
    },
    /// Prompt plus `max_tokens` beyond what the model or the KV budget can hold (400); the
    /// message carries both numbers.
    #[error("{message}")]
    ContextLength { message: String, param: String },
    /// Missing or wrong bearer token (401).
    #[error("{0}")]
    Unauthorized(String),
    /// The request names a model this server does not serve (404).
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// No such route (404).
    #[error("no route for {0}")]
    RouteNotFound(String),
    /// The route exists but not for this method (405; the `allow` header lists the methods).
    #[error("{0} is not allowed on this route")]
    MethodNotAllowed(String),
    /// The body is larger than `--max-body-bytes` (413).
    #[error("the request body exceeds the limit of {0} bytes")]
    PayloadTooLarge(usize),
    /// The request carries a body that is not declared JSON (415): a browser may send a
    /// `text/plain` body to any origin without asking first, so only JSON is taken.
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// The client did not finish sending its body within the server's read timeout (408);
    /// the message names the limit.
    #[error("the request body was not received within {0}")]
    RequestTimeout(String),
    /// The admission limit or the engine's queue is full (429).
    #[error("{0}")]
    TooManyRequests(String),
    /// The engine is not running or the server is shutting down (503).
    #[error("{0}")]
    Unavailable(String),
    /// The engine failed a request it had accepted (500).
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
            code: Some("invalid_value"),
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } | Self::ContextLength { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::ModelNotFound(_) | Self::RouteNotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::TooManyRequests(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `type`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidRequest { .. }
            | Self::ContextLength { .. }
            | Self::ModelNotFound(_)
            | Self::RouteNotFound(_)
            | Self::MethodNotAllowed(_)
            | Self::PayloadTooLarge(_)
            | Self::UnsupportedMediaType(_)
            | Self::RequestTimeout(_) => "invalid_request_error",
            Self::Unauthorized(_) => "authentication_error",
            Self::TooManyRequests(_) => "rate_limit_error",
            Self::Unavailable(_) => "service_unavailable_error",
            Self::Internal(_) => "server_error",
        }
    }

    /// OpenAI's `param`.
    pub fn param(&self) -> Option<&str> {
        match self {
            Self::InvalidRequest { param, .. } => param.as_deref(),
            Self::ContextLength { param, .. } => Some(param),
            Self::ModelNotFound(_) => Some("model"),
            _ => None,
        }
    }

    /// OpenAI's `code`.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            Self::InvalidRequest { code, .. } => *code,
            Self::ContextLength { .. } => Some("context_length_exceeded"),
            Self::Unauthorized(_) => Some("invalid_api_key"),
            Self::ModelNotFound(_) => Some("model_not_found"),
            Self::RouteNotFound(_) => Some("not_found"),
            Self::MethodNotAllowed(_) => Some("method_not_allowed"),
            Self::PayloadTooLarge(_) => Some("payload_too_large"),
            Self::UnsupportedMediaType(_) => Some("unsupported_media_type"),
            Self::RequestTimeout(_) => Some("request_timeout"),
            Self::TooManyRequests(_) => Some("rate_limit_exceeded"),
            Self::Unavailable(_) => Some("service_unavailable"),
            Self::Internal(_) => Some("internal_error"),
        }
    }

    /// The error envelope, as sent in a body or as a final SSE event.
    pub fn body(&self) -> ErrorEnvelope {
        ErrorEnvelope {
            error: ErrorBody {
                code: self.code(),
                message: self.to_string(),
                param: self.param().map(str::to_owned),
                kind: self.kind(),
            },
        }
    }

    /// A request the engine refused to validate: 400, naming the field at fault (a sampling
    /// parameter, `n` for too many sequences, else the prompt's `field`).
    pub(crate) fn from_request(err: RequestError, field: PromptField) -> Self {
        let message = err.to_string();
        match err {
            RequestError::Sampling(SamplingError::InvalidParam { param, reason }) => {
                let param = field.sampling_field(param);
                Self::invalid(param, format!("invalid `{param}`: {reason}"))
            }
            RequestError::Sampling(_) => Self::InvalidRequest {
                message,
                param: None,
                code: None,
            },
            RequestError::ContextLength(_) => Self::ContextLength {
                message,
                param: field.name().into(),
            },
            RequestError::EmptyPrompt { sequence } => {
                Self::invalid(field.of_sequence(sequence), message)
            }
            RequestError::TooManySequences { .. } => Self::invalid("n", message),
            RequestError::KvExport(_) => Self::invalid("kv_transfer_params", message),
            RequestError::NoSequences
            | RequestError::OutOfVocabulary { .. }
            | RequestError::TooManyTokens { .. } => Self::invalid(field.name(), message),
        }
    }

    /// An engine submission error: 429 for a full queue (it counts sequences), 503 when the
    /// engine stopped, 500 for anything that is the server's fault.
    pub(crate) fn from_engine(err: EngineError, field: PromptField) -> Self {
        match err {
            EngineError::Request(e) => Self::from_request(e, field),
            EngineError::QueueFull { .. } => Self::TooManyRequests(err.to_string()),
            EngineError::Unavailable => Self::Unavailable(err.to_string()),
            other => Self::Internal(other.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, axum::Json(self.body())).into_response();
        if matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_shape() {
        let body = serde_json::to_string(&ApiError::invalid("top_p", "bad").body()).unwrap();
        assert_eq!(
            body,
            r#"{"error":{"code":"invalid_value","message":"bad","param":"top_p","type":"invalid_request_error"}}"#
        );
        let body = serde_json::to_string(&ApiError::TooManyRequests("full".into()).body()).unwrap();
        assert_eq!(
            body,
            r#"{"error":{"code":"rate_limit_exceeded","message":"full","param":null,"type":"rate_limit_error"}}"#
        );
    }

    #[test]
    fn engine_refusals_name_the_field_at_fault() {
        let completions = PromptField::Prompt { n: 2 };
        let err = ApiError::from_request(RequestError::EmptyPrompt { sequence: 3 }, completions);
        assert_eq!(err.param(), Some("prompt[1]"));
        let err = ApiError::from_request(
            RequestError::EmptyPrompt { sequence: 0 },
            PromptField::Messages,
        );
        assert_eq!(err.param(), Some("messages"));
        let too_many = SamplingError::InvalidParam {
            param: "logprobs",
            reason: "must be at most 20, got 21".into(),
        };
        let err = ApiError::from_request(too_many.clone().into(), PromptField::Messages);
        assert_eq!(err.param(), Some("top_logprobs"));
        assert_eq!(
            err.to_string(),
            "invalid `top_logprobs`: must be at most 20, got 21"
        );
        let err = ApiError::from_request(too_many.into(), completions);
        assert_eq!(err.param(), Some("logprobs"));
        let err = ApiError::from_request(
            RequestError::TooManySequences {
                sequences: 9,
                limit: 8,
            },
            completions,
        );
        assert_eq!(
            (err.param(), err.status()),
            (Some("n"), StatusCode::BAD_REQUEST)
        );
        let full = EngineError::QueueFull {
            waiting: 3,
            needed: 2,
            limit: 4,
        };
        let err = ApiError::from_engine(full, completions);
        assert_eq!(err.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(err.to_string().contains("sequences"), "{err}");
    }
}
