//! The swarm study: what session affinity buys an LLM fleet, with numbers and a chart.
//!
//! ```text
//! cargo run --release --example swarm                          # the study's swarm, 8 agents
//! cargo run --release --example swarm -- --scenario two-on-two
//! cargo run --release --example swarm -- --scenario overload   # more agents than slots
//! cargo run --release --example swarm -- --scenario trace --trace mooncake.jsonl
//! ```
//!
//! Agents (or a replayed Mooncake trace) send their turns through the real
//! [`SessionAffinity`](tower_affinity::SessionAffinity) service, once per placement policy, to
//! simulated llama.cpp backends ([`backend`]) whose slots and RAM prompt caches decide how much
//! of each prompt must be read again (or, with `--slot-policy paged`, backends that keep KV as
//! vLLM and SGLang do; see [`cache`]). Everything runs on tokio's paused clock in one thread, so
//! a night of fleet time takes seconds and a seed gives the same table every time.
//!
//! The model and its calibration are in [`fleet`]; the agents in [`workload`]; the trace
//! replay in [`trace`]; the metrics in [`report`]; the replay of a run's turns against
//! idealised caches, which bounds what placement could do, in [`bound`].

mod backend;
mod bound;
mod cache;
mod chart;
mod fleet;
mod report;
mod rng;
mod routers;
mod sim;
mod trace;
mod workload;

use std::future::Future;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cache::Source;
use fleet::{BackendSpec, FleetKind};
use report::{Row, Table, TurnRecord};
use sim::{Policy, Svc};
use tower_affinity::BackendId;
use workload::AgentConfig;

const USAGE: &str = "\
usage: cargo run --release --example swarm -- [options]

  --scenario NAME   study (default) | two-on-two | overload | trace | all
  --sessions N      agents (default: study 8, two-on-two 2, overload 36)
  --turns N         turns per agent (default 60)
  --seed N          seed of every random draw (default 1)
  --waves N         agents come in N waves (default 1), each with a system prompt and spec
                    of its own: a new kind of agent, or a new task, that the fleet has not
                    read before; wave w starts at w times --wave-gap
  --wave-gap SECS   seconds between the waves' starts (default 600)
  --trace FILE      Mooncake-format JSONL trace, for --scenario trace (traces are published
                    in kvcache-ai/Mooncake, FAST25-release/traces/)
  --ram-cache SIZE  RAM prompt cache of each backend, e.g. 8GiB, 512MiB (default 8GiB);
                    overload and trace also run at 8 times this
  --fleet NAME      study | two-slots | datacenter (default: the scenario's own)
  --keyless         agents send no session key: the router has only their prompt chains
                    (a trace is replayed both ways whatever this says)
  --routers N       N router replicas in front of the fleet (default 1), each modelling
                    its share of every backend's cache
  --entry E         random (default) | sticky: how turns reach the replicas (sticky: by
                    session, as consistent hashing at the ingress)
  --shared-store    the replicas share one store of homes (as through Redis)
  --replica-slots S all (default) | share: each replica counts all of every backend's
                    slots (a backend queues what they send beyond them), or is given its
                    share of them (rounded up: together they exceed them by
                    less than one a replica)
  --trace-chains C  blocks (default) | turn-ends: the router's chains of a replayed trace
                    cut at its blocks only, or also where each turn's prompt ends (as a
                    chat body's chain is cut at its messages)
  --trace-answers A dropped (default) | kept: a replayed trace's later turns as the trace
                    gives them, or each as its previous turn's prompt and answer and then the
                    trace's new tokens, as an agent sends them
  --slot-policy P   llama (default) | llama-no-idle | llama-unified | save-all | paged: how
                    a backend keeps KV between requests. llama and save-all keep each slot's
                    last state and save it to the RAM cache, which they search (llama: as
                    llama-server does with -np given, only when the slot is taken as the
                    least recently used or keeps less than half of its tokens, and every
                    idle slot's state as a task starts; llama-no-idle: the same with
                    --no-cache-idle-slots; llama-unified: with a unified KV cache, as
                    without -np, where the idle slots saved are cleared too; save-all:
                    whenever another prompt takes the slot); paged keeps every prompt's
                    blocks in one pool shared by prefix, GPU then host memory, as vLLM and
                    SGLang do
  --vram V          run (default) | wait | split: a llama-server backend runs a prompt whose
                    KV does not fit in the VRAM beside its busy slots' (counted under each
                    table), or waits until they leave it room; its idle slots' states go to
                    RAM, least recently used first, to make room. split: each slot has a
                    context of its own, a share of the VRAM, as llama-server with -np given:
                    no idle slot's state goes to RAM for room, and prompts over a slot's
                    share are counted
  --gpu-work W      prompts (default) | all: what takes a backend's GPU time. prompts:
                    reading prompts and restoring states, one after another, while its
                    slots decode beside them and saving a state to RAM is free; all: as
                    llama-server's one loop, where a save takes what a restore of as many
                    tokens does and decoding slots stall while the GPU reads or copies
  --router-context  the routers give each backend its VRAM's tokens as the context its
                    running requests share (Backend::context_tokens): a prompt that does
                    not fit there beside those in flight finds the backend full
  --assign-slots    the routers assign each llama-server backend's slots
                    (Backend::assign_slots; the backend takes the slot a request names)
  --live-window S   seconds since its last turn that a conversation counts where
                    NodeThenBackend spreads new ones (default 300; 0: every conversation
                    the cache models remember)
  --oracle          adds NTB+oracle: NodeThenBackend told what the simulated caches
                    really hold, the same rules with a perfect cache model (not an
                    upper bound: greedy rules can do worse knowing more)
  --out FILE        the SVG chart (default swarm-<scenario>.svg in Cargo's target directory)
";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Study,
    TwoOnTwo,
    Overload,
    Trace,
    All,
}

impl Scenario {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "study" => Scenario::Study,
            "two-on-two" => Scenario::TwoOnTwo,
            "overload" => Scenario::Overload,
            "trace" => Scenario::Trace,
            "all" => Scenario::All,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Scenario::Study => "study",
            Scenario::TwoOnTwo => "two-on-two",
            Scenario::Overload => "overload",
            Scenario::Trace => "trace",
            Scenario::All => "all",
        }
    }
}

#[derive(Clone, Debug)]
struct Options {
    scenario: Scenario,
    sessions: Option<u32>,
    turns: u32,
    seed: u64,
    waves: u32,
    wave_gap: Duration,
    trace: Option<PathBuf>,
    ram_bytes: u64,
    fleet: Option<FleetKind>,
    out: Option<PathBuf>,
    keyless: bool,
    oracle: bool,
    trace_chains: trace::Chains,
    /// `--trace-answers kept`: each later turn of a trace extends its previous turn's prompt
    /// and answer.
    answers_kept: bool,
    slot_policy: cache::SlotPolicy,
    vram: cache::Vram,
    gpu_work: backend::GpuWork,
    router_context: bool,
    assign_slots: bool,
    live_window: Option<Duration>,
    replicas: routers::Replicas,
}

impl Options {
    /// The fleet as titles name it: its kind, the replicas, the backends' slot policy.
    fn describe_fleet(&self, fleet: FleetKind) -> String {
        let slots = match self.slot_policy {
            cache::SlotPolicy::SaveAll => {
                "; every slot's state saved, RAM searched for every prompt"
            }
            cache::SlotPolicy::Llama => "",
            cache::SlotPolicy::LlamaNoIdle => "; idle slots' states not saved to RAM",
            cache::SlotPolicy::LlamaUnified => "; unified KV, idle slots saved to RAM and cleared",
            cache::SlotPolicy::Paged => "; KV in one pool shared by prefix, GPU then host memory",
        };
        let vram = match self.vram {
            cache::Vram::Run => "",
            cache::Vram::Wait => "; a prompt waits for room in VRAM",
            cache::Vram::Split => "; each slot a context of its own (-np)",
        };
        let gpu = match self.gpu_work {
            backend::GpuWork::Prompts => "",
            backend::GpuWork::All => "; saves take GPU time and decoding stalls behind prompts",
        };
        let context = match self.router_context {
            true => "; routers count each backend's VRAM as its context",
            false => "",
        };
        let assigned = match self.assign_slots {
            true => "; routers assign the slots",
            false => "",
        };
        let live = match self.live_window {
            Some(Duration::ZERO) => "; new conversations spread by all the models remember".into(),
            Some(w) => format!(
                "; new conversations spread by those with a turn in the last {} s",
                w.as_secs_f64()
            ),
            None => String::new(),
        };
        fleet.describe().to_owned()
            + &self.replicas.describe()
            + slots
            + vram
            + gpu
            + context
            + assigned
            + &live
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            scenario: Scenario::Study,
            sessions: None,
            turns: 60,
            seed: 1,
            waves: 1,
            wave_gap: Duration::from_secs(600),
            trace: None,
            ram_bytes: 8 << 30,
            fleet: None,
            out: None,
            keyless: false,
            oracle: false,
            trace_chains: trace::Chains::Blocks,
            answers_kept: false,
            slot_policy: cache::SlotPolicy::Llama,
            vram: cache::Vram::Run,
            gpu_work: backend::GpuWork::Prompts,
            router_context: false,
            assign_slots: false,
            live_window: None,
            replicas: routers::Replicas {
                routers: 1,
                entry: routers::Entry::Random,
                shared_store: false,
                slot_shares: false,
            },
        }
    }
}

