//! The `--prometheus` endpoint: `GET /metrics` in the OpenMetrics text format, served by hyper on
//! the agent's tokio runtime. A scrape encodes the registry (atomics read, nothing locked that the
//! event path takes).
use std::{convert::Infallible, net::SocketAddr, sync::Arc};

use anyhow::Context;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode, body::Bytes, header::CONTENT_TYPE, service::service_fn};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Binds `addr` now (so that a port in use fails the command before it
/// traces) and serves scrapes until the task is aborted.
pub(super) async fn serve(addr: SocketAddr, registry: Arc<Registry>) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} for --prometheus: choose a free address and port"))?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let registry = registry.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| respond(req, registry.clone()));
                // A scraper that hangs up mid-response is its own problem.
                let _ =
                    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    }))
}

async fn respond(
    req: Request<hyper::body::Incoming>,
    registry: Arc<Registry>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let reply = |status: StatusCode, content_type: &str, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        if let Ok(v) = content_type.parse() {
            r.headers_mut().insert(CONTENT_TYPE, v);
        }
        Ok(r)
    };
    if req.uri().path() != "/metrics" {
        return reply(StatusCode::NOT_FOUND, "text/plain", "profiler: live metrics are at /metrics\n".into());
    }
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &registry) {
        Ok(()) => reply(StatusCode::OK, OPENMETRICS, body),
        Err(e) => reply(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", format!("encoding failed: {e}\n")),
    }
}
