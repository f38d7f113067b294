//! [`Prober`]: probes the backends its stream announced, and reports what it finds.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::{poll_fn, Future};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;

use http::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;

use super::check::{check, Checked, Health, ProbeClient};
use super::probe::HealthProbe;
use super::status::ProbeStatus;
use super::target::{MarkHealth, ProbeTarget};
use crate::{Backend, BackendId};

/// The probing half of [`HealthProbe::discover`]: probes the backends that its [`Probed`]
/// stream announced, marks them down and up, and keeps what it found ([`status`]).
///
/// Run it with [`spawn`](Self::spawn), which probes every backend each interval (a backend
/// announced later is probed at once); or a round at a time with [`round`](Self::round), as
/// a proxy might before it takes its first request, so that a loading backend is down and
/// slot counts are known. Cheap to clone: clones share the state.
///
/// [`Probed`]: super::Probed
/// [`status`]: Self::status
pub struct Prober<S> {
    shared: Arc<Shared<S>>,
}

struct Shared<S> {
    config: HealthProbe,
    client: ProbeClient,
    /// For backends spoken to in HTTP/2 with prior knowledge.
    client_h2: ProbeClient,
    state: Mutex<HashMap<BackendId, Target<S>>>,
    /// Generations of targets: a probe's answer for a backend removed meanwhile (and perhaps
    /// announced again), or announced again at another address, is dropped.
    generations: AtomicU64,
    /// Learned slot counts, for the stream to announce.
    updates: mpsc::UnboundedSender<Update>,
    receiver: Mutex<Option<mpsc::UnboundedReceiver<Update>>>,
    /// A backend was announced that has not been probed yet.
    fresh: Notify,
    transitions: AtomicU64,
}

/// One backend as the probe knows it.
struct Target<S> {
    /// As the inner stream announced it.
    backend: Backend<S>,
    generation: u64,
    status: ProbeStatus,
    /// What `status` holds of the slots and the request context was read at the address the
    /// backend had before it was announced again at this one. It stands until the server here
    /// first answers ready, so that a server moved as it was loses nothing meanwhile; from
    /// then on what this server says stands, and what it does not say is unknown.
    inherited: bool,
}

/// A slot count or request context learned, for the backend to be announced again with
/// what was learned of it.
pub(crate) struct Update {
    id: BackendId,
    generation: u64,
    /// A count or a context read at the backend's previous address was forgotten: the
    /// backend is announced again even with nothing learned of it.
    forgot: bool,
}

impl<S> Clone for Prober<S> {
    fn clone(&self) -> Self {
        Prober {
            shared: self.shared.clone(),
        }
    }
}

impl<S> fmt::Debug for Prober<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prober")
            .field("config", &self.shared.config)
            .field("backends", &self.shared.state.lock().len())
            .finish_non_exhaustive()
    }
}

/// One backend's probe: where, and what to ask.
struct Job {
    id: BackendId,
    generation: u64,
    uri: Uri,
    /// Spoken to in HTTP/2 with prior knowledge.
    h2: bool,
    /// `/slots` asked too.
    slots: bool,
    /// `/v1/models` asked too, if it has no slots.
    models: bool,
    /// `/props` asked for the slots before `/slots`.
    props: bool,
}

/// A probe's answer, and the backend (and generation) it is for.
type ProbeAnswer = (BackendId, u64, Checked);

/// What one probe's answer calls for, done outside the lock.
enum Mark {
    Down(String),
    Up,
}

