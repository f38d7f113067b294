//! What the backends' answers teach: per backend, the prompt and reused tokens they report,
//! their time to first byte, how long their requests take and how fast they read a prompt;
//! and from those, whether a request whose cache is on a full backend should wait for it or
//! move.
//!
//! Every figure is an atomic of the backend's [`Load`](crate::fleet::Load), written once per
//! answer that reports one, so that reading them on the placement path takes no lock. The
//! prefill rate, the request time and the time to first byte are moving averages of the
//! median of each answer's figure and the two before it: one odd answer (a cached prompt said
//! to be read in a millisecond, a request stalled for minutes) moves none of them, and a
//! backend that got slower or faster is followed from its second answer on. Each moving
//! average gives the newest figure a weight of 1/4. A backend's first answer teaches each
//! figure alone until its third, whose median of the three replaces it: an odd first answer
//! (a prompt read while the weights are paged in) is forgotten then, and an odd second one
//! moves nothing.
//!
//! # Wait versus move
//!
//! When the backend holding a request's prefix is full and another has room:
//!
//! - the wait for a slot there is estimated from its requests in flight (how long they have
//!   run, on average, from the sum of their start times) against how long its requests take
//!   (learned), and from the requests already waiting whose cache is there: its next slots go
//!   to them first, one every request time over its requests in flight. A slot freed there
//!   and promised to a waiter that has not run yet is a request starting now, that waiter's;
//! - the cost of moving is the prompt tokens the other backend would read again (what the
//!   cache model says it lacks), after those it is still reading for the requests it has not
//!   answered yet, divided by its learned prefill rate. A backend reads one prompt after
//!   another (llama.cpp shares one batch among its slots): a free slot behind a long cold
//!   prompt is no sooner than a busy home;
//! - the move's read is counted for every request it delays, not only for the request
//!   moved: a backend reads one prompt after another, so each request that reaches it while
//!   it reads waits as long again. By Little's law, requests reach a backend at its requests
//!   in flight (this one included) over its learned request time a second. A move reads the
//!   whole prompt in front of the other backend's turns, and under load that is the larger
//!   part of what it costs; staying reads only what the home lacks, for a warm turn a few
//!   hundred tokens whose delay to others is second order, and is counted as the request's
//!   own read alone.
//!
//! If the wait is the cheaper, the request waits for the full backend, at most as long as
//! moving would cost more than staying; then it moves. Waiting up to the price of the
//! alternative and then paying it never costs more than twice the better choice made with
//! hindsight (the ski-rental bound, on the costs counted so), however wrong the estimate of
//! the wait was.
//!
//! Tokens are counted as the backend counts them: the cache model's figures are the chain's
//! estimate (four bytes a token, a digit a token), and each answer teaches the backend's own
//! tokens per token of the estimate: a ratio of two moving averages, of the backend's counts
//! and of the estimates, so that a long prompt weighs more than a short one. An answer that
//! counts more than twice what the scale learned so far makes of its estimate, or less than
//! half, moves nothing unless the answer before it was odd on the same side: a prompt the
//! backend truncated or counted only in part does not halve the context a request is taken
//! to need there. A backend removed and announced again learns that scale again, as it may
//! be another model with another tokenizer; an answer to a request sent to it before it came
//! back is the old server's, and teaches nothing. A backend that has not taught its prefill
//! rate or that scale yet (a new one, or one this router replica has not sent to yet) is
//! taken to read as the fleet's others do, on average. Until the home's request time and some
//! backend's rate are learned, the request moves at once, as it did before anything was
//! learned.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::cache::Verdict;
use crate::Usage;

/// The weight of the newest answer in the learned averages.
const ALPHA: f64 = 0.25;

/// Prompts shorter than this many read tokens teach nothing about the prefill rate: their
/// time is mostly the fixed cost of a request.
const MIN_READ_FOR_RATE: u64 = 256;

/// A read timed shorter than this was not timed: no backend reads `MIN_READ_FOR_RATE` tokens
/// in under a millisecond.
const MIN_READ_TIME: Duration = Duration::from_millis(1);

/// An answer whose prompt counts more than this many times the learned token scale's tokens,
/// or fewer than its inverse, is odd: one alone teaches nothing of the scale.
const ODD_SCALE: f64 = 2.0;

/// A request is a misprediction when the backend reused less than half the share of its
/// prompt the cache model predicted, and the model predicted at least this share.
const MIN_PREDICTED_SHARE: f64 = 0.25;

