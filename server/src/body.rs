//! Reading request bodies before any handler runs: within the size limit (413 beyond it) and
//! within a time limit (408 when the client stops sending), so a client that declares a body
//! and never finishes it cannot hold a connection and its task forever.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::validation::ApiError;
use crate::AppState;

/// Bodies declared larger than the limit are read and discarded, up to this many bytes, before
/// the 413 goes out. A server that answers while the client is still sending, then closes,
/// resets the connection, and the client sees a broken pipe instead of the 413.
const DRAIN_OVERSIZED_UP_TO: u64 = 64 << 20;

/// Buffers the request body (at most `max_body_bytes`, within `read_timeout`) and passes
/// the request on with the buffered body. A body declared too large by its `Content-Length` is
/// drained (see [`DRAIN_OVERSIZED_UP_TO`], also within the timeout) and answered 413; one that
/// turns out too large while reading (chunked) is 413 too; one not finished in time is 408.
pub(crate) async fn read_body(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let config = state.config();
    let (limit, timeout) = (config.max_body_bytes, config.read_timeout);
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let (parts, body) = request.into_parts();
    if let Some(len) = declared.filter(|&len| len > limit as u64) {
        if len <= DRAIN_OVERSIZED_UP_TO {
            let drain = async {
                let mut body = body.into_data_stream();
                while let Some(Ok(_)) = body.next().await {}
            };
            // A client that stops sending gets the 413 when the time is up.
            let _ = tokio::time::timeout(timeout, drain).await;
        }
        return ApiError::PayloadTooLarge(limit).into_response();
    }
    match tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await {
        Ok(Ok(collected)) => {
            let body = Body::from(collected.to_bytes());
            next.run(Request::from_parts(parts, body)).await
        }
        Ok(Err(err)) if err.downcast_ref::<LengthLimitError>().is_some() => {
            ApiError::PayloadTooLarge(limit).into_response()
        }
        Ok(Err(err)) => ApiError::InvalidRequest {
            message: format!("cannot read the request body: {err}"),
            param: None,
            code: None,
        }
        .into_response(),
        Err(_) => ApiError::RequestTimeout(timeout_text(timeout)).into_response(),
    }
}

/// A handler's body, already buffered and size-checked by [`read_body`], or 400 if it still
/// could not be read.
pub(crate) fn buffered(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| ApiError::InvalidRequest {
        message: format!("cannot read the request body: {rejection}"),
        param: None,
        code: None,
    })
}

/// `30 s`, `0.5 s`: the limit as the error message states it.
fn timeout_text(timeout: Duration) -> String {
    format!("{} s", timeout.as_secs_f64())
}