/// `8GiB`, `8G`, `512MiB`, `65536KiB`, or bytes; units are binary.
fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

/// `n` and what it counts, in the plural but for one.
fn counted(n: impl Into<u64>, what: &str) -> String {
    let n = n.into();
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

fn human_bytes(b: u64) -> String {
    if b >= 1 << 30 && b.is_multiple_of(1 << 30) {
        format!("{} GiB", b >> 30)
    } else if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{} MiB", b >> 20)
    } else {
        format!("{b} bytes")
    }
}

/// The most router replicas `--routers` takes: each is a service of its own.
const MAX_ROUTERS: usize = 1024;

/// The most turns the agents of one run may send (`--sessions` times `--turns`): each policy's
/// run keeps a record of every turn, and a run of a million takes minutes.
const MAX_AGENT_TURNS: u64 = 1_000_000;

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Options, String> {
    let mut o = Options::default();
    let mut args = args.into_iter();
    // Flags that only some runs read: given to another, they would be ignored without a word.
    let (mut replica_flag, mut chains_given, mut answers_given) = (None, false, false);
    // The agents' flags: a trace replays its own conversations, with no random draw.
    let mut agent_flag = None;
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            return Err(String::new());
        }
        // A flag where its value should be is taken for a missing value: `--out --keyless`
        // would write the chart to a file named `--keyless`.
        let mut value = || {
            args.next()
                .filter(|v| !v.starts_with("--"))
                .ok_or(format!("{flag} needs a value"))
        };
        let bad = |v: &str| format!("{flag}: cannot read {v:?}");
        match flag.as_str() {
            "--scenario" => {
                let v = value()?;
                o.scenario = Scenario::parse(&v).ok_or_else(|| bad(&v))?;
            }
            "--sessions" => {
                agent_flag = Some(flag.clone());
                let v = value()?;
                o.sessions = Some(v.parse().ok().filter(|&n| n > 0).ok_or_else(|| bad(&v))?);
            }
            "--turns" => {
                agent_flag = Some(flag.clone());
                let v = value()?;
                o.turns = v.parse().ok().filter(|&n| n > 0).ok_or_else(|| bad(&v))?;
            }
            "--seed" => {
                agent_flag = Some(flag.clone());
                let v = value()?;
                o.seed = v.parse().map_err(|_| bad(&v))?;
            }
            "--waves" => {
                agent_flag = Some(flag.clone());
                let v = value()?;
                o.waves = v.parse().ok().filter(|&n| n > 0).ok_or_else(|| bad(&v))?;
            }
            "--wave-gap" => {
                agent_flag = Some(flag.clone());
                let v = value()?;
                let secs: f64 = v.parse().map_err(|_| bad(&v))?;
                o.wave_gap = Duration::try_from_secs_f64(secs).map_err(|_| bad(&v))?;
            }
            "--trace" => o.trace = Some(value()?.into()),
            "--ram-cache" => {
                let v = value()?;
                o.ram_bytes = parse_size(&v).ok_or_else(|| bad(&v))?;
                // Overload and trace also run at eight times it.
                if o.ram_bytes.checked_mul(8).is_none() {
                    return Err(format!(
                        "{flag}: {v} is too large: at most {} bytes (2 EiB), since overload \
                         and trace also run at eight times it",
                        u64::MAX / 8
                    ));
                }
            }
            "--fleet" => {
                let v = value()?;
                o.fleet = Some(FleetKind::parse(&v).ok_or_else(|| bad(&v))?);
            }
            "--out" => o.out = Some(value()?.into()),
            "--keyless" => o.keyless = true,
            "--router-context" => o.router_context = true,
            "--assign-slots" => o.assign_slots = true,
            "--live-window" => {
                let v = value()?;
                let secs: f64 = v.parse().map_err(|_| bad(&v))?;
                o.live_window = Some(Duration::try_from_secs_f64(secs).map_err(|_| bad(&v))?);
            }
            "--oracle" => o.oracle = true,
            "--slot-policy" => {
                let v = value()?;
                o.slot_policy = cache::SlotPolicy::parse(&v).ok_or_else(|| bad(&v))?;
            }
            "--gpu-work" => {
                let v = value()?;
                o.gpu_work = backend::GpuWork::parse(&v).ok_or_else(|| bad(&v))?;
            }
            "--vram" => {
                let v = value()?;
                o.vram = cache::Vram::parse(&v).ok_or_else(|| bad(&v))?;
            }
            "--trace-chains" => {
                chains_given = true;
                let v = value()?;
                o.trace_chains = trace::Chains::parse(&v).ok_or_else(|| bad(&v))?;
            }
            "--trace-answers" => {
                answers_given = true;
                let v = value()?;
                o.answers_kept = match v.as_str() {
                    "dropped" => false,
                    "kept" => true,
                    _ => return Err(bad(&v)),
                };
            }
            "--routers" => {
                let v = value()?;
                o.replicas.routers = v.parse().ok().filter(|&n| n >= 1).ok_or_else(|| bad(&v))?;
            }
            "--entry" => {
                replica_flag = Some(flag.clone());
                let v = value()?;
                o.replicas.entry = match v.as_str() {
                    "random" => routers::Entry::Random,
                    "sticky" => routers::Entry::Sticky,
                    _ => return Err(bad(&v)),
                };
            }
            "--shared-store" => {
                o.replicas.shared_store = true;
                replica_flag = Some(flag.clone());
            }
            "--replica-slots" => {
                replica_flag = Some(flag.clone());
                let v = value()?;
                o.replicas.slot_shares = match v.as_str() {
                    "all" => false,
                    "share" => true,
                    _ => return Err(bad(&v)),
                };
            }
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    if let Some(flag) = replica_flag.filter(|_| o.replicas.routers < 2) {
        return Err(format!(
            "{flag} is for router replicas: give --routers 2 or more"
        ));
    }
    if let Some(flag) = agent_flag.filter(|_| o.scenario == Scenario::Trace) {
        return Err(format!(
            "{flag} is for the agents (--scenario study, two-on-two, overload or all): a \
             trace replays its own conversations"
        ));
    }
    let replays = matches!(o.scenario, Scenario::Trace | Scenario::All);
    if o.trace.is_some() && !replays {
        return Err("--trace FILE is replayed by --scenario trace (or all)".into());
    }
    if chains_given && o.trace.is_none() {
        return Err("--trace-chains is for a replayed trace: give --trace FILE".into());
    }
    if answers_given && o.trace.is_none() {
        return Err("--trace-answers is for a replayed trace: give --trace FILE".into());
    }
    if o.answers_kept && o.trace_chains == trace::Chains::TurnEnds {
        return Err(
            "--trace-answers kept cuts every prompt where its previous turn ended: \
             --trace-chains turn-ends adds nothing to it"
                .into(),
        );
    }
    // A paged backend keeps its KV in one pool that moves blocks to host memory when the GPU
    // is full: it never waits for room, and `--vram wait` would change nothing but the title.
    if o.vram != cache::Vram::Run && o.slot_policy == cache::SlotPolicy::Paged {
        return Err(
            "--vram wait and split are for llama-server's slots: a paged backend (--slot-policy \
             paged) moves blocks to host memory to make room, and never waits for it"
                .into(),
        );
    }
    if o.replicas.routers > MAX_ROUTERS {
        return Err(format!(
            "--routers: {} is too many: at most {MAX_ROUTERS}",
            o.replicas.routers
        ));
    }
    let default_sessions = match o.scenario {
        Scenario::Study => 8,
        Scenario::TwoOnTwo => 2,
        Scenario::Overload | Scenario::All => 36,
        Scenario::Trace => 0,
    };
    let sessions = o.sessions.unwrap_or(default_sessions);
    if o.waves > sessions.max(1) {
        return Err(format!(
            "--waves: {} waves need as many sessions at least (--sessions {sessions})",
            o.waves
        ));
    }
    let turns = u64::from(sessions) * u64::from(o.turns);
    if turns > MAX_AGENT_TURNS {
        return Err(format!(
            "--sessions x --turns: {turns} turns is too many: at most {MAX_AGENT_TURNS} a run"
        ));
    }
    if o.scenario == Scenario::Trace && o.trace.is_none() {
        return Err(
            "--scenario trace needs --trace FILE (Mooncake traces are published in \
                    kvcache-ai/Mooncake, FAST25-release/traces/)"
                .into(),
        );
    }
    Ok(o)
}

/// One policy's run: its turns and the states its backends evicted from RAM.
struct Run {
    policy: Policy,
    records: Vec<TurnRecord>,
    ram_evictions: u64,
    /// Admissions after which busy slots held more KV than the VRAM, and all admissions.
    over_vram: (u64, u64),
    /// The service's counters at the end: what the backends' answers reported.
    stats: tower_affinity::Stats,
    /// With a shared store, its reads, their hits, and the hits that found the reading
    /// replica's own keyless write, summed over the replicas.
    store: Option<[u64; 3]>,
}

