//! The agents: a swarm of coding sessions building the same app from the same spec.
//!
//! Every session starts with the same system prompt and the same spec (the study's 437-line
//! spec), so the first two messages are identical across sessions: only the `X-Session-Id`
//! header tells them apart. Each turn's prompt is the previous one plus the model's answer and
//! the tool output; between turns the agent thinks (runs its tools). Past a context threshold
//! the agent compacts: the history is rewritten to a summary after the system prompt, and no
//! cache holds that prompt.
//!
//! Sizes and times are drawn from each session's own stream of the seeded generator, in a fixed
//! order, so a session sends the same prompts whichever policy serves it.

use std::time::Duration;

use crate::backend::Prompt;
use crate::cache::{self, Block};
use crate::report::TurnRecord;
use crate::rng::Rng;
use crate::sim::{self, Svc, TurnInput};

/// A log-normal distribution, clamped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Dist {
    pub(crate) median: f64,
    pub(crate) sigma: f64,
    pub(crate) lo: f64,
    pub(crate) hi: f64,
}

impl Dist {
    fn draw(&self, rng: &mut Rng) -> f64 {
        rng.lognormal(self.median, self.sigma, self.lo, self.hi)
    }
}

/// The swarm's shape.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AgentConfig {
    pub(crate) sessions: u32,
    pub(crate) turns: u32,
    /// Sessions start at uniform offsets in `[0, start_spread)`.
    pub(crate) start_spread: Duration,
    pub(crate) system_tokens: u32,
    pub(crate) spec_tokens: u32,
    /// Answer tokens (tool calls included).
    pub(crate) answer: Dist,
    /// Tool output tokens appended after each answer.
    pub(crate) tool: Dist,
    /// Seconds between the end of an answer and the next request.
    pub(crate) think: Dist,
    /// Context tokens past which the agent compacts.
    pub(crate) compact_at: u64,
    pub(crate) summary_tokens: u32,
    /// Whether agents send their session's key; without one the router has only the chains.
    pub(crate) keyed: bool,
    /// The agents come in this many waves, each with a system prompt and spec of its own that
    /// no earlier wave sent; the sessions are split between them in order.
    pub(crate) waves: u32,
    /// Wave `w`'s sessions start at `w` times this, plus their offset in `start_spread`.
    pub(crate) wave_gap: Duration,
}

impl AgentConfig {
    /// The study's swarm.
    pub(crate) fn study(sessions: u32, turns: u32) -> Self {
        AgentConfig {
            sessions,
            turns,
            start_spread: Duration::from_secs(60),
            system_tokens: 2_000,
            // 437 lines at about 10 tokens a line.
            spec_tokens: 4_500,
            // Tool calls that write whole files make the tail.
            answer: Dist {
                median: 300.0,
                sigma: 1.0,
                lo: 20.0,
                hi: 4_000.0,
            },
            // Median 160 tokens (a short command's output), with file reads in the tail.
            tool: Dist {
                median: 160.0,
                sigma: 1.6,
                lo: 10.0,
                hi: 10_000.0,
            },
            think: Dist {
                median: 8.0,
                sigma: 1.0,
                lo: 1.0,
                hi: 120.0,
            },
            compact_at: 60_000,
            summary_tokens: 4_000,
            keyed: true,
            waves: 1,
            wave_gap: Duration::from_secs(600),
        }
    }
}

/// Block ids: agents' own messages, then the two messages every session shares.
const AGENT_IDS: u64 = 1 << 62;
const SYSTEM_ID: u64 = 1 << 61;
const SPEC_ID: u64 = SYSTEM_ID + 1;

/// One session's prompt state.
struct Agent {
    session: u64,
    rng: Rng,
    blocks: Vec<Block>,
    next: u64,
}

impl Agent {
    /// Session `session` of wave `wave`.
    fn new(cfg: &AgentConfig, session: u32, wave: u32, rng: Rng) -> Self {
        let shared = 2 * u64::from(wave);
        Agent {
            session: u64::from(session),
            rng,
            blocks: vec![
                Block {
                    id: SYSTEM_ID + shared,
                    tokens: cfg.system_tokens,
                },
                Block {
                    id: SPEC_ID + shared,
                    tokens: cfg.spec_tokens,
                },
            ],
            next: 0,
        }
    }

    fn block(&mut self, tokens: f64) -> Block {
        self.next += 1;
        Block {
            id: AGENT_IDS | (self.session << 32) | self.next,
            tokens: tokens.round() as u32,
        }
    }