/// One backend's learned figures.
#[derive(Debug, Default)]
pub(crate) struct Learned {
    /// Answers that reported usage.
    pub(crate) reports: AtomicU64,
    /// Prompt tokens of those answers that said how many they reused.
    pub(crate) prompt_tokens: AtomicU64,
    /// Of them, reused tokens.
    pub(crate) reused_tokens: AtomicU64,
    /// Prompt tokens of the answers that did not say how many they reused.
    pub(crate) unreported_prompt_tokens: AtomicU64,
    /// Answers whose reuse was far below the cache model's prediction.
    pub(crate) corrections: AtomicU64,
    /// Whether this backend has ever reported its reuse in the OpenAI chat and completions
    /// shape: from then on an answer in that shape that leaves it out reused nothing (vLLM
    /// omits `cached_tokens` when it is 0).
    says_reuse: AtomicBool,
    /// Time to first byte in milliseconds (an `f64`'s bits), a moving average of the median
    /// of each answer's and the two before it; valid once `first_bytes` is not 0.
    first_byte_ms: AtomicU64,
    /// Answers that timed their first byte.
    first_bytes: AtomicU64,
    /// The last times to first byte measured (see [`Recent`]). Held while the average is
    /// written, so that answers ending together blend in turn.
    first_byte_samples: Mutex<Recent>,
    /// Prompt tokens read per second (an `f64`'s bits; 0 until learned).
    prefill_rate: AtomicU64,
    /// The last prefill rates measured, for [`blend_median`].
    prefill_samples: Mutex<Recent>,
    /// How long a request takes, dispatch to the end of its answer, in milliseconds (an
    /// `f64`'s bits; 0 until learned).
    duration_ms: AtomicU64,
    /// The last durations measured, for [`blend_median`].
    duration_samples: Mutex<Recent>,
    /// The sum of the dispatch times (fleet milliseconds) of the requests in flight.
    pub(crate) started_ms: AtomicU64,
    /// Prompt tokens of the requests in flight that have no answer yet and that the cache
    /// model said this backend lacked: what it still has to read before it can start on
    /// another prompt.
    pub(crate) unread_tokens: AtomicU64,
    /// The backend's prompt tokens per token of the chain's estimate is the ratio of these
    /// two averages (each an `f64`'s bits; 0 until learned): of the prompt tokens the
    /// backend reported, and of the chain's estimates of the same prompts. The chain counts
    /// four bytes a token and a digit a token, the backend's own tokenizer may count otherwise, and the prefill
    /// rate is in the backend's tokens. A ratio of averages, not an average of ratios: a
    /// short prompt (a title to write, a question of a line) is mostly the chat template's
    /// own tokens, and its ratio says nothing of a long prompt's, which carries the weight.
    /// The two are written one after the other; a reader between them sees the ratio of one
    /// answer before, at most. An answer odd against the scale teaches nothing alone (see
    /// [`learn_scale`](Self::learn_scale)).
    scale_tokens: AtomicU64,
    scale_estimates: AtomicU64,
    /// The side of the learned scale the last answer's count fell on past [`ODD_SCALE`]:
    /// -1 below, 1 above, 0 neither. Held while the scale is written, so that answers ending
    /// together blend in turn.
    scale_side: Mutex<i8>,
    /// Times the backend was announced again after its removal, wrapping: an answer to a
    /// request dispatched before the last of them is the old server's, and teaches nothing
    /// (see [`returned`](Self::returned)). Read once a dispatch, never written on it.
    pub(crate) returns: AtomicU32,
}

/// What placement predicted for a request on the backend it chose, kept for its answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Prediction {
    /// Tokens of the prompt, by the chain's estimate.
    pub(crate) prompt_tokens: u64,
    /// Of them, the tokens the model said the backend held.
    pub(crate) held_tokens: u64,
    /// When the deepest held link was last used (the model's clock), before this request.
    pub(crate) stamp: u32,
    /// The record that first recorded that link.
    pub(crate) born: u32,
    /// Whether that record's request was still in flight when this one was sent: the backend
    /// may not have finished reading the prefix, and cannot share it before (llama-server
    /// shares nothing between busy slots), so reusing less of it is no sign that it was
    /// evicted.
    pub(crate) pending: bool,
}

/// One answer, as the response body saw it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Answer {
    /// What the answer reported; `None` for an answer other than a success, which did not
    /// take its prompt.
    pub(crate) usage: Option<Usage>,
    /// Dispatch to the first byte of the body that follows the prompt's read: its first
    /// byte, or for a stream the first event after those sent before the read (a Responses
    /// stream's `response.created`, `response.in_progress`; llama-server's progress chunks).
    pub(crate) first_byte: Option<Duration>,
    /// Dispatch to the end of the body; `None` for an answer other than a success (a request
    /// turned down at once), whose time says nothing of how long requests take.
    pub(crate) duration: Option<Duration>,
    /// Whether the body streamed (SSE): its first byte came as soon as the prompt was read,
    /// and times the read.
    pub(crate) stream: bool,
    /// The backend's [`returns`](Learned::returns) when its request was dispatched: an
    /// answer to one dispatched before the backend was announced again teaches nothing.
    pub(crate) returns: u32,
}

fn load_f64(a: &AtomicU64) -> Option<f64> {
    let v = f64::from_bits(a.load(Ordering::Relaxed));
    (v > 0.0).then_some(v)
}

/// `secs` seconds: zero below zero, and `Duration::MAX` past it (the figures a backend
/// reported can be any finite number, so what they teach can be too).
fn duration_of(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(Duration::MAX)
}

fn blend(a: &AtomicU64, sample: f64) {
    if !(sample.is_finite() && sample > 0.0) {
        return;
    }
    let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
        let old = f64::from_bits(bits);
        let new = if old > 0.0 {
            old + ALPHA * (sample - old)
        } else {
            sample
        };
        Some(new.to_bits())
    });
}

/// Takes `sample` into the average `a` (see [`Recent::next`]), so that one odd answer moves
/// nothing: a prompt the backend found cached and said it read in a millisecond, a request
/// stalled for ten minutes.
fn blend_median(a: &AtomicU64, recent: &Mutex<Recent>, sample: f64) {
    if !(sample.is_finite() && sample > 0.0) {
        return;
    }
    // Held while the average is written, so that answers ending together blend in turn.
    let mut recent = recent.lock();
    if let Some(new) = recent.next(load_f64(a), sample) {
        a.store(new.to_bits(), Ordering::Relaxed);
    }
}

/// What a moving average of medians keeps between answers: the last two figures, and how
/// many it has been given.
#[derive(Debug, Default)]
struct Recent {
    samples: [Option<f64>; 2],
    given: u8,
}

impl Recent {
    /// Takes in `sample`; returns the average's new value, from `old` (`None`: not set), or
    /// `None` to leave it as it is. The first figure starts the average; the second is kept
    /// for the median alone, as either of the two may be the odd one; the median of the first
    /// three replaces the first, so that an odd first answer is forgotten at the third and an
    /// odd second one moves nothing. From the fourth on, the average moves by [`ALPHA`] of
    /// the way to the median of the figure and the two before it: two in a row on the same
    /// side move it as one figure does, so a backend that changed is followed one answer
    /// later. An average set before any figure (a snapshot's) is blended with the first.
    fn next(&mut self, old: Option<f64>, sample: f64) -> Option<f64> {
        let median = median(&mut self.samples, sample);
        self.given = self.given.saturating_add(1);
        match (self.given, old) {
            (2, _) => None,
            (3, _) | (_, None) => Some(median),
            (_, Some(old)) => Some(old + ALPHA * (median - old)),
        }
    }
}

