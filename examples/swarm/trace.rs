//! Replaying a Mooncake trace (kvcache-ai/Mooncake, `FAST25-release/traces/`).
//!
//! One JSON object a line: `timestamp` (arrival, ms; replayed from the first request's),
//! `input_length` and `output_length` (tokens), `hash_ids` (the prompt's 512-token blocks; ids
//! are chained, so equal ids at equal positions mean an equal prefix). The trace has no session
//! ids: a request whose blocks extend all but the last block of an earlier request continues
//! that request's conversation (the last block of a turn is usually partial, so its hash
//! changes when the next turn appends to it).
//! A turn that is already continued starts a new conversation instead of a second branch.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde::Deserialize;
use tokio::time::Instant;

use crate::backend::Prompt;
use crate::cache::{self, Block, Blocks};
use crate::report::TurnRecord;
use crate::sim::{self, Svc, TurnInput};
use tower_affinity::PromptChain;

/// The cache unit of the trace.
pub(crate) const BLOCK_TOKENS: u32 = 512;

/// Answer blocks: ids no prompt block can have.
const ANSWER_IDS: u64 = 1 << 63;

/// The latest timestamp a trace may have after its first request's: a century (36,525 days),
/// in ms. The replay's paused clock advances by bounded steps, so a later one would keep it
/// stepping for minutes to hours.
const MAX_TIMESTAMP_MS: u64 = 36_525 * 24 * 3600 * 1000;

#[derive(Debug, Deserialize)]
struct Line {
    timestamp: u64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// One request of the trace.
#[derive(Clone, Debug)]
pub(crate) struct TraceRequest {
    /// Arrival, after the trace's first request.
    pub(crate) at: Duration,
    pub(crate) blocks: Blocks,
    pub(crate) input: u32,
    pub(crate) output: u32,
    /// What an infinite cache shared by the whole fleet would reuse: the longest prefix of
    /// blocks any earlier request had.
    pub(crate) ideal: u64,
}

/// A parsed trace with its conversations rebuilt.
#[derive(Clone, Debug)]
pub(crate) struct Trace {
    pub(crate) requests: Vec<TraceRequest>,
    /// Each conversation's requests, in order.
    pub(crate) conversations: Vec<Vec<usize>>,
    /// Lines whose timestamp is earlier than an earlier line's: replayed in timestamp order.
    pub(crate) out_of_order: usize,
}

impl Trace {
    pub(crate) fn parse(text: &str) -> Result<Trace, String> {
        // A file saved with a byte order mark, as some editors write UTF-8, begins with it.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut lines = Vec::new();
        for (n, l) in text.lines().enumerate() {
            if l.trim().is_empty() {
                continue;
            }
            let line: Line = serde_json::from_str(l).map_err(|e| bad_json(n + 1, &e))?;
            // Each block's tokens are taken from the length, so the two must agree: a length
            // far beyond its ids made one block of billions of tokens.
            let blocks = line.input_length.div_ceil(BLOCK_TOKENS);
            if line.hash_ids.len() != blocks as usize {
                return Err(format!(
                    "line {}: {} hash_ids for an input_length of {}: a Mooncake trace has an id \
                     for each {BLOCK_TOKENS} tokens ({blocks})",
                    n + 1,
                    line.hash_ids.len(),
                    line.input_length
                ));
            }
            lines.push((n, line));
        }
        // Timestamps count from the trace's first request: a trace cut from a longer one, or
        // stamped with the time of day, is replayed from its first request on.
        let Some(first) = lines.iter().map(|(_, l)| l.timestamp).min() else {
            return Err("no requests: the trace has no lines".into());
        };
        if let Some((n, l)) = lines
            .iter()
            .find(|(_, l)| l.timestamp - first > MAX_TIMESTAMP_MS)
        {
            return Err(format!(
                "line {}: timestamp {} is more than a century ({MAX_TIMESTAMP_MS} ms) after \
                 the trace's first request (at {first}); timestamps are milliseconds",
                n + 1,
                l.timestamp
            ));
        }
        let mut lines: Vec<Line> = lines
            .into_iter()
            .map(|(_, l)| Line {
                timestamp: l.timestamp - first,
                ..l
            })
            .collect();
        let mut latest = 0;
        let out_of_order = lines
            .iter()
            .filter(|l| {
                let before = l.timestamp < latest;
                latest = latest.max(l.timestamp);
                before
            })
            .count();
        // Arrival order; a stable sort keeps the file's order among equal timestamps.
        lines.sort_by_key(|l| l.timestamp);
        let conversations = rebuild_conversations(&lines);
        let ideal = ideal_reuse(&lines);
        let requests = lines
            .iter()
            .zip(ideal)
            .map(|(l, ideal)| TraceRequest {
                at: Duration::from_millis(l.timestamp),
                blocks: blocks_of(l).into(),
                input: l.input_length,
                output: l.output_length,
                ideal,
            })
            .collect();
        Ok(Trace {
            requests,
            conversations,
            out_of_order,
        })
    }