    /// This turn's request.
    fn prompt(&mut self, cfg: &AgentConfig) -> Prompt {
        let n = cfg.answer.draw(&mut self.rng);
        Prompt {
            blocks: self.blocks.as_slice().into(),
            answer: self.block(n),
        }
    }

    /// Appends the answer and the tool output; returns the think time before the next turn
    /// and whether that turn is a compaction.
    fn after(&mut self, cfg: &AgentConfig, answer: Block) -> (Duration, bool) {
        let tool = cfg.tool.draw(&mut self.rng);
        let think = Duration::from_secs_f64(cfg.think.draw(&mut self.rng));
        self.blocks.push(answer);
        let tool = self.block(tool);
        self.blocks.push(tool);
        if cache::tokens(&self.blocks) > cfg.compact_at {
            let summary = self.block(f64::from(cfg.summary_tokens));
            self.blocks.truncate(1);
            self.blocks.push(summary);
            return (think, true);
        }
        (think, false)
    }
}

/// The wave session `s` comes in: the sessions split between the waves in order, as evenly as
/// they divide.
pub(crate) fn wave_of(cfg: &AgentConfig, s: u32) -> u32 {
    let waves = cfg.waves.clamp(1, cfg.sessions.max(1));
    (u64::from(s) * u64::from(waves) / u64::from(cfg.sessions.max(1))) as u32
}

/// Runs the swarm against `svc` and returns every turn, session by session.
pub(crate) async fn run(svc: Svc, cfg: &AgentConfig, seed: u64) -> Vec<TurnRecord> {
    let root = Rng::new(seed);
    let mut tasks = Vec::new();
    for s in 0..cfg.sessions {
        let mut rng = root.fork(u64::from(s));
        let wave = wave_of(cfg, s);
        let start = cfg.wave_gap * wave + cfg.start_spread.mul_f64(rng.f64());
        let mut agent = Agent::new(cfg, s, wave, rng);
        let cfg = cfg.clone();
        let svc = svc.clone();
        tasks.push(tokio::task::spawn_local(async move {
            tokio::time::sleep(start).await;
            let name = format!("agent-{s}");
            let mut records = Vec::with_capacity(cfg.turns as usize);
            let (mut prev, mut prev_prompt, mut compaction) = (None, None, false);
            for _ in 0..cfg.turns {
                let prompt = agent.prompt(&cfg);
                let answer = prompt.answer;
                let prompt_tokens = cache::tokens(&prompt.blocks);
                let input = TurnInput {
                    conversation: s,
                    session: cfg.keyed.then_some(name.as_str()),
                    prompt,
                    prev_prompt,
                    compaction,
                    ideal: 0,
                    chain: None,
                };
                records.push(sim::turn(&svc, input, &mut prev).await);
                prev_prompt = Some(prompt_tokens);
                let (think, compacts) = agent.after(&cfg, answer);
                compaction = compacts;
                tokio::time::sleep(think).await;
            }
            records
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("an agent task"));
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_share_their_first_two_messages_and_compact_past_the_threshold() {
        let mut cfg = AgentConfig::study(2, 0);
        cfg.compact_at = 12_000;
        let root = Rng::new(1);
        let mut a = Agent::new(&cfg, 0, 0, root.fork(0));
        let mut b = Agent::new(&cfg, 1, 0, root.fork(1));
        let (pa, pb) = (a.prompt(&cfg), b.prompt(&cfg));
        assert_eq!(pa.blocks, pb.blocks);
        assert_ne!(pa.answer.id, pb.answer.id);

        let mut prompt = pa;
        let mut compacted = false;
        for _ in 0..200 {
            let (_, compacts) = a.after(&cfg, prompt.answer);
            let next = a.prompt(&cfg);
            if compacts {
                // Only the system prompt survives: the old prefix is gone.
                assert_eq!(
                    cache::common_prefix(&next.blocks, &prompt.blocks),
                    u64::from(cfg.system_tokens)
                );
                compacted = true;
                break;
            }
            // Otherwise the new prompt extends the previous prompt and its answer.
            let mut kv = prompt.blocks.to_vec();
            kv.push(prompt.answer);
            assert_eq!(cache::common_prefix(&next.blocks, &kv), cache::tokens(&kv));
            prompt = next;
        }
        assert!(compacted);
    }
}
