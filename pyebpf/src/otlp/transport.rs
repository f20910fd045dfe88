//! Sending one encoded request, over gRPC (tonic's generic client, the bytes sent as they are)
//! or HTTP/protobuf (hyper on rustls), both gzip-compressed; and what the collector's answer
//! means: delivered, refused for good, or worth another try.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::header::HeaderValue;
use http::uri::PathAndQuery;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use prost::Message;
use tonic::codec::{Codec, CompressionEncoding, EncodeBuf, Encoder};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tower_service::Service;

use super::proto::collector::{ExportProfilesPartialSuccess, ExportProfilesServiceResponse};
use super::tls::TlsMaterial;
use super::{Endpoint, Headers, OtlpError, Protocol, GRPC_PATH};

/// The most of a response's body read (an answer, or why not).
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

/// The most of a refusal's text shown.
const MAX_MESSAGE_CHARS: usize = 300;

/// What became of one send.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Accepted; the collector may have said something about it.
    Delivered { warning: Option<String> },
    /// Refused for good (bad data, bad credentials): retrying would not help.
    Refused(String),
    /// Not delivered, but it may be later: the collector is unreachable, busy or failing.
    Retry { cause: String, after: Option<Duration> },
}

pub(super) enum Transport {
    Grpc(Box<GrpcClient>),
    Http(Box<HttpClient>),
}

pub(super) struct GrpcClient {
    grpc: tonic::client::Grpc<FastGzip>,
    /// The headers, sent with every request.
    metadata: tonic::metadata::MetadataMap,
}

pub(super) struct HttpClient {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    uri: http::Uri,
    headers: Headers,
}

impl Transport {
    /// A client for `endpoint`; connects at the first send (in a tokio runtime).
    pub fn new(endpoint: &Endpoint, tls: &TlsMaterial, headers: &Headers) -> Result<Transport, OtlpError> {
        let bad_uri = |_| OtlpError::Endpoint(endpoint.to_string(), "not a valid URI");
        match endpoint.protocol {
            Protocol::Grpc => {
                let mut channel = Channel::from_shared(endpoint.uri()).map_err(|_| OtlpError::Endpoint(endpoint.to_string(), "not a valid URI"))?;
                channel = channel.connect_timeout(Duration::from_secs(10)).user_agent(user_agent()).map_err(|err| OtlpError::Tls(err.to_string()))?;
                if endpoint.tls {
                    channel = channel.tls_config(grpc_tls(endpoint, tls)).map_err(|err| OtlpError::Tls(err.to_string()))?;
                }
                let grpc = tonic::client::Grpc::new(FastGzip(channel.connect_lazy())).accept_compressed(CompressionEncoding::Gzip);
                Ok(Transport::Grpc(Box::new(GrpcClient { grpc, metadata: grpc_metadata(headers) })))
            }
            Protocol::Http => {
                let connector = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls.client_config()?).https_or_http().enable_http1().build();
                let client = Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
                let uri = endpoint.uri().parse().map_err(bad_uri)?;
                Ok(Transport::Http(Box::new(HttpClient { client, uri, headers: headers.clone() })))
            }
        }
    }

    /// Sends an encoded `ExportProfilesServiceRequest`, giving up after `timeout`.
    pub async fn send(&mut self, body: Bytes, timeout: Duration) -> Outcome {
        let sent = match self {
            Transport::Grpc(client) => tokio::time::timeout(timeout, send_grpc(&mut client.grpc, &client.metadata, body, timeout)).await,
            Transport::Http(http) => tokio::time::timeout(timeout, http.send(body)).await,
        };
        // One cause whatever the timeout was, so that it is said once.
        sent.unwrap_or_else(|_| Outcome::Retry { cause: "no answer before the request timed out".into(), after: None })
    }
}

fn user_agent() -> String {
    format!("pyebpf/{}", env!("CARGO_PKG_VERSION"))
}

fn grpc_tls(endpoint: &Endpoint, tls: &TlsMaterial) -> ClientTlsConfig {
    let mut config = ClientTlsConfig::new().domain_name(endpoint.host.trim_start_matches('[').trim_end_matches(']'));
    config = match &tls.ca_pem {
        Some(pem) => config.ca_certificate(Certificate::from_pem(pem)),
        None => config.with_native_roots(),
    };
    if let Some((cert, key)) = &tls.identity_pem {
        config = config.identity(Identity::from_pem(cert, key));
    }
    config
}

/// The headers as gRPC metadata (checked as HTTP headers already, so none is left out but
/// those gRPC cannot carry).
fn grpc_metadata(headers: &Headers) -> tonic::metadata::MetadataMap {
    let mut metadata = tonic::metadata::MetadataMap::new();
    for (name, value) in &headers.0 {
        if let (Ok(key), Ok(Ok(value))) = (tonic::metadata::AsciiMetadataKey::from_bytes(name.as_str().as_bytes()), value.to_str().map(str::parse)) {
            metadata.append(key, value);
        }
    }
    metadata
}

