//! A simulated llama.cpp server as a tower service.
//!
//! A request carries a [`Prompt`]. The backend takes an idle slot, finds the prompt's longest
//! cached prefix ([`BackendCache`]), and answers after
//!
//! ```text
//! time to first token = queue + restore + uncached tokens / prefill rate + overhead
//! ```
//!
//! where `queue` is the wait for the backend's GPU (prompt processing of concurrent requests is
//! serialised, as one GPU pair processes one batch of prompt tokens at a time) and `restore` is
//! the copy of a RAM-cached state into the slot. The response body then streams the answer for
//! its decode time and frees the slot when it ends, keeping the prompt and the answer as the
//! slot's KV: that is what the router's slot guard waits for too.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

use crate::cache::{self, Admission, BackendCache, Block, Blocks, RamCache, Source};

/// What a request carries: the prompt, and the answer it will generate (its id lets the
/// next turn of the same session match it).
#[derive(Clone, Debug)]
pub(crate) struct Prompt {
    pub(crate) blocks: Blocks,
    pub(crate) answer: Block,
}

/// Speeds and sizes of one backend class.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Model {
    /// Prompt tokens processed per second.
    pub(crate) prefill_tps: f64,
    /// Tokens of KV restored from the RAM cache per second.
    pub(crate) restore_tps: f64,
    /// Tokens generated per second by one slot.
    pub(crate) decode_tps: f64,
    /// Fixed cost of a request until its first token: template, sampling, first decode step.
    pub(crate) overhead: Duration,
    /// Requests served at once (`--parallel`).
    pub(crate) slots: u32,
    /// Host-memory prompt cache budget (`--cache-ram`).
    pub(crate) ram_bytes: u64,
    /// KV bytes per token in host memory.
    pub(crate) kv_bytes_per_token: u64,
    /// Tokens of KV the GPUs hold over all slots.
    pub(crate) vram_tokens: u64,
}

impl Model {
    /// Tokens of prompt the backend keeps: its slots' KV in VRAM and its RAM cache. What the
    /// router's cache model is told.
    pub(crate) fn cache_tokens(&self) -> u64 {
        self.vram_tokens + self.ram_bytes / self.kv_bytes_per_token.max(1)
    }

    /// Restore and prefill time for a prompt of which `reused` tokens were cached, `restored`
    /// of them copied from RAM.
    pub(crate) fn work(&self, prompt_tokens: u64, reused: u64, restored: u64) -> Duration {
        let uncached = prompt_tokens.saturating_sub(reused);
        Duration::from_secs_f64(
            restored as f64 / self.restore_tps + uncached as f64 / self.prefill_tps,
        )
    }

    /// Time to first token on an idle backend.
    #[cfg(test)]
    pub(crate) fn ttft(&self, prompt_tokens: u64, reused: u64, restored: u64) -> Duration {
        self.work(prompt_tokens, reused, restored) + self.overhead
    }

    pub(crate) fn decode(&self, tokens: u32) -> Duration {
        Duration::from_secs_f64(f64::from(tokens) / self.decode_tps)
    }
}

/// What the backend did for a request; put in the response's extensions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Served {
    pub(crate) reused: u64,
    pub(crate) source: Source,
}

struct State {
    cache: BackendCache,
    /// When the GPU finishes the prompt work already queued.
    gpu_free: Instant,
    /// Under `--vram wait`, the requests waiting to be admitted, in arrival order.
    queue: VecDeque<u64>,
    next_ticket: u64,
    /// Under `--gpu-work all`, when the GPU read prompts, restored and saved states, oldest
    /// first (disjoint, as the work is queued): decoding slots stall meanwhile.
    busy: VecDeque<(Instant, Instant)>,
}

/// What takes the GPU's time (`--gpu-work`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum GpuWork {
    /// Reading prompts and restoring states, one after another; decoding goes on beside
    /// them, and saving a state to RAM is free.
    #[default]
    Prompts,
    /// As llama-server runs them, in one loop: saving a state to RAM takes the time a
    /// restore of as many tokens does, and a decoding slot makes no progress while the GPU
    /// reads another prompt or copies a state (a rough model of one batch shared by all).
    All,
}

impl GpuWork {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "prompts" => Some(GpuWork::Prompts),
            "all" => Some(GpuWork::All),
            _ => None,
        }
    }
}

thread_local! {
    static GPU_WORK: std::cell::Cell<GpuWork> = const { std::cell::Cell::new(GpuWork::Prompts) };
}

/// Sets what takes the GPU's time on the backends built on this thread from now on.
pub(crate) fn set_gpu_work(w: GpuWork) {
    GPU_WORK.with(|c| c.set(w));
}

/// How long the GPU's busy times are kept: longer than any answer decodes.
const BUSY_KEPT: Duration = Duration::from_secs(3600);