/// The median of `sample` and the two before it in `recent`, or `sample` until two are kept;
/// keeps `sample` in `recent` for the next.
fn median(recent: &mut [Option<f64>; 2], sample: f64) -> f64 {
    let [older, last] = *recent;
    *recent = [last, Some(sample)];
    match (older, last) {
        (Some(older), Some(last)) => older.min(last).max(older.max(last).min(sample)),
        _ => sample,
    }
}

impl Learned {
    /// Takes in one answer; returns its usage with the reuse filled in where this backend's
    /// habits say what an absent figure means, and how it compares with the cache model's prediction.
    ///
    /// An answer to a request dispatched before the backend was announced again (see
    /// [`returned`](Self::returned)) is counted, as it reported, and teaches nothing: it is
    /// the old server's.
    pub(crate) fn learn(
        &self,
        answer: &Answer,
        predicted: Option<Prediction>,
    ) -> (Option<Usage>, Verdict) {
        if answer.returns != self.returns.load(Ordering::Relaxed) {
            if let Some(usage) = &answer.usage {
                self.count(usage);
            }
            return (answer.usage, Verdict::Fine);
        }
        if let Some(d) = answer.duration {
            let ms = d.as_secs_f64() * 1000.0;
            blend_median(&self.duration_ms, &self.duration_samples, ms);
        }
        if let Some(t) = answer.first_byte {
            self.learn_first_byte(t);
        }
        let Some(mut usage) = answer.usage else {
            return (None, Verdict::Fine);
        };
        match usage.reused_tokens {
            _ if !usage.zero_left_out => {}
            Some(_) => self.says_reuse.store(true, Ordering::Relaxed),
            None if self.says_reuse.load(Ordering::Relaxed) => usage.reused_tokens = Some(0),
            None => {}
        }
        self.count(&usage);
        // Every answer counts its prompt in the backend's tokens, whether or not it says
        // what it reused.
        if let Some(p) = predicted.filter(|p| p.prompt_tokens > 0 && usage.prompt_tokens > 0) {
            self.learn_scale(usage.prompt_tokens as f64, p.prompt_tokens as f64);
        }
        let Some(reused) = usage.reused_tokens else {
            return (Some(usage), Verdict::Fine);
        };
        let read = usage.prompt_tokens.saturating_sub(reused);
        // The time the prompt took to read: llama.cpp says; a stream's first byte after the
        // read tells (see `Answer::first_byte`).
        // A read of `MIN_READ_FOR_RATE` tokens or more timed under `MIN_READ_TIME` was not
        // timed (a server that reports 0 for a time it does not measure, a first byte on a
        // paused clock), and one such sample would multiply the learned rate a thousandfold.
        let timed = |t: &Duration| *t >= MIN_READ_TIME;
        let first_byte = answer.first_byte.filter(|_| answer.stream);
        let read_time = usage.prompt_time.filter(timed).or(first_byte.filter(timed));
        if let Some(t) = read_time.filter(|_| read >= MIN_READ_FOR_RATE) {
            let rate = read as f64 / t.as_secs_f64();
            blend_median(&self.prefill_rate, &self.prefill_samples, rate);
        }
        // An answer that counts no prompt says nothing of what was reused of the one sent
        // (Ollama's reports 0 for a prompt it found whole in its cache).
        let verdict = predicted.filter(|_| usage.prompt_tokens > 0);
        let verdict = verdict.map_or(Verdict::Fine, |p| {
            let predicted = p.held_tokens as f64 / p.prompt_tokens.max(1) as f64;
            let measured = reused as f64 / usage.prompt_tokens.max(1) as f64;
            if predicted >= MIN_PREDICTED_SHARE && measured < predicted / 2.0 && !p.pending {
                Verdict::HeldLess
            } else if measured >= MIN_PREDICTED_SHARE && predicted < measured / 2.0 {
                Verdict::HeldMore
            } else {
                Verdict::Fine
            }
        });
        if verdict == Verdict::HeldLess {
            self.corrections.fetch_add(1, Ordering::Relaxed);
        }
        (Some(usage), verdict)
    }

    /// Counts `usage` in the reports: its prompt tokens, with those it reused if it says.
    fn count(&self, usage: &Usage) {
        self.reports.fetch_add(1, Ordering::Relaxed);
        let tokens = usage.prompt_tokens;
        match usage.reused_tokens {
            Some(reused) => {
                self.prompt_tokens.fetch_add(tokens, Ordering::Relaxed);
                self.reused_tokens.fetch_add(reused, Ordering::Relaxed);
            }
            None => {
                self.unreported_prompt_tokens
                    .fetch_add(tokens, Ordering::Relaxed);
            }
        }
    }

    /// Takes in one answer's time to first byte: into a moving average of medians, as the
    /// request time is (see [`Recent::next`]). A first byte in no time (a backend on the same
    /// host, a paused clock) is a figure like any other.
    fn learn_first_byte(&self, t: Duration) {
        let mut recent = self.first_byte_samples.lock();
        let old = (self.first_bytes.load(Ordering::Relaxed) > 0)
            .then(|| f64::from_bits(self.first_byte_ms.load(Ordering::Relaxed)));
        if let Some(new) = recent.next(old, t.as_secs_f64() * 1000.0) {
            self.first_byte_ms.store(new.to_bits(), Ordering::Relaxed);
        }
        // After the figure: a reader that sees the count sees a figure.
        self.first_bytes.fetch_add(1, Ordering::Release);
    }