/// Runs `drive` once per policy (and with `oracle`, for [`Policy::Oracle`] too), each on a
/// fresh fleet and a fresh virtual clock.
fn run_policies<F, Fut>(fleet: &[BackendSpec], oracle: bool, drive: F) -> Vec<Run>
where
    F: Fn(Svc) -> Fut,
    Fut: Future<Output = Vec<TurnRecord>>,
{
    Policy::ALL
        .iter()
        .copied()
        .chain(oracle.then_some(Policy::Oracle))
        .map(|policy| {
            sim::block_on(async {
                let (svc, backends) = sim::build(policy, fleet);
                let records = drive(svc.clone()).await;
                Run {
                    stats: svc.stats(),
                    store: svc.store_counts(),
                    policy,
                    records,
                    ram_evictions: backends.iter().map(|b| b.ram_evictions()).sum(),
                    over_vram: backends
                        .iter()
                        .map(|b| b.over_vram())
                        .fold((0, 0), |(o, a), (bo, ba)| (o + bo, a + ba)),
                }
            })
        })
        .collect()
}

/// TTFT medians of follow-up turns by where they ran, pooled over every policy: the check
/// against the study's 1.3 s (stayed), 26 s (same node) and 120 s (other node).
fn calibration_note(runs: &[Run]) -> String {
    let all: Vec<TurnRecord> = runs.iter().flat_map(|r| r.records.clone()).collect();
    let [stay, node, cross] = Row::new("all", &all).by_move;
    let f = |(d, n): (Duration, usize)| format!("{:.1} s ({n} turns)", d.as_secs_f64());
    format!(
        "median TTFT of follow-up turns, all policies: same backend {}, same node {}, other node {}",
        f(stay),
        f(node),
        f(cross)
    )
}

fn ram_note(runs: &[Run]) -> String {
    let v: Vec<String> = runs
        .iter()
        .map(|r| {
            let restores = r.records.iter().filter(|t| t.source == Source::Ram).count();
            // Paged backends count no admissions: their pool bounds the KV itself.
            format!(
                "{} {}/{}/{}",
                r.policy.name(),
                restores,
                r.ram_evictions,
                count_share_or_dash(r.over_vram)
            )
        })
        .collect();
    // A paged backend keeps blocks, not states: what it drops from host memory is blocks.
    let evicted = match cache::slot_policy() {
        cache::SlotPolicy::Paged => "blocks dropped from host memory",
        _ => "states evicted from RAM",
    };
    format!(
        "turns restored from RAM / {evicted} / admissions after which the busy slots' KV \
         exceeded the VRAM (the simulation runs them; a backend could not): {}",
        v.join(", ")
    )
}

/// Each backend's slots.
fn slots(fleet: &[BackendSpec]) -> std::collections::HashMap<BackendId, u32> {
    fleet
        .iter()
        .map(|s| (BackendId::from(s.id.as_str()), s.model.slots))
        .collect()
}

/// `n` of `of` as a share, or `-` when `of` is 0 (see [`share_or_dash`]).
fn count_share_or_dash((n, of): (u64, u64)) -> String {
    share_or_dash((of > 0).then(|| n as f64 / of as f64))
}

/// A share in percent, or `-` when there was nothing to share.
fn share_or_dash(share: Option<f64>) -> String {
    share.map_or_else(|| "-".to_owned(), |s| format!("{:.1}%", 100.0 * s))
}

/// Each policy's hit rate in each wave of agents, with `--waves`.
fn waves_note(runs: &[Run], cfg: &AgentConfig) -> Option<String> {
    (cfg.waves > 1).then(|| {
        let v: Vec<String> = runs
            .iter()
            .map(|r| {
                let rates: Vec<String> = hits_by_wave(&r.records, cfg)
                    .into_iter()
                    .map(count_share_or_dash)
                    .collect();
                format!("{} {}", r.policy.name(), rates.join(" / "))
            })
            .collect();
        format!("hit rate of each wave, in order: {}", v.join(", "))
    })
}

/// The hits and the later turns (compactions aside) of each wave of agents.
fn hits_by_wave(records: &[TurnRecord], cfg: &AgentConfig) -> Vec<(u64, u64)> {
    let mut n = vec![(0, 0); cfg.waves.max(1) as usize];
    for t in records.iter().filter(|t| t.eligible()) {
        let w = &mut n[workload::wave_of(cfg, t.conversation) as usize];
        w.0 += u64::from(t.hit());
        w.1 += 1;
    }
    n
}

/// Each policy's turns by whether the backend serving them homed more conversations than its
/// slots (see [`bound::crowding`]).
fn crowding_note(runs: &[Run], fleet: &[BackendSpec]) -> String {
    let slots = slots(fleet);
    let v: Vec<String> = runs
        .iter()
        .map(|r| {
            let c = bound::crowding(&r.records, &slots);
            // Every turn counts in the last share: the run sent some.
            let fewest = 100.0 * c.fewest.0 as f64 / c.fewest.1.max(1) as f64;
            format!(
                "{} {} at {} / {} at {} / {fewest:.0}%",
                r.policy.name(),
                c.crowded.0,
                count_share_or_dash((c.crowded.1 as u64, c.crowded.0 as u64)),
                c.roomy.0,
                count_share_or_dash((c.roomy.1 as u64, c.roomy.0 as u64)),
            )
        })
        .collect();
    format!(
        "later turns on a backend homing more conversations than its slots, and their hits / the \
         other later turns, and theirs / turns sent with as few conversations homed beyond the \
         slots as the fleet allows: {}",
        v.join(", ")
    )
}

/// Reuse of the ideal split between first turns, whose ideal is what earlier conversations'
/// prompts share with them, and later turns, with the first turns' share of the ideal.
fn first_turns_note(runs: &[Run]) -> String {
    let share = |(reused, ideal): (u64, u64)| {
        share_or_dash((ideal > 0).then(|| reused as f64 / ideal as f64))
    };
    let ideal_first = runs.first().map_or((0, 0), |r| {
        let [first, later] = reuse_by_turn(&r.records);
        (first.1, first.1 + later.1)
    });
    let v: Vec<String> = runs
        .iter()
        .map(|r| {
            let [first, later] = reuse_by_turn(&r.records);
            format!("{} {} / {}", r.policy.name(), share(first), share(later))
        })
        .collect();
    format!(
        "reuse / ideal of first turns (what earlier conversations' prompts share with them; \
         {} of the ideal) / of later turns: {}",
        share(ideal_first),
        v.join(", ")
    )
}

/// Reused and ideal tokens of first turns and of later turns (as the table's reuse / ideal
/// counts them).
fn reuse_by_turn(records: &[TurnRecord]) -> [(u64, u64); 2] {
    let mut n = [(0, 0); 2];
    for t in records {
        let side = &mut n[usize::from(t.prev_prompt.is_some())];
        side.0 += t.reused;
        side.1 += t.ideal;
    }
    n
}

/// Each policy's later turns split by their previous prompt's size against the backends' RAM
/// cache: over half of the smallest backend's (two such states cannot both be kept there),
/// and the rest, with the hits of each.
fn large_states_note(runs: &[Run], fleet: &[BackendSpec]) -> String {
    let half = large_state_tokens(fleet);
    let v: Vec<String> = runs
        .iter()
        .map(|r| {
            let [large, rest] = by_state_size(&r.records, half);
            format!(
                "{} {} at {} / {} at {}",
                r.policy.name(),
                large.0,
                count_share_or_dash((large.1 as u64, large.0 as u64)),
                rest.0,
                count_share_or_dash((rest.1 as u64, rest.0 as u64)),
            )
        })
        .collect();
    format!(
        "later turns whose previous prompt was over half a backend's RAM cache ({} tokens), and \
         their hits / the other later turns, and theirs: {}",
        half,
        v.join(", ")
    )
}

/// Half the smallest RAM cache of `fleet`, in tokens.
fn large_state_tokens(fleet: &[BackendSpec]) -> u64 {
    let ram = |s: &BackendSpec| s.model.ram_bytes / s.model.kv_bytes_per_token.max(1);
    fleet.iter().map(ram).min().unwrap_or(0) / 2
}

/// Eligible later turns, and their hits, whose previous prompt was over `tokens`; then the
/// rest.
fn by_state_size(records: &[TurnRecord], tokens: u64) -> [(usize, usize); 2] {
    let mut n = [(0, 0); 2];
    for t in records.iter().filter(|t| t.eligible()) {
        let side = &mut n[usize::from(t.prev_prompt.unwrap_or(0) <= tokens)];
        side.0 += 1;
        side.1 += usize::from(t.hit());
    }
    n
}

