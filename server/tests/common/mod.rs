//! A real server on an ephemeral port, serving the built-in model, and a real HTTP client.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use rackfill_engine::{EngineConfig, EpConfig, SchedulerConfig};
use rackfill_models::ModelBundle;
use rackfill_server::{AppState, ServerConfig};
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub struct TestServer {
    pub base: String,
    pub addr: SocketAddr,
    pub state: AppState,
    pub client: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

pub fn engine_config(ep_size: usize) -> EngineConfig {
    EngineConfig {
        ep: EpConfig {
            ep_size,
            ..EpConfig::default()
        },
        scheduler: SchedulerConfig {
            chunk_tokens: 512,
            kv_tokens_per_rank: 65_536,
            ..SchedulerConfig::default()
        },
        max_waiting: 256,
        ..EngineConfig::default()
    }
}

/// A loopback listener whose accepted connections have a 4 KiB send buffer, so a response backs
/// up behind a client that stops reading after a few dozen chunks.
pub fn small_send_buffer_listener() -> tokio::net::TcpListener {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_send_buffer_size(4096).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    socket.listen(16).unwrap()
}

impl TestServer {
    pub async fn start(config: ServerConfig) -> Self {
        Self::start_with(config, engine_config(2)).await
    }

    pub async fn start_with(config: ServerConfig, engine: EngineConfig) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::start_on(listener, config, engine)
    }

    /// Serves on `listener` (whose socket options the accepted connections inherit).
    pub fn start_on(
        listener: tokio::net::TcpListener,
        config: ServerConfig,
        engine: EngineConfig,
    ) -> Self {
        let bundle = ModelBundle::load(None).expect("built-in model");
        Self::start_bundle(listener, bundle, config, engine)
    }

    /// Serves `bundle` (a model loaded from a directory, say) on `listener`.
    pub fn start_bundle(
        listener: tokio::net::TcpListener,
        bundle: ModelBundle,
        config: ServerConfig,
        engine: EngineConfig,
    ) -> Self {
        let state = AppState::launch(bundle, engine, config).expect("engine starts");
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(rackfill_server::serve(
            listener,
            state.clone(),
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            base: format!("http://{addr}"),
            addr,
            state,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(120))
                .build()
                .unwrap(),
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// POSTs `body` as JSON; returns status and parsed body (Null when not JSON).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let response = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// POSTs raw bytes with a JSON content type.
    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> (u16, Value) {
        let response = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let response = self.client.get(self.url(path)).send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.text().await.unwrap())
    }

    /// Signals shutdown and waits for `serve` to return.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let task = self.task.take().unwrap();
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("serve returns after shutdown")
            .unwrap()
    }

    pub fn trigger_shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    pub async fn join(mut self) -> std::io::Result<()> {
        let task = self.task.take().unwrap();
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("serve returns after shutdown")
            .unwrap()
    }
}

/// Incremental SSE parser: feed bytes, get complete `data:` payloads.
#[derive(Default)]
pub struct SseParser {
    buffer: String,
}

impl SseParser {
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buffer.push_str(&String::from_utf8_lossy(bytes));
        let mut events = Vec::new();
        while let Some(end) = self.buffer.find("\n\n") {
            let block: String = self.buffer.drain(..end + 2).collect();
            let data: Vec<&str> = block
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                events.push(data.join("\n"));
            }
        }
        events
    }
}

/// Reads a whole SSE response; returns every `data:` payload in order.
pub async fn read_sse(response: reqwest::Response) -> Vec<String> {
    use futures_util::StreamExt;
    assert_eq!(response.status().as_u16(), 200);
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let mut parser = SseParser::default();
    let mut events = Vec::new();
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        events.extend(parser.feed(&chunk.unwrap()));
    }
    events
}

/// The JSON chunks before `[DONE]`; asserts the stream ends with `[DONE]` exactly once.
pub fn json_chunks(events: &[String]) -> Vec<Value> {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
        .collect()
}

/// The sum of every sample of `name` in a `/metrics` text whose labels contain all of
/// `labels` (`key="value"`).
pub fn sample(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let rest = series.strip_prefix(name)?;
            let matches = (rest.is_empty() || rest.starts_with('{'))
                && labels.iter().all(|l| rest.contains(l));
            matches.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}
