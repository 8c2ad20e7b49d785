//! Reading request bodies before any handler runs: within the size limit (413 beyond it) and
//! within a time limit (408 when the client stops sending), so a client that declares a body
//! and never finishes it cannot hold a connection and its task forever. The bytes held count in
//! `rackfill:http_body_bytes_buffered` from their arrival until the handler takes the body.
//! A body refused from the head alone is never buffered, only read and discarded behind the
//! answer ([`answer_then_discard`]).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use ::metrics::gauge;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;

use crate::api_error::ApiError;
use crate::{metrics, AppState};

/// Bodies declared larger than the limit are read and discarded, up to this many bytes, before
/// the 413 goes out; bodies refused from the head alone, behind their answer. A server that
/// answers while the client is still sending, then closes, resets the connection, and a client
/// that sends its whole body before reading sees a broken pipe instead of the answer.
const DRAIN_UP_TO: u64 = 64 << 20;

/// Buffers the request body (at most `max_body_bytes`, within `read_timeout`) and passes
/// the request on with the buffered body. A body declared too large by its `Content-Length` is
/// drained (see [`DRAIN_UP_TO`], also within the timeout) and answered 413; one that
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
        if len <= DRAIN_UP_TO {
            // A client that stops sending gets the 413 when the time is up.
            let _ = tokio::time::timeout(timeout, discard(body)).await;
        }
        return ApiError::PayloadTooLarge(limit).into_response();
    }
    let mut held = Held::default();
    // Room for what the head announced (pages are only taken as bytes arrive).
    let expected = declared.map_or(0, |len| len as usize);
    let reading = collect(body, limit, expected, &mut held);
    match tokio::time::timeout(timeout, reading).await {
        Ok(Ok(bytes)) => {
            let body = Body::new(HeldBody {
                bytes: Some(bytes),
                _held: held,
            });
            next.run(Request::from_parts(parts, body)).await
        }
        Ok(Err(err)) => err.into_response(),
        Err(_) => ApiError::RequestTimeout(timeout_text(timeout)).into_response(),
    }
}

/// The whole body, or 413 once it passes `limit`, or 400 if the connection failed; every byte
/// kept is added to `held` as it arrives. `expected` (at most `limit`) is reserved up front.
async fn collect(
    mut body: Body,
    limit: usize,
    expected: usize,
    held: &mut Held,
) -> Result<Bytes, ApiError> {
    let mut bytes = Vec::with_capacity(expected);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|err| ApiError::InvalidRequest {
            message: format!("cannot read the request body: {err}"),
            param: None,
            code: None,
        })?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        if bytes.len() + data.len() > limit {
            return Err(ApiError::PayloadTooLarge(limit));
        }
        bytes.extend_from_slice(&data);
        held.add(data.len());
    }
    Ok(Bytes::from(bytes))
}

/// Bytes of one request body counted in `rackfill:http_body_bytes_buffered`, until dropped.
#[derive(Default)]
struct Held {
    bytes: usize,
}

impl Held {
    fn add(&mut self, bytes: usize) {
        self.bytes += bytes;
        gauge!(metrics::HTTP_BODY_BYTES_BUFFERED).increment(bytes as f64);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.bytes > 0 {
            gauge!(metrics::HTTP_BODY_BYTES_BUFFERED).decrement(self.bytes as f64);
        }
    }
}

/// A buffered body handed to the router: one frame, and its bytes leave the gauge when the
/// handler has taken it (or the request ended without a handler taking it).
struct HeldBody {
    bytes: Option<Bytes>,
    _held: Held,
}

impl http_body::Body for HeldBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.bytes.take().map(|bytes| Ok(Frame::data(bytes))))
    }

    fn is_end_stream(&self) -> bool {
        self.bytes.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.bytes.as_ref().map_or(0, |b| b.len() as u64))
    }
}

/// `answer`, a refusal decided from the request's head, sent at once, with the request's `body`
/// read and discarded behind it (at most [`DRAIN_UP_TO`] bytes, within `timeout`), none of it
/// kept. The answer goes out chunked and its last chunk follows the discarded body, so the
/// connection stays open while the client is sending: a client that writes its whole body
/// before reading gets the answer instead of a reset, and one that stalls is let go after
/// `timeout`.
pub(crate) fn answer_then_discard(answer: Response, body: Body, timeout: Duration) -> Response {
    let (mut parts, answer) = answer.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    let discarded = futures_util::stream::once(async move {
        let _ = tokio::time::timeout(timeout, discard(body)).await;
    })
    .filter_map(|()| std::future::ready(None::<Result<Bytes, axum::Error>>));
    let body = answer.into_data_stream().chain(discarded);
    Response::from_parts(parts, Body::from_stream(body))
}

/// Reads `body` to its end, or [`DRAIN_UP_TO`] bytes, or a connection error, keeping nothing.
async fn discard(body: Body) {
    let mut body = body.into_data_stream();
    let mut read = 0u64;
    while let Some(Ok(chunk)) = body.next().await {
        read += chunk.len() as u64;
        if read > DRAIN_UP_TO {
            return;
        }
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
