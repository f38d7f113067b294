//! Turn records, the metrics drawn from them, and the printed table.

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;
use tower_affinity::{BackendId, Outcome};

use crate::cache::Source;

/// The study's hit threshold: a turn hits when it reused at least this share of the previous
/// turn's context.
pub(crate) const HIT_SHARE: f64 = 0.8;

/// One turn as the agent saw it.
#[derive(Clone, Debug)]
pub(crate) struct TurnRecord {
    /// Which conversation the turn belongs to: the agent, or the trace's conversation.
    pub(crate) conversation: u32,
    /// When the agent sent it.
    pub(crate) sent: Instant,
    /// Its prompt's tokens.
    pub(crate) prompt: u64,
    /// The backend that served it.
    pub(crate) backend: BackendId,
    /// How the router placed it.
    pub(crate) outcome: Outcome,
    /// The previous turn's prompt tokens; `None` on a session's first turn.
    pub(crate) prev_prompt: Option<u64>,
    /// The client rewrote its history: no cache can serve this turn.
    pub(crate) compaction: bool,
    /// Prompt tokens the backend did not have to prefill.
    pub(crate) reused: u64,
    /// What an infinite cache shared by the whole fleet would have reused (trace replay).
    pub(crate) ideal: u64,
    pub(crate) source: Source,
    pub(crate) moved_node: bool,
    pub(crate) moved_backend: bool,
    pub(crate) ttft: Duration,
}

impl TurnRecord {
    /// Whether the turn counts in the hit rate: it has a previous turn and is not a compaction.
    pub(crate) fn eligible(&self) -> bool {
        self.prev_prompt.is_some() && !self.compaction
    }

    pub(crate) fn hit(&self) -> bool {
        match self.prev_prompt {
            Some(prev) if !self.compaction => self.reused as f64 >= HIT_SHARE * prev as f64,
            _ => false,
        }
    }
}

/// One row of a table: one policy's run.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Row {
    pub(crate) policy: &'static str,
    pub(crate) turns: usize,
    /// Turns with a previous turn: the base of the move shares.
    pub(crate) follow_ups: usize,
    pub(crate) eligible: usize,
    pub(crate) hits: usize,
    pub(crate) node_moves: usize,
    pub(crate) backend_moves: usize,
    /// Turns the router placed as a cold home, and as a compaction.
    pub(crate) cold_homes: usize,
    pub(crate) compactions: usize,
    pub(crate) p50: Duration,
    pub(crate) p90: Duration,
    pub(crate) reused: u64,
    pub(crate) ideal: u64,
    /// Median time to first token of warm home turns, same-node moves and cross-node moves
    /// (follow-ups that are not compactions), with their counts.
    pub(crate) by_move: [(Duration, usize); 3],
}

/// The `q`-quantile by nearest rank.
pub(crate) fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Row {
    pub(crate) fn new(policy: &'static str, records: &[TurnRecord]) -> Self {
        let mut ttft: Vec<Duration> = records.iter().map(|r| r.ttft).collect();
        ttft.sort_unstable();
        let median_of = |f: &dyn Fn(&TurnRecord) -> bool| {
            let mut v: Vec<Duration> = records
                .iter()
                .filter(|r| r.eligible() && f(r))
                .map(|r| r.ttft)
                .collect();
            v.sort_unstable();
            (quantile(&v, 0.5), v.len())
        };
        Row {
            policy,
            turns: records.len(),
            follow_ups: records.iter().filter(|r| r.prev_prompt.is_some()).count(),
            eligible: records.iter().filter(|r| r.eligible()).count(),
            hits: records.iter().filter(|r| r.hit()).count(),
            node_moves: records.iter().filter(|r| r.moved_node).count(),
            backend_moves: records.iter().filter(|r| r.moved_backend).count(),
            cold_homes: records
                .iter()
                .filter(|r| r.outcome == Outcome::ColdHome)
                .count(),
            compactions: records
                .iter()
                .filter(|r| r.outcome == Outcome::Compaction)
                .count(),
            p50: quantile(&ttft, 0.5),
            p90: quantile(&ttft, 0.9),
            reused: records.iter().map(|r| r.reused).sum(),
            ideal: records.iter().map(|r| r.ideal).sum(),
            by_move: [
                median_of(&|r| !r.moved_node && !r.moved_backend),
                median_of(&|r| r.moved_backend),
                median_of(&|r| r.moved_node),
            ],
        }
    }

    pub(crate) fn hit_rate(&self) -> f64 {
        share(self.hits, self.eligible)
    }

    /// The reused tokens as a share of the ideal's; `None` when the ideal is nothing.
    pub(crate) fn reuse_of_ideal(&self) -> Option<f64> {
        (self.ideal > 0).then(|| self.reused as f64 / self.ideal as f64)
    }
}

