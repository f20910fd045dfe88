//! The requests waiting to be sent, in order and within a memory bound (the oldest goes first
//! when a new one does not fit), and the sender that delivers them one at a time: what may pass
//! later is retried with exponential backoff and jitter (or when the collector says), what is
//! refused is counted and left. Each distinct problem is said once on standard error.

use std::collections::hash_map::RandomState;
use std::collections::{HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::transport::{Outcome, Transport};
use super::OtlpTotals;
use crate::report;

/// The first retry's delay; each next one doubles, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// Short enough that a collector back from a restart gets the waiting periods within seconds.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// The longest wait a collector's `Retry-After` or RetryInfo is followed for.
const MAX_SERVER_DELAY: Duration = Duration::from_secs(60);
/// The longest one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Distinct problems said at most; past that, they are only counted.
const MAX_CAUSES: usize = 64;

/// One encoded request: a period, or a part of one too large for a single request.
pub(super) struct Encoded {
    pub body: Bytes,
    pub samples: u64,
    /// The period's last (or only) request: its delivery counts the period as sent.
    pub ends_period: bool,
}

struct Queued {
    seq: u64,
    period: Encoded,
}

/// What the encoder and the sender share.
pub(super) struct Shared {
    state: Mutex<State>,
    /// A period was queued, or the end began.
    wake: Notify,
}

struct State {
    queue: VecDeque<Queued>,
    bytes: usize,
    limit: usize,
    next_seq: u64,
    /// Set when the run ends: no period comes after, and what is not sent by then is dropped.
    deadline: Option<Instant>,
    totals: OtlpTotals,
    causes: HashSet<String>,
    told_full: bool,
    /// What is to be said, kept while the recording's status line is up (its loop prints them
    /// without tearing it); None: said at once.
    lines: Option<Vec<String>>,
}

impl Shared {
    pub fn new(limit: usize, endpoint: String) -> Shared {
        let totals = OtlpTotals { endpoint, ..OtlpTotals::default() };
        let state = State {
            queue: VecDeque::new(),
            bytes: 0,
            limit,
            next_seq: 0,
            deadline: None,
            totals,
            causes: HashSet::new(),
            told_full: false,
            lines: Some(Vec::new()),
        };
        Shared { state: Mutex::new(state), wake: Notify::new() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere leaves counters that are still worth reporting.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues a period, dropping the oldest ones (or, larger than the whole bound, this one)
    /// until it fits.
    pub fn push(&self, period: Encoded) {
        let mut state = self.lock();
        let size = period.body.len();
        if size > state.limit {
            state.drop_for_room(1);
            return;
        }
        while state.bytes + size > state.limit {
            let Some(oldest) = state.queue.pop_front() else { break };
            state.bytes -= oldest.period.body.len();
            state.drop_for_room(1);
        }
        let seq = state.next_seq;
        state.next_seq += 1;
        state.bytes += size;
        state.queue.push_back(Queued { seq, period });
        drop(state);
        self.wake.notify_one();
    }

    /// No period comes after this; the sender stops at `deadline` at the latest. What is still
    /// to be said is said, and what comes later is said at once.
    pub fn close(&self, deadline: Instant) {
        let mut state = self.lock();
        state.deadline = Some(deadline);
        for line in state.lines.take().unwrap_or_default() {
            report!("{line}");
        }
        drop(state);
        self.wake.notify_one();
    }

    /// The lines to say (`pyebpf: ` not included) since the last call.
    pub fn take_lines(&self) -> Vec<String> {
        self.lock().lines.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// A period goes without timestamps: it had too many events.
    pub fn count_untimed(&self) {
        self.lock().totals.untimed += 1;
    }

    pub fn totals(&self) -> OtlpTotals {
        self.lock().totals.clone()
    }
}

impl State {
    fn drop_for_room(&mut self, count: u64) {
        self.totals.dropped += count;
        if !self.told_full {
            self.told_full = true;
            self.say("otlp: the periods waiting to be sent exceed --otlp-queue-mb: dropping the oldest".into());
        }
    }

    /// Says `line` unless it was said already.
    fn tell_once(&mut self, line: String) {
        if self.causes.len() < MAX_CAUSES && self.causes.insert(line.clone()) {
            self.say(format!("otlp: {line}"));
        }
    }

    fn say(&mut self, line: String) {
        match &mut self.lines {
            Some(lines) => lines.push(line),
            None => report!("{line}"),
        }
    }

    /// Removes the period `seq` if it is still queued (the bound may have dropped it while it was
    /// being sent); whether it was.
    fn take(&mut self, seq: u64) -> bool {
        match self.queue.front() {
            Some(front) if front.seq == seq => {
                let front = self.queue.pop_front().map_or(0, |front| front.period.body.len());
                self.bytes -= front;
                true
            }
            _ => false,
        }
    }
}

/// Sends the queued periods until the run ends and the queue is empty or its deadline passed.
pub(super) async fn send_all(shared: Arc<Shared>, mut transport: Transport, endpoint: String) {
    let mut backoff = Backoff::default();
    loop {
        let wake = shared.wake.notified();
        let (next, deadline) = {
            let state = shared.lock();
            (state.queue.front().map(|front| (front.seq, front.period.body.clone(), (front.period.samples, front.period.ends_period))), state.deadline)
        };
        let Some((seq, body, counts)) = next else {
            if deadline.is_some() {
                return;
            }
            wake.await;
            continue;
        };
        let timeout = deadline.map_or(REQUEST_TIMEOUT, |deadline| REQUEST_TIMEOUT.min(deadline.saturating_duration_since(Instant::now())));
        if timeout.is_zero() {
            drop_the_rest(&shared);
            return;
        }
        let outcome = tokio::select! {
            outcome = transport.send(body, timeout) => outcome,
            // A request under way when the end's deadline passes is cut there.
            _ = until_deadline(&shared) => {
                drop_the_rest(&shared);
                return;
            }
        };
        let retry = record(&shared, seq, counts, outcome, &endpoint);
        match retry {
            None => backoff = Backoff::default(),
            Some(after) => {
                let delay = after.map_or_else(|| backoff.next(), |after| after.min(MAX_SERVER_DELAY));
                wait(&shared, delay).await;
            }
        }
    }
}

/// Counts what became of request `seq` (its samples, and whether it ends its period) and says
/// what went wrong; the wait before a retry, if it is to be retried (Some(None): as the backoff
/// says).
fn record(shared: &Shared, seq: u64, (samples, ends_period): (u64, bool), outcome: Outcome, endpoint: &str) -> Option<Option<Duration>> {
    let mut state = shared.lock();
    match outcome {
        Outcome::Delivered { warning } => {
            if !state.take(seq) {
                // Dropped for room while it was being sent, but it got there.
                state.totals.dropped = state.totals.dropped.saturating_sub(1);
            }
            state.totals.periods_sent += u64::from(ends_period);
            state.totals.samples_sent += samples;
            if let Some(warning) = warning {
                state.tell_once(format!("the collector accepted a period with a warning: {warning}"));
            }
            None
        }
        Outcome::Refused(cause) => {
            if state.take(seq) {
                state.totals.refused += 1;
            }
            state.tell_once(format!("the collector refused a period: {cause}"));
            None
        }
        Outcome::Retry { cause, after } => {
            let line = if cause.starts_with("HTTP ") || cause.starts_with("gRPC ") {
                format!("the collector at {endpoint} cannot take a period now: {cause} (retrying)")
            } else {
                format!("cannot connect to {endpoint}: {cause}")
            };
            state.tell_once(line);
            state.totals.retries += 1;
            Some(after)
        }
    }
}

/// Waits `delay` before a retry, or less when the run's deadline comes first.
async fn wait(shared: &Shared, delay: Duration) {
    let until = Instant::now() + delay;
    loop {
        let wake = shared.wake.notified();
        let deadline = shared.lock().deadline;
        let end = deadline.map_or(until, |deadline| deadline.min(until));
        if Instant::now() >= end {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(end) => return,
            // The end of the run may bring the deadline nearer.
            _ = wake => {}
        }
    }
}

/// Returns when the run has ended and its deadline passed.
async fn until_deadline(shared: &Shared) {
    loop {
        let wake = shared.wake.notified();
        let deadline = shared.lock().deadline;
        match deadline {
            Some(deadline) => return tokio::time::sleep_until(deadline).await,
            None => wake.await,
        }
    }
}

/// At the deadline: what is still queued is dropped, and counted.
pub(super) fn drop_the_rest(shared: &Shared) {
    let mut state = shared.lock();
    let left = state.queue.len() as u64;
    state.queue.clear();
    state.bytes = 0;
    if left > 0 {
        state.totals.dropped += left;
        state.say(format!("otlp: {left} periods not delivered within --otlp-flush-timeout: dropped"));
    }
}

/// Exponential backoff with jitter: each delay is drawn between half and all of the current
/// step, so that many profilers do not retry in step.
#[derive(Default)]
pub(super) struct Backoff {
    attempt: u32,
}

impl Backoff {
    pub fn next(&mut self) -> Duration {
        let step = FIRST_BACKOFF.saturating_mul(1 << self.attempt.min(16)).min(MAX_BACKOFF);
        self.attempt = self.attempt.saturating_add(1);
        let half = step / 2;
        let jitter = RandomState::new().hash_one(self.attempt) % (half.as_millis() as u64 + 1);
        half + Duration::from_millis(jitter)
    }
}