    /// Requests that continue an earlier one.
    pub(crate) fn later_turns(&self) -> usize {
        self.requests.len() - self.conversations.len()
    }
}

impl Trace {
    /// The trace as agents that keep their answers send it (`--trace-answers kept`): each
    /// later turn's prompt is its previous turn's prompt and answer, then the trace's tokens
    /// beyond them (none when the turn grew by less than the answer). The trace's own turns
    /// keep neither: its lengths grow by less than the answer in most of them, and a turn's
    /// partial last block gets a new hash in the next. So, as a backend that compares tokens
    /// sees an agent's conversation, a turn's state (its prompt and answer) is a prefix of the
    /// next turn's prompt. The ideal is recomputed over these prompts, an answer seen once its
    /// request was.
    /// A conversation whose prompt would grow past `u32::MAX` tokens is an error.
    pub(crate) fn with_answers_kept(&self) -> Result<Trace, String> {
        let mut requests = self.requests.clone();
        for conversation in &self.conversations {
            for pair in conversation.windows(2) {
                let (p, i) = (pair[0], pair[1]);
                let trace = &self.requests[i];
                let mut blocks = requests[p].blocks.to_vec();
                blocks.push(answer_of(p, &requests[p]));
                // Where the turn's own tokens resume, counted in the trace's turn.
                let start = u64::from(self.requests[p].input) + u64::from(self.requests[p].output);
                let end = u64::from(trace.input);
                if start < end {
                    let k = (start / u64::from(BLOCK_TOKENS)) as usize;
                    let block = trace.blocks[k];
                    let block_end = (k as u64 + 1) * u64::from(BLOCK_TOKENS);
                    let skipped = start % u64::from(BLOCK_TOKENS);
                    blocks.push(Block {
                        id: if skipped == 0 {
                            block.id
                        } else {
                            block.id | REST_IDS
                        },
                        tokens: (block_end.min(end) - start) as u32,
                    });
                    blocks.extend_from_slice(&trace.blocks[k + 1..]);
                }
                let r = &mut requests[i];
                r.input = u32::try_from(cache::tokens(&blocks)).map_err(|_| {
                    format!(
                        "with its answers kept, request {} (by timestamp) would hold more than \
                         {} tokens",
                        i + 1,
                        u32::MAX
                    )
                })?;
                r.blocks = blocks.into();
            }
        }
        let mut seen: HashSet<Block> = HashSet::new();
        for (i, r) in requests.iter_mut().enumerate() {
            r.ideal = r
                .blocks
                .iter()
                .take_while(|b| seen.contains(b))
                .map(|b| u64::from(b.tokens))
                .sum();
            seen.extend(r.blocks.iter().copied());
            seen.insert(answer_of(i, r));
        }
        Ok(Trace {
            requests,
            conversations: self.conversations.clone(),
            out_of_order: self.out_of_order,
        })
    }
}

/// The answer request `i` generates, as the backend keeps it after the prompt.
pub(crate) fn answer_of(i: usize, r: &TraceRequest) -> Block {
    Block {
        id: ANSWER_IDS | i as u64,
        tokens: r.output,
    }
}

/// `line N, column C: what` for a line that is no request. serde_json's message ends with
/// where in the text it read, `at line 1 column C`: the line is the trace's line's own first,
/// which, after the trace's line number, would read as another line of the trace.
fn bad_json(line: usize, e: &serde_json::Error) -> String {
    let message = e.to_string();
    let at = format!(" at line {} column {}", e.line(), e.column());
    match message.strip_suffix(&at) {
        Some(what) => format!("line {line}, column {}: {what}", e.column()),
        None => format!("line {line}: {message}"),
    }
}

/// The request's blocks: 512 tokens each, the last one holding the rest.
fn blocks_of(l: &Line) -> Vec<Block> {
    let n = l.hash_ids.len() as u32;
    l.hash_ids
        .iter()
        .enumerate()
        .map(|(i, &id)| Block {
            id,
            tokens: if (i as u32) + 1 < n {
                BLOCK_TOKENS
            } else {
                l.input_length.saturating_sub(BLOCK_TOKENS * (n - 1)).max(1)
            },
        })
        .collect()
}

fn rebuild_conversations(lines: &[Line]) -> Vec<Vec<usize>> {
    // The id of a request's next-to-last block names the prefix a continuation must extend.
    let mut by_prefix: HashMap<u64, Vec<usize>> = HashMap::new();
    let mut continued = vec![false; lines.len()];
    let mut conversation_of = vec![0; lines.len()];
    let mut conversations: Vec<Vec<usize>> = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let h = &l.hash_ids;
        let n = h.len();
        // The longest earlier prefix this request extends by at least one block.
        let parent = (0..n.saturating_sub(1)).rev().find_map(|k| {
            by_prefix
                .get(&h[k])?
                .iter()
                .rev()
                .copied()
                .find(|&p| lines[p].hash_ids.len() == k + 2 && !continued[p])
        });
        match parent {
            Some(p) => {
                continued[p] = true;
                let c = conversation_of[p];
                conversation_of[i] = c;
                conversations[c].push(i);
            }
            None => {
                conversation_of[i] = conversations.len();
                conversations.push(vec![i]);
            }
        }
        if n >= 2 {
            by_prefix.entry(h[n - 2]).or_default().push(i);
        }
    }
    conversations
}

