//! The exporter's thread: it receives a period's profiles from the sampling loop, encodes them
//! into one request when the period ends, queues it and sends the queue, on a tokio runtime of
//! its own so that neither encoding nor a slow collector holds the sampling back.

use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use tokio::sync::mpsc;

use super::model::{self, Context};
use super::queue::{self, Encoded, Shared};
use super::tls::TlsMaterial;
use super::transport::Transport;
use super::OtlpTotals;
use super::{OtlpError, OtlpOptions};
use crate::stack::Profile;

enum Order {
    /// A piece of the current period (the whole of it, unless `--rotate` cut it too).
    Piece(Arc<Profile>),
    /// The period ends: its pieces become a request.
    EndPeriod,
    /// No more periods: deliver what is queued within the flush timeout.
    Close,
}

/// The handle the recording keeps.
pub struct Exporter {
    messages: mpsc::UnboundedSender<Order>,
    shared: Arc<Shared>,
    thread: std::thread::JoinHandle<OtlpTotals>,
}

impl Exporter {
    /// Checks the TLS files, makes the client and starts the thread; nothing is sent yet.
    pub fn start(options: OtlpOptions) -> Result<Exporter, OtlpError> {
        let tls = TlsMaterial::load(&options.tls)?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(OtlpError::Start)?;
        // tonic's channel starts its worker in the runtime it is made in.
        let transport = {
            let _entered = runtime.enter();
            Transport::new(&options.endpoint, &tls, &options.headers)?
        };
        let (messages, received) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared::new(options.queue_bytes, options.endpoint.to_string()));
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("pyebpf-otlp".into())
            .spawn(move || runtime.block_on(run(options, transport, thread_shared, received)))
            .map_err(OtlpError::Start)?;
        Ok(Exporter { messages, shared, thread })
    }

    /// Adds a piece of the current period.
    pub fn add(&self, piece: Arc<Profile>) {
        // The thread only stops after Close: a send cannot fail before.
        let _ = self.messages.send(Order::Piece(piece));
    }

    /// Ends the current period: its pieces are encoded and queued.
    pub fn end_period(&self) {
        let _ = self.messages.send(Order::EndPeriod);
    }

    /// What the exporter has to say since the last call, one `otlp: ...` line each, for the
    /// recording to print (until [`Exporter::close`], which has the rest said at once).
    pub fn take_lines(&self) -> Vec<String> {
        self.shared.take_lines()
    }

    /// No more periods: from now on, the queue has `--otlp-flush-timeout` to be delivered.
    pub fn close(&self) {
        let _ = self.messages.send(Order::Close);
    }

    /// Waits for the thread (after [`Exporter::close`]); what the export came to.
    pub fn join(self) -> OtlpTotals {
        self.close();
        self.thread.join().unwrap_or_else(|_| {
            crate::report!("otlp: the exporter failed");
            OtlpTotals::default()
        })
    }
}

/// Receives pieces and ends of periods, encodes and queues each period, and sends the queue
/// meanwhile; returns once the queue is delivered or dropped after the end.
async fn run(options: OtlpOptions, transport: Transport, shared: Arc<Shared>, mut received: mpsc::UnboundedReceiver<Order>) -> OtlpTotals {
    let endpoint = options.endpoint.to_string();
    let sender = tokio::spawn(queue::send_all(Arc::clone(&shared), transport, endpoint));
    let context = Context { service_name: &options.service_name, host_name: &options.host_name };
    let mut pieces = Vec::new();
    loop {
        match received.recv().await {
            Some(Order::Piece(piece)) => pieces.push(piece),
            Some(Order::EndPeriod) => {
                if model::untimed(&pieces) {
                    shared.count_untimed();
                }
                for request in encode(&std::mem::take(&mut pieces), &context, MAX_REQUEST_BYTES) {
                    shared.push(request);
                }
                // Let the sender start on it before the next period comes.
                tokio::task::yield_now().await;
            }
            Some(Order::Close) | None => break,
        }
    }
    shared.close(tokio::time::Instant::now() + options.flush_timeout);
    // The sender stops by the deadline; the extra second covers a request cut at it. Whatever
    // it left is counted as dropped.
    let _ = tokio::time::timeout(options.flush_timeout + Duration::from_secs(1), sender).await;
    queue::drop_the_rest(&shared);
    shared.totals()
}

/// The largest request made when a period can be split: gRPC servers refuse messages past 4 MiB
/// unless told otherwise (the collector's receiver among them).
const MAX_REQUEST_BYTES: usize = 3 << 20;

/// The period's requests, encoded: one, or for a period past `max_bytes` as many as it takes, each
/// with a share of the processes (a process is never split); none for a period without samples.
pub(super) fn encode(pieces: &[Arc<Profile>], context: &Context<'_>, max_bytes: usize) -> Vec<Encoded> {
    let whole = model::request(pieces, context, None);
    let body = whole.message.encode_to_vec();
    let pids = model::pids(&whole.message);
    if pids.is_empty() {
        return Vec::new();
    }
    let parts = body.len().div_ceil(max_bytes.max(1)).clamp(1, pids.len());
    if parts == 1 {
        return vec![Encoded { body: body.into(), samples: whole.samples, ends_period: true }];
    }
    let chunks: Vec<&[u32]> = pids.chunks(pids.len().div_ceil(parts)).collect();
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(index, chunk)| {
            let part = model::request(pieces, context, Some(chunk));
            Encoded { body: part.message.encode_to_vec().into(), samples: part.samples, ends_period: index == last }
        })
        .collect()
}