struct Inner {
    model: Model,
    gpu_work: GpuWork,
    state: Mutex<State>,
    freed: Notify,
}

/// One simulated backend. Clones share the backend.
#[derive(Clone)]
pub(crate) struct SimBackend {
    inner: Arc<Inner>,
}

impl SimBackend {
    pub(crate) fn new(model: Model) -> Self {
        let ram = RamCache::new(model.ram_bytes, model.kv_bytes_per_token);
        SimBackend {
            inner: Arc::new(Inner {
                model,
                gpu_work: GPU_WORK.with(std::cell::Cell::get),
                state: Mutex::new(State {
                    cache: BackendCache::new(model.slots as usize, model.vram_tokens, ram),
                    gpu_free: Instant::now(),
                    queue: VecDeque::new(),
                    next_ticket: 0,
                    busy: VecDeque::new(),
                }),
                freed: Notify::new(),
            }),
        }
    }

    /// Tokens of `prompt` this backend's caches hold (see [`BackendCache::holds`]).
    pub(crate) fn holds(&self, prompt: &[crate::cache::Block]) -> u64 {
        self.inner.state.lock().cache.holds(prompt)
    }

    /// States evicted from the RAM cache so far.
    pub(crate) fn ram_evictions(&self) -> u64 {
        self.inner.state.lock().cache.evictions()
    }

    /// Admissions after which the busy slots' KV exceeded the VRAM, and all admissions.
    pub(crate) fn over_vram(&self) -> (u64, u64) {
        self.inner.state.lock().cache.over_vram()
    }
}

impl fmt::Debug for SimBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimBackend")
            .field("model", &self.inner.model)
            .finish_non_exhaustive()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tower::Service<http::Request<Prompt>> for SimBackend {
    type Response = http::Response<Answer>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Prompt>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move {
            let slot = req
                .extensions()
                .get::<tower_affinity::AssignedSlot>()
                .map(|s| s.index() as usize);
            let prompt = req.into_body();
            let (admission, first_token, work) = admit(&inner, &prompt.blocks, slot).await;
            tokio::time::sleep_until(first_token).await;
            let served = Served {
                reused: admission.reused,
                source: admission.source,
            };
            let mut kv = prompt.blocks.to_vec();
            kv.push(prompt.answer);
            let decode = inner.model.decode(prompt.answer.tokens);
            let prompt_tokens = cache::tokens(&prompt.blocks);
            let read = prompt_tokens.saturating_sub(admission.reused);
            // What llama-server's last chunk says: its usage, and its own timings.
            let last = format!(
                "data: {{\"choices\":[{{\"delta\":{{}},\"finish_reason\":\"stop\"}}],\
                 \"usage\":{{\"prompt_tokens\":{prompt_tokens},\"completion_tokens\":{},\
                 \"prompt_tokens_details\":{{\"cached_tokens\":{}}}}},\
                 \"timings\":{{\"cache_n\":{},\"prompt_n\":{read},\"prompt_ms\":{:.1}}}}}\n\n\
                 data: [DONE]\n\n",
                prompt.answer.tokens,
                admission.reused,
                admission.reused,
                work.as_secs_f64() * 1000.0,
            );
            let body = Answer {
                first: Some(Bytes::from_static(FIRST_CHUNK)),
                last: Some(Bytes::from(last)),
                lease: Some(Lease {
                    inner,
                    slot: admission.slot,
                    kv: kv.into(),
                }),
                done: Box::pin(tokio::time::sleep(decode)),
                decoding: (first_token, decode),
            };
            let mut res = http::Response::new(body);
            res.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/event-stream"),
            );
            res.extensions_mut().insert(served);
            Ok(res)
        })
    }
}

/// Takes a slot (waiting for one if the router sent more than the backend has) and queues the
/// prompt's work on the GPU; returns the admission, the time of the first token, and the
/// prompt's own work (restore and prefill, without the queue). Under `--vram wait` the
/// requests are admitted in the order they came, as a scheduler that waits for room serves
/// its queue: a long prompt is not passed by shorter ones that fit.
async fn admit(
    inner: &Inner,
    prompt: &Blocks,
    slot: Option<usize>,
) -> (Admission, Instant, Duration) {
    let _turn = {
        let mut s = inner.state.lock();
        s.cache.waits_for_vram().then(|| {
            let ticket = s.next_ticket;
            s.next_ticket += 1;
            s.queue.push_back(ticket);
            Turn { inner, ticket }
        })
    };
    let ticket = _turn.as_ref().map(|t| t.ticket);
    loop {
        let freed = inner.freed.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        {
            let mut s = inner.state.lock();
            let first = ticket.is_none_or(|t| s.queue.front() == Some(&t));
            if let Some(a) = first.then(|| s.cache.admit_in(prompt, slot)).flatten() {
                let now = Instant::now();
                let start = s.gpu_free.max(now);
                let mut work = inner
                    .model
                    .work(cache::tokens(prompt), a.reused, a.restored);
                let saved = s.cache.take_saved();
                if inner.gpu_work == GpuWork::All {
                    work += Duration::from_secs_f64(saved as f64 / inner.model.restore_tps);
                    if !work.is_zero() {
                        s.busy.push_back((start, start + work));
                    }
                    while s
                        .busy
                        .front()
                        .is_some_and(|&(_, end)| end + BUSY_KEPT < now)
                    {
                        s.busy.pop_front();
                    }
                }
                s.gpu_free = start + work;
                return (a, start + work + inner.model.overhead, work);
            }
        }
        freed.await;
    }
}