fn ideal_reuse(lines: &[Line]) -> Vec<u64> {
    let mut seen: HashSet<u64> = HashSet::new();
    lines
        .iter()
        .map(|l| {
            let cached = l.hash_ids.iter().take_while(|id| seen.contains(id)).count() as u64;
            seen.extend(l.hash_ids.iter().copied());
            (cached * u64::from(BLOCK_TOKENS)).min(u64::from(l.input_length))
        })
        .collect()
}

/// What the router's prompt chains are cut at (`--trace-chains`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Chains {
    /// The trace's own blocks: a turn's partial last block is a link the next turn does not
    /// have (its hash changes when the next turn fills the block).
    Blocks,
    /// Also at every turn's end, as a chat body's chain is cut at its messages: a turn's
    /// prompt is a prefix of the next turn's chain.
    TurnEnds,
}

impl Chains {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "blocks" => Some(Chains::Blocks),
            "turn-ends" => Some(Chains::TurnEnds),
            _ => None,
        }
    }
}

/// Marks the id of the part of a block after an earlier turn's partial last block.
const REST_IDS: u64 = 1 << 62;

/// The chains of one conversation's turns cut as a chat body's would be ([`Chains::TurnEnds`]):
/// a turn's prompt ends at a message boundary the next turn keeps, so its partial last block
/// stays a link of the next turn's chain, followed by the rest of the block that completes
/// it. A turn that does not extend its previous one's last block keeps only the blocks they
/// share.
fn message_chains(turns: &[(usize, TraceRequest)]) -> Vec<Vec<Block>> {
    let mut out: Vec<Vec<Block>> = Vec::with_capacity(turns.len());
    for (j, (_, r)) in turns.iter().enumerate() {
        let blocks: &[Block] = &r.blocks;
        let Some(prev) = j.checked_sub(1).map(|p| (&turns[p].1.blocks, &out[p])) else {
            out.push(blocks.to_vec());
            continue;
        };
        let (prev_blocks, prev_chain) = prev;
        let n = prev_blocks.len();
        let last = prev_blocks[n - 1];
        let chain = match blocks.get(n - 1) {
            // The previous prompt ended inside this block: its tail stays, then the rest.
            Some(b) if last.tokens < BLOCK_TOKENS && b.tokens > last.tokens => {
                let mut c = prev_chain.clone();
                c.push(Block {
                    id: b.id | REST_IDS,
                    tokens: b.tokens - last.tokens,
                });
                c.extend_from_slice(&blocks[n..]);
                c
            }
            _ => {
                let shared = u64::from(BLOCK_TOKENS) * (n as u64 - 1);
                let mut at = 0u64;
                let mut c: Vec<Block> = prev_chain
                    .iter()
                    .take_while(|b| {
                        at += u64::from(b.tokens);
                        at <= shared
                    })
                    .copied()
                    .collect();
                c.extend_from_slice(&blocks[(n - 1).min(blocks.len())..]);
                c
            }
        };
        out.push(chain);
    }
    out
}

