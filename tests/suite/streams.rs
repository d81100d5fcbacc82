//! Requests whose body is a stream the client writes as answers come back,
//! through a real Envoy: a WebSocket upgrade is forwarded at its headers (its
//! body flows only once Envoy answers), and a gRPC stream once its first
//! message is in (its client may wait for a reply before it sends more).
//! Held for `prefix_length` bytes, either would wait for ever.

use std::time::Duration;

use bytes::Bytes;
use harness::client::PieceBody;
use harness::{wait_until, Harness};
use http_body_util::BodyExt as _;
use hyper_util::rt::TokioIo;
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;

/// How long a request the filter must not hold may take to get through.
const PROMPTLY: Duration = Duration::from_secs(5);

/// A WebSocket upgrade (HTTP/1.1) reaches an instance and its answer comes
/// back without the client sending anything after its headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_upgrade_is_forwarded_at_its_headers() {
    let harness = Harness::start_with(|b| {
        b.edit(|config| {
            let mut managers = 0;
            let listeners = config["static_resources"]["listeners"].as_sequence_mut();
            for listener in listeners.into_iter().flatten() {
                let chains = listener["filter_chains"].as_sequence_mut();
                for filter in chains
                    .into_iter()
                    .flatten()
                    .flat_map(|chain| chain["filters"].as_sequence_mut().into_iter().flatten())
                {
                    if filter["name"] == "envoy.filters.network.http_connection_manager" {
                        filter["typed_config"]["upgrade_configs"] =
                            serde_yaml::from_str("[{upgrade_type: websocket}]")?;
                        managers += 1;
                    }
                }
            }
            anyhow::ensure!(managers > 0, "no HTTP connection manager");
            Ok(())
        })
    });
    let mut stream = tokio::net::TcpStream::connect(harness.envoy.listener_addr())
        .await
        .unwrap();
    stream
        .write_all(
            b"GET /v1/realtime HTTP/1.1\r\nhost: prefix-router.test\r\n\
              connection: Upgrade\r\nupgrade: websocket\r\n\
              sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        )
        .await
        .unwrap();
    let mut answer = vec![0u8; 1024];
    let read = tokio::time::timeout(PROMPTLY, stream.read(&mut answer))
        .await
        .expect("an answer while the client waits for one")
        .unwrap();
    let head = String::from_utf8_lossy(&answer[..read]).to_lowercase();
    assert!(head.starts_with("http/1.1 "), "{head}");
    assert!(
        head.contains("x-served-by:"),
        "not from an instance: {head}"
    );
    let records = harness.fleet.records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].path, "/v1/realtime");
}

/// One gRPC message: the uncompressed flag, the length, the bytes.
fn grpc_message(payload: &[u8]) -> Bytes {
    let mut message = vec![0];
    message.extend(u32::try_from(payload.len()).unwrap().to_be_bytes());
    message.extend(payload);
    message.into()
}

/// A gRPC stream (HTTP/2) whose first message is far shorter than
/// `prefix_length` goes to an instance while the client waits; the
/// messages after it still arrive, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_stream_is_forwarded_once_its_first_message_is_in() {
    let harness = Harness::start();
    let stream = tokio::net::TcpStream::connect(harness.envoy.listener_addr())
        .await
        .unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .unwrap();
    let connection = tokio::spawn(connection);
    let (pieces, receiver) = mpsc::channel(4);
    let request = hyper::Request::post(
        "http://prefix-router.test/inference.GRPCInferenceService/ModelStreamInfer",
    )
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(PieceBody::new(receiver))
    .unwrap();
    let exchange = tokio::spawn(async move {
        let response = sender.send_request(request).await?;
        let status = response.status().as_u16();
        response.into_body().collect().await?;
        anyhow::Ok(status)
    });
    let first = grpc_message(b"model llama-3.1-70b: the first question");
    pieces.send(first.clone()).await.unwrap();
    let started = |h: &Harness| {
        h.envoy
            .stat("cluster.vllm.upstream_rq_total")
            .unwrap()
            .unwrap_or(0)
    };
    wait_until(
        "the stream forwarded after its first message",
        PROMPTLY,
        || started(&harness),
        |n| *n >= 1,
    )
    .await;
    let second = grpc_message(b"and the second");
    pieces.send(second.clone()).await.unwrap();
    drop(pieces);
    let status = tokio::time::timeout(PROMPTLY, exchange)
        .await
        .expect("the answer once the stream ends")
        .unwrap()
        .unwrap();
    assert_eq!(status, 200);
    let records = harness.fleet.records();
    assert_eq!(records.len(), 1);
    let mut sent = first.to_vec();
    sent.extend_from_slice(&second);
    assert_eq!(records[0].body_len, sent.len());
    assert_eq!(
        records[0].body_sha256,
        hex::encode(Sha256::digest(&sent)),
        "the messages arrive byte for byte"
    );
    connection.abort();
}