    /// Takes in one answer's prompt: `tokens` by the backend's count, `estimate` by the
    /// chain's. An answer that counts more than [`ODD_SCALE`] times what the learned scale
    /// makes of its estimate, or less than its inverse, teaches nothing, unless the answer
    /// before it was odd on the same side: one odd answer (a prompt the backend truncated to
    /// its context, a count of only the tokens it did not find cached) moves nothing, and a
    /// backend that changed is followed from its second answer on. An answer that is not odd
    /// moves the scale toward its own ratio and at most to it: by at most that factor.
    fn learn_scale(&self, tokens: f64, estimate: f64) {
        let mut last = self.scale_side.lock();
        let side = match self.token_scale() {
            Some(s) if tokens > estimate * s * ODD_SCALE => 1,
            Some(s) if tokens * ODD_SCALE < estimate * s => -1,
            _ => 0,
        };
        let alone = side != 0 && side != *last;
        *last = side;
        if !alone {
            blend(&self.scale_tokens, tokens);
            blend(&self.scale_estimates, estimate);
        }
    }

    /// The backend was removed and is announced again: it may be another server (another
    /// address, another version, another model), which may leave its reuse out in every
    /// answer. Whether it says its reuse is learned again, so that an answer without it is
    /// not read as reusing nothing, which would correct the cache model for conversations
    /// the backend holds. Its token scale is learned again too: another model counts a
    /// prompt with another tokenizer, and the scale sizes the context a request takes there.
    /// Until an answer teaches it again, it is taken as for a new backend; every answer
    /// with a prediction teaches it, so the same server back costs one answer. The prefill
    /// rate and the request time stay, as few answers teach them: the new server's answers
    /// move them. From now on, an answer to a request dispatched before teaches nothing: it
    /// is the old server's, and would teach the new one its habits.
    pub(crate) fn returned(&self) {
        self.returns.fetch_add(1, Ordering::Relaxed);
        self.says_reuse.store(false, Ordering::Relaxed);
        let mut side = self.scale_side.lock();
        *side = 0;
        self.scale_tokens.store(0, Ordering::Relaxed);
        self.scale_estimates.store(0, Ordering::Relaxed);
    }

    /// Prompt tokens read per second, once learned.
    pub(crate) fn prefill_rate(&self) -> Option<f64> {
        load_f64(&self.prefill_rate)
    }

    /// Sets the prefill rate as if the answers had taught `tokens_per_second` (0: not
    /// learned), for a [`Snapshot`](crate::placement::Snapshot).
    pub(crate) fn set_prefill_rate(&self, tokens_per_second: u32) {
        let rate = f64::from(tokens_per_second);
        self.prefill_rate.store(rate.to_bits(), Ordering::Relaxed);
    }

    /// How long a request takes, once learned.
    pub(crate) fn request_time(&self) -> Option<Duration> {
        load_f64(&self.duration_ms).map(|ms| duration_of(ms / 1000.0))
    }

    /// The time to first byte, once an answer timed it: a moving average of recent answers'
    /// (see [`learn_first_byte`](Self::learn_first_byte)).
    pub(crate) fn first_byte_time(&self) -> Option<Duration> {
        let n = self.first_bytes.load(Ordering::Acquire);
        (n > 0).then(|| {
            let ms = f64::from_bits(self.first_byte_ms.load(Ordering::Relaxed));
            duration_of(ms / 1000.0)
        })
    }

    /// The estimated wait for a slot on a backend whose `in_flight` requests and `promised`
    /// slots fill it, with `ahead` requests waiting for its slots before this one, at fleet
    /// time `now_ms`; `None` until its request time is learned.
    ///
    /// A promised slot has freed and is held for a waiter that has not run yet (see
    /// [`wait`](crate::wait)): it counts as a request that starts now, and as one of the
    /// requests ahead, as a freed slot goes first to the oldest waiter whose cache is there.
    /// Its requests' starts are taken as spread evenly: the oldest of `n` has then run
    /// `2n / (n + 1)` times their mean age, and its slot frees when it reaches the learned
    /// request time; the slots after it free one every `1 / n` of that time, the first
    /// `ahead` of them to the requests ahead.
    pub(crate) fn wait_estimate(
        &self,
        in_flight: u32,
        promised: u32,
        ahead: u32,
        now_ms: u64,
    ) -> Option<Duration> {
        let took = load_f64(&self.duration_ms)?;
        let running = in_flight.saturating_add(promised);
        if running == 0 {
            return Some(Duration::ZERO);
        }
        let ahead = ahead.saturating_sub(promised);
        let n = f64::from(running);
        let starts = self.started_ms.load(Ordering::Relaxed) as f64;
        let started = (starts + f64::from(promised) * now_ms as f64) / n;
        let mean_age = (now_ms as f64 - started).max(0.0);
        let oldest = mean_age * 2.0 * n / (n + 1.0);
        let first = (took - oldest).max(0.0);
        Some(duration_of((first + f64::from(ahead) * took / n) / 1000.0))
    }

    /// What a read of `read` on this backend costs its requests, not only the one read: the
    /// read itself, and as long again for each request that reaches the backend meanwhile,
    /// as that one waits behind it (a backend reads one prompt after another). Requests
    /// reach it at `in_flight` (its requests in flight with this one) over its learned
    /// request time a second, by Little's law; until that time is learned, the read alone.
    pub(crate) fn read_cost(&self, read: Duration, in_flight: u32) -> Duration {
        let Some(took_ms) = load_f64(&self.duration_ms) else {
            return read;
        };
        let secs = read.as_secs_f64();
        let arriving = f64::from(in_flight) * secs * 1000.0 / took_ms;
        let behind = duration_of(secs * arriving);
        read.saturating_add(behind)
    }

    /// What moving a request here costs: the time to read `tokens` (the chain's estimate),
    /// once the rate is learned.
    pub(crate) fn read_time(&self, tokens: u64) -> Option<Duration> {
        self.read_time_or(tokens, &Prior::default())
    }

