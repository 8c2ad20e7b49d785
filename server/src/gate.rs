//! What is checked from a request's head alone, before a byte of its body is read: the API key
//! on the protected routes (401), then that a body is JSON (415). Both answer before the route's
//! 404 or 405, so an unauthenticated client learns nothing about which routes or methods exist,
//! and the server never buffers a body it refuses (it reads and discards it behind the answer,
//! see [`body::answer_then_discard`]).

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::Body as _;
use subtle::ConstantTimeEq;

use crate::api_error::ApiError;
use crate::body;
use crate::AppState;

/// Routes outside `/v1` that need the key too: vLLM's tokenizer endpoints.
const PROTECTED_OUTSIDE_V1: &[&str] = &["/tokenize", "/detokenize", "/tokenizer_info"];

/// The middleware: 401 without a valid key on a protected path (when a key is set), 415 for a
/// body that is not JSON, else the request goes on (to the body reader, then the router).
pub(crate) async fn gate(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Err(refusal) = check_head(&state, &request) else {
        return next.run(request).await;
    };
    if has_body(&request) {
        let timeout = state.config().read_timeout;
        body::answer_then_discard(refusal.into_response(), request.into_body(), timeout)
    } else {
        refusal.into_response()
    }
}

/// The key (when one is set and the path is protected), then the body's media type.
fn check_head(state: &AppState, request: &Request) -> Result<(), ApiError> {
    if let Some(key) = &state.config().api_key {
        if is_protected(request.uri().path()) {
            check_key(request.headers().get(header::AUTHORIZATION), key)?;
        }
    }
    if has_body(request) {
        check_json(request.headers().get(header::CONTENT_TYPE))?;
    }
    Ok(())
}

/// `/v1` and everything under it (known routes or not), and [`PROTECTED_OUTSIDE_V1`].
/// `/health`, `/metrics` and `/version` stay open for probes and scrapers.
fn is_protected(path: &str) -> bool {
    path == "/v1" || path.starts_with("/v1/") || PROTECTED_OUTSIDE_V1.contains(&path)
}

/// Bearer auth; the comparison is constant-time.
fn check_key(authorization: Option<&HeaderValue>, key: &str) -> Result<(), ApiError> {
    let given = authorization
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    if given.is_some_and(|token| bool::from(token.as_bytes().ct_eq(key.as_bytes()))) {
        return Ok(());
    }
    let message = if given.is_some() {
        "invalid API key"
    } else {
        "missing API key: send `Authorization: Bearer <key>`"
    };
    Err(ApiError::Unauthorized(message.into()))
}

/// Whether the request declares a body (a non-zero `Content-Length`, or chunked).
fn has_body(request: &Request) -> bool {
    request.body().size_hint().upper() != Some(0)
}

/// A body must be declared JSON: `application/json` or `application/<anything>+json`, in any
/// case, with any parameters (`; charset=utf-8`). Anything else, or no `Content-Type`, is 415:
/// what a browser sends cross-origin without a CORS preflight (`text/plain`, forms, no type)
/// never reaches a handler.
fn check_json(content_type: Option<&HeaderValue>) -> Result<(), ApiError> {
    let Some(value) = content_type else {
        return Err(ApiError::UnsupportedMediaType(
            "the request body must be JSON: send `Content-Type: application/json`".into(),
        ));
    };
    let text = String::from_utf8_lossy(value.as_bytes());
    let essence = text
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let json = match essence.split_once('/') {
        Some(("application", subtype)) => {
            subtype == "json" || subtype.strip_suffix("+json").is_some_and(|s| !s.is_empty())
        }
        _ => false,
    };
    if json {
        return Ok(());
    }
    Err(ApiError::UnsupportedMediaType(format!(
        "the request body must be JSON (`Content-Type: application/json`), not `{}`",
        text.chars().take(100).collect::<String>()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_media_types() {
        for ok in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON ;charset=UTF-8",
            "application/vnd.api+json",
        ] {
            assert!(
                check_json(Some(&HeaderValue::from_static(ok))).is_ok(),
                "{ok}"
            );
        }
        for bad in [
            "text/plain",
            "text/plain; charset=application/json",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/jsonx",
            "application/+json",
            "text/json",
            "",
        ] {
            let err = check_json(Some(&HeaderValue::from_static(bad))).unwrap_err();
            assert_eq!(err.status().as_u16(), 415, "{bad}");
        }
        assert!(check_json(None).is_err());
    }

    #[test]
    fn protected_paths() {
        for path in [
            "/v1",
            "/v1/",
            "/v1/models",
            "/v1/nope/x",
            "/tokenize",
            "/tokenizer_info",
        ] {
            assert!(is_protected(path), "{path}");
        }
        for path in [
            "/health",
            "/metrics",
            "/version",
            "/v1x",
            "/v10/models",
            "/tokenize/x",
        ] {
            assert!(!is_protected(path), "{path}");
        }
    }
}