fn share(n: usize, of: usize) -> f64 {
    if of == 0 {
        0.0
    } else {
        n as f64 / of as f64
    }
}

/// One scenario's table.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Table {
    /// Short name, for the chart.
    pub(crate) label: String,
    /// The heading printed above the table.
    pub(crate) title: String,
    pub(crate) rows: Vec<Row>,
    /// Print the reused tokens as a share of the ideal cache's (trace replay).
    pub(crate) ideal: bool,
    /// Lines printed under the table.
    pub(crate) notes: Vec<String>,
}

impl Table {
    pub(crate) fn row(&self, policy: &str) -> Option<&Row> {
        self.rows.iter().find(|r| r.policy == policy)
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// `n` and its share of `of`; no share when `of` is 0.
fn count_share(n: usize, of: usize) -> String {
    if of == 0 {
        return format!("{n} (-)");
    }
    format!("{n} ({:.1}%)", 100.0 * share(n, of))
}

/// What the columns say, printed once under a run's tables.
pub(crate) const LEGEND: &str = "\
hit rate: of the later turns (compactions aside), those that reused at least 80% of the
  previous turn's prompt; - when there were none
node moves, backend moves: later turns sent to another node, or to another backend of the
  same node, and their share of the later turns
cold: keyed turns whose home had evicted their session (the router's count); compact:
  turns the router counted as compactions (keyless runs count none)
TTFT: time to first token over every turn, first turns included";

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.title)?;
        write!(
            f,
            "{:<16} {:>6} {:>9} {:>14} {:>14} {:>6} {:>8} {:>10} {:>10}",
            "policy",
            "turns",
            "hit rate",
            "node moves",
            "backend moves",
            "cold",
            "compact",
            "TTFT p50",
            "TTFT p90"
        )?;
        if self.ideal {
            write!(f, " {:>13}", "reuse / ideal")?;
        }
        writeln!(f)?;
        for r in &self.rows {
            let hit_rate = if r.eligible == 0 {
                "-".to_string()
            } else {
                format!("{:.1}%", 100.0 * r.hit_rate())
            };
            write!(
                f,
                "{:<16} {:>6} {:>9} {:>14} {:>14} {:>6} {:>8} {:>10} {:>10}",
                r.policy,
                r.turns,
                hit_rate,
                count_share(r.node_moves, r.follow_ups),
                count_share(r.backend_moves, r.follow_ups),
                r.cold_homes,
                r.compactions,
                secs(r.p50),
                secs(r.p90),
            )?;
            if self.ideal {
                match r.reuse_of_ideal() {
                    Some(share) => write!(f, " {:>12.1}%", 100.0 * share)?,
                    None => write!(f, " {:>13}", "-")?,
                }
            }
            writeln!(f)?;
        }
        for n in &self.notes {
            writeln!(f, "{n}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(prev: Option<u64>, reused: u64, compaction: bool) -> TurnRecord {
        TurnRecord {
            conversation: 0,
            sent: Instant::now(),
            prompt: 0,
            backend: "b".into(),
            outcome: Outcome::HomeHit,
            prev_prompt: prev,
            compaction,
            reused,
            ideal: 0,
            source: Source::Slot,
            moved_node: false,
            moved_backend: false,
            ttft: Duration::from_secs(1),
        }
    }

    #[test]
    fn compaction_is_excluded_from_the_hit_rate() {
        let records = [
            // A first turn: no previous context, not counted.
            turn(None, 0, false),
            // 80% of the previous context reused: a hit; 79%: a miss.
            turn(Some(10_000), 8_000, false),
            turn(Some(10_000), 7_900, false),
            // A compaction reuses only the system prompt: not counted either way.
            turn(Some(40_000), 2_000, true),
            turn(Some(5_000), 5_000, false),
        ];
        let row = Row::new("p", &records);
        assert_eq!((row.turns, row.eligible, row.hits), (5, 3, 2));
        assert!((row.hit_rate() - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<Duration> = (1..=10).map(Duration::from_secs).collect();
        assert_eq!(quantile(&v, 0.5), Duration::from_secs(5));
        assert_eq!(quantile(&v, 0.9), Duration::from_secs(9));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }
}