    /// [`read_time`](Self::read_time), taking what this backend has not learned yet from
    /// `prior`: what the fleet's other backends taught.
    pub(crate) fn read_time_or(&self, tokens: u64, prior: &Prior) -> Option<Duration> {
        let rate = self.prefill_rate().or(prior.rate)?;
        let scale = self.token_scale().or(prior.scale).unwrap_or(1.0);
        Some(duration_of(tokens as f64 * scale / rate))
    }

    /// The prompt tokens of this backend's requests in flight that have no answer yet.
    pub(crate) fn backlog(&self) -> u64 {
        self.unread_tokens.load(Ordering::Relaxed)
    }

    /// Whether the backend has taught how many of its tokens a token of the chain's estimate is.
    pub(crate) fn knows_scale(&self) -> bool {
        self.token_scale().is_some()
    }

    /// The backend's prompt tokens per token of the chain's estimate, once learned.
    pub(crate) fn token_scale(&self) -> Option<f64> {
        let tokens = load_f64(&self.scale_tokens)?;
        let estimates = load_f64(&self.scale_estimates)?;
        Some(tokens / estimates).filter(|s| s.is_finite())
    }

    /// Teaches the scale as if the answers had (of prompts of 1,024 tokens by the estimate).
    #[cfg(test)]
    pub(crate) fn set_token_scale(&self, scale: f64) {
        self.scale_estimates
            .store(1024f64.to_bits(), Ordering::Relaxed);
        self.scale_tokens
            .store((scale * 1024.0).to_bits(), Ordering::Relaxed);
    }

    /// The time to read `tokens` after the prompts of the requests in flight that have not
    /// been answered yet, once the rate is learned: a backend reads one prompt at a time
    /// (llama.cpp shares one batch among its slots), so a long prompt there delays the next.
    pub(crate) fn time_to_read(&self, tokens: u64) -> Option<Duration> {
        self.read_time(self.backlog().saturating_add(tokens))
    }
}

/// What a fleet's backends have taught, on average: stands in for a backend that has not
/// answered enough yet to teach its own (a new one, or one this router replica has not sent
/// to yet). A backend with its own figures uses them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Prior {
    /// The mean learned prefill rate.
    pub(crate) rate: Option<f64>,
    /// The mean learned token scale.
    pub(crate) scale: Option<f64>,
}