/// Replays the trace against `svc`: each request is sent at its timestamp, or when the
/// previous turn of its conversation has finished if that is later (a client does not send a
/// turn before it has the answer to the last one).
pub(crate) async fn replay(
    svc: Svc,
    trace: &Trace,
    keyed: bool,
    chains: Chains,
) -> Vec<TurnRecord> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (c, conv) in trace.conversations.iter().enumerate() {
        let turns: Vec<(usize, TraceRequest)> = conv
            .iter()
            .map(|&i| (i, trace.requests[i].clone()))
            .collect();
        let svc = svc.clone();
        let chains = (chains == Chains::TurnEnds).then(|| message_chains(&turns));
        tasks.push(tokio::task::spawn_local(async move {
            let name = format!("conversation-{c}");
            let (mut prev, mut prev_prompt) = (None, None);
            let mut records = Vec::with_capacity(turns.len());
            for (j, (i, r)) in turns.into_iter().enumerate() {
                tokio::time::sleep_until(start + r.at).await;
                let chain = chains
                    .as_ref()
                    .map(|c| PromptChain::from_blocks(c[j].iter().map(|b| (b.id, b.tokens))));
                let input = TurnInput {
                    conversation: c as u32,
                    session: keyed.then_some(name.as_str()),
                    prompt: Prompt {
                        answer: answer_of(i, &r),
                        blocks: r.blocks,
                    },
                    prev_prompt,
                    compaction: false,
                    ideal: r.ideal,
                    chain,
                };
                records.push(sim::turn(&svc, input, &mut prev).await);
                prev_prompt = Some(u64::from(r.input));
            }
            records
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("a conversation task"));
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(ts: u64, input: u32, ids: &[u64]) -> String {
        format!(
            r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": 10, "hash_ids": {ids:?}}}"#
        )
    }

    #[test]
    fn sessions_are_rebuilt_from_the_hash_chains() {
        let text = [
            // Conversation A, turn 1: two full blocks and a partial one.
            line(0, 1200, &[1, 2, 3]),
            // Conversation B shares A's first block only (a common system prompt).
            line(5, 1100, &[1, 7, 8]),
            // A, turn 2: keeps 1, 2, replaces the partial 3 and grows.
            line(10, 2000, &[1, 2, 4, 5]),
            // A second request extending A's turn 1 again is a new conversation, not a branch.
            line(12, 1500, &[1, 2, 6]),
            // B, turn 2.
            line(20, 1800, &[1, 7, 9, 10]),
            // A, turn 3.
            line(30, 2600, &[1, 2, 4, 5, 12, 13]),
            // Unrelated.
            line(40, 100, &[20]),
        ]
        .join("\n");
        let t = Trace::parse(&text).unwrap();
        assert_eq!(
            t.conversations,
            vec![vec![0, 2, 5], vec![1, 4], vec![3], vec![6]]
        );
        assert_eq!(t.later_turns(), 3);
        let tokens: Vec<u32> = t.requests[0].blocks.iter().map(|b| b.tokens).collect();
        assert_eq!(tokens, [512, 512, 176]);
        let ideal: Vec<u64> = t.requests.iter().map(|r| r.ideal).collect();
        assert_eq!(ideal, [0, 512, 1024, 1024, 1024, 2048, 0]);
    }

    #[test]
    fn turn_end_chains_keep_each_turn_as_a_prefix_of_the_next() {
        let text = [
            // Turn 1 ends inside its second block; turn 2 fills it and goes on.
            line(0, 612, &[1, 2]),
            line(10, 1536, &[1, 3, 4]),
            // Turn 2's last block is full; turn 3 keeps the blocks before it, not it.
            line(20, 1546, &[1, 3, 7, 8]),
        ]
        .join("\n");
        let t = Trace::parse(&text).unwrap();
        assert_eq!(t.conversations, vec![vec![0, 1, 2]]);
        let turns: Vec<(usize, TraceRequest)> =
            (0..3).map(|i| (i, t.requests[i].clone())).collect();
        let chains = message_chains(&turns);
        let ids = |c: &[Block]| c.iter().map(|b| (b.id, b.tokens)).collect::<Vec<_>>();
        assert_eq!(ids(&chains[0]), [(1, 512), (2, 100)]);
        // Turn 1's partial block stays a link, then the rest of the block it grew into.
        assert_eq!(
            ids(&chains[1]),
            [(1, 512), (2, 100), (3 | REST_IDS, 412), (4, 512)]
        );
        // Each chain covers its prompt's tokens.
        for (c, r) in chains.iter().zip(&t.requests) {
            assert_eq!(c.iter().map(|b| b.tokens).sum::<u32>(), r.input);
        }
        // Turn 2's last block is not in turn 3: only the links before it stay.
        assert_eq!(
            ids(&chains[2]),
            [(1, 512), (2, 100), (3 | REST_IDS, 412), (7, 512), (8, 10)]
        );
    }

    #[test]
    fn with_answers_kept_each_turn_extends_its_previous_prompt_and_answer() {
        let text = [
            // Turn 1 ends inside its second block and answers in 10 tokens.
            line(0, 612, &[1, 2]),
            // Turn 2 fills that block and goes on: after turn 1's 612 tokens and answer, the
            // rest of block 3 and block 4.
            line(10, 1536, &[1, 3, 4]),
            // Turn 3 grew by less than turn 2's answer: turn 2's prompt and answer.
            line(20, 1540, &[1, 3, 5, 6]),
            // Another conversation sharing the first block.
            line(30, 700, &[1, 9]),
        ]
        .join("\n");
        let t = Trace::parse(&text).unwrap();
        assert_eq!(t.conversations, vec![vec![0, 1, 2], vec![3]]);
        let kept = t.with_answers_kept().unwrap();
        let ids = |i: usize| {
            let r = &kept.requests[i];
            r.blocks
                .iter()
                .map(|b| (b.id, b.tokens))
                .collect::<Vec<_>>()
        };
        let answer = |i: u64| (ANSWER_IDS | i, 10);
        assert_eq!(ids(0), [(1, 512), (2, 100)]);
        assert_eq!(
            ids(1),
            [(1, 512), (2, 100), answer(0), (3 | REST_IDS, 402), (4, 512)]
        );
        let mut third = ids(1);
        third.push(answer(1));
        assert_eq!(ids(2), third);
        assert_eq!(ids(3), [(1, 512), (9, 188)]);
        // The prompts' lengths: the trace's, or the previous prompt and answer if longer.
        let input: Vec<u32> = kept.requests.iter().map(|r| r.input).collect();
        assert_eq!(input, [612, 1536, 1546, 700]);
        // The ideal reuses each earlier prompt and answer.
        let ideal: Vec<u64> = kept.requests.iter().map(|r| r.ideal).collect();
        assert_eq!(ideal, [0, 622, 1546, 512]);
        // The trace as given is left as it was.
        assert_eq!(t.requests[2].input, 1540);
    }

    #[test]
    fn with_answers_kept_refuses_a_prompt_past_u32_tokens() {
        // Answers of 3e9 tokens: the third turn would hold two of them.
        let big = |ts: u64, input: u32, ids: &[u64]| {
            format!(
                r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": 3000000000, "hash_ids": {ids:?}}}"#
            )
        };
        let text = [
            big(0, 612, &[1, 2]),
            big(10, 1536, &[1, 3, 4]),
            big(20, 2048, &[1, 3, 5, 6]),
        ]
        .join("\n");
        let t = Trace::parse(&text).unwrap();
        assert_eq!(t.conversations, vec![vec![0, 1, 2]]);
        let err = t.with_answers_kept().unwrap_err();
        assert!(err.contains("request 3"), "{err}");
    }

    #[test]
    fn a_bad_line_is_reported_with_its_number() {
        let err = Trace::parse(&format!("{}\nnot json", line(0, 1, &[1]))).unwrap_err();
        assert!(err.starts_with("line 2"), "{err}");
        // The position in the line is its column alone: no `line 1` of serde_json's own.
        let ms = r#"{"timestamp": 1.5, "input_length": 1, "output_length": 1, "hash_ids": [2]}"#;
        let err = Trace::parse(&format!("{}\n{ms}", line(0, 1, &[1]))).unwrap_err();
        assert_eq!(
            err,
            "line 2, column 17: invalid type: floating point `1.5`, expected u64"
        );
        let err = Trace::parse(&format!("{}\n{{", line(0, 1, &[1]))).unwrap_err();
        assert_eq!(err, "line 2, column 1: EOF while parsing an object");
    }

    #[test]
    fn a_timestamp_past_a_century_and_an_empty_trace_are_refused() {
        // u64::MAX ms would keep the replay's clock stepping for hours.
        let text = format!("{}\n{}", line(0, 1, &[1]), line(u64::MAX, 1, &[2]));
        let err = Trace::parse(&text).unwrap_err();
        assert!(
            err.starts_with("line 2: timestamp 18446744073709551615"),
            "{err}"
        );
        // A century after the first request, wherever the trace starts.
        for start in [0, 5] {
            let trace = |last| [line(start, 1, &[1]), line(start + last, 1, &[2])].join("\n");
            assert!(Trace::parse(&trace(MAX_TIMESTAMP_MS)).is_ok());
            let err = Trace::parse(&trace(MAX_TIMESTAMP_MS + 1)).unwrap_err();
            assert!(err.starts_with("line 2: "), "{err}");
        }
        // Ids and length disagree: one block of 4.29e9 tokens, or ten blocks for 100 tokens.
        for bad in [line(0, u32::MAX, &[1, 2, 3]), line(0, 100, &[1, 2])] {
            let err = Trace::parse(&bad).unwrap_err();
            assert!(
                err.starts_with("line 1: ") && err.contains("hash_ids"),
                "{err}"
            );
        }
        assert!(Trace::parse(&line(0, 0, &[])).is_ok());
        assert!(Trace::parse(&line(0, 1025, &[1, 2, 3])).is_ok());
        for empty in ["", "\n  \n"] {
            let err = Trace::parse(empty).unwrap_err();
            assert!(err.starts_with("no requests"), "{err}");
        }
    }

    #[test]
    fn a_byte_order_mark_before_the_first_line_is_skipped() {
        let text = format!("\u{feff}{}\n{}", line(0, 1, &[1]), line(5, 1, &[2]));
        let t = Trace::parse(&text).unwrap();
        assert_eq!(t.requests.len(), 2);
        // Anywhere else it is no JSON.
        let text = format!("{}\n\u{feff}{}", line(0, 1, &[1]), line(5, 1, &[2]));
        let err = Trace::parse(&text).unwrap_err();
        assert!(err.starts_with("line 2, column 1: "), "{err}");
    }

    #[test]
    fn timestamps_count_from_the_first_request() {
        // Stamped with the time of day (ms since 1970), as a trace cut from a longer one or
        // logged by a server is: replayed from its first request, 10 s long.
        let text = [
            line(1_733_480_010_000, 1, &[2]),
            line(1_733_480_000_000, 1, &[1]),
        ]
        .join("\n");
        let t = Trace::parse(&text).unwrap();
        let at: Vec<u64> = t.requests.iter().map(|r| r.at.as_millis() as u64).collect();
        assert_eq!(at, [0, 10_000]);
        assert_eq!(t.out_of_order, 1);
    }

    #[test]
    fn lines_out_of_order_are_counted_and_replayed_in_timestamp_order() {
        let text = [
            line(5, 1, &[1]),
            line(2, 1, &[2]),
            line(9, 1, &[3]),
            line(7, 1, &[4]),
        ]
        .join("\n");
        let t = Trace::parse(&text).unwrap();
        assert_eq!(t.out_of_order, 2);
        let at: Vec<u64> = t.requests.iter().map(|r| r.at.as_millis() as u64).collect();
        // Counted from the first request's, at 2.
        assert_eq!(at, [0, 3, 5, 7]);
        let sorted = [line(1, 1, &[1]), line(1, 1, &[2]), line(3, 1, &[3])].join("\n");
        assert_eq!(Trace::parse(&sorted).unwrap().out_of_order, 0);
    }
}