/// A request's place in the backend's queue; left, letting the next try, when dropped.
struct Turn<'a> {
    inner: &'a Inner,
    ticket: u64,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.inner.state.lock().queue.retain(|&t| t != self.ticket);
        self.inner.freed.notify_waiters();
    }
}

/// A slot in use; freed, keeping `kv`, when dropped.
struct Lease {
    inner: Arc<Inner>,
    slot: usize,
    kv: Blocks,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.inner
            .state
            .lock()
            .cache
            .release(self.slot, self.kv.clone());
        self.inner.freed.notify_waiters();
    }
}

/// The first chunk of a stream, sent with the first token.
const FIRST_CHUNK: &[u8] = b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n";

/// The streamed answer, as llama-server sends one: a chunk with the first token, then once
/// decoding is done the last chunk with its usage and timings, then the end. The slot is
/// freed before the end is reported, so the router's slot and the backend's free together.
pub(crate) struct Answer {
    first: Option<Bytes>,
    last: Option<Bytes>,
    lease: Option<Lease>,
    done: Pin<Box<Sleep>>,
    /// When decoding began, and how long it takes on a GPU doing nothing else.
    decoding: (Instant, Duration),
}

impl Answer {
    /// Under [`GpuWork::All`], when decoding ends: its own time after the GPU's other work
    /// since it began, up to that end (a fixed point: work queued while it stalls stalls it
    /// further). `None` otherwise.
    fn stalled_end(&self) -> Option<Instant> {
        let lease = self.lease.as_ref()?;
        if lease.inner.gpu_work != GpuWork::All {
            return None;
        }
        let (from, decode) = self.decoding;
        let s = lease.inner.state.lock();
        let mut end = from + decode;
        loop {
            let stalled: Duration = (s.busy.iter())
                .filter(|&&(a, b)| b > from && a < end)
                .map(|&(a, b)| b.min(end) - a.max(from))
                .sum();
            let next = from + decode + stalled;
            if next <= end {
                return Some(end);
            }
            end = next;
        }
    }
}

impl fmt::Debug for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Answer")
            .field("streaming", &self.lease.is_some())
            .finish()
    }
}

