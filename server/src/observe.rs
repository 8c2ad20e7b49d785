//! Request id, tracing span and HTTP metrics around every request.
//!
//! A request counts as in flight, and its duration runs, until its response body has been sent
//! or dropped: a stream is observed to its last event, and a request dropped before its response
//! (its connection torn down, as at the end of a shutdown) is still counted (status `499`,
//! nginx's "client closed request") and leaves the in-flight gauge. A client that merely closed
//! its connection is not noticed before the response is written (see `listen`: half-closed
//! connections are served). Both come from a guard that is dropped with the request's future
//! or with its response body, whichever holds it last.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use ::metrics::{counter, gauge, histogram};
use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Request};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};
use tracing::Instrument;

use crate::{metrics, random_id, REQUEST_ID_HEADER};

/// The status recorded for a request dropped before its response: the client closed it.
const CLIENT_CLOSED: u16 = 499;

/// The middleware: tags the request with an id (the client's `x-request-id` when sane), runs
/// it in a span, and observes it until its response body is done.
pub(crate) async fn observe(mut request: Request, next: Next) -> Response {
    let request_id = request
        .headers()
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(random_id);
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let method = request.method().as_str().to_string();
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        request.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    let span = tracing::info_span!("request", request_id = %request_id, %method, %route);
    let mut observation = Observation::start(method, route, span.clone());
    let mut response = next.run(request).instrument(span).await;
    observation.status = Some(response.status().as_u16());
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response.map(|inner| {
        Body::new(ObservedBody {
            inner,
            _observation: observation,
        })
    })
}

/// One request's HTTP metrics, recorded when it is dropped.
struct Observation {
    method: String,
    route: String,
    span: tracing::Span,
    start: Instant,
    /// The response's status once the handler answered.
    status: Option<u16>,
}

impl Observation {
    fn start(method: String, route: String, span: tracing::Span) -> Self {
        gauge!(metrics::HTTP_IN_FLIGHT).increment(1.0);
        Self {
            method,
            route,
            span,
            start: Instant::now(),
            status: None,
        }
    }
}

impl Drop for Observation {
    fn drop(&mut self) {
        let elapsed = self.start.elapsed();
        let status = self.status.unwrap_or(CLIENT_CLOSED);
        counter!(metrics::HTTP_REQUESTS, "method" => self.method.clone(),
            "route" => self.route.clone(), "status" => status.to_string())
        .increment(1);
        histogram!(metrics::HTTP_DURATION, "method" => self.method.clone(),
            "route" => self.route.clone())
        .record(elapsed.as_secs_f64());
        // Last: a request leaves the gauge only once it is counted.
        gauge!(metrics::HTTP_IN_FLIGHT).decrement(1.0);
        self.span.in_scope(|| {
            let elapsed_ms = elapsed.as_secs_f64() * 1e3;
            if self.status.is_some() {
                tracing::info!(status, elapsed_ms, "response");
            } else {
                tracing::info!(
                    elapsed_ms,
                    "client closed the connection before the response"
                );
            }
        });
    }
}

/// A response body that holds its request's [`Observation`] until the body is done.
struct ObservedBody {
    inner: Body,
    /// Recorded when the body is dropped: after its last frame, or when the client went away.
    _observation: Observation,
}

impl http_body::Body for ObservedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