impl<S> Prober<S> {
    pub(crate) fn new(config: HealthProbe) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector.clone());
        let client_h2 = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build(connector);
        let (updates, receiver) = mpsc::unbounded_channel();
        Prober {
            shared: Arc::new(Shared {
                config,
                client,
                client_h2,
                state: Mutex::default(),
                generations: AtomicU64::new(0),
                updates,
                receiver: Mutex::new(Some(receiver)),
                fresh: Notify::new(),
                transitions: AtomicU64::new(0),
            }),
        }
    }

    /// The receiving end of the learned slot counts, for the one stream.
    pub(crate) fn take_updates(&self) -> mpsc::UnboundedReceiver<Update> {
        self.shared.receiver.lock().take().unwrap_or_else(|| {
            // Only `HealthProbe::discover` takes it, once; a second taker gets a closed one.
            mpsc::unbounded_channel().1
        })
    }

    /// What the probe knows of backend `id`, if its stream announced it.
    pub fn status(&self, id: &str) -> Option<ProbeStatus> {
        self.shared.state.lock().get(id).map(|t| t.status.clone())
    }

    /// What the probe knows of every backend it probes, in no particular order.
    pub fn statuses(&self) -> Vec<ProbeStatus> {
        self.shared
            .state
            .lock()
            .values()
            .map(|t| t.status.clone())
            .collect()
    }

    /// Times the probe marked any backend down or up, removed backends' included.
    pub fn transitions(&self) -> u64 {
        self.shared.transitions.load(Ordering::Relaxed)
    }

    /// The settings.
    pub fn config(&self) -> &HealthProbe {
        &self.shared.config
    }
}

impl<S: Clone> Prober<S> {
    /// The inner stream announced `backend`: registers it, and returns it as the balancer
    /// should have it (with the slot count learned before, if its own was not given; learned
    /// at its previous address, if it moved, until the server at the new one answers).
    pub(crate) fn announced(&self, id: &BackendId, backend: Backend<S>) -> Backend<S>
    where
        S: ProbeTarget,
    {
        let mut state = self.shared.state.lock();
        match state.get_mut(id) {
            Some(t) => {
                let (was, now) = (t.backend.service(), backend.service());
                if was.base_uri() != now.base_uri()
                    || was.http2_prior_knowledge() != now.http2_prior_knowledge()
                {
                    // Another server from now on: the answers of probes sent to the old one
                    // are dropped, and its failures and successes in a row do not count for
                    // this one. Up or down stays as it was, as the balancer keeps its mark
                    // on an update.
                    t.generation = self.shared.generations.fetch_add(1, Ordering::Relaxed);
                    t.status.failures = 0;
                    t.status.successes = 0;
                    t.status.no_slots = false;
                    t.status.slots_error = None;
                    t.status.models_error = None;
                    t.inherited = true;
                }
                t.backend = backend;
                (self.with_learned(&t.backend, &t.status)).unwrap_or_else(|| t.backend.clone())
            }
            None => {
                let generation = self.shared.generations.fetch_add(1, Ordering::Relaxed);
                state.insert(
                    id.clone(),
                    Target {
                        backend: backend.clone(),
                        generation,
                        status: ProbeStatus::new(id.clone()),
                        inherited: false,
                    },
                );
                self.shared.fresh.notify_one();
                backend
            }
        }
    }

    /// The inner stream removed `id`.
    pub(crate) fn removed(&self, id: &BackendId) {
        self.shared.state.lock().remove(id);
    }

    /// `update` as a backend to announce, if it is still the backend it was learned for: as
    /// the inner stream last announced it (a service, node or budget announced since the
    /// count was read stands), with what was learned of it, unless it now gives its own.
    pub(crate) fn still_current(&self, update: Update) -> Option<(BackendId, Backend<S>)> {
        let state = self.shared.state.lock();
        let t = state.get(&update.id)?;
        if t.generation != update.generation {
            return None;
        }
        let backend = (self.with_learned(&t.backend, &t.status))
            .or_else(|| update.forgot.then(|| t.backend.clone()))?;
        Some((update.id, backend))
    }

    /// `backend` with what `/slots` (or `/v1/models`) taught of it where it does not give its
    /// own (its slot count, its request context); `None` if nothing applies.
    fn with_learned(&self, backend: &Backend<S>, status: &ProbeStatus) -> Option<Backend<S>> {
        let slots = status.slots.filter(|_| self.learns_slots(backend));
        let context = (status.request_context).filter(|_| self.learns_context(backend));
        if slots.is_none() && context.is_none() {
            return None;
        }
        let mut backend = backend.clone();
        if let Some(slots) = slots {
            backend = backend.slots(slots);
        }
        if let Some(context) = context {
            backend = backend.request_context_tokens(context);
        }
        Some(backend)
    }