impl Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        if self.lease.is_none() {
            return Poll::Ready(None);
        }
        if self.done.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        if let Some(end) = self.stalled_end().filter(|&end| end > Instant::now()) {
            self.done.as_mut().reset(end);
            if self.done.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
        self.lease = None;
        Poll::Ready(self.last.take().map(|last| Ok(Frame::data(last))))
    }

    fn is_end_stream(&self) -> bool {
        self.lease.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet;

    fn secs(d: Duration) -> f64 {
        d.as_secs_f64()
    }

    #[test]
    fn prefill_time_arithmetic() {
        let radeon = fleet::radeon_vii_pair(4, 8 << 30);
        let a4000 = fleet::a4000_pair(5, 8 << 30);
        // A cold 30,000-token prompt: about 150 s on a Radeon VII pair, a third of that on an
        // A4000 pair.
        assert!((secs(radeon.ttft(30_000, 0, 0)) - 150.5).abs() < 1e-9);
        assert!((secs(a4000.ttft(30_000, 0, 0)) - 50.5).abs() < 1e-9);
        // A warm turn appends a typical tool output to a cached context: about 1.3 s.
        assert!((secs(radeon.ttft(30_160, 30_000, 0)) - 1.3).abs() < 1e-9);
        // Restoring 30,000 tokens from RAM is far cheaper than prefilling them.
        let restored = secs(radeon.ttft(30_160, 30_000, 30_000));
        assert!((restored - 2.5).abs() < 1e-9, "{restored}");
    }

    #[tokio::test(start_paused = true)]
    async fn slot_is_busy_until_the_answer_has_streamed() {
        use http_body_util::BodyExt;
        use tower::ServiceExt;

        let model = fleet::radeon_vii_pair(1, 1 << 30);
        let backend = SimBackend::new(model);
        let prompt = |answer| Prompt {
            blocks: vec![Block {
                id: 1,
                tokens: 2000,
            }]
            .into(),
            answer: Block {
                id: answer,
                tokens: 180,
            },
        };
        let t0 = Instant::now();
        let res = backend
            .clone()
            .oneshot(http::Request::new(prompt(2)))
            .await
            .unwrap();
        assert_eq!(t0.elapsed(), model.ttft(2000, 0, 0));
        let second = tokio::spawn(backend.clone().oneshot(http::Request::new(prompt(3))));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!second.is_finished(), "the only slot is still streaming");
        res.into_body().collect().await.unwrap();
        let res2 = second.await.unwrap().unwrap();
        let served = res2.extensions().get::<Served>().unwrap();
        assert_eq!((served.source, served.reused), (Source::Slot, 2000));
    }

    /// A prompt of one block `id` of `tokens`, answered in `answer` tokens.
    fn ask(id: u64, tokens: u32, answer: u32) -> http::Request<Prompt> {
        let blocks = vec![Block { id, tokens }].into();
        let answer = Block {
            id: id + 100,
            tokens: answer,
        };
        http::Request::new(Prompt { blocks, answer })
    }

    /// On a 2-slot backend doing `work`: A's answer of 180 tokens (10 s of decoding) while B's
    /// prompt of 2,000 tokens (10 s of prefill) is read; how long A's answer took to end.
    async fn decoding_beside_a_prompt(work: GpuWork) -> Duration {
        use http_body_util::BodyExt;
        use tower::ServiceExt;

        set_gpu_work(work);
        let backend = SimBackend::new(fleet::radeon_vii_pair(2, 1 << 30));
        set_gpu_work(GpuWork::Prompts);
        let a = backend.clone().oneshot(ask(1, 200, 180)).await.unwrap();
        let decoding = Instant::now();
        let b = tokio::spawn(backend.clone().oneshot(ask(2, 2_000, 10)));
        a.into_body().collect().await.unwrap();
        let took = decoding.elapsed();
        drop(b.await.unwrap().unwrap());
        took
    }

    #[tokio::test(start_paused = true)]
    async fn decoding_stalls_while_the_gpu_reads_another_prompt_only_when_all_work_counts() {
        assert_eq!(
            decoding_beside_a_prompt(GpuWork::Prompts).await,
            Duration::from_secs(10)
        );
        assert_eq!(
            decoding_beside_a_prompt(GpuWork::All).await,
            Duration::from_secs(20)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn saving_a_state_takes_gpu_time_only_when_all_work_counts() {
        use tower::ServiceExt;

        // One slot: A's 25,000 tokens and answer, then a stranger, which takes the slot as
        // the least recently used and saves A's state (25,010 tokens) first: 1 s at 25,000
        // tokens a second.
        let stranger_first_token = |work| async move {
            set_gpu_work(work);
            let backend = SimBackend::new(fleet::radeon_vii_pair(1, 8 << 30));
            set_gpu_work(GpuWork::Prompts);
            drop(backend.clone().oneshot(ask(1, 25_000, 10)).await.unwrap());
            let sent = Instant::now();
            drop(backend.oneshot(ask(2, 200, 10)).await.unwrap());
            sent.elapsed()
        };
        let free = stranger_first_token(GpuWork::Prompts).await;
        let paid = stranger_first_token(GpuWork::All).await;
        // (Tokio's timers count whole milliseconds.)
        let save = Duration::from_secs_f64(25_010.0 / 25_000.0);
        assert!(
            (paid - free).abs_diff(save) <= Duration::from_millis(1),
            "{paid:?} {free:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_for_vram_a_short_prompt_does_not_pass_a_long_one() {
        use http_body_util::BodyExt;
        use tower::ServiceExt;

        cache::set_vram(cache::Vram::Wait);
        let backend = SimBackend::new(Model {
            vram_tokens: 1_000,
            ..fleet::radeon_vii_pair(3, 1 << 30)
        });
        cache::set_vram(cache::Vram::Run);
        let running = backend.clone().oneshot(ask(1, 700, 10)).await.unwrap();
        // 800 tokens do not fit beside 700; 100 would, but came later.
        let long = tokio::spawn(backend.clone().oneshot(ask(2, 800, 10)));
        tokio::task::yield_now().await;
        let short = tokio::spawn(backend.clone().oneshot(ask(3, 100, 10)));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!long.is_finished() && !short.is_finished());
        running.into_body().collect().await.unwrap();
        let long = long.await.unwrap().unwrap();
        let long_at = Instant::now();
        short.await.unwrap().unwrap();
        assert!(
            Instant::now() > long_at,
            "the short prompt passed the long one"
        );
        drop(long);
    }
}
