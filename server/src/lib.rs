//! rackfill-server: the OpenAI-compatible HTTP API (axum), request validation, admission and
//! Prometheus metrics, talking to the engine through a backend trait. Nothing is implemented yet.