async fn send_grpc(grpc: &mut tonic::client::Grpc<FastGzip>, metadata: &tonic::metadata::MetadataMap, body: Bytes, timeout: Duration) -> Outcome {
    if let Err(err) = grpc.ready().await {
        return Outcome::Retry { cause: connection_cause(&*err), after: None };
    }
    let mut request = tonic::Request::new(body);
    *request.metadata_mut() = metadata.clone();
    request.set_timeout(timeout);
    match grpc.unary(request, PathAndQuery::from_static(GRPC_PATH), RawCodec).await {
        Ok(response) => delivered(response.into_inner().partial_success),
        Err(status) => grpc_outcome(&status),
    }
}

/// What a gRPC status means: codes that may pass are retried (RESOURCE_EXHAUSTED only when the
/// server says when, as OTLP asks), every other one refuses the request.
pub(super) fn grpc_outcome(status: &tonic::Status) -> Outcome {
    use tonic::Code;
    let retry_after = retry_delay(status.details());
    let text = || format!("gRPC {:?}: {}", status.code(), clip(status.message()));
    match status.code() {
        // A status made from a transport error (no answer: refused, reset, not HTTP/2) is a
        // connection failure, whatever code tonic gave it.
        Code::Unavailable | Code::Unknown if status.source().is_some() => Outcome::Retry { cause: connection_cause(status), after: retry_after },
        Code::Unavailable | Code::DeadlineExceeded | Code::Aborted | Code::Cancelled | Code::OutOfRange | Code::DataLoss => {
            Outcome::Retry { cause: text(), after: retry_after }
        }
        Code::ResourceExhausted if retry_after.is_some() => Outcome::Retry { cause: text(), after: retry_after },
        _ => Outcome::Refused(text()),
    }
}

/// A successful answer: refused in part when it says it rejected profiles.
fn delivered(partial: Option<ExportProfilesPartialSuccess>) -> Outcome {
    match partial {
        Some(partial) if partial.rejected_profiles > 0 => {
            Outcome::Refused(format!("{} profiles rejected: {}", partial.rejected_profiles, clip(&partial.error_message)))
        }
        Some(partial) if !partial.error_message.is_empty() => Outcome::Delivered { warning: Some(clip(&partial.error_message)) },
        _ => Outcome::Delivered { warning: None },
    }
}

impl HttpClient {
    async fn send(&self, body: Bytes) -> Outcome {
        let mut request = http::Request::post(self.uri.clone())
            .header(http::header::CONTENT_TYPE, "application/x-protobuf")
            .header(http::header::CONTENT_ENCODING, "gzip")
            .header(http::header::USER_AGENT, user_agent());
        for (name, value) in &self.headers.0 {
            request = request.header(name, value);
        }
        let request = match request.body(Full::new(gzip(&body))) {
            Ok(request) => request,
            Err(err) => return Outcome::Refused(format!("cannot make the request: {err}")),
        };
        let response = match self.client.request(request).await {
            Ok(response) => response,
            Err(err) => return Outcome::Retry { cause: connection_cause(&err), after: None },
        };
        let status = response.status();
        let retry_after = response.headers().get(http::header::RETRY_AFTER).and_then(|value| value.to_str().ok()?.trim().parse().ok()).map(Duration::from_secs);
        let protobuf = response.headers().get(http::header::CONTENT_TYPE).is_some_and(|kind| kind.as_bytes().starts_with(b"application/x-protobuf"));
        // A body past the bound is not read: the status alone says enough.
        let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES).collect().await.map(|body| body.to_bytes()).unwrap_or_default();
        http_outcome(status, retry_after, protobuf, &body)
    }
}

/// What an HTTP answer means: 2xx delivered (or rejected in part), 429, 502, 503 and 504
/// retried, any other status refused.
pub(super) fn http_outcome(status: http::StatusCode, retry_after: Option<Duration>, protobuf: bool, body: &[u8]) -> Outcome {
    if status.is_success() {
        // Only a protobuf answer is read: text decoded as protobuf could claim anything.
        let response = if protobuf { ExportProfilesServiceResponse::decode(body).ok() } else { None };
        return delivered(response.and_then(|response| response.partial_success));
    }
    // The collector says why as a google.rpc.Status in protobuf, others in text or JSON.
    let message = if protobuf { RpcStatus::decode(body).map(|status| status.message).ok() } else { None }
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string());
    let text = format!("HTTP {}: {}", status, clip(&message));
    match status.as_u16() {
        429 | 502 | 503 | 504 => Outcome::Retry { cause: text, after: retry_after },
        _ => Outcome::Refused(text),
    }
}

/// A gRPC channel whose messages go gzip-compressed at the level HTTP's requests are: tonic
/// compresses at gzip's default level and offers no other (0.14), at which a period's export
/// took nearly twice the CPU. tonic frames each message uncompressed; it is compressed here and
/// framed again, as gRPC frames a compressed message.
#[derive(Clone)]
pub(super) struct FastGzip(Channel);