/// Each policy's turns replayed against caches of whole sessions (see [`bound`]): pooled with
/// foresight, pooled least recently used, and per backend least recently used where the policy
/// sent each turn.
fn bound_note(runs: &[Run], fleet: &[BackendSpec]) -> String {
    use bound::{Evict, Stores};
    let capacity: std::collections::HashMap<BackendId, u64> = fleet
        .iter()
        .map(|s| (BackendId::from(s.id.as_str()), s.model.cache_tokens()))
        .collect();
    let v: Vec<String> = runs
        .iter()
        .map(|r| {
            let rate = |stores, evict| {
                share_or_dash(bound::hit_rate(&r.records, &capacity, stores, evict))
            };
            format!(
                "{} {}/{}/{}",
                r.policy.name(),
                rate(Stores::Pooled, Evict::FurthestAhead),
                rate(Stores::Pooled, Evict::LeastRecentlyUsed),
                rate(Stores::PerBackend, Evict::LeastRecentlyUsed),
            )
        })
        .collect();
    format!(
        "caches of whole sessions, the fleet's KV and RAM pooled and evicting the state needed \
         furthest ahead / pooled, least recently used / each backend its own, least recently \
         used: {}",
        v.join(", ")
    )
}

/// What caches of blocks would have reused of each policy's requests (see
/// [`bound::block_reuse`]). With `answers_kept`, each request's answer is held after its
/// prompt, as the backends hold it: the next turn's prompt goes on past it.
fn block_bound_note(
    runs: &[Run],
    fleet: &[BackendSpec],
    trace: &trace::Trace,
    answers_kept: bool,
) -> String {
    use bound::Stores;
    let capacity: std::collections::HashMap<BackendId, u64> = fleet
        .iter()
        .map(|s| (BackendId::from(s.id.as_str()), s.model.cache_tokens()))
        .collect();
    let v: Vec<String> = runs
        .iter()
        .map(|r| {
            // A conversation's records, in the order sent, are its requests in order.
            let mut records: Vec<&TurnRecord> = r.records.iter().collect();
            records.sort_by_key(|t| (t.conversation, t.sent));
            let mut next = vec![0usize; trace.conversations.len()];
            let requests: Vec<(&TurnRecord, Vec<cache::Block>)> = records
                .into_iter()
                .filter_map(|t| {
                    let c = t.conversation as usize;
                    let i = *trace.conversations.get(c)?.get(next[c])?;
                    next[c] += 1;
                    let r = &trace.requests[i];
                    let mut blocks = r.blocks.to_vec();
                    if answers_kept {
                        blocks.push(trace::answer_of(i, r));
                    }
                    Some((t, blocks))
                })
                .collect();
            let requests: Vec<(&TurnRecord, &[cache::Block])> =
                requests.iter().map(|(t, b)| (*t, &b[..])).collect();
            let rate = |stores| share_or_dash(bound::block_reuse(&requests, &capacity, stores));
            format!(
                "{} {}/{}",
                r.policy.name(),
                rate(Stores::Pooled),
                rate(Stores::PerBackend),
            )
        })
        .collect();
    format!(
        "caches of blocks, least recently used, the fleet's KV and RAM pooled / each backend \
         its own, reuse / ideal: {}",
        v.join(", ")
    )
}

/// Each policy's missed later turns (compactions aside): those sent to the backend that served
/// the conversation's previous turn, by what that backend still held of it (a slot holding a
/// shorter prefix, such as what the conversations share; a state in RAM holding too little;
/// nothing), and those sent elsewhere. A miss that stayed is one the backend dropped, whatever
/// the router predicted: sent elsewhere, it would have been read again there too.
fn misses_note(runs: &[Run]) -> String {
    let v: Vec<String> = runs
        .iter()
        .map(|r| {
            let n = misses(&r.records);
            format!(
                "{} {} ({}/{}/{}) / {}",
                r.policy.name(),
                n[0] + n[1] + n[2],
                n[0],
                n[1],
                n[2],
                n[3]
            )
        })
        .collect();
    format!(
        "missed later turns sent where the previous turn was served (of them, what that backend \
         still held: a slot's shorter prefix / a state in RAM / nothing) / sent elsewhere: {}",
        v.join(", ")
    )
}

/// The missed later turns of [`misses_note`]: those that stayed, by what their backend found
/// (a slot's shorter prefix, a state in RAM, nothing), then those sent elsewhere.
fn misses(records: &[TurnRecord]) -> [usize; 4] {
    let mut n = [0; 4];
    for t in records.iter().filter(|t| t.eligible() && !t.hit()) {
        let i = match (t.moved_node || t.moved_backend, t.source) {
            (true, _) => 3,
            (false, Source::Slot) => 0,
            (false, Source::Ram) => 1,
            (false, Source::Cold) => 2,
        };
        n[i] += 1;
    }
    n
}

/// The reuse the backends reported, as the service read it from their answers, and how often
/// it was far below the cache model's prediction.
fn reported_note(runs: &[Run]) -> String {
    let v: Vec<String> = runs
        .iter()
        .map(|r| {
            let s = &r.stats;
            let share = s.reused_tokens as f64 / s.prompt_tokens.max(1) as f64;
            format!(
                "{} {:.1}%/{}",
                r.policy.name(),
                100.0 * share,
                s.corrections
            )
        })
        .collect();
    format!(
        "reuse the backends reported / answers far below the model's prediction: {}",
        v.join(", ")
    )
}

/// With a shared store: what the replicas read from it.
fn store_note(runs: &[Run]) -> Option<String> {
    let v: Vec<String> = runs
        .iter()
        .map(|r| {
            let [reads, hits, own] = r.store?;
            Some(format!("{} {reads}/{hits}/{own}", r.policy.name()))
        })
        .collect::<Option<_>>()?;
    Some(format!(
        "the shared store, over the replicas: reads / homes found / of those, keyless prompts \
         the reading replica had written itself: {}",
        v.join(", ")
    ))
}

fn table(label: String, title: String, runs: &[Run], ideal: bool, notes: Vec<String>) -> Table {
    Table {
        label,
        title,
        rows: runs
            .iter()
            .map(|r| Row::new(r.policy.name(), &r.records))
            .collect(),
        ideal,
        notes,
    }
}

fn agent_runs(fleet: FleetKind, cfg: &AgentConfig, o: &Options, ram: u64) -> Vec<Run> {
    let specs = fleet.backends(ram);
    let cfg = AgentConfig {
        keyed: !o.keyless,
        ..cfg.clone()
    };
    run_policies(&specs, o.oracle, |svc| workload::run(svc, &cfg, o.seed))
}

/// How the agents are told apart, for titles.
fn keys(o: &Options) -> &'static str {
    if o.keyless {
        "no session keys"
    } else {
        "keyed"
    }
}

/// The agents of a scenario whose default is `sessions` of them.
fn agents(o: &Options, sessions: u32) -> AgentConfig {
    let mut cfg = AgentConfig::study(o.sessions.unwrap_or(sessions), o.turns);
    cfg.waves = o.waves;
    cfg.wave_gap = o.wave_gap;
    cfg
}

/// The agents' waves, for a title: nothing for one wave.
fn waves(cfg: &AgentConfig) -> String {
    match cfg.waves {
        0 | 1 => String::new(),
        n => format!(
            ", {} of a system prompt and spec of their own, {} s apart",
            counted(n, "wave"),
            cfg.wave_gap.as_secs_f64()
        ),
    }
}

fn study(o: &Options) -> Table {
    let fleet = o.fleet.unwrap_or(FleetKind::Study);
    let cfg = agents(o, 8);
    let runs = agent_runs(fleet, &cfg, o, o.ram_bytes);
    let title = format!(
        "study: {} x {}, {}, {}; {}; RAM cache {}; seed {}",
        counted(cfg.sessions, "session"),
        counted(cfg.turns, "turn"),
        match cfg.waves {
            0 | 1 => "same system prompt and spec".to_owned(),
            _ => waves(&cfg)[2..].to_owned(),
        },
        keys(o),
        o.describe_fleet(fleet),
        human_bytes(o.ram_bytes),
        o.seed
    );
    let mut notes = vec![
        calibration_note(&runs),
        ram_note(&runs),
        reported_note(&runs),
        misses_note(&runs),
        bound_note(&runs, &fleet.backends(o.ram_bytes)),
    ];
    notes.extend(waves_note(&runs, &cfg));
    if cfg.waves > 1 {
        notes.push(crowding_note(&runs, &fleet.backends(o.ram_bytes)));
    }
    notes.extend(store_note(&runs));
    table("study".into(), title, &runs, false, notes)
}

fn two_on_two(o: &Options) -> Table {
    let fleet = o.fleet.unwrap_or(FleetKind::TwoSlots);
    let mut cfg = agents(o, 2);
    // Both start together, so the first turns find each other's slot busy.
    cfg.start_spread = Duration::ZERO;
    let runs = agent_runs(fleet, &cfg, o, o.ram_bytes);
    let title = format!(
        "two-on-two: {} x {}{}, {}; {}; RAM cache {}; seed {}",
        counted(cfg.sessions, "session"),
        counted(cfg.turns, "turn"),
        waves(&cfg),
        keys(o),
        o.describe_fleet(fleet),
        human_bytes(o.ram_bytes),
        o.seed
    );
    table("two-on-two".into(), title, &runs, false, vec![])
}