    /// Whether the slot count of `backend` is learned from `/slots`.
    fn learns_slots(&self, backend: &Backend<S>) -> bool {
        self.shared.config.learn_slots && !backend.slots_given()
    }

    /// Whether the request context of `backend` is learned from `/slots` (or `/v1/models`).
    fn learns_context(&self, backend: &Backend<S>) -> bool {
        self.shared.config.learn_slots && !backend.request_context_given()
    }
}

impl<S> Prober<S>
where
    S: ProbeTarget + Clone + Send + Sync + 'static,
{
    /// Probes every backend once, at once, and acts on what it finds: marks backends down and
    /// up through `health`, and announces learned slot counts (applied before this returns).
    /// Checks the balancer's shared store beside them ([`MarkHealth::check_store`]).
    ///
    /// For a proxy that drives its own schedule, or a test, in place of
    /// [`spawn`](Self::spawn): not beside it. Two probes of one backend that run at once, one
    /// from each, may be acted on in either order, so an older answer can undo a newer one
    /// until the next probe.
    pub async fn round<H: MarkHealth>(&self, health: &H) {
        // The fleet as the balancer has it: what its stream has announced so far.
        health.apply_discovery();
        let mut probes = JoinSet::new();
        for job in self.jobs(|_, _| true) {
            probes.spawn(self.probe(job));
        }
        let store = health.check_store();
        let mut announced = false;
        let backends = async {
            while let Some(done) = probes.join_next().await {
                let Ok((id, generation, checked)) = done else {
                    continue;
                };
                announced |= self.settle(health, &id, generation, checked);
            }
        };
        tokio::join!(store, backends);
        if announced {
            health.apply_discovery();
        }
    }

    /// Probes every backend each interval, and a backend announced later at once, until the
    /// returned [`ProbeTask`] is dropped; each interval the shared store is checked too, in a
    /// task of its own, one check at a time, so that a store slower than the interval does not
    /// hold the probes back. Each backend's probe runs on its own, and its answer is acted on
    /// as it comes: a backend slow to answer (up to the [timeout](HealthProbe::timeout), which
    /// bounds each probe whole) holds back no other's probes, and is not probed again until its
    /// probe is done; if an interval ended meanwhile, it is probed again as soon as it is
    /// (a backend that does not answer, once a timeout). Needs a tokio runtime.
    #[must_use = "probing stops when the returned ProbeTask is dropped: keep it"]
    pub fn spawn<H>(self, health: H) -> ProbeTask
    where
        H: MarkHealth + Send + Sync + 'static,
    {
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(self.shared.config.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The shared store's check, in a task of its own beside the probes, one at a
            // time: a store that does not answer holds its check up to its deadline, which
            // may be longer than the interval, and the backends' probes do not wait for it.
            // Aborted with this task, as the probes are.
            let mut store_check = JoinSet::new();
            let mut probes = JoinSet::new();
            // The backends (and generations) whose probe is out, by task.
            let mut out: HashMap<tokio::task::Id, (BackendId, u64)> = HashMap::new();
            // Those of them whose interval ended while their probe was out: probed again as
            // soon as it is in. A backend that does not answer, with the timeout as long as
            // the interval (the defaults), would otherwise be probed every other interval, and
            // its failures take twice as long to take it down.
            let mut owed: HashSet<(BackendId, u64)> = HashSet::new();
            loop {
                enum Next {
                    Tick,
                    Fresh,
                    Answer(Result<(tokio::task::Id, ProbeAnswer), tokio::task::JoinError>),
                }
                let fresh = self.shared.fresh.notified();
                let mut fresh = std::pin::pin!(fresh);
                let next = poll_fn(|cx| {
                    if tick.poll_tick(cx).is_ready() {
                        return Poll::Ready(Next::Tick);
                    }
                    if let Poll::Ready(Some(done)) = probes.poll_join_next_with_id(cx) {
                        return Poll::Ready(Next::Answer(done));
                    }
                    fresh.as_mut().poll(cx).map(|()| Next::Fresh)
                })
                .await;
                let only_new = match next {
                    Next::Answer(done) => {
                        let task = match &done {
                            Ok((task, _)) => *task,
                            Err(e) => e.id(),
                        };
                        let backend = out.remove(&task);
                        if let Ok((_, (id, generation, checked))) = done {
                            if self.settle(&health, &id, generation, checked) {
                                health.apply_discovery();
                            }
                        }
                        if let Some(backend) = backend.filter(|b| owed.remove(b)) {
                            let (id, generation) = &backend;
                            let wanted = |i: &BackendId, t: &Target<S>| {
                                i == id && t.generation == *generation
                            };
                            for job in self.jobs(wanted) {
                                let task = probes.spawn(self.probe(job)).id();
                                out.insert(task, backend.clone());
                            }
                        }
                        continue;
                    }
                    Next::Tick => false,
                    Next::Fresh => true,
                };
                while store_check.try_join_next().is_some() {}
                if !only_new && store_check.is_empty() {
                    store_check.spawn(health.check_store());
                }
                // The fleet as the balancer has it: what its stream has announced so far.
                health.apply_discovery();
                let busy: HashSet<(BackendId, u64)> = out.values().cloned().collect();
                let wanted = |id: &BackendId, t: &Target<S>| {
                    (!only_new || t.status.probes == 0)
                        && !busy.contains(&(id.clone(), t.generation))
                };
                let jobs = self.jobs(wanted);
                if !only_new {
                    owed.extend(busy);
                }
                for job in jobs {
                    let backend = (job.id.clone(), job.generation);
                    let task = probes.spawn(self.probe(job)).id();
                    out.insert(task, backend);
                }
            }
        });
        ProbeTask { task }
    }

    /// The probes to send: to the backends `wanted` says.
    fn jobs(&self, wanted: impl Fn(&BackendId, &Target<S>) -> bool) -> Vec<Job> {
        let state = self.shared.state.lock();
        state
            .iter()
            .filter(|(id, t)| wanted(id, t))
            .map(|(id, t)| {
                // For its request context alone, a backend is not asked again once its
                // `/slots` answered that it has none (vLLM and SGLang have none), until it
                // fails or loads.
                let context = self.learns_context(&t.backend) && !t.status.no_slots;
                let slots = self.learns_slots(&t.backend) || self.shared.config.busy_slots;
                let service = t.backend.service();
                Job {
                    id: id.clone(),
                    generation: t.generation,
                    uri: service.base_uri().clone(),
                    h2: service.http2_prior_knowledge(),
                    slots: slots || context,
                    // A backend without slots gives its request context in `/v1/models`.
                    models: self.learns_context(&t.backend),
                    // A llama-server (one whose slots were read: from `/slots`, or from
                    // `/props` after its 501), unless its busy slots are wanted, which only
                    // `/slots` gives. The others are not asked it.
                    // Not one whose count was read at its previous address.
                    props: t.status.slots.is_some()
                        && !t.inherited
                        && !self.shared.config.busy_slots,
                }
            })
            .collect()
    }

    /// One backend's probe, to run in a task of its own.
    fn probe(&self, job: Job) -> impl Future<Output = ProbeAnswer> + Send + 'static {
        let client = if job.h2 {
            self.shared.client_h2.clone()
        } else {
            self.shared.client.clone()
        };
        let timeout = self.shared.config.timeout;
        let headers = self.shared.config.headers.clone();
        async move {
            let checked = check(
                client, job.uri, &headers, timeout, job.slots, job.models, job.props,
            )
            .await;
            (job.id, job.generation, checked)
        }
    }

    /// Acts on one probe's answer: records it, marks the backend down or up through `health`
    /// (logged once), and sends what was learned of it for the stream to announce; returns
    /// whether it sent something.
    fn settle<H: MarkHealth>(
        &self,
        health: &H,
        id: &BackendId,
        generation: u64,
        checked: Checked,
    ) -> bool {
        let (mark, update, node) = self.record(id, generation, checked);
        match mark {
            Some(Mark::Down(reason)) => {
                health.mark_down(id);
                tracing::warn!(backend = %id, node = %node, %reason, "backend down until /health is 200");
            }
            Some(Mark::Up) => {
                health.mark_up(id);
                tracing::info!(backend = %id, node = %node, "backend up: /health is 200");
            }
            None => {}
        }
        update.is_some_and(|update| self.shared.updates.send(update).is_ok())
    }

    /// Records one probe's answer; returns the transition it makes, the slot update it calls
    /// for, and the backend's node (for the log).
    fn record(
        &self,
        id: &BackendId,
        generation: u64,
        checked: Checked,
    ) -> (Option<Mark>, Option<Update>, String) {
        let config = &self.shared.config;
        let mut state = self.shared.state.lock();
        let Some(t) = state.get_mut(id).filter(|t| t.generation == generation) else {
            return (None, None, String::new());
        };
        let (learns_slots, learns_context) = (
            self.learns_slots(&t.backend),
            self.learns_context(&t.backend),
        );
        let given = t.backend.slots_given().then(|| t.backend.slot_count());
        // The first ready answer of the server at a new address: what the old one said goes,
        // and this answer says what stands.
        let inherited = if t.inherited && checked.health == Health::Ready {
            t.inherited = false;
            Some((t.status.slots.take(), t.status.request_context.take()))
        } else {
            None
        };
        let s = &mut t.status;
        s.probes += 1;
        let mut mark = None;
        if checked.health != Health::Ready {
            // Failing or loading, it may be restarting as another server: once ready again,
            // `/slots` is asked again even if this one had none.
            s.no_slots = false;
        }
        match checked.health {
            Health::Ready => {
                s.loading = false;
                s.failures = 0;
                s.successes = s.successes.saturating_add(1);
                let first = !std::mem::replace(&mut s.ready_once, true);
                if !s.up && (first || s.successes >= config.success_threshold) {
                    s.up = true;
                    mark = Some(Mark::Up);
                }
            }
            Health::Loading => {
                s.loading = true;
                s.successes = 0;
                s.failures = s.failures.saturating_add(1);
                s.last_error = Some("loading: /health answered 503".into());
                if s.up {
                    s.up = false;
                    mark = Some(Mark::Down("loading: /health answered 503".into()));
                }
            }
            Health::Failed(reason) => {
                s.loading = false;
                s.successes = 0;
                s.failures = s.failures.saturating_add(1);
                if s.up && (!s.ready_once || s.failures >= config.failure_threshold) {
                    s.up = false;
                    mark = Some(Mark::Down(reason.clone()));
                }
                s.last_error = Some(reason);
            }
        }
        if mark.is_some() {
            s.transitions += 1;
            self.shared.transitions.fetch_add(1, Ordering::Relaxed);
        }
        let mut learned = false;
        // Those this probe read, if it read them: a backend failing, or whose `/slots` did
        // not answer, has none known rather than an earlier probe's.
        s.busy_slots = None;
        match checked.slots {
            None => {}
            Some(Err(reason)) => {
                // Once, when it starts failing: a backend whose count is still unknown serves
                // as one slot meanwhile, which a proxy in front of a many-slot server must not
                // miss.
                if learns_slots && s.slots.is_none() && s.slots_error.is_none() {
                    tracing::warn!(
                        backend = %id,
                        error = %reason,
                        "slot count not readable from /slots: the backend counts as one slot \
                         until it is, or until it is announced with its slot count"
                    );
                }
                s.slots_error = Some(reason);
                s.no_slots = checked.no_slots;
            }
            Some(Ok(read)) => {
                s.slots_error = None;
                s.no_slots = false;
                s.busy_slots = read.busy;
                let total = NonZeroU32::new(read.total);
                if s.slots != total {
                    s.slots = total;
                    if let (true, Some(total)) = (learns_slots, total) {
                        tracing::info!(backend = %id, slots = total.get(), "slot count read from {}", checked.slots_from);
                        learned = true;
                    }
                    // Once for each count read: a count given that is more than the server
                    // runs (a `slots=4` for a llama-server's `-np 2`) sends it requests it
                    // makes wait, unseen, and the ids of slots assigned past its count name
                    // its slots in use, as llama-server takes an `id_slot` modulo its slots.
                    if let (Some(given), Some(total)) = (given, total) {
                        if given > total {
                            tracing::warn!(
                                backend = %id,
                                given = given.get(),
                                listed = total.get(),
                                "more slots given than {} lists: the requests past them wait in \
                                 the server, unseen by placement, and an id_slot assigned past \
                                 them names a slot in use",
                                checked.slots_from
                            );
                        }
                    }
                }
                // A count missing from a later answer keeps the last one read.
                if read.n_ctx.is_some() && s.request_context != read.n_ctx {
                    s.request_context = read.n_ctx;
                    if let (true, Some(n)) = (learns_context, read.n_ctx) {
                        tracing::info!(backend = %id, tokens = n.get(), "request context read from {} (n_ctx)", checked.slots_from);
                        learned = true;
                    }
                }
            }
        }
        match checked.max_model_len {
            None => {}
            Some(Err(reason)) => {
                // Once, when it starts failing, as for `/slots`.
                if learns_context && s.request_context.is_none() && s.models_error.is_none() {
                    tracing::warn!(
                        backend = %id,
                        error = %reason,
                        "request context not readable from /v1/models: it stays unknown until \
                         it is, or until the backend is announced with its request context"
                    );
                }
                // A later answer without it keeps the last one read, as `n_ctx` does.
                s.models_error = Some(reason);
            }
            Some(Ok(n)) => {
                s.models_error = None;
                if s.request_context != Some(n) {
                    s.request_context = Some(n);
                    if learns_context {
                        tracing::info!(backend = %id, tokens = n.get(), "request context read from /v1/models (max_model_len)");
                        learned = true;
                    }
                }
            }
        }
        // What the old server said and this one does not: announced again without it.
        let forgot = inherited.is_some_and(|(slots, context)| {
            (learns_slots && slots.is_some() && s.slots.is_none())
                || (learns_context && context.is_some() && s.request_context.is_none())
        });
        let update = (learned || forgot).then(|| Update {
            id: id.clone(),
            generation,
            forgot,
        });
        (mark, update, t.backend.node().to_string())
    }
}