type BoxError = Box<dyn StdError + Send + Sync>;

impl Service<http::Request<tonic::body::Body>> for FastGzip {
    type Response = http::Response<tonic::body::Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        // The channel polled ready makes the call; a clone takes its place.
        let clone = self.0.clone();
        let mut channel = std::mem::replace(&mut self.0, clone);
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let framed = body.collect().await?.to_bytes();
            let body = match compressed_frame(&framed) {
                Some(compressed) => {
                    parts.headers.insert("grpc-encoding", HeaderValue::from_static("gzip"));
                    compressed
                }
                // Not the one uncompressed message expected: sent as it is, which is valid too.
                None => framed,
            };
            let request = http::Request::from_parts(parts, tonic::body::Body::new(Full::new(body)));
            channel.call(request).await.map_err(Into::into)
        })
    }
}

/// A gRPC body of one uncompressed message, compressed and framed again (flag 1, its length
/// big-endian, the gzip stream); `None` for any other body.
pub(super) fn compressed_frame(framed: &[u8]) -> Option<Bytes> {
    let ([0, length @ ..], message) = framed.split_first_chunk::<5>()? else { return None };
    if u32::from_be_bytes(*length) as usize != message.len() {
        return None;
    }
    let compressed = gzip(message);
    let mut frame = BytesMut::with_capacity(5 + compressed.len());
    frame.put_u8(1);
    frame.put_u32(u32::try_from(compressed.len()).ok()?);
    frame.put_slice(&compressed);
    Some(frame.freeze())
}

/// The request gzip-compressed (a level that costs little; profiles compress about tenfold).
fn gzip(body: &[u8]) -> Bytes {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::with_capacity(body.len() / 4), flate2::Compression::fast());
    // Writing into a Vec cannot fail.
    let _ = encoder.write_all(body);
    encoder.finish().map(Bytes::from).unwrap_or_default()
}

/// Why a connection failed, in one line: `TLS: ...` for a certificate or handshake problem,
/// else the innermost cause (`Connection refused (os error 111)`).
pub(super) fn connection_cause(err: &(dyn StdError + 'static)) -> String {
    let mut innermost = err.to_string();
    let mut current: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(error) = current {
        if let Some(tls) = tls_error(error) {
            return format!("TLS: {tls}");
        }
        innermost = error.to_string();
        current = error.source();
    }
    innermost
}

/// A rustls error, itself or wrapped in I/O errors (whose `source` skips what they wrap).
fn tls_error<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    let mut current = error;
    loop {
        if let Some(tls) = current.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        let wrapped: &(dyn StdError + 'static) = current.downcast_ref::<std::io::Error>()?.get_ref()?;
        current = wrapped;
    }
}

/// At most [`MAX_MESSAGE_CHARS`] of a remote text, on one line.
fn clip(text: &str) -> String {
    let line: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).take(MAX_MESSAGE_CHARS).collect();
    if text.chars().count() > MAX_MESSAGE_CHARS {
        format!("{}...", line.trim_end())
    } else {
        line.trim().to_string()
    }
}

/// `google.rpc.Status`, as a refusal's details carry it.
#[derive(Clone, PartialEq, Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<prost_types_any::Any>,
}

/// `google.protobuf.Any` and `google.rpc.RetryInfo`, for the delay a busy server asks for.
mod prost_types_any {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Any {
        #[prost(string, tag = "1")]
        pub type_url: String,
        #[prost(bytes = "vec", tag = "2")]
        pub value: Vec<u8>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RetryInfo {
        #[prost(message, optional, tag = "1")]
        pub retry_delay: Option<Duration>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Duration {
        #[prost(int64, tag = "1")]
        pub seconds: i64,
        #[prost(int32, tag = "2")]
        pub nanos: i32,
    }
}

/// The RetryInfo delay among a gRPC status's details, if the server gave one.
fn retry_delay(details: &[u8]) -> Option<Duration> {
    let status = RpcStatus::decode(details).ok()?;
    let info = status.details.iter().find(|any| any.type_url.ends_with("google.rpc.RetryInfo"))?;
    let delay = prost_types_any::RetryInfo::decode(&info.value[..]).ok()?.retry_delay?;
    let seconds = u64::try_from(delay.seconds).ok()?;
    Some(Duration::from_secs(seconds) + Duration::from_nanos(u64::try_from(delay.nanos).unwrap_or(0).min(999_999_999)))
}

/// Sends an already-encoded request as it is, and decodes the answer with prost.
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = ExportProfilesServiceResponse;
    type Encoder = RawEncoder;
    type Decoder = tonic_prost::ProstDecoder<ExportProfilesServiceResponse>;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::new(Default::default())
    }
}

struct RawEncoder;

impl Encoder for RawEncoder {
    type Item = Bytes;
    type Error = tonic::Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put(item);
        Ok(())
    }
}