impl Prior {
    /// The means over `backends`' learned figures.
    pub(crate) fn of<'a>(backends: impl Iterator<Item = &'a Learned>) -> Self {
        let (mut rates, mut scales) = ((0.0, 0u32), (0.0, 0u32));
        for l in backends {
            if let Some(r) = l.prefill_rate() {
                rates = (rates.0 + r, rates.1 + 1);
            }
            if let Some(s) = l.token_scale() {
                scales = (scales.0 + s, scales.1 + 1);
            }
        }
        let mean = |(sum, n): (f64, u32)| (n > 0).then(|| sum / f64::from(n));
        Prior {
            rate: mean(rates),
            scale: mean(scales),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer in the OpenAI chat shape.
    fn answer(prompt: u64, reused: Option<u64>, first_byte_ms: u64) -> Answer {
        Answer {
            usage: Some(Usage {
                prompt_tokens: prompt,
                reused_tokens: reused,
                prompt_time: None,
                zero_left_out: true,
            }),
            first_byte: Some(Duration::from_millis(first_byte_ms)),
            duration: Some(Duration::from_secs(10)),
            stream: true,
            returns: 0,
        }
    }

    #[test]
    fn prefill_rate_is_learned_from_read_tokens_against_first_byte() {
        let l = Learned::default();
        assert_eq!(l.prefill_rate(), None);
        l.learn(&answer(10_000, Some(0), 50_000), None);
        assert_eq!(l.prefill_rate(), Some(200.0));
        // A warm turn reads too little to say anything about the rate.
        l.learn(&answer(10_100, Some(10_000), 1_000), None);
        assert_eq!(l.prefill_rate(), Some(200.0));
        assert_eq!(l.read_time(2_000), Some(Duration::from_secs(10)));
    }

    #[test]
    fn figures_past_what_a_duration_holds_saturate_rather_than_panic() {
        let l = Learned::default();
        // A backend that says it read 1e18 tokens in 1e15 s, of a prompt the chain estimated
        // at one token, teaches a slow rate and a scale of 1e18.
        let mut huge = answer(1_000_000_000_000_000_000, Some(0), 1_000);
        huge.usage.as_mut().unwrap().prompt_time = Some(Duration::from_secs(1_000_000_000_000_000));
        let p = Prediction {
            prompt_tokens: 1,
            ..Prediction::default()
        };
        l.learn(&huge, Some(p));
        assert_eq!(l.read_time(u64::MAX), Some(Duration::MAX));
        assert_eq!(l.read_cost(Duration::MAX, 3), Duration::MAX);
        assert_eq!(l.wait_estimate(1, 0, 0, u64::MAX), Some(Duration::ZERO));
    }

    #[test]
    fn the_chains_token_estimate_is_scaled_to_the_backends_own_count() {
        let l = Learned::default();
        // The chain estimated 2,500 tokens (four bytes each) of a prompt the backend counted
        // as 10,000 (a byte each), read cold in 50 s: 200 of its tokens a second.
        let p = Prediction {
            prompt_tokens: 2_500,
            ..Prediction::default()
        };
        l.learn(&answer(10_000, Some(0), 50_000), Some(p));
        assert_eq!(l.token_scale(), Some(4.0));
        // 2,500 tokens of the estimate are 10,000 of the backend's: 50 s, not 12.5 s.
        assert_eq!(l.read_time(2_500), Some(Duration::from_secs(50)));
        // A short prompt, mostly the chat template's own tokens (27 of a question the chain
        // counts as 4), moves it little: the ratio of the averages, not the average of the
        // ratios (which would make it 4.7).
        let short = Prediction {
            prompt_tokens: 4,
            ..p
        };
        l.learn(&answer(27, Some(0), 100), Some(short));
        let scale = l.token_scale().unwrap();
        assert!((scale - 4.0).abs() < 0.01, "{scale}");
        // Without a prediction (no chain) nothing is learned of the scale.
        let l = Learned::default();
        l.learn(&answer(10_000, Some(0), 50_000), None);
        assert_eq!(l.token_scale(), None);
        assert_eq!(l.read_time(2_000), Some(Duration::from_secs(10)));
    }

    #[test]
    fn a_backend_that_taught_nothing_yet_reads_as_the_others_do() {
        let p = predicting;
        let (a, b, new) = (Learned::default(), Learned::default(), Learned::default());
        // a reads 200 of its tokens a second, b 600; both count four of theirs a chain token.
        a.learn(&answer(10_000, Some(0), 50_000), Some(p(2_500)));
        b.learn(&answer(30_000, Some(0), 50_000), Some(p(7_500)));
        let prior = Prior::of([&a, &b, &new].into_iter());
        assert_eq!(prior.rate, Some(400.0));
        assert_eq!(prior.scale, Some(4.0));
        assert_eq!(new.read_time(1_000), None, "nothing of its own");
        // 1,000 chain tokens are 4,000 of the backend's, at 400 a second.
        assert_eq!(
            new.read_time_or(1_000, &prior),
            Some(Duration::from_secs(10))
        );
        // A backend with figures of its own keeps them.
        assert_eq!(a.read_time_or(1_000, &prior), Some(Duration::from_secs(20)));
        assert_eq!(Prior::of([&new].into_iter()), Prior::default());
    }

    #[test]
    fn a_backend_that_once_said_its_reuse_reused_nothing_when_it_leaves_it_out() {
        let l = Learned::default();
        let (u, _) = l.learn(&answer(100, None, 10), None);
        assert_eq!(u.unwrap().reused_tokens, None);
        l.learn(&answer(100, Some(50), 10), None);
        let (u, _) = l.learn(&answer(100, None, 10), None);
        assert_eq!(u.unwrap().reused_tokens, Some(0));
        // Only the answers that said their reuse count against it.
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
        assert_eq!(count(&l.prompt_tokens), 200);
        assert_eq!(count(&l.reused_tokens), 50);
        assert_eq!(count(&l.unreported_prompt_tokens), 100);
    }

    #[test]
    fn an_answer_in_a_shape_that_never_says_its_reuse_is_not_read_as_reusing_nothing() {
        // vLLM's chat endpoint says its reuse; its Anthropic endpoint has no such figure.
        let l = Learned::default();
        l.learn(&answer(1_000, Some(900), 10), None);
        let messages = br#"{"type":"message","usage":{"input_tokens":1100,"output_tokens":5}}"#;
        let anthropic = Answer {
            usage: Usage::from_body(messages),
            ..answer(0, None, 10)
        };
        let (u, verdict) = l.learn(&anthropic, None);
        assert_eq!(u.unwrap().reused_tokens, None);
        assert_eq!(verdict, Verdict::Fine);
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
        assert_eq!(count(&l.prompt_tokens), 1_000);
        assert_eq!(count(&l.reused_tokens), 900);
        assert_eq!(count(&l.unreported_prompt_tokens), 1_100);
    }

    #[test]
    fn far_less_reuse_than_predicted_is_a_misprediction() {
        let l = Learned::default();
        let p = Prediction {
            prompt_tokens: 10_000,
            held_tokens: 9_000,
            ..Prediction::default()
        };
        let verdict = |reused, p| l.learn(&answer(10_000, Some(reused), 10), Some(p)).1;
        assert_eq!(verdict(8_800, p), Verdict::Fine);
        assert_eq!(verdict(100, p), Verdict::HeldLess);
        // The same shortfall on a prefix another request was still reading is no verdict.
        let read_elsewhere = Prediction { pending: true, ..p };
        assert_eq!(verdict(100, read_elsewhere), Verdict::Fine);
        assert_eq!(l.corrections.load(Ordering::Relaxed), 1);
        // Predicting little of a prompt that reused little is right.
        let small = Prediction {
            held_tokens: 500,
            ..p
        };
        assert_eq!(verdict(0, small), Verdict::Fine);
        assert_eq!(verdict(9_000, small), Verdict::HeldMore);
    }

    #[test]
    fn wait_estimate_from_the_requests_in_flight() {
        let l = Learned::default();
        assert_eq!(l.wait_estimate(2, 0, 0, 1_000), None);
        l.learn(&answer(1, Some(0), 1), None); // a 10 s request
                                               // Two requests started at 0 s and 4 s; now is 6 s: mean age 4 s, the oldest about
                                               // 5.3 s, so about 4.7 s to go.
        l.started_ms.store(4_000, Ordering::Relaxed);
        let w = l.wait_estimate(2, 0, 0, 6_000).unwrap();
        assert!((w.as_secs_f64() - 4.667).abs() < 0.01, "{w:?}");
        // Requests older than the learned time: a slot is due now.
        assert_eq!(l.wait_estimate(2, 0, 0, 60_000), Some(Duration::ZERO));
        // Three requests ahead, waiting for its slots: the first frees in about 4.7 s and
        // the next every 5 s, so this one's is the fourth, in about 19.7 s.
        let w = l.wait_estimate(2, 0, 3, 6_000).unwrap();
        assert!((w.as_secs_f64() - 19.667).abs() < 0.01, "{w:?}");
    }

    /// A slot freed and promised to a waiter that has not run yet is that waiter's request,
    /// starting now: a backend whose one slot is promised so frees it in a request time, not
    /// at once, and the waiter holding the promise is not ahead of a request twice.
    #[test]
    fn a_promised_slot_counts_as_a_request_starting_now() {
        let l = Learned::default();
        l.learn(&answer(1, Some(0), 1), None); // a 10 s request
        assert_eq!(
            l.wait_estimate(0, 1, 1, 6_000),
            Some(Duration::from_secs(10))
        );
        // One request in flight since 0 s, one slot promised at 6 s, one more waiting ahead:
        // the mean age is 3 s, the oldest about 4 s old, its slot due in about 6 s, and the
        // next 5 s later.
        let w = l.wait_estimate(1, 1, 2, 6_000).unwrap();
        assert!((w.as_secs_f64() - 11.0).abs() < 0.01, "{w:?}");
    }

    #[test]
    fn a_read_costs_as_long_again_for_each_request_arriving_while_it_lasts() {
        let l = Learned::default();
        let read = Duration::from_secs(5);
        // Nothing learned: the read alone.
        assert_eq!(l.read_cost(read, 4), read);
        l.learn(&answer(1, Some(0), 1), None); // a 10 s request
                                               // Two requests in flight for 10 s each: one arrives every 5 s, one during the read.
        assert_eq!(l.read_cost(read, 2), Duration::from_secs(10));
        assert_eq!(l.read_cost(read, 0), read);
        assert_eq!(l.read_cost(Duration::ZERO, 2), Duration::ZERO);
        assert_eq!(l.read_cost(Duration::MAX, u32::MAX), Duration::MAX);
    }

    /// A prompt time of 0 (a server that reports a time it does not measure) is not a read of
    /// thousands of tokens in no time: it teaches nothing, and the stream's first byte, if
    /// any, times the read instead.
    #[test]
    fn a_read_timed_at_under_a_millisecond_does_not_poison_the_prefill_rate() {
        let l = Learned::default();
        l.learn(&answer(10_000, Some(0), 50_000), None);
        assert_eq!(l.prefill_rate(), Some(200.0));
        for prompt_time in [Duration::ZERO, Duration::from_micros(999)] {
            let mut untimed = answer(10_000, Some(0), 1_000);
            untimed.usage.as_mut().unwrap().prompt_time = Some(prompt_time);
            untimed.stream = false;
            l.learn(&untimed, None);
            assert_eq!(l.prefill_rate(), Some(200.0), "{prompt_time:?}");
        }
        // A stream's first byte at once, as a paused clock gives, teaches nothing either.
        l.learn(&answer(10_000, Some(0), 0), None);
        assert_eq!(l.prefill_rate(), Some(200.0));
        // Without a time of its own, the first byte of its stream times the read.
        let mut untimed = answer(10_000, Some(0), 50_000);
        untimed.usage.as_mut().unwrap().prompt_time = Some(Duration::ZERO);
        let fresh = Learned::default();
        fresh.learn(&untimed, None);
        assert_eq!(fresh.prefill_rate(), Some(200.0));
    }

    /// A backend's first answers are as likely to be odd as any later one (its first prompt
    /// read while its weights are paged in, a request stalled behind its warm-up): an odd
    /// first answer is forgotten at the third, and an odd second one moves nothing. Blended
    /// as they came, a first answer ten times slow left the learned request time more than
    /// twice the backend's for nine answers.
    #[test]
    fn an_odd_first_or_second_answer_is_not_what_the_backend_is_taken_to_do() {
        // 10,000 tokens read in `read_s`, the first byte then, the answer `took_s` after.
        let timed = |read_s: u64, took_s: u64| Answer {
            duration: Some(Duration::from_secs(took_s)),
            ..answer(10_000, Some(0), read_s * 1_000)
        };
        let normal = || timed(50, 52);
        let odd = || timed(500, 650);
        let learned = |l: &Learned| (l.prefill_rate(), l.request_time(), l.first_byte_time());
        let want = (
            Some(200.0),
            Some(Duration::from_secs(52)),
            Some(Duration::from_secs(50)),
        );
        let first = Learned::default();
        first.learn(&odd(), None);
        first.learn(&normal(), None);
        first.learn(&normal(), None);
        assert_eq!(learned(&first), want, "an odd first answer");
        let second = Learned::default();
        second.learn(&normal(), None);
        second.learn(&odd(), None);
        assert_eq!(learned(&second), want, "an odd second answer");
        second.learn(&normal(), None);
        assert_eq!(learned(&second), want, "an odd second answer, then a third");
        // From the fourth answer on, a backend that got slower is followed from its second
        // slow answer, by a quarter of the way.
        first.learn(&timed(100, 104), None);
        assert_eq!(first.prefill_rate(), Some(200.0));
        first.learn(&timed(100, 104), None);
        assert_eq!(first.prefill_rate(), Some(175.0));
    }

    #[test]
    fn a_prompt_of_at_least_256_read_tokens_teaches_the_prefill_rate() {
        let l = Learned::default();
        l.learn(&answer(255, Some(0), 1_000), None);
        assert_eq!(l.prefill_rate(), None, "255 read tokens teach nothing");
        l.learn(&answer(1_256, Some(1_000), 1_000), None);
        assert_eq!(l.prefill_rate(), Some(256.0));
    }

    /// A prediction of a prompt of `tokens`, none of them held.
    fn predicting(tokens: u64) -> Prediction {
        Prediction {
            prompt_tokens: tokens,
            ..Prediction::default()
        }
    }

    /// The verdict on an answer reusing `reused` tokens of a prompt of 10,000, of which the
    /// cache model predicted `held` held.
    fn verdict_on(l: &Learned, held: u64, reused: u64) -> Verdict {
        let p = Prediction {
            prompt_tokens: 10_000,
            held_tokens: held,
            ..Prediction::default()
        };
        l.learn(&answer(10_000, Some(reused), 10), Some(p)).1
    }

    #[test]
    fn a_prediction_of_a_quarter_of_the_prompt_can_be_a_misprediction() {
        let l = Learned::default();
        assert_eq!(verdict_on(&l, 2_500, 1_000), Verdict::HeldLess);
        assert_eq!(verdict_on(&l, 2_499, 1_000), Verdict::Fine);
    }

    #[test]
    fn only_far_more_reuse_than_predicted_says_the_backend_holds_more() {
        let l = Learned::default();
        let verdict = |reused| verdict_on(&l, 3_000, reused);
        assert_eq!(verdict(5_000), Verdict::Fine, "more, not twice as much");
        assert_eq!(verdict(6_000), Verdict::Fine, "twice as much exactly");
        assert_eq!(verdict(6_100), Verdict::HeldMore);
    }

    /// An answer that does not say what it reused still counts its prompt in the backend's
    /// tokens: it teaches the scale, though not the prefill rate, which needs what was read.
    #[test]
    fn an_answer_that_does_not_say_its_reuse_teaches_the_scale() {
        let l = Learned::default();
        let p = Prediction {
            prompt_tokens: 2_500,
            ..Prediction::default()
        };
        let (u, verdict) = l.learn(&answer(10_000, None, 50_000), Some(p));
        assert_eq!((u.unwrap().reused_tokens, verdict), (None, Verdict::Fine));
        assert_eq!(l.token_scale(), Some(4.0));
        assert_eq!(l.prefill_rate(), None);
    }

    /// The scale's first answer is taken whole; each answer after it that is not odd moves
    /// both averages a quarter of the way to its own figures.
    #[test]
    fn the_token_scale_starts_at_its_first_answer_and_moves_a_quarter_of_the_way_to_each_next() {
        let l = Learned::default();
        let p = predicting;
        l.learn(&answer(4_000, Some(0), 10), Some(p(1_000)));
        assert_eq!(l.token_scale(), Some(4.0));
        // 2.4 tokens a token of the estimate: within twice the scale, not odd.
        l.learn(&answer(12_000, Some(0), 10), Some(p(5_000)));
        // (4,000 + 8,000 / 4) / (1,000 + 4,000 / 4).
        assert_eq!(l.token_scale(), Some(3.0));
    }

    /// An answer that counts no prompt (Ollama's, for a prompt it found whole in its cache),
    /// or a prediction of no prompt, teaches nothing of the token scale, even two in a row.
    #[test]
    fn an_answer_or_a_prediction_of_no_prompt_teaches_nothing_of_the_token_scale() {
        let l = Learned::default();
        let p = predicting;
        l.learn(&answer(10_000, Some(0), 10), Some(p(2_500)));
        for _ in 0..2 {
            l.learn(&answer(0, Some(0), 10), Some(p(1_000)));
        }
        assert_eq!(l.token_scale(), Some(4.0), "no prompt counted");
        for _ in 0..2 {
            l.learn(&answer(20_000, Some(0), 10), Some(p(0)));
        }
        assert_eq!(l.token_scale(), Some(4.0), "no prompt predicted");
    }

    #[test]
    fn reusing_exactly_half_the_predicted_share_is_no_misprediction() {
        let l = Learned::default();
        assert_eq!(verdict_on(&l, 5_000, 2_500), Verdict::Fine, "half exactly");
        assert_eq!(verdict_on(&l, 5_000, 2_499), Verdict::HeldLess);
    }

    /// A backend reads one prompt after another: a read there waits for the prompts of its
    /// requests in flight that have no answer yet.
    #[test]
    fn a_read_waits_behind_the_prompts_not_answered_yet() {
        let l = Learned::default();
        assert_eq!(l.time_to_read(2_000), None);
        l.learn(&answer(10_000, Some(0), 50_000), None); // 200 tokens a second
        assert_eq!(l.time_to_read(2_000), Some(Duration::from_secs(10)));
        l.unread_tokens.store(4_000, Ordering::Relaxed);
        assert_eq!(l.backlog(), 4_000);
        assert_eq!(l.time_to_read(2_000), Some(Duration::from_secs(30)));
    }

    /// A backend knows its token scale once an answer with a prediction taught it, and not
    /// after it was announced again.
    #[test]
    fn a_backend_knows_its_token_scale_from_an_answer_with_a_prediction_until_it_returns() {
        let l = Learned::default();
        assert!(!l.knows_scale());
        l.learn(&answer(10_000, Some(0), 10), None);
        assert!(!l.knows_scale(), "no prediction");
        let p = Prediction {
            prompt_tokens: 2_500,
            ..Prediction::default()
        };
        l.learn(&answer(10_000, Some(0), 10), Some(p));
        assert!(l.knows_scale());
        l.returned();
        assert!(!l.knows_scale());
        assert_eq!(l.token_scale(), None);
    }

    /// An answer that counts more than twice what the token scale makes of its estimate, or
    /// less than half, teaches nothing alone; one that counts twice or half exactly is not
    /// odd, and moves the scale.
    #[test]
    fn an_answer_past_twice_or_half_the_token_scale_teaches_nothing_alone() {
        let p = Prediction {
            prompt_tokens: 2_500,
            ..Prediction::default()
        };
        // Four tokens a token of the estimate, then answers of `tokens`.
        let scale_after = |tokens: &[u64]| {
            let l = Learned::default();
            l.learn(&answer(10_000, Some(0), 10), Some(p));
            for &t in tokens {
                l.learn(&answer(t, Some(0), 10), Some(p));
            }
            l.token_scale()
        };
        assert_eq!(scale_after(&[20_001]), Some(4.0), "more than twice");
        assert_eq!(scale_after(&[4_999]), Some(4.0), "less than half");
        // Two odd answers on opposite sides are not a backend that changed.
        assert_eq!(scale_after(&[20_001, 4_999]), Some(4.0), "one of each");
        // (10,000 + 10,000 / 4) / 2,500 and (10,000 - 5,000 / 4) / 2,500.
        assert_eq!(scale_after(&[20_000]), Some(5.0), "twice exactly");
        assert_eq!(scale_after(&[5_000]), Some(3.5), "half exactly");
    }
}