/// The task of [`Prober::spawn`]: probing stops when it is dropped.
#[derive(Debug)]
#[must_use = "probing stops when the ProbeTask is dropped: keep it"]
pub struct ProbeTask {
    task: tokio::task::JoinHandle<()>,
}

impl ProbeTask {
    /// Stops probing (as dropping it does).
    pub fn abort(&self) {
        self.task.abort();
    }
}

impl Drop for ProbeTask {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::check::{Health, Slots};

    /// A backend service naming the address it was made for.
    #[derive(Clone, Debug, PartialEq)]
    struct At(Uri);

    impl ProbeTarget for At {
        fn base_uri(&self) -> &Uri {
            &self.0
        }
    }

    fn at(uri: &'static str) -> Backend<At> {
        Backend::new("n", At(Uri::from_static(uri)))
    }

    #[test]
    fn a_slot_count_learned_before_a_backend_was_announced_again_keeps_the_new_announcement() {
        let prober = Prober::new(HealthProbe::new());
        let id = BackendId::from("a");
        prober.announced(&id, at("http://10.0.0.1:8080/"));
        let generation = prober.shared.state.lock()[&id].generation;
        let checked = Checked {
            health: Health::Ready,
            slots: Some(Ok(Slots {
                total: 4,
                busy: Some(0),
                n_ctx: None,
            })),
            slots_from: "/slots",
            no_slots: false,
            max_model_len: None,
        };
        let (_, update, _) = prober.record(&id, generation, checked);
        // Announced again, on another node, before the learned count went out.
        prober.announced(
            &id,
            Backend::new("m", At(Uri::from_static("http://10.0.0.1:8080/"))),
        );
        let (_, backend) = prober.still_current(update.unwrap()).unwrap();
        assert_eq!(backend.node().to_string(), "m");
        assert_eq!(backend.slot_count().get(), 4);
        // Announced with a count of its own: that stands, the learned one is not sent.
        let generation = prober.shared.state.lock()[&id].generation;
        let checked = Checked {
            health: Health::Ready,
            slots: Some(Ok(Slots {
                total: 8,
                busy: Some(0),
                n_ctx: None,
            })),
            slots_from: "/slots",
            no_slots: false,
            max_model_len: None,
        };
        let (_, update, _) = prober.record(&id, generation, checked);
        let given = at("http://10.0.0.1:8080/").slots(NonZeroU32::new(2).unwrap());
        prober.announced(&id, given);
        assert!(prober.still_current(update.unwrap()).is_none());
    }
    fn failed() -> Checked {
        Checked {
            health: Health::Failed("/health: connection refused".into()),
            slots: None,
            slots_from: "/slots",
            no_slots: false,
            max_model_len: None,
        }
    }