fn overload(o: &Options) -> Vec<Table> {
    let fleet = o.fleet.unwrap_or(FleetKind::Study);
    let cfg = agents(o, 36);
    [o.ram_bytes, o.ram_bytes * 8]
        .into_iter()
        .map(|ram| {
            let runs = agent_runs(fleet, &cfg, o, ram);
            let specs = fleet.backends(ram);
            let title = format!(
                "overload: {} x {} on {}{}, {}; {}; RAM cache {}; seed {}",
                counted(cfg.sessions, "session"),
                counted(cfg.turns, "turn"),
                counted(specs.iter().map(|s| s.model.slots).sum::<u32>(), "slot"),
                waves(&cfg),
                keys(o),
                o.describe_fleet(fleet),
                human_bytes(ram),
                o.seed
            );
            let mut notes = vec![
                ram_note(&runs),
                reported_note(&runs),
                misses_note(&runs),
                large_states_note(&runs, &specs),
                bound_note(&runs, &specs),
                crowding_note(&runs, &specs),
            ];
            notes.extend(waves_note(&runs, &cfg));
            notes.extend(store_note(&runs));
            table(
                format!("overload, {}", human_bytes(ram)),
                title,
                &runs,
                false,
                notes,
            )
        })
        .collect()
}

fn replay(o: &Options, path: &Path) -> Result<Vec<Table>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let t = trace::Trace::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let t = if o.answers_kept {
        t.with_answers_kept()
            .map_err(|e| format!("{}: {e}", path.display()))?
    } else {
        t
    };
    if t.out_of_order > 0 {
        let _ = writeln!(
            std::io::stderr(),
            "note: {}: {}; the requests are replayed in timestamp order",
            path.display(),
            match t.out_of_order {
                1 => "1 line has an earlier timestamp than a line before it".to_owned(),
                n => format!("{n} lines have an earlier timestamp than a line before them"),
            },
        );
    }
    let fleet = o.fleet.unwrap_or(FleetKind::Datacenter);
    let span = t.requests.last().map_or(Duration::ZERO, |r| r.at);
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let mut tables = Vec::new();
    for (ram, keyed) in [
        (o.ram_bytes, true),
        (o.ram_bytes * 8, true),
        (o.ram_bytes, false),
        (o.ram_bytes * 8, false),
    ] {
        let runs = run_policies(&fleet.backends(ram), o.oracle, |svc| {
            trace::replay(svc, &t, keyed, o.trace_chains)
        });
        let keys = if keyed {
            "keyed by the rebuilt conversations"
        } else {
            "no session keys"
        };
        let title = format!(
            "trace: {name}, {} in {} ({}) over {:.0} s, {}-token blocks{}, {keys}; {}; RAM \
             cache {}",
            counted(t.requests.len() as u64, "request"),
            counted(t.conversations.len() as u64, "conversation"),
            counted(t.later_turns() as u64, "later turn"),
            span.as_secs_f64(),
            trace::BLOCK_TOKENS,
            match (o.trace_chains, o.answers_kept) {
                (_, true) => " (each later turn extends its previous prompt and answer)",
                (trace::Chains::Blocks, false) => "",
                (trace::Chains::TurnEnds, false) => " (chains also cut at turn ends)",
            },
            o.describe_fleet(fleet),
            human_bytes(ram),
        );
        let mut notes = vec![
            "reuse / ideal: reused prompt tokens as a share of what one infinite cache shared \
             by the whole fleet would have reused"
                .into(),
            ram_note(&runs),
            reported_note(&runs),
            misses_note(&runs),
            first_turns_note(&runs),
            block_bound_note(&runs, &fleet.backends(ram), &t, o.answers_kept),
        ];
        notes.extend(store_note(&runs));
        let label = format!(
            "trace, {}{}",
            human_bytes(ram),
            if keyed { "" } else { ", keyless" }
        );
        tables.push(table(label, title, &runs, true, notes));
    }
    Ok(tables)
}

fn run(o: &Options) -> Result<Vec<Table>, String> {
    Ok(match o.scenario {
        Scenario::Study => vec![study(o)],
        Scenario::TwoOnTwo => vec![two_on_two(o)],
        Scenario::Overload => overload(o),
        Scenario::Trace => {
            let path = o.trace.as_deref().ok_or("--trace FILE is required")?;
            replay(o, path)?
        }
        Scenario::All => {
            let mut v = vec![study(o), two_on_two(o)];
            v.extend(overload(o));
            if let Some(path) = o.trace.as_deref() {
                v.extend(replay(o, path)?);
            }
            v
        }
    })
}