    #[test]
    fn a_probe_answer_from_the_address_a_backend_had_before_its_update_is_dropped() {
        let prober = Prober::new(HealthProbe::new());
        let id = BackendId::from("a");
        prober.announced(&id, at("http://10.0.0.1:8080/"));
        let old = prober.shared.state.lock()[&id].generation;
        // Moved to another server while a probe of the old one is out; that one's failure
        // comes after, and would take down at once a backend never found ready.
        prober.announced(&id, at("http://10.0.0.2:8080/"));
        let (mark, update, _) = prober.record(&id, old, failed());
        assert!(mark.is_none() && update.is_none());
        let status = prober.status("a").unwrap();
        assert!(status.up);
        assert_eq!((status.probes, status.failures), (0, 0));
    }

    #[test]
    fn failures_of_a_backends_old_address_do_not_count_toward_its_threshold_at_the_new_one() {
        let prober = Prober::new(HealthProbe::new().failure_threshold(3));
        let id = BackendId::from("a");
        prober.announced(&id, at("http://10.0.0.1:8080/"));
        let generation = || prober.shared.state.lock()[&id].generation;
        let ready = Checked {
            health: Health::Ready,
            ..failed()
        };
        prober.record(&id, generation(), ready);
        prober.record(&id, generation(), failed());
        prober.record(&id, generation(), failed());
        prober.announced(&id, at("http://10.0.0.2:8080/"));
        // The new server's first failure is its first in a row.
        let (mark, _, _) = prober.record(&id, generation(), failed());
        assert!(mark.is_none());
        assert_eq!(prober.status("a").unwrap().failures, 1);
        assert!(prober.status("a").unwrap().up);
    }

    #[test]
    fn a_backend_moved_from_a_server_that_said_nothing_to_one_that_says_nothing_is_not_announced_again(
    ) {
        let prober = Prober::new(HealthProbe::new());
        let id = BackendId::from("a");
        let generation = || prober.shared.state.lock()[&id].generation;
        // Neither server gives slots nor a context: nothing learned at the old address, so
        // nothing to forget at the new one.
        let ready = || Checked {
            health: Health::Ready,
            slots: Some(Err("/slots answered 404 Not Found".into())),
            slots_from: "/slots",
            no_slots: true,
            max_model_len: Some(Err("/v1/models answered 404 Not Found".into())),
        };
        prober.announced(&id, at("http://10.0.0.1:8080/"));
        let (_, update, _) = prober.record(&id, generation(), ready());
        assert!(update.is_none());
        prober.announced(&id, at("http://10.0.0.2:8080/"));
        let (_, update, _) = prober.record(&id, generation(), ready());
        assert!(update.is_none(), "announced again with nothing changed");
    }
}