fn main() {
    // Written without `println!` and `eprintln!`, which panic when the reader has gone
    // (`| head`).
    let o = match parse_args(std::env::args().skip(1)) {
        Ok(o) => o,
        // Asked for: the usage, on standard output.
        Err(e) if e.is_empty() => {
            let _ = write!(std::io::stdout(), "{USAGE}");
            std::process::exit(0);
        }
        Err(e) => {
            let _ = write!(std::io::stderr(), "error: {e}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    if o.scenario == Scenario::All && o.trace.is_none() {
        let _ = writeln!(
            std::io::stderr(),
            "note: --scenario all replays no trace without --trace FILE"
        );
    }
    routers::set(o.replicas);
    cache::set_slot_policy(o.slot_policy);
    cache::set_vram(o.vram);
    backend::set_gpu_work(o.gpu_work);
    sim::set_router_context(o.router_context);
    sim::set_assign_slots(o.assign_slots);
    sim::set_live_window(o.live_window);
    let started = Instant::now();
    let tables = match run(&o) {
        Ok(t) => t,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e}");
            std::process::exit(1);
        }
    };
    // The chart is drawn even when the reader of the tables has gone.
    let mut stdout = std::io::stdout().lock();
    for t in &tables {
        let _ = writeln!(stdout, "{t}");
    }
    let _ = writeln!(stdout, "{}\n", report::LEGEND);
    let out = o.out.clone().unwrap_or_else(|| {
        // Cargo's target directory: `CARGO_TARGET_DIR` when set, as Cargo itself reads it.
        std::env::var_os("CARGO_TARGET_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"))
            .join(format!("swarm-{}.svg", o.scenario.name()))
    });
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        let _ = std::fs::create_dir_all(dir);
    }
    let title = format!(
        "tower-affinity swarm study: {} (seed {})",
        o.scenario.name(),
        o.seed
    );
    match chart::draw(&out, &title, &tables) {
        Ok(()) => {
            let _ = writeln!(stdout, "chart: {}", out.display());
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: chart {}: {e}", out.display());
            std::process::exit(1);
        }
    }
    // On standard error, so that a run's standard output is the same every time.
    let _ = writeln!(
        std::io::stderr(),
        "ran in {:.2} s",
        started.elapsed().as_secs_f64()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(scenario: Scenario, turns: u32) -> Options {
        Options {
            scenario,
            turns,
            ..Options::default()
        }
    }

    #[test]
    fn same_seed_same_table() {
        let o = options(Scenario::Study, 12);
        let (a, b) = (study(&o), study(&o));
        assert_eq!(a, b);
        assert_eq!(a.to_string(), b.to_string());
        let other = study(&Options { seed: 2, ..o });
        assert_ne!(a.to_string(), other.to_string());
    }

    /// The overload scenario at the larger cache (where a single router keeps nearly every
    /// session home) through two replicas entered at random: NodeThenBackend's moves, its
    /// follow-up turns, and the table.
    fn through_two_replicas(o: &Options, shared_store: bool) -> (usize, usize, String) {
        routers::set(routers::Replicas {
            routers: 2,
            entry: routers::Entry::Random,
            shared_store,
            slot_shares: false,
        });
        let t = &overload(o)[1];
        let ntb = t.row("NodeThenBackend").unwrap();
        (
            ntb.node_moves + ntb.backend_moves,
            ntb.follow_ups,
            t.to_string(),
        )
    }

    #[test]
    fn two_replicas_entered_at_random_keep_affinity_only_through_a_shared_store() {
        let mut o = options(Scenario::Overload, 20);
        o.sessions = Some(36);
        let (local, follow_ups, local_table) = through_two_replicas(&o, false);
        let (shared, _, shared_table) = through_two_replicas(&o, true);
        // Local tables only: a turn entering the other replica after a spill goes back to
        // the old home; the shared store sends it where the spill went.
        assert!(local > follow_ups / 5, "{local_table}");
        assert!(shared * 4 < local, "{local_table}\n{shared_table}");
    }

    #[test]
    fn keyless_agents_through_two_replicas_entered_at_random_follow_a_shared_store() {
        let mut o = options(Scenario::Overload, 20);
        o.sessions = Some(36);
        o.keyless = true;
        let (local, _, local_table) = through_two_replicas(&o, false);
        let (shared, _, shared_table) = through_two_replicas(&o, true);
        // Local cache models only: a turn entering the other replica finds its conversation's
        // prefix only where that replica last sent it; the store names the backend of the
        // conversation's latest turn, by its prompt.
        assert!(shared * 2 < local, "{local_table}\n{shared_table}");
    }

    #[test]
    fn under_overload_node_patience_spills_within_the_node_first() {
        let mut o = options(Scenario::Overload, 20);
        o.sessions = Some(36);
        let t = &overload(&o)[0];
        let patient = t.row("NTB+patience").unwrap();
        assert!(patient.node_moves < patient.backend_moves, "{t}");
        let ntb = t.row("NodeThenBackend").unwrap();
        assert!(patient.node_moves < ntb.node_moves, "{t}");
        for free in ["RoundRobin", "LeastLoaded"] {
            let r = t.row(free).unwrap();
            assert!(ntb.p50 < r.p50, "{t}");
            assert!(patient.p50 < r.p50, "{t}");
            assert!(patient.hit_rate() > r.hit_rate() + 0.2, "{t}");
        }
    }

    #[test]
    fn under_overload_the_turns_llama_slots_lose_are_those_on_backends_homing_more_than_their_slots(
    ) {
        // 36 sessions on 34 slots: some backend must home more conversations than it has
        // slots, and on llama-server's slots those conversations take each other's slots.
        let o = options(Scenario::Overload, 30);
        let fleet = FleetKind::Study.backends(8 << 30);
        let cfg = AgentConfig::study(36, 30);
        let runs = agent_runs(FleetKind::Study, &cfg, &o, 8 << 30);
        let ntb = runs
            .iter()
            .find(|r| r.policy == Policy::NodeThenBackend)
            .unwrap();
        let c = bound::crowding(&ntb.records, &slots(&fleet));
        let rate = |(turns, hits): (usize, usize)| hits as f64 / turns.max(1) as f64;
        let note = crowding_note(&runs, &fleet);
        assert!(c.crowded.0 > 0, "{note}");
        assert!(rate(c.crowded) + 0.1 < rate(c.roomy), "{note}");
        // Most of the run, no more crowding than 36 on 34 forces.
        assert!(c.fewest.0 * 2 > c.fewest.1, "{note}");
    }

    #[test]
    fn under_overload_node_then_backend_misses_turns_where_their_backend_dropped_them() {
        // Round robin loses its turns by moving them; `NodeThenBackend` keeps its turns where
        // their cache was, and what it misses there the backend no longer held.
        let o = options(Scenario::Overload, 30);
        let runs = agent_runs(FleetKind::Study, &AgentConfig::study(36, 30), &o, 8 << 30);
        let note = misses_note(&runs);
        let of = |p| misses(&runs.iter().find(|r| r.policy == p).unwrap().records);
        let stayed = |n: [usize; 4]| n[0] + n[1] + n[2];
        let (rr, ntb) = (of(Policy::RoundRobin), of(Policy::NodeThenBackend));
        assert!(rr[3] > 4 * stayed(rr), "{note}");
        assert!(stayed(ntb) > 2 * ntb[3], "{note}");
        // Every miss is counted once.
        let row = Row::new(
            "NodeThenBackend",
            &runs
                .iter()
                .find(|r| r.policy == Policy::NodeThenBackend)
                .unwrap()
                .records,
        );
        assert_eq!(ntb.iter().sum::<usize>(), row.eligible - row.hits, "{note}");
    }

    #[test]
    fn under_overload_at_8_gib_the_turns_missed_most_are_those_of_states_over_half_the_ram() {
        // A backend's 8 GiB of RAM holds 65,536 of the study model's tokens: two conversations
        // over half of that cannot both be kept there, and their turns miss most.
        let o = options(Scenario::Overload, 60);
        let fleet = FleetKind::Study.backends(8 << 30);
        let runs = agent_runs(FleetKind::Study, &AgentConfig::study(36, 60), &o, 8 << 30);
        let half = large_state_tokens(&fleet);
        assert_eq!(half, 32_768);
        let ntb = runs
            .iter()
            .find(|r| r.policy == Policy::NodeThenBackend)
            .unwrap();
        let [large, rest] = by_state_size(&ntb.records, half);
        let note = large_states_note(&runs, &fleet);
        let missed = |(turns, hits): (usize, usize)| (turns - hits) as f64 / turns.max(1) as f64;
        assert!(large.0 > 0 && rest.0 > 0, "{note}");
        assert!(missed(large) > 2.0 * missed(rest), "{note}");
        let row = Row::new("NodeThenBackend", &ntb.records);
        assert_eq!(large.0 + rest.0, row.eligible, "{note}");
        assert_eq!(large.1 + rest.1, row.hits, "{note}");
    }

    /// The overload scenario's runs at 8 GiB, `turns` turns, on backends of slot policy `policy`.
    fn overload_at_8_gib(policy: cache::SlotPolicy, turns: u32) -> Vec<Run> {
        let o = options(Scenario::Overload, turns);
        cache::set_slot_policy(policy);
        let runs = agent_runs(
            FleetKind::Study,
            &AgentConfig::study(36, turns),
            &o,
            8 << 30,
        );
        cache::set_slot_policy(cache::SlotPolicy::Llama);
        runs
    }

    #[test]
    fn on_paged_backends_the_overload_scenario_keeps_nine_turns_in_ten_warm() {
        // The same router on backends that hold a shared prefix once and evict block by block
        // (vLLM, SGLang) reaches what llama-server's slots do not.
        let at_8_gib = |policy| {
            let runs = overload_at_8_gib(policy, 60);
            table(String::new(), String::new(), &runs, false, vec![])
        };
        let (paged, llama) = (
            at_8_gib(cache::SlotPolicy::Paged),
            at_8_gib(cache::SlotPolicy::Llama),
        );
        let ntb = |t: &Table| t.row("NodeThenBackend").unwrap().hit_rate();
        assert!(ntb(&paged) >= 0.9, "{paged}");
        assert!(ntb(&paged) > ntb(&llama), "{paged}{llama}");
    }

    #[test]
    fn under_overload_assigning_the_slots_of_llama_servers_that_clear_idle_slots_loses_hits() {
        // With a unified KV cache, llama-server saves and clears every idle slot as a task
        // starts. A conversation sent to its own slot then names an empty slot, for which
        // llama-server searches no RAM cache: it reads its prompt again.
        let at_8_gib = |assign| {
            sim::set_assign_slots(assign);
            let runs = overload_at_8_gib(cache::SlotPolicy::LlamaUnified, 60);
            sim::set_assign_slots(false);
            table(String::new(), String::new(), &runs, false, vec![])
        };
        let (assigned, chosen) = (at_8_gib(true), at_8_gib(false));
        let ntb = |t: &Table| t.row("NodeThenBackend").unwrap().hit_rate();
        assert!(ntb(&assigned) + 0.1 < ntb(&chosen), "{assigned}{chosen}");
    }

    #[test]
    fn keyless_agents_in_waves_are_spread_by_the_conversations_with_a_turn_lately() {
        // Three waves of 34 keyless agents on 34 slots, 25 minutes apart, each opening with a
        // system prompt no earlier wave sent. Counted against every conversation the models
        // remember, a backend's share grows with each wave, and the first backend to read a
        // wave's prompt draws many of its agents onto its slots.
        let later_waves = |window| {
            sim::set_live_window(window);
            let o = Options {
                keyless: true,
                ..options(Scenario::Study, 20)
            };
            let mut cfg = AgentConfig::study(102, 20);
            (cfg.waves, cfg.wave_gap) = (3, Duration::from_secs(1500));
            let runs = agent_runs(FleetKind::Study, &cfg, &o, 8 << 30);
            sim::set_live_window(None);
            let ntb = runs.iter().find(|r| r.policy == Policy::NodeThenBackend);
            hits_by_wave(&ntb.unwrap().records, &cfg)
                .into_iter()
                .map(|(hits, of)| hits as f64 / of.max(1) as f64)
                .collect::<Vec<f64>>()
        };
        let (lately, all) = (later_waves(None), later_waves(Some(Duration::ZERO)));
        assert!(lately[1..].iter().all(|&r| r >= 0.9), "{lately:?}");
        // Seed 1: 96.4% and 94.0% against 93.2% and 93.7%. Over seeds 1 to 12 the later
        // waves reuse 93.8% against 90.6%, and the window is ahead on each seed.
        let mean = |v: &[f64]| v[1..].iter().sum::<f64>() / 2.0;
        assert!(
            mean(&lately) > mean(&all) + 0.01,
            "{lately:?} against {all:?}"
        );
    }

    #[test]
    fn under_overload_llama_servers_saving_idle_slots_evict_more_from_ram() {
        // llama-server's default copies every idle slot's state to RAM as a task starts: the
        // copies of states the slots still hold crowd out those that only RAM holds.
        let evicted = |policy| {
            let runs = overload_at_8_gib(policy, 30);
            let ntb = runs.iter().find(|r| r.policy == Policy::NodeThenBackend);
            ntb.unwrap().ram_evictions
        };
        let (idle, no_idle) = (
            evicted(cache::SlotPolicy::Llama),
            evicted(cache::SlotPolicy::LlamaNoIdle),
        );
        assert!(idle > no_idle + no_idle / 2, "{idle} against {no_idle}");
    }

    #[test]
    fn sticky_placement_beats_free_routing_and_two_on_two_always_hits() {
        let t = study(&options(Scenario::Study, 24));
        let ntb = t.row("NodeThenBackend").unwrap();
        assert!(ntb.hit_rate() >= 0.99, "{t}");
        assert!(
            ntb.node_moves + ntb.backend_moves <= ntb.follow_ups / 100,
            "{t}"
        );
        for free in ["RoundRobin", "LeastLoaded"] {
            let r = t.row(free).unwrap();
            assert!(r.hit_rate() <= ntb.hit_rate() - 0.2, "{t}");
            assert!(r.node_moves > r.follow_ups / 5, "{t}");
            assert!(r.p50 > ntb.p50 * 3, "{t}");
        }

        let t = two_on_two(&options(Scenario::TwoOnTwo, 24));
        let ntb = t.row("NodeThenBackend").unwrap();
        assert_eq!(ntb.hits, ntb.eligible, "{t}");
        assert_eq!(ntb.node_moves + ntb.backend_moves, 0, "{t}");
    }

    #[test]
    fn agents_without_keys_keep_their_caches_through_their_prompt_chains() {
        let o = Options {
            keyless: true,
            ..options(Scenario::Study, 24)
        };
        let t = study(&o);
        let ntb = t.row("NodeThenBackend").unwrap();
        // A miss or two of 184 later turns, as ties between equal backends fall: 98.9% to
        // 100% over seeds 1 to 10.
        assert!(ntb.hit_rate() >= 0.985, "{t}");
        // Without keys the stateless policies have nothing to go by.
        for free in ["RoundRobin", "LeastLoaded", "Rendezvous"] {
            let r = t.row(free).unwrap();
            assert!(r.hit_rate() <= ntb.hit_rate() - 0.2, "{t}");
        }
        // Compactions are the router's to count only when it knows the session; agents
        // compact past 60,000 tokens, within 60 turns.
        assert_eq!(ntb.compactions, 0, "{t}");
        let keyed = study(&options(Scenario::Study, 60));
        assert!(
            keyed.row("NodeThenBackend").unwrap().compactions > 0,
            "{keyed}"
        );
    }

    /// A Mooncake trace of `(timestamp, input_length, hash_ids)` lines, in a directory of its
    /// own that goes when it is dropped.
    struct TraceFile {
        dir: std::path::PathBuf,
        path: std::path::PathBuf,
    }

    impl TraceFile {
        fn write(name: &str, lines: &[(u64, u32, &[u64])]) -> Self {
            let text: Vec<String> = lines
                .iter()
                .map(|(ts, input, ids)| {
                    format!(
                        r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": 20, "hash_ids": {ids:?}}}"#
                    )
                })
                .collect();
            let dir = std::env::temp_dir().join(format!("swarm-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(format!("{name}.jsonl"));
            std::fs::write(&path, text.join("\n")).unwrap();
            TraceFile { dir, path }
        }

        fn options(&self, oracle: bool) -> Options {
            Options {
                scenario: Scenario::Trace,
                trace: Some(self.path.clone()),
                oracle,
                ..Options::default()
            }
        }
    }

    impl Drop for TraceFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn a_traces_reuse_is_split_between_first_turns_and_later_turns() {
        // Two conversations of two turns, then a third conversation whose first prompt begins
        // with the first one's two blocks: its ideal is those blocks, which only an earlier
        // conversation's prompt holds.
        let trace = TraceFile::write(
            "shared",
            &[
                (0, 1100, &[1, 2, 3]),
                (100, 1100, &[4, 5, 6]),
                (30_000, 2100, &[1, 2, 7, 8, 9]),
                (31_000, 2100, &[4, 5, 10, 11, 12]),
                (40_000, 1600, &[1, 2, 13, 14]),
            ],
        );
        let tables = replay(&trace.options(false), &trace.path).unwrap();
        let t = &tables[0];
        let note = t
            .notes
            .iter()
            .find(|n| n.starts_with("reuse / ideal of first turns"))
            .expect("the trace's tables split reuse by turn");
        // Ideal: 1,024 tokens of the third conversation's first turn, 2,048 of later turns.
        assert!(note.contains("33.3% of the ideal"), "{note}");
        // `NodeThenBackend` sends the new conversation where its prefix is, and every later
        // turn home.
        assert!(note.contains("NodeThenBackend 100.0% / 100.0%"), "{note}");
        // Rendezvous sends later turns home too, and the new conversation by its key alone,
        // here to a backend that does not hold the prefix.
        assert!(note.contains("Rendezvous 0.0% / 100.0%"), "{note}");
        let ntb = t.row("NodeThenBackend").unwrap();
        assert_eq!((ntb.turns, ntb.reused, ntb.ideal), (5, 3072, 3072), "{t}");
    }

    #[test]
    fn the_overload_notes_print_no_share_of_turns_or_admissions_there_were_none_of() {
        // At 64 GiB no state is over half a backend's RAM cache; on the datacenter fleet's
        // 128 slots no backend homes more conversations than its slots.
        let o = options(Scenario::Overload, 3);
        let cfg = AgentConfig::study(4, 3);
        let runs = agent_runs(FleetKind::Study, &cfg, &o, 64 << 30);
        let note = large_states_note(&runs, &FleetKind::Study.backends(64 << 30));
        assert!(note.contains("NodeThenBackend 0 at - / 8 at "), "{note}");
        let runs = agent_runs(FleetKind::Datacenter, &cfg, &o, 8 << 30);
        let note = crowding_note(&runs, &FleetKind::Datacenter.backends(8 << 30));
        assert!(note.contains("NodeThenBackend 0 at - / 8 at "), "{note}");
        // Paged backends count no admissions beyond the VRAM: their pool bounds the KV.
        cache::set_slot_policy(cache::SlotPolicy::Paged);
        let runs = agent_runs(FleetKind::Study, &cfg, &o, 8 << 30);
        cache::set_slot_policy(cache::SlotPolicy::Llama);
        let note = ram_note(&runs);
        assert!(note.contains("NodeThenBackend 0/0/-"), "{note}");
    }

    #[test]
    fn the_ram_line_of_paged_backends_counts_blocks_not_states() {
        // A paged backend drops blocks from host memory one by one: its count is of blocks.
        let o = options(Scenario::Overload, 2);
        let cfg = AgentConfig::study(2, 2);
        cache::set_slot_policy(cache::SlotPolicy::Paged);
        let paged = ram_note(&agent_runs(FleetKind::TwoSlots, &cfg, &o, 8 << 30));
        cache::set_slot_policy(cache::SlotPolicy::Llama);
        assert!(
            paged.contains("/ blocks dropped from host memory /"),
            "{paged}"
        );
        assert!(!paged.contains("states"), "{paged}");
        let llama = ram_note(&agent_runs(FleetKind::TwoSlots, &cfg, &o, 8 << 30));
        assert!(llama.contains("/ states evicted from RAM /"), "{llama}");
    }

    #[test]
    fn a_run_with_nothing_to_count_prints_no_share_of_it() {
        // One turn per agent: no later turn, so no hit rate, in the table or in the bounds.
        let t = study(&options(Scenario::Study, 1));
        let bounds = t
            .notes
            .iter()
            .find(|n| n.starts_with("caches of whole sessions"))
            .unwrap();
        assert!(bounds.contains("NodeThenBackend -/-/-"), "{bounds}");
        assert!(!bounds.contains('%'), "{bounds}");
        // One request: nothing an ideal cache could have reused, so no share of it.
        let trace = TraceFile::write("single", &[(0, 1100, &[1, 2, 3])]);
        let tables = replay(&trace.options(false), &trace.path).unwrap();
        let t = &tables[0];
        let ntb = t.to_string();
        let row = ntb
            .lines()
            .find(|l| l.starts_with("NodeThenBackend"))
            .unwrap();
        assert!(row.trim_end().ends_with(" -"), "{t}");
        for note in ["caches of blocks", "reuse / ideal of first turns"] {
            let n = t.notes.iter().find(|n| n.starts_with(note)).unwrap();
            assert!(n.contains("NodeThenBackend -"), "{n}");
        }
    }

    #[test]
    fn a_traces_title_gives_its_span_from_its_first_request() {
        let trace = TraceFile::write(
            "late",
            &[
                (1_000_000, 1100, &[1, 2, 3]),
                (1_010_000, 2100, &[1, 2, 7, 8, 9]),
            ],
        );
        let tables = replay(&trace.options(false), &trace.path).unwrap();
        let title = &tables[0].title;
        assert!(title.contains(" over 10 s,"), "{title}");
    }

    #[test]
    fn a_traces_title_counts_one_of_a_thing_in_the_singular() {
        let trace = TraceFile::write(
            "pair",
            &[(0, 1100, &[1, 2, 3]), (100, 2100, &[1, 2, 7, 8, 9])],
        );
        let title = &replay(&trace.options(false), &trace.path).unwrap()[0].title;
        assert!(
            title.contains("2 requests in 1 conversation (1 later turn) over"),
            "{title}"
        );
        let trace = TraceFile::write("one", &[(0, 1100, &[1, 2, 3])]);
        let title = &replay(&trace.options(false), &trace.path).unwrap()[0].title;
        assert!(
            title.contains("1 request in 1 conversation (0 later turns) over"),
            "{title}"
        );
    }

    #[test]
    fn trace_replay_runs_a_small_trace_end_to_end() {
        let trace = TraceFile::write(
            "tiny",
            &[
                (0, 1100, &[1, 2, 3]),
                (100, 1100, &[4, 5, 6]),
                (30_000, 2100, &[1, 2, 7, 8, 9]),
                (31_000, 2100, &[4, 5, 10, 11, 12]),
            ],
        );
        let tables = replay(&trace.options(true), &trace.path).unwrap();
        let without = replay(&trace.options(false), &trace.path).unwrap();
        assert!(without[0].row("NTB+oracle").is_none());
        let t = &tables[0];
        let ntb = t.row("NodeThenBackend").unwrap();
        assert_eq!((ntb.turns, ntb.eligible, ntb.hits), (4, 2, 2), "{t}");
        // Each later turn reuses its first two blocks, all an ideal cache could.
        assert_eq!((ntb.reused, ntb.ideal), (2048, 2048), "{t}");
        // Without keys, the chains alone find the same backends.
        let t = &tables[2];
        assert!(t.title.contains("no session keys"), "{t}");
        let ntb = t.row("NodeThenBackend").unwrap();
        assert_eq!((ntb.turns, ntb.hits, ntb.reused), (4, 2, 2048), "{t}");
        // The oracle, told what the simulated caches hold, finds them too, with keys or not.
        for t in [&tables[0], &tables[2]] {
            let oracle = t.row("NTB+oracle").expect("--oracle adds its row");
            assert_eq!(
                (oracle.turns, oracle.hits, oracle.reused),
                (4, 2, 2048),
                "{t}"
            );
        }
        // With the answers kept, each later turn reuses its previous prompt and answer whole
        // (1,100 and 20 tokens), and so would the ideal.
        let kept = Options {
            answers_kept: true,
            ..trace.options(false)
        };
        let tables = replay(&kept, &trace.path).unwrap();
        assert!(tables[0]
            .title
            .contains("extends its previous prompt and answer"));
        for t in [&tables[0], &tables[2]] {
            let ntb = t.row("NodeThenBackend").unwrap();
            assert_eq!((ntb.hits, ntb.reused, ntb.ideal), (2, 2240, 2240), "{t}");
            // Caches of blocks as large as the fleet's hold each prompt and its answer too.
            let blocks = t
                .notes
                .iter()
                .find(|n| n.starts_with("caches of blocks"))
                .unwrap();
            assert!(blocks.contains("NodeThenBackend 100.0%/100.0%"), "{blocks}");
        }
    }

    #[test]
    fn options_and_sizes() {
        assert_eq!(parse_size("8GiB"), Some(8 << 30));
        assert_eq!(parse_size("512MiB"), Some(512 << 20));
        assert_eq!(parse_size("64g"), Some(64 << 30));
        assert_eq!(parse_size("12 parsecs"), None);
        let o = parse_args(
            [
                "--scenario",
                "overload",
                "--sessions",
                "40",
                "--ram-cache",
                "16GiB",
            ]
            .map(String::from),
        )
        .unwrap();
        assert_eq!(
            (o.scenario, o.sessions, o.ram_bytes),
            (Scenario::Overload, Some(40), 16 << 30)
        );
        assert!(parse_args(["--scenario".to_string(), "trace".to_string()]).is_err());
    }

    #[test]
    fn the_overload_title_counts_the_fleets_slots() {
        let o = Options {
            fleet: Some(FleetKind::TwoSlots),
            ..options(Scenario::Overload, 2)
        };
        let t = &overload(&o)[0];
        assert!(
            t.title
                .starts_with("overload: 36 sessions x 2 turns on 2 slots,"),
            "{t}"
        );
        let t = &overload(&options(Scenario::Overload, 2))[0];
        assert!(
            t.title
                .starts_with("overload: 36 sessions x 2 turns on 34 slots,"),
            "{t}"
        );
    }

    #[test]
    fn one_of_a_thing_is_not_counted_in_the_plural() {
        assert_eq!(counted(1u32, "session"), "1 session");
        assert_eq!(counted(36u32, "session"), "36 sessions");
        assert_eq!(counted(0u32, "turn"), "0 turns");
    }

    #[test]
    fn sizes_print_in_the_largest_unit_that_says_them_exactly() {
        assert_eq!(human_bytes(8 << 30), "8 GiB");
        assert_eq!(human_bytes(1536 << 20), "1536 MiB");
        assert_eq!(human_bytes(1000), "1000 bytes");
        assert_eq!(human_bytes(0), "0 bytes");
    }

    #[test]
    fn flags_a_run_would_ignore_and_flags_taken_for_values_are_refused() {
        let parse = |args: &[&str]| parse_args(args.iter().map(|a| a.to_string()));
        let err = parse(&["--out", "--keyless"]).unwrap_err();
        assert_eq!(err, "--out needs a value");
        let err = parse(&["--trace", "t.jsonl"]).unwrap_err();
        assert!(err.contains("--scenario trace"), "{err}");
        assert!(parse(&["--trace", "t.jsonl", "--scenario", "all"]).is_ok());
        let err = parse(&["--scenario", "overload", "--trace-chains", "turn-ends"]).unwrap_err();
        assert!(err.contains("--trace FILE"), "{err}");
        let err = parse(&["--trace-answers", "kept"]).unwrap_err();
        assert!(err.contains("--trace FILE"), "{err}");
        let trace = ["--scenario", "trace", "--trace", "t.jsonl"];
        let kept = [&trace[..], &["--trace-answers", "kept"]].concat();
        assert!(parse(&kept).unwrap().answers_kept);
        let both = [&kept[..], &["--trace-chains", "turn-ends"]].concat();
        assert!(parse(&both).unwrap_err().contains("adds nothing"));
        for flag in [["--sessions", "4"], ["--turns", "10"], ["--seed", "2"]] {
            let err = parse(&[&trace[..], &flag].concat()).unwrap_err();
            assert!(err.starts_with(flag[0]) && err.contains("agents"), "{err}");
            let all = [&flag[..], &["--scenario", "all", "--trace", "t.jsonl"]].concat();
            assert!(parse(&all).is_ok(), "{all:?}");
        }
        let err = parse(&["--vram", "wait", "--slot-policy", "paged"]).unwrap_err();
        assert!(
            err.starts_with("--vram wait") && err.contains("paged"),
            "{err}"
        );
        assert!(parse(&["--vram", "wait", "--slot-policy", "save-all"]).is_ok());
        assert!(parse(&["--vram", "run", "--slot-policy", "paged"]).is_ok());
        let dropped = [&trace[..], &["--trace-answers", "dropped"]].concat();
        assert!(!parse(&dropped).unwrap().answers_kept);
        assert!(parse(&[&trace[..], &["--trace-answers", "some"]].concat()).is_err());
        for flag in [
            &["--shared-store"][..],
            &["--entry", "sticky"],
            &["--replica-slots", "share"],
        ] {
            let err = parse(flag).unwrap_err();
            assert!(err.contains("--routers 2"), "{err}");
            let with_two: Vec<&str> = flag.iter().copied().chain(["--routers", "2"]).collect();
            assert!(parse(&with_two).is_ok(), "{with_two:?}");
        }
    }

    #[test]
    fn sizes_and_counts_too_large_to_run_are_refused() {
        let parse = |args: &[&str]| parse_args(args.iter().map(|a| a.to_string()));
        // Eight times 2 EiB would wrap around to 0 bytes for the second table.
        let err = parse(&["--ram-cache", "2305843009213693952"]).unwrap_err();
        assert!(err.contains("too large"), "{err}");
        let max = (u64::MAX / 8).to_string();
        assert_eq!(
            parse(&["--ram-cache", &max]).unwrap().ram_bytes,
            u64::MAX / 8
        );
        assert!(parse(&["--ram-cache", "0"]).is_ok());
        // Replicas and turns that would exhaust memory before the first table.
        let err = parse(&["--routers", "4294967296"]).unwrap_err();
        assert!(err.contains("at most 1024"), "{err}");
        assert!(parse(&["--routers", "1024"]).is_ok());
        let err = parse(&["--sessions", "4294967295"]).unwrap_err();
        assert!(err.contains("too many"), "{err}");
        let err = parse(&["--turns", "4294967295"]).unwrap_err();
        assert!(err.contains("too many"), "{err}");
        // The scenario's own number of agents counts: 36 x 30,000 for the overload.
        assert!(parse(&["--turns", "30000"]).is_ok());
        assert!(parse(&["--turns", "30000", "--scenario", "overload"]).is_err());
        assert!(parse(&["--sessions", "1000", "--turns", "1000"]).is_ok());
    }
}
